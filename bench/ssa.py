"""Spiking self-attention on the CPU at the zoo's shapes: the kernel's torch reference path and the
model's attention module, time and peak memory.

    python bench/ssa.py [--repeats 5] [--threads 1] [--batch 4]

Cases (T=4): Spikformer-4-384 on CIFAR (N=64 tokens, 12 heads of 32) and Spikformer-8-512 on
ImageNet (N=196 tokens, 8 heads of 64). `reference` = `spiking_attention(..., backend="torch")`
with the anchor (one more token) and scores (the path CPU training takes; forward + backward); `module` = the model's
`SSA` block (Q/K/V Linear-BN-LIF units, attention, attention LIF, projection unit; training mode,
forward + backward). Each case runs in a fresh process: peak = rise of the process's peak RSS
during the first call (its temporaries and any one-time set-up included); time = median of
`--repeats` calls after it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SHAPES = {"cifar N=64": (64, 384, 12), "imagenet N=196": (196, 512, 8)}  # N, embed dim, heads


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(case: str, shape: str, batch: int, repeats: int, threads: int) -> dict:
    import torch

    from efficient.kernels.ssa import spiking_attention
    from efficient.models.spikformer import SSA
    from efficient.models.spiking_transformer import SpikingTransformerConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    T, B = 4, batch
    N, dim, heads = SHAPES[shape]
    d = dim // heads
    if case == "reference":
        q, k, v = ((torch.rand(T, B, heads, N + 1, d) < 0.25).float().requires_grad_() for _ in range(3))

        def step():
            y, s, c = spiking_attention(q, k, v, 0.125, anchor=True, scores=True, backend="torch")
            (y.sum() + s.sum() + c.sum()).backward()
    else:
        m = SSA(dim, heads, SpikingTransformerConfig().neuron(), kernel_backend="torch").train()
        x = torch.randn(T, B, N, dim, requires_grad=True)

        def step():
            m(x)[0].sum().backward()

    before = _peak_mib()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    peak = _peak_mib() - before
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    tokens = N + 1 if case == "reference" else N  # the reference runs STATA's anchor as token 0
    return {"case": case, "shape": shape, "T": T, "B": B, "N": tokens, "heads": heads, "d": d,
            "ms": 1e3 * statistics.median(times), "first_ms": 1e3 * first, "peak_mib": peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--one", nargs=2, metavar=("CASE", "SHAPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_case(*args.one, args.batch, args.repeats, args.threads)))
        return 0
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    print("| case | shape | T x B x H x N x d | median ms (fwd+bwd) | peak MiB |")
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        for case in ("reference", "module"):
            cmd = [sys.executable, __file__, "--one", case, shape, "--repeats", str(args.repeats),
                   "--threads", str(args.threads), "--batch", str(args.batch)]
            r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            print(f"| {case} | {shape} | {r['T']} x {r['B']} x {r['heads']} x {r['N']} x {r['d']} | {r['ms']:.1f} | {r['peak_mib']:.1f} |",
                  flush=True)
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
