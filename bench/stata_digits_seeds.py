"""Seed stability of the digits STATA recipe: the table of `bench/stata_digits_runs.sh seeds` and `... long`.

Per variant (dense and STATA at 8 epochs, the STATA recipe with one change each, and both as shipped
at 20 epochs): final validation accuracy over seeds (mean +- std, worst seed), the paired difference
to dense and to STATA at 8 epochs with a 95 % t-interval, and STATA minus dense at 20 epochs.

    python bench/stata_digits_seeds.py runs/stata          # reads <dir>/<variant>_s<seed>/summary.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stata_ablation import fmt, paired_diffs, t_interval  # noqa: E402

VARIANTS = {
    "dense": "recipes/spikformer_digits.yaml at 8 epochs",
    "stata": "recipes/stata_digits.yaml at 8 epochs (blocks 1, 2 at rho 0.5, warm-up epochs 0.5-2.5)",
    "rho07": "keep ratio 0.7 (17 -> 13 -> 10 tokens)",
    "block2": "prune block 2 only (17 -> 17 -> 9 tokens)",
    "late": "keep-ratio warm-up over epochs 2-5",
    "rho07late": "keep ratio 0.7 and warm-up over epochs 2-5",
    "denselong": "recipes/spikformer_digits.yaml as shipped (20 epochs)",
    "statalong": "recipes/stata_digits.yaml as shipped (20 epochs)",
}


def load(root: Path) -> tuple[dict[str, dict[int, float]], dict[str, list[float]]]:
    """Final val accuracy (%) per variant and seed; energy per sample (uJ, the run's cost report) per variant."""
    acc: dict[str, dict[int, float]] = {}
    energy: dict[str, list[float]] = {}
    for f in root.glob("*_s*/summary.json"):
        m = re.fullmatch(r"(.+)_s(\d+)", f.parent.name)
        if m and m.group(1) in VARIANTS:
            s = json.loads(f.read_text())
            acc.setdefault(m.group(1), {})[int(m.group(2))] = 100 * s["val"]["acc"]
            if "cost" in s:
                energy.setdefault(m.group(1), []).append(s["cost"]["energy_pj_per_sample"] / 1e6)
    return acc, energy


def paired(a: dict[int, float], b: dict[int, float]) -> str:
    diffs = paired_diffs(a, b)
    if not diffs:
        return "n/a"
    m, lo, hi = t_interval(diffs)
    return f"{m:+.2f} [{fmt(lo)}, {fmt(hi)}] (n={len(diffs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="the OUT directory of bench/stata_digits_runs.sh")
    args = ap.parse_args()
    acc, energy = load(args.root)
    print("| variant | seeds | val acc % mean +- std | worst | minus 8-epoch dense [95 % CI] | minus 8-epoch STATA [95 % CI] | energy / sample (uJ) |")
    print("|---|---|---|---|---|---|---|")
    for name, what in VARIANTS.items():
        if name not in acc:
            continue
        v = list(acc[name].values())
        std = statistics.stdev(v) if len(v) > 1 else float("nan")
        vs_stata = "(reference)" if name == "stata" else paired(acc[name], acc.get("stata", {}))
        vs_dense = "(reference)" if name == "dense" else paired(acc[name], acc.get("dense", {}))
        e = fmt(statistics.fmean(energy[name]), 3) if energy.get(name) else "n/a"
        print(f"| {name}: {what} | {len(v)} | {statistics.fmean(v):.2f} +- {fmt(std)} | {min(v):.2f} | {vs_dense} | {vs_stata} | {e} |")
    if "statalong" in acc and "denselong" in acc:
        # The columns above compare with the 8-epoch runs; at 20 epochs the pair that matters is STATA vs dense.
        print(f"\nAt 20 epochs, STATA minus dense [95 % CI]: {paired(acc['statalong'], acc['denselong'])}")


if __name__ == "__main__":
    main()
