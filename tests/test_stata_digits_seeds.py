"""The digits seed study (bench/stata_digits_seeds.py) and the pairing of the two digits recipes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from efficient.config import load_yaml

ROOT = Path(__file__).resolve().parents[1]


def _seeds_module():
    sys.path.insert(0, str(ROOT / "bench"))  # it imports stata_ablation from beside it
    spec = importlib.util.spec_from_file_location("stata_digits_seeds", ROOT / "bench" / "stata_digits_seeds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(root: Path, name: str, acc: float, energy_pj: float = 2.5e6) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"val": {"acc": acc}, "cost": {"energy_pj_per_sample": energy_pj}}))


def test_digits_twins_share_data_optimizer_schedule_and_budget():
    """STATA vs dense is only a comparison if everything but the model and objective is the same."""
    stata, dense = load_yaml(ROOT / "recipes" / "stata_digits.yaml"), load_yaml(ROOT / "recipes" / "spikformer_digits.yaml")
    for section in ("data", "optim", "schedule", "train", "eval"):
        assert stata[section] == dense[section], section
    assert stata["train"]["epochs"] == 20  # BENCHMARKS.md `## stata` 3b: at 8 both were still learning


def test_seed_table_pairs_by_seed_and_reports_stata_minus_dense_at_20_epochs(tmp_path, capsys, monkeypatch):
    mod = _seeds_module()
    for s, (d8, s8, d20, s20) in enumerate([(0.94, 0.92, 0.97, 0.96), (0.93, 0.90, 0.96, 0.97), (0.95, 0.93, 0.98, 0.97)]):
        _summary(tmp_path, f"dense_s{s}", d8, 4.5e6)
        _summary(tmp_path, f"stata_s{s}", s8)
        _summary(tmp_path, f"denselong_s{s}", d20, 4.6e6)
        _summary(tmp_path, f"statalong_s{s}", s20)
    _summary(tmp_path, "statalong_s7", 0.5)  # no dense partner: left out of the pair, kept in its own row
    _summary(tmp_path, "other_s0", 0.1)  # not a variant: ignored
    acc, energy = mod.load(tmp_path)
    assert set(acc) == {"dense", "stata", "denselong", "statalong"} and acc["statalong"][7] == pytest.approx(50.0)
    m, lo, hi = mod.t_interval([-1.0, 1.0, -1.0])
    assert mod.paired(acc["statalong"], acc["denselong"]) == f"{m:+.2f} [{lo:.2f}, {hi:.2f}] (n=3)"
    monkeypatch.setattr(sys, "argv", ["stata_digits_seeds.py", str(tmp_path)])
    mod.main()
    out = capsys.readouterr().out
    assert "| dense: recipes/spikformer_digits.yaml at 8 epochs | 3 | 94.00 +- 1.00 | 93.00 | (reference) |" in out
    assert "| statalong: recipes/stata_digits.yaml as shipped (20 epochs) | 4 |" in out
    assert out.rstrip().endswith(f"At 20 epochs, STATA minus dense [95 % CI]: {m:+.2f} [{lo:.2f}, {hi:.2f}] (n=3)")
    assert "| 4.500 |" in out  # the dense rows' energy, uJ
