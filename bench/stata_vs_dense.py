"""Accuracy and energy of trained runs, dense vs STATA, from their run dirs (any dataset).

Reads each run's `summary.json`: final validation accuracy and the trainer's cost report
(`efficient.profile` on the first `profile.samples` validation samples; 45 nm: 4.6 pJ/MAC,
0.9 pJ/SOP). Prints a markdown table, mean +- std over seeds, the STATA / dense energy ratio and
the accuracy difference paired by seed (`train.seed` of each run's config.yaml) with its 95 % t-interval.

    python bench/stata_vs_dense.py --dense runs/sd/dense_s0 ... --stata runs/sd/stata_s0 ...

`--archive FILE.json` keeps what the table needs from each run (its summary and seed) under the run
directory's name, so a study can be re-tabulated, or finished later, without the run directories:
a run named on the command line is read from its directory when it exists (and stored in the
archive), else from the archive. `--convention NAME` re-profiles each run directory with that
counting convention (`efficient.profile_run`, the run's own validation samples) and uses those
counts: runs trained under different profiler versions are then counted alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from efficient.config import load_yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stata_ablation import fmt, paired_diffs, t_interval  # noqa: E402


def load(runs: list[str], archive: dict | None = None, convention: str | None = None) -> list[dict]:
    """Each run's summary, with its seed (from config.yaml) under "seed", in seed order; read from
    the run directory when it exists (and stored in `archive`), else from `archive`. With
    `convention`, the cost block is re-profiled under it (run directories only)."""
    out = []
    for r in runs:
        d = Path(r)
        if (d / "summary.json").exists():
            s = json.loads((d / "summary.json").read_text())
            s["seed"] = load_yaml(d / "config.yaml")["train"]["seed"]
            if convention:
                from efficient.profiler import profile_run

                s["cost"] = dict(profile_run(d, convention=convention).totals)
                s["cost_convention"] = convention
            if archive is not None:
                archive[d.name] = s
        elif archive is not None and d.name in archive:
            s = archive[d.name]
            if convention and s.get("cost_convention") != convention:
                raise SystemExit(f"{r}: the archive holds its cost under {s.get('cost_convention', 'its training-time count')!r}, "
                                 f"not {convention!r}, and the run directory is gone")
        else:
            raise SystemExit(f"{r}: no summary.json there" + (f" and no run {d.name!r} in the archive" if archive is not None else ""))
        out.append(s)
    return sorted(out, key=lambda s: s["seed"])


def save_archive(path: Path, archive: dict) -> None:
    """Write the archive atomically (a crash leaves the old file whole)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(dict(sorted(archive.items())), indent=1))
    tmp.replace(path)


def accuracy_by_seed(runs: list[dict]) -> dict[int, float]:
    return {s["seed"]: 100 * s["val"]["acc"] for s in runs}


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.4g} +- {statistics.stdev(xs) if len(xs) > 1 else 0.0:.2g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense", nargs="+", required=True)
    ap.add_argument("--stata", nargs="+", required=True)
    ap.add_argument("--archive", type=Path, default=None, help="JSON file of run summaries (read and updated)")
    ap.add_argument("--convention", default=None, help="re-profile the runs under this counting convention (e.g. stata, efficient)")
    a = ap.parse_args()
    archive = json.loads(a.archive.read_text()) if a.archive and a.archive.exists() else ({} if a.archive else None)
    rows = {"dense": load(a.dense, archive, a.convention), "stata": load(a.stata, archive, a.convention)}
    if a.archive:
        save_archive(a.archive, archive)
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
        print(f"{name} per seed acc % (seeds {', '.join(str(s['seed']) for s in runs)}): "
              + ", ".join(f"{100 * s['val']['acc']:.2f}" for s in runs))
    e = {n: statistics.mean(s["cost"]["energy_pj_per_sample"] for s in r) for n, r in rows.items()}
    diffs = paired_diffs(accuracy_by_seed(rows["stata"]), accuracy_by_seed(rows["dense"]))
    if not diffs:
        raise SystemExit("no seed is in both --dense and --stata: nothing to pair")
    m, lo, hi = t_interval(diffs)
    print(f"energy STATA / dense: {e['stata'] / e['dense']:.3f} ({100 * (1 - e['stata'] / e['dense']):.1f} % less)")
    print(f"accuracy STATA - dense, paired by seed: {mean_std(diffs)} points; "
          f"{m:+.2f} [{fmt(lo)}, {fmt(hi)}] 95 % CI, n={len(diffs)}")


if __name__ == "__main__":
    main()
