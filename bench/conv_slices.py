"""A convolution's forward by slices of the batch against the whole call, on this CPU, side by side at
the stable-SNN VGG-11's six convolution shapes (CIFAR 32 px, T x batch samples): time (paired rounds,
median ratio), whether the values are the whole call's bit for bit, and the call's peak of live tensor
bytes (`torch.profiler` memory records). Slices hold at most `--slice` output elements each (the
default: `efficient.memory.conv_backward.FORWARD_SLICE`, what a recomputed region's conv units use).

    python bench/conv_slices.py --samples 256 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from efficient.memory.conv_backward import FORWARD_SLICE, sliced_conv2d

# (in channels, out channels, side) of VGG-11's convolutions at 32 px (the stable-SNN model's layout)
VGG11 = [(3, 64, 32), (64, 128, 32), (128, 256, 16), (256, 256, 16), (256, 512, 8), (512, 512, 8)]


def peak_mib(fn) -> float:
    """Peak of live tensor bytes the call allocates (above what was live before it), MiB."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    live = peak = 0
    for r in sorted((r for r in prof.profiler.kineto_results.events() if r.name() == "[memory]"),
                    key=lambda r: r.start_ns()):
        live += r.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=256, help="T x batch (256: T=4, b64)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--slice", type=int, default=FORWARD_SLICE, help="output elements per slice")
    ap.add_argument("--density", type=float, default=0.2, help="fraction of ones in the spike inputs")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# python bench/conv_slices.py {' '.join(sys.argv[1:])}")
    print(f"# torch {torch.__version__}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
          f"load before {os.getloadavg()[0]:.2f}")
    rows = []
    import efficient.memory.conv_backward as cb

    cb.FORWARD_SLICE = args.slice
    for c_in, c_out, side in VGG11:
        x = (torch.rand(args.samples, c_in, side, side) < args.density).float()
        w = torch.randn(c_out, c_in, 3, 3) * (2.0 / (9 * c_in)) ** 0.5
        whole = lambda: F.conv2d(x, w, None, 1, 1)  # noqa: E731
        sliced = lambda: sliced_conv2d(x, w, None, 1, 1, 1, 1)  # noqa: E731
        same = torch.equal(whole(), sliced())
        times: dict[str, list[float]] = {"whole": [], "sliced": []}
        for r in range(args.rounds):
            for k in (("whole", "sliced") if r % 2 == 0 else ("sliced", "whole")):
                fn = whole if k == "whole" else sliced
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        ratio = statistics.median(s / w_ for s, w_ in zip(times["sliced"], times["whole"]))
        out_mib = args.samples * c_out * side * side * 4 / 2**20
        rows.append((c_in, c_out, side, out_mib, peak_mib(whole), peak_mib(sliced), statistics.median(times["whole"]),
                     statistics.median(times["sliced"]), ratio, same))
    print(f"# load after {os.getloadavg()[0]:.2f}\n")
    print(f"| conv ({args.samples} samples) | output MiB | peak whole MiB | peak sliced MiB | whole ms | sliced ms "
          "| sliced / whole (median of rounds) | bit for bit |")
    print("|---|---|---|---|---|---|---|---|")
    for c_in, c_out, side, out, pw, ps, tw, ts, ratio, same in rows:
        print(f"| {c_in} -> {c_out} @ {side}x{side} | {out:.0f} | {pw:.1f} | {ps:.1f} | {tw * 1e3:.0f} | {ts * 1e3:.0f} "
              f"| {ratio:.2f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
