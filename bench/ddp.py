"""DDP scaling on this machine: samples/s of one recipe with 1 and N processes, same global batch.

    python bench/ddp.py --recipe recipes/spikformer_digits.yaml --steps 30 --nproc 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def throughput(recipe: str, steps: int, nproc: int, out: Path) -> float:
    cmd = [sys.executable, "-m", "efficient", "train", recipe, "--out", str(out), "--nproc", str(nproc),
           f"train.max_steps={steps}", "train.log_every=1", "train.progress=false", "profile.enabled=false", "train.threads=2"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in rows if "samples_per_s" in r]
    return statistics.median(rates[len(rates) // 3 :])  # skip the warm-up third (first-step compile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default="recipes/spikformer_digits.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        res = {n: throughput(args.recipe, args.steps, n, Path(d) / f"n{n}") for n in args.nproc}
    base = res[args.nproc[0]]
    print("| processes | samples/s (median) | vs 1 process |\n|---|---|---|")
    for n, r in res.items():
        print(f"| {n} | {r:.1f} | {r / base:.2f}x |")


if __name__ == "__main__":
    main()
