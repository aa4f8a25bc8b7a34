"""Host memory of CPU training: glibc's malloc as it is (`system`) against `reuse`
(`efficient.memory.host.keep_freed_memory`: no mmap, no trimming), training steps side by side.

    python bench/host_memory.py --archs sdt-2-512 spikformer-4-384 stable-snn-vgg11 --batch 16 --pairs 3

The setting is process-wide, so each measurement is a fresh process: per architecture, `--pairs`
pairs of processes, system and reuse, the order alternating pair by pair so a drift of the machine's
speed falls on both. A process applies its setting first (as `efficient train` does), builds the
model at memory level `--level`, runs one warm-up step, then `--steps` timed steps (forward + CE +
backward, no optimizer). It reports the median step, and per step the minor page faults and the
system and user CPU seconds (`getrusage`), and the process's peak RSS. Ratios are reuse over system
per pair: geometric mean with a 95 % t-interval.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import RESULT, _child  # noqa: E402 - bench/memory.py: the child-process runner
from robust_study import t_interval  # noqa: E402 - mean and 95 % t-interval (scipy)
ARCHS = ("sdt-2-512", "spikformer-4-384", "stable-snn-vgg11")


def child(spec: dict) -> dict:
    from efficient.memory import host

    host.apply(spec["mode"])
    import memory as M  # bench/memory.py: the same models, inputs and step

    x, y = M._inputs(spec["arch"], spec["batch"])
    model = M.build(spec["arch"], spec["level"], spec["T"])[0]
    M.train_step(model, x, y)  # warm-up: one-off allocations
    steps = []
    for _ in range(spec["steps"]):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        M.train_step(model, x, y)
        t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        steps.append((t, r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime, r1.ru_utime - r0.ru_utime))
    med = [statistics.median(c) for c in zip(*steps)]
    return {"step_s": med[0], "minflt": med[1], "sys_s": med[2], "user_s": med[3],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def geo_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of `ratios` with a 95 % t-interval (of the logs)."""
    m, lo, hi = t_interval([math.log(r) for r in ratios])
    return math.exp(m), math.exp(lo), math.exp(hi)


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--level", default="none", choices=["none", "bits", "recompute"])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(child(json.loads(args.child[1]))), flush=True)
        return 0
    from efficient.memory import host

    if not host.reuse_supported():
        print("this C library is not glibc: nothing to compare")
        return 1
    print(f"# bench/host_memory.py -- {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
          f"level {args.level}, batch {args.batch}, T={args.T}, {args.steps} steps per process; load before {_load()}",
          flush=True)
    out: dict = {"date": str(datetime.date.today()), "machine": platform.machine(), "cores": os.cpu_count(),
                 "args": vars(args), "load_before": _load(), "archs": {}}
    failed = False
    print("\n| architecture | pairs | system step s | reuse step s | reuse / system (95 % CI) | page faults / step, system -> reuse "
          "| sys CPU s / step | peak RSS MiB, system -> reuse |")
    print("|---|---|---|---|---|---|---|---|")
    for arch in args.archs:
        rows: dict[str, list[dict]] = {"system": [], "reuse": []}
        for i in range(args.pairs):
            for mode in (("system", "reuse") if i % 2 == 0 else ("reuse", "system")):
                spec = {"arch": arch, "mode": mode, "batch": args.batch, "T": args.T, "level": args.level,
                        "steps": args.steps}
                r = _child("step", spec, args.timeout_s, script=__file__)
                if "error" in r:
                    print(f"# {arch} {mode}: {r['error']}", flush=True)
                    failed = True
                rows[mode].append(r)
        ok = [(s, u) for s, u in zip(rows["system"], rows["reuse"]) if "error" not in s and "error" not in u]
        out["archs"][arch] = rows
        if not ok:
            continue
        g, lo, hi = geo_ci([u["step_s"] / s["step_s"] for s, u in ok])
        med = lambda mode, k: statistics.median(r[k] for r in rows[mode] if "error" not in r)  # noqa: E731
        print(f"| {arch} | {len(ok)} | {med('system', 'step_s'):.3f} | {med('reuse', 'step_s'):.3f} | "
              f"{g:.3f} [{lo:.3f}, {hi:.3f}] | {med('system', 'minflt'):,.0f} -> {med('reuse', 'minflt'):,.0f} | "
              f"{med('system', 'sys_s'):.2f} -> {med('reuse', 'sys_s'):.2f} | "
              f"{med('system', 'peak_rss_mib'):,.0f} -> {med('reuse', 'peak_rss_mib'):,.0f} |", flush=True)
    out["load_after"] = _load()
    print(f"\n# load after {out['load_after']}")
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
