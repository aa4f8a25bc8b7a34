"""Profiler overhead: `efficient.profile(spikformer-4-384)` against a plain no-grad forward.

    python bench/profiler.py [--batch 8] [--repeats 5] [--threads N]

Two weight settings: the fresh init (nearly silent neurons) and weights scaled so that neurons
fire at realistic rates (~0.1-0.3), since spike statistics are part of what the profiler pays for.
Prints medians and the ratio profile / forward (target: <= 3x). On CPU, profile() runs our neurons
on their eager torch reference (no compile inside the counting mode), so the eager forward is shown too.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

import efficient
from efficient.profiler import profile


def excite(model: nn.Module, gain: float) -> None:
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * gain / math.sqrt(m.weight[0].numel()))


def timed(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="spikformer-4-384")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for label, gain in (("fresh init", None), ("firing (gain 5)", 5.0)):
        model = efficient.zoo.create(args.model).eval().to(device)
        if gain is not None:
            excite(model, gain)
        spec = efficient.zoo.get_entry(args.model).input_spec
        x = torch.randn(args.batch, *spec.shape, device=device)

        def forward() -> None:
            with torch.no_grad():
                model(x)
            if device == "cuda":
                torch.cuda.synchronize()

        def forward_eager() -> None:  # neurons on the eager torch reference, as profile() runs them on CPU
            for m in model.modules():
                if getattr(m, "backend", None) == "auto":
                    m.backend = "torch"
            try:
                forward()
            finally:
                for m in model.modules():
                    if getattr(m, "backend", None) == "torch":
                        m.backend = "auto"

        def prof() -> None:
            profile(model, inputs=x)
            if device == "cuda":
                torch.cuda.synchronize()

        forward(), forward_eager(), prof()  # warm-up (compiles the CPU neuron kernels once)
        # interleave so that machine noise hits all alike
        tf, te, tp = [], [], []
        for _ in range(args.repeats):
            tf.append(timed(forward, 1))
            te.append(timed(forward_eager, 1))
            tp.append(timed(prof, 1))
        r = profile(model, inputs=x)
        rows.append((label, statistics.median(tf), statistics.median(te), statistics.median(tp),
                     r.totals.get("mean_firing_rate", 0.0)))
    print(f"model {args.model}, batch {args.batch}, T={model.timesteps}, device {device}, threads {torch.get_num_threads()}, repeats {args.repeats}")
    print("| weights | mean firing rate | forward (s) | forward, eager neurons (s) | profile (s) | profile / forward | profile / eager forward |")
    print("|---|---|---|---|---|---|---|")
    for label, f, e, p, fr in rows:
        print(f"| {label} | {fr:.3f} | {f:.3f} | {e:.3f} | {p:.3f} | {p / f:.2f}x | {p / e:.2f}x |")


if __name__ == "__main__":
    main()
