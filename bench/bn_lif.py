"""BatchNorm + LIF as one op (`efficient.kernels.bn_lif`) against the two calls it replaces
(`nn.BatchNorm` then `efficient.kernels.lif`), forward + backward, at the zoo units' shapes.

Each case is checked before it is timed: spikes (at most one in a million may flip where the two
normalisations round differently at the threshold; on CPU none may), gradients and running
statistics. Times are medians, fused and separate alternated in one process.

    python bench/bn_lif.py                      # CPU, Spikformer-4-384 units at batch 8
    python bench/bn_lif.py --device cuda        # CUDA: the Triton kernel, CIFAR b64 and ImageNet b32 units
    TRITON_INTERPRET=1 python bench/bn_lif.py --dry-run   # the CUDA cases at toy sizes on this CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

from efficient.kernels.bn_lif import bn_lif
from efficient.kernels.lif import lif

# (label, z shape [T*R, C, ...], T): Spikformer-4-384's units at CIFAR (T=4, 64 tokens), its stem's
# widest conv stage, and Spikformer-8-512's units at ImageNet (196 tokens)
CASES = {
    "cpu": [("mlp fc1 [4x8x64, 1536]", (4 * 8 * 64, 1536), 4), ("proj [4x8x64, 384]", (4 * 8 * 64, 384), 4),
            ("stem conv [4x8, 48, 32, 32]", (4 * 8, 48, 32, 32), 4)],
    "cuda": [("cifar b64 fc1 [4x64x64, 1536]", (4 * 64 * 64, 1536), 4), ("cifar b64 proj [4x64x64, 384]", (4 * 64 * 64, 384), 4),
             ("cifar b64 stem [4x64, 48, 32, 32]", (4 * 64, 48, 32, 32), 4),
             ("imagenet b32 fc1 [4x32x196, 2048]", (4 * 32 * 196, 2048), 4),
             ("imagenet b32 stem [4x32, 64, 112, 112]", (4 * 32, 64, 112, 112), 4)],
    "dry": [("toy linear [4x2x8, 16]", (4 * 2 * 8, 16), 4), ("toy conv [2x2, 4, 6, 6]", (2 * 2, 4, 6, 6), 2)],
}


def _setup(shape, T, device, seed=0):
    torch.manual_seed(seed)
    bn = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(shape[1]).to(device)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
    z = torch.randn(shape, device=device) * 1.5
    g = torch.randn(shape, device=device)
    return bn, z, g


def _fused(bn, z, g, T, impl):
    zz = z.detach().requires_grad_()
    s = bn_lif(zz, T, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, bn.eps, impl=impl)
    (s * g).sum().backward()
    return s, zz.grad


def _separate(bn, z, g, T, impl):
    zz = z.detach().requires_grad_()
    y = bn(zz)
    s = lif(y.reshape(T, -1), impl=impl).view(z.shape)
    (s * g).sum().backward()
    return s, zz.grad


def check(shape, T, device, impl, exact: bool) -> list[str]:
    """Fused vs separate on one case: what differs (empty when they agree)."""
    bn, z, g = _setup(shape, T, device)
    a, b = copy.deepcopy(bn), copy.deepcopy(bn)
    sf, gf = _fused(a, z, g, T, impl)
    ss, gs = _separate(b, z, g, T, impl)
    bad = []
    flips = int((sf != ss).sum())
    if flips > (0 if exact else max(1, sf.numel() // 10**6)):
        bad.append(f"{flips} spikes differ")
    pairs = [("grad z", gf, gs), ("grad weight", a.weight.grad, b.weight.grad), ("grad bias", a.bias.grad, b.bias.grad),
             ("running mean", a.running_mean, b.running_mean), ("running var", a.running_var, b.running_var)]
    for name, x, y in pairs:
        if exact and not torch.equal(x, y):
            bad.append(f"{name} not bit for bit")
        elif not exact and flips == 0:
            # against the tensor's own scale: the weight and bias gradients are sums over every
            # element of a channel (up to 262144 here) taken in another order, so an entry near zero
            # can differ by more than an element-wise tolerance allows
            rel = ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item()
            if rel > 1e-5:
                bad.append(f"{name} differs by {rel:.2e} of its largest entry")
    return bad


def _time(fn, device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dry-run", action="store_true", help="the CUDA cases at toy sizes on this CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--impl", default=None, help="implementation (default: triton on CUDA, inductor on CPU)")
    ap.add_argument("--repeats", type=int, default=0, help="timed rounds (default 20 on CUDA, 7 on CPU, 1 dry)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else args.device)
    key = "dry" if args.dry_run else ("cuda" if device.type == "cuda" else "cpu")
    impl = args.impl or ("triton" if key in ("cuda", "dry") else "inductor")
    repeats = args.repeats or {"cuda": 20, "cpu": 7, "dry": 1}[key]
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.machine()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# bench/bn_lif.py -- {name}, torch {torch.__version__}, impl {impl}, load {load:.2f}")
    ok, rows = True, []
    for label, shape, T in CASES[key]:
        bad = check(shape, T, device, impl, exact=impl != "triton")
        if bad:
            ok = False
            print(f"FAIL {label}: {'; '.join(bad)}")
            continue
        bn, z, g = _setup(shape, T, device)
        fused, sep = [], []
        _fused(bn, z, g, T, impl)  # warm-up (compiles where the implementation compiles)
        _separate(bn, z, g, T, impl)
        for _ in range(repeats):  # alternated: the machine's drift hits both alike
            fused += _time(lambda: _fused(bn, z, g, T, impl), device, 1)
            sep += _time(lambda: _separate(bn, z, g, T, impl), device, 1)
        f, s = statistics.median(fused) * 1e3, statistics.median(sep) * 1e3
        rows.append({"case": label, "fused_ms": f, "separate_ms": s, "speedup": s / f})
    print("\n| unit (fwd+bwd, training) | one op ms | BatchNorm + LIF ms | speed-up |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['fused_ms']:.2f} | {r['separate_ms']:.2f} | {r['speedup']:.2f}x |")
    print(f"\nchecks before timing: {'all match' if ok else 'FAILURES above'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": name, "torch": torch.__version__, "impl": impl, "correct": ok, "rows": rows}, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
