"""Accuracy vs energy per sample, dense and STATA, for each spiking-transformer family of the
cluttered-digits seed study (`bench/stata_families_runs.sh`), from the run archive that
`bench/stata_vs_dense.py --archive` keeps: one point per model (mean +- std over its seeds), an
arrow from dense to its STATA twin.

    python bench/stata_families_frontier.py bench/figures/stata_families_runs.json bench/figures/stata_families_frontier.png
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def points(archive: dict) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """{family: {"dense"|"stata": [(energy uJ, acc %) per seed]}} from run names `<family>_[stata_]cluttered_s<seed>`."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for name, s in archive.items():
        m = re.fullmatch(r"(.+?)_(stata_)?cluttered_s\d+", name)
        if not m:
            continue
        arm = "stata" if m.group(2) else "dense"
        energy = s["cost"]["energy_pj_per_sample"] / 1e6
        out.setdefault(m.group(1), {}).setdefault(arm, []).append((energy, 100 * s["val"]["acc"]))
    return out


def _ms(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive", type=Path)
    ap.add_argument("png", type=Path)
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(json.loads(a.archive.read_text()))
    if not pts:
        raise SystemExit(f"{a.archive}: no cluttered-digits runs in it")
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for fam, arms in sorted(pts.items()):
        xy = {}
        for arm, style in (("dense", "o"), ("stata", "s")):
            if arm not in arms:
                continue
            (ex, es), (ay, ays) = _ms([e for e, _ in arms[arm]]), _ms([c for _, c in arms[arm]])
            xy[arm] = (ex, ay)
            ax.errorbar([ex], [ay], xerr=[es], yerr=[ays], fmt=style, capsize=3,
                        label=f"{fam} {'STATA' if arm == 'stata' else 'dense'} (n={len(arms[arm])})")
        if len(xy) == 2:
            ax.annotate("", xy=xy["stata"], xytext=xy["dense"], arrowprops={"arrowstyle": "->", "alpha": 0.5})
    ax.set_xscale("log")
    ax.set_xlabel("energy per sample (uJ, log scale; stata count: 4.6 pJ/MAC, 0.9 pJ/SOP)")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title("cluttered digits: dense -> STATA per family (mean +- std over seeds)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(a.png, dpi=120)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
