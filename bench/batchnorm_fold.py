"""Inference with BatchNorm folded into the layer before it (`efficient.fold_batchnorm`): eval
forward time and aten ops per forward, unfolded vs folded, side by side in one process.

    python bench/batchnorm_fold.py --models spikformer-4-384 sdt-2-512 stable-snn-vgg11 --batch 8

Each model is built once; the folded copy is a deep copy of it folded with one sample, and the two
are timed in alternation (median of `--repeats` forwards each, after a warm-up forward). The
outputs of the two are compared first (float32: a membrane within rounding of its threshold may
flip a spike, so the count of differing logits is reported rather than asserted).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import efficient
from efficient.zoo import get_entry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import OpCounter  # noqa: E402 - bench/ is not a package


def _ops(model: torch.nn.Module, x: torch.Tensor) -> int:
    mode = OpCounter()
    with torch.no_grad(), mode:
        model(x)
    return mode.n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["spikformer-4-384", "sdt-2-512", "stable-snn-vgg11"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"# {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {os.cpu_count()} cores, load before {os.getloadavg()[0]:.2f}")
    print("| model (eval, batch %d) | BatchNorms folded | aten ops / forward | folded | forward s | folded s | speed-up | logits differing |" % args.batch)
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        model = efficient.load(name).eval()
        x = torch.rand(args.batch, *get_entry(name).input_spec.shape, generator=torch.Generator().manual_seed(1)) * 2
        folded = copy.deepcopy(model)
        names = efficient.fold_batchnorm(folded, x[:1])
        with torch.no_grad():
            a, b = model(x), folded(x)
            diff = int((a != b).sum())
            times: dict[str, list[float]] = {"plain": [], "folded": []}
            for _ in range(args.repeats):
                for key, m in (("plain", model), ("folded", folded)):
                    t = time.perf_counter()
                    m(x)
                    times[key].append(time.perf_counter() - t)
        p, f = statistics.median(times["plain"]), statistics.median(times["folded"])
        print(f"| {name} | {len(names)} | {_ops(model, x)} | {_ops(folded, x)} | {p:.3f} | {f:.3f} | {p / f:.2f}x | "
              f"{diff} of {a.numel()} |", flush=True)
    print(f"# load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
