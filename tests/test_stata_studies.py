"""The STATA study scripts (bench/stata_digits_seeds.py, bench/stata_vs_dense.py) and the pairing of
the two digits recipes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from efficient.config import load_yaml

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    if str(ROOT / "bench") not in sys.path:  # the scripts import stata_ablation from beside them
        sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
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
    mod = _bench("stata_digits_seeds")
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


def _run(root: Path, name: str, seed: int, acc: float, model: str) -> str:
    d = root / name
    d.mkdir()
    (d / "config.yaml").write_text(f"train:\n  seed: {seed}\n")
    cost = {"energy_pj_per_sample": 2.0e6 if "stata" in model else 4.0e6, "macs": 64, "sops": 32, "dense_macs": 128,
            "batch_size": 32}
    (d / "summary.json").write_text(json.dumps({"model": model, "val": {"acc": acc}, "cost": cost, "train_time_s": 1.0}))
    return str(d)


def test_stata_vs_dense_pairs_runs_by_their_seed_not_their_order(tmp_path, capsys, monkeypatch):
    mod = _bench("stata_vs_dense")
    dense = [_run(tmp_path, f"d{s}", s, a, "spikformer-tiny") for s, a in [(0, 0.90), (1, 0.80), (2, 0.70)]]
    stata = [_run(tmp_path, f"s{s}", s, a, "spikformer-tiny-stata") for s, a in [(2, 0.72), (0, 0.91), (5, 0.10)]]
    monkeypatch.setattr(sys, "argv", ["stata_vs_dense.py", "--dense", *dense, "--stata", *stata])
    mod.main()
    out = capsys.readouterr().out
    m, lo, hi = mod.t_interval([1.0, 2.0])  # seeds 0 and 2; seed 5 has no dense run
    assert f"{m:+.2f} [{lo:.2f}, {hi:.2f}] 95 % CI, n=2" in out and m == pytest.approx(1.5)
    assert "stata per seed acc % (seeds 0, 2, 5): 91.00, 72.00, 10.00" in out
    assert "energy STATA / dense: 0.500 (50.0 % less)" in out
    monkeypatch.setattr(sys, "argv", ["stata_vs_dense.py", "--dense", dense[1], "--stata", stata[2]])
    with pytest.raises(SystemExit, match="no seed is in both"):
        mod.main()
