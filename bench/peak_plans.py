"""What a memory budget of the step's peak chooses (`optimize(..., budget_of="peak")`): per architecture and
budget, level none's step peak of live tensors, the peak with every unit rerun whole, the plan's measured
peak, the units it runs plainly (starred: keeping their membrane traces from forward to backward), the reruns
that keep their membrane traces (those off the step's peak), the neurons whose fused Linear units keep their
Linear outputs for their reruns, the share of the units' matmul/convolution FLOPs still rerun, and how long
planning took. Bytes are the same on any machine; planning time is this machine's.

    python bench/peak_plans.py --archs spikformer-4-384 --budgets 0 0.2 0.3 0.5
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory as M  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=["spikformer-4-384", "sdt-2-512", "stable-snn-vgg11"],
                    choices=sorted(M.ARCHS))
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.0, 0.2])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--T", type=int, default=4)
    args = ap.parse_args()

    import torch

    from efficient.memory.plan import choose_plain_for_peak

    torch.set_num_threads(os.cpu_count() or 1)
    print(f"# bench/peak_plans.py -- {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
          f"batch {args.batch}, T {args.T}, load {os.getloadavg()[0]:.2f} before")
    print("\n| architecture | none peak MiB | every unit rerun whole MiB | budget | plan's peak MiB | vs none "
          "| units run plainly | reruns keeping their traces | outputs kept for reruns "
          "| matmul/conv FLOPs still rerun | planning s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arch in args.archs:
        x, _ = M._inputs(arch, args.batch)
        model, _, _ = M.build(arch, "none", args.T, None)
        for budget in args.budgets:
            t0 = time.perf_counter()
            c = choose_plain_for_peak(model, x, budget)
            # a plain unit that keeps its membrane traces from forward to backward is starred
            plains = ", ".join(u + ("*" if u in c.keeping else "") for u in c.plain)
            took = time.perf_counter() - t0
            print(f"| {arch} | {c.none_bytes / M.MiB:,.1f} | {c.floor_bytes / M.MiB:,.1f} | {budget:g} | "
                  f"{c.kept_bytes / M.MiB:,.1f} | {c.fraction:.1%} | {plains or '-'} | "
                  f"{', '.join(u for u in c.keeping if u not in c.plain) or '-'} | {', '.join(c.outputs) or '-'} | "
                  f"{c.rerun_flops / c.flops:.0%} | "
                  f"{took:.0f} |", flush=True)
    print(f"\n# load {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
