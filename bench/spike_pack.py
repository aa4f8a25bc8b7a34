"""Spike packing: pack + unpack time of the fast path against the torch reference, and the bytes a
saved spike tensor takes before and after packing.

    python bench/spike_pack.py                          # CPU, the default shapes
    python bench/spike_pack.py --device cuda --json out.json
    python bench/spike_pack.py --quick                  # fewer repeats, the first shape only

Shapes: a Spikformer-4-384 block activation on CIFAR ([T=4, B=64, N=64, D=384], the acceptance
shape), a smaller and a ragged one (numel not a multiple of 8), at 20 % firing. Every run first
checks that the fast path's bytes equal the reference's and that unpacking restores the input
exactly; the timings are medians over `--repeats` calls. Ratios > 1 mean the fast path is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from efficient.kernels import spike_pack as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stata_kernels import median_ms  # noqa: E402 - one timing loop for the kernel benchmarks

SHAPES = {
    "[4, 64, 64, 384]": (4, 64, 64, 384),
    "[4, 16, 64, 384]": (4, 16, 64, 384),
    "[4, 8, 197, 511] ragged": (4, 8, 197, 511),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def run(dev: torch.device, shapes: dict, dtypes: list[str], repeats: int, backend: str) -> list[dict]:
    rows = []
    for name, shape in shapes.items():
        for dn in dtypes:
            dt = DTYPES[dn]
            g = torch.Generator(device=dev).manual_seed(0)
            x = (torch.rand(shape, device=dev, generator=g) < 0.2).to(dt)
            bits = sp.pack_spikes(x, backend=backend)
            ref_bits = sp.pack_spikes_ref(x)
            assert torch.equal(bits, ref_bits), f"{name} {dn}: packed bytes differ from the reference"
            y = sp.unpack_spikes(bits, shape, dt, backend=backend)
            assert torch.equal(y, x) and y.dtype == dt, f"{name} {dn}: unpack does not restore the input"
            t = {
                "pack_ms": median_ms(lambda: sp.pack_spikes(x, backend=backend), dev, repeats),
                "unpack_ms": median_ms(lambda: sp.unpack_spikes(bits, shape, dt, backend=backend), dev, repeats),
                "ref_pack_ms": median_ms(lambda: sp.pack_spikes_ref(x), dev, repeats),
                "ref_unpack_ms": median_ms(lambda: sp.unpack_spikes_ref(bits, shape, dt), dev, repeats),
            }
            before, after = x.numel() * x.element_size(), bits.numel()
            rows.append({
                "shape": name, "dtype": dn, "numel": x.numel(), **t,
                "round_trip_ms": t["pack_ms"] + t["unpack_ms"], "ref_round_trip_ms": t["ref_pack_ms"] + t["ref_unpack_ms"],
                "speedup": (t["ref_pack_ms"] + t["ref_unpack_ms"]) / (t["pack_ms"] + t["unpack_ms"]),
                "bytes_before": before, "bytes_after": after, "compression": before / after,
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto", choices=sp.BACKENDS)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the first shape, 3 repeats")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    dev = torch.device(args.device)
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    repeats = 3 if args.quick else args.repeats
    rows = run(dev, shapes, args.dtypes, repeats, args.backend)
    print(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else f'{os.cpu_count()} cores'}), "
          f"torch threads {torch.get_num_threads()}, backend {sp.resolve_backend(args.backend, torch.empty(0, device=dev))}, "
          f"median of {repeats}")
    print(f"{'shape':<24} {'dtype':<5} {'pack ms':>8} {'unpack ms':>9} {'ref pack':>9} {'ref unpack':>10} {'speedup':>8} "
          f"{'MB before':>9} {'MB after':>8} {'ratio':>5}")
    for r in rows:
        print(f"{r['shape']:<24} {r['dtype']:<5} {r['pack_ms']:>8.2f} {r['unpack_ms']:>9.2f} {r['ref_pack_ms']:>9.2f} "
              f"{r['ref_unpack_ms']:>10.2f} {r['speedup']:>7.1f}x {r['bytes_before'] / 2**20:>9.2f} "
              f"{r['bytes_after'] / 2**20:>8.2f} {r['compression']:>5.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
