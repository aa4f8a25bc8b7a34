"""bench/robust_study.py's summary: paired rho and neuron differences by seed, verdicts, time and
unique breaks, from evaluation records of the suite's shape."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("robust_study", Path(__file__).resolve().parents[1] / "bench" / "robust_study.py")
rs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("robust_study", rs)
_spec.loader.exec_module(rs)


def record(run: str, clean: float, worst: float, seconds: float = 10.0) -> dict:
    attacks = [{"attack": "apgd-ce", "acc": worst, "seconds": 0.75 * seconds, "unique_breaks": 2},
               {"attack": "square", "acc": worst + 0.1, "seconds": 0.25 * seconds, "unique_breaks": 1}]
    return {"run": run, "suite": {"clean": clean, "worst_case": worst, "attacks": attacks, "seconds": seconds,
                                  "seconds_per_image": seconds / 100, "n": 100},
            "checks": {"passed": True, "checks": [{"check": "monotone", "passed": True}]}}


def test_summary_pairs_rho_by_seed_and_gives_a_verdict_from_the_interval():
    arms = rs.arms(["gaussian"], ["dlif"])
    worst0, worst1 = {43: 0.10, 44: 0.12, 45: 0.11}, {43: 0.30, 44: 0.29, 45: 0.33}
    results = {}
    for s in (43, 44, 45):
        results[("gaussian_dlif_rho0", s, "32/255")] = record(f"gaussian_dlif_rho0_s{s}", 0.98, worst0[s])
        results[("gaussian_dlif_rho1", s, "32/255")] = record(f"gaussian_dlif_rho1_s{s}", 0.95, worst1[s], seconds=20.0)
    summary, md = rs.summarise(results, arms, [43, 44, 45], ["32/255"], "32/255")
    (d,) = summary["eps"]["32/255"]["differences"]
    assert d["worst_case"] == pytest.approx([20.0, 17.0, 22.0])
    m, lo, hi = rs.t_interval([20.0, 17.0, 22.0])
    assert d["mean"] == pytest.approx(59 / 3) and d["ci"] == pytest.approx([lo, hi]) and lo > 0
    assert d["verdict"] == "rho = 1 better"
    assert summary["eps"]["32/255"]["seconds_per_image"]["median"] == pytest.approx(0.15)  # 3 models at 0.1, 3 at 0.2
    assert summary["eps"]["32/255"]["time_share"] == {"apgd-ce": pytest.approx(0.75), "square": pytest.approx(0.25)}
    assert summary["eps"]["32/255"]["unique_breaks"] == {"apgd-ce": 12, "square": 6}
    assert "| **11.0 +- 1.0** |" in md and "gaussian_dlif_rho1_s45: all passed" in md


def test_summary_with_one_seed_gives_no_interval():
    arms = rs.arms(["fgsm"], ["lif"])
    results = {("fgsm_lif_rho0", 43, "8/255"): record("fgsm_lif_rho0_s43", 0.97, 0.85),
               ("fgsm_lif_rho1", 43, "8/255"): record("fgsm_lif_rho1_s43", 0.96, 0.86)}
    summary, _ = rs.summarise(results, arms, [43], ["8/255"], "32/255")
    (d,) = summary["eps"]["8/255"]["differences"]
    assert d["verdict"] == "one seed: no interval"
