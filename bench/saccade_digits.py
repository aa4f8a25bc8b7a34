"""Accuracy and energy of trained saccade_digits runs, dense vs STATA, from their run dirs.

Reads each run's `summary.json`: final validation accuracy and the trainer's cost report
(`efficient.profile` on the first `profile.samples` validation samples; 45 nm: 4.6 pJ/MAC,
0.9 pJ/SOP). Prints a markdown table, mean +- std over seeds and the STATA / dense ratios.

    python bench/saccade_digits.py --dense runs/sd/dense_s0 ... --stata runs/sd/stata_s0 ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(runs: list[str]) -> list[dict]:
    return [json.loads((Path(r) / "summary.json").read_text()) for r in runs]


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.4g} +- {statistics.stdev(xs) if len(xs) > 1 else 0.0:.2g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense", nargs="+", required=True)
    ap.add_argument("--stata", nargs="+", required=True)
    a = ap.parse_args()
    rows = {"dense": load(a.dense), "stata": load(a.stata)}
    keys = [("acc", lambda s: 100 * s["val"]["acc"]), ("energy uJ/sample", lambda s: s["cost"]["energy_pj_per_sample"] / 1e6),
            ("MACs M/sample", lambda s: s["cost"]["macs"] / s["cost"]["batch_size"] / 1e6),
            ("SOPs M/sample", lambda s: s["cost"]["sops"] / s["cost"]["batch_size"] / 1e6),
            ("dense MACs M/sample", lambda s: s["cost"]["dense_macs"] / s["cost"]["batch_size"] / 1e6),
            ("train s", lambda s: s["train_time_s"])]
    print("| model | seeds | val acc % | " + " | ".join(k for k, _ in keys[1:]) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, runs in rows.items():
        per = [[f(s) for s in runs] for _, f in keys]
        print(f"| {runs[0]['model']} | {len(runs)} | " + " | ".join(mean_std(v) for v in per) + " |")
    for name, runs in rows.items():
        print(f"{name} per seed acc %: " + ", ".join(f"{100 * s['val']['acc']:.2f}" for s in runs))
    e = {n: statistics.mean(s["cost"]["energy_pj_per_sample"] for s in r) for n, r in rows.items()}
    acc = {n: [100 * s["val"]["acc"] for s in r] for n, r in rows.items()}
    diffs = [s - d for s, d in zip(acc["stata"], acc["dense"])]
    print(f"energy STATA / dense: {e['stata'] / e['dense']:.3f} ({100 * (1 - e['stata'] / e['dense']):.1f} % less)")
    print(f"accuracy STATA - dense, paired by seed: {mean_std(diffs)} points")


if __name__ == "__main__":
    main()
