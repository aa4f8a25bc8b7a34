"""Where a training step's peak of live tensors sits at memory level `recompute`: the most live bytes in the
forward and while each unit's rerun and backward run (every unit rerun whole, or a plan's units run plainly,
keeping traces or outputs), read from one step's allocator records with each unit's forward and backward
marked (`efficient.memory.peak_phases`, as the peak planner reads them). Bytes are the same on any machine.

    python bench/peak_phases.py --archs sdt-2-512
    python bench/peak_phases.py --archs sdt-2-512 --plain head_lif --outputs patch_embed.convs.3 patch_embed.rpe_conv
    python bench/peak_phases.py --archs sdt-2-512 --before bn-max-pool+linear-bits

`--before`: without the changes `bench/rebuild_paths.py --compare` names (joined by +).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory as M  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=["sdt-2-512"], choices=sorted(M.ARCHS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--plain", nargs="*", default=[], help="units run plainly (a plan's `plain`)")
    ap.add_argument("--keeping", nargs="*", default=[], help="units keeping their membrane traces (`keeping`)")
    ap.add_argument("--outputs", nargs="*", default=[], help="outputs kept for reruns (`outputs`)")
    ap.add_argument("--before", default=None, help="changes of bench/rebuild_paths.py --compare to undo (joined by +)")
    args = ap.parse_args()
    import contextlib

    import rebuild_paths as RP

    if args.before and (unknown := [c for c in args.before.split("+") if c not in RP.CHANGES]):
        ap.error(f"--before: {', '.join(unknown)} not a change; choose from {', '.join(RP.CHANGES)} (joined by +)")

    import torch

    from efficient.memory import peak_phases
    from efficient.memory.levels import apply

    torch.set_num_threads(os.cpu_count() or 1)
    plan = {"plain": args.plain, "keeping": args.keeping, "outputs": args.outputs}
    said = "; ".join(f"{k} {', '.join(v)}" for k, v in plan.items() if v) or "every unit rerun whole"
    print(f"# bench/peak_phases.py -- {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
          f"batch {args.batch}, T {args.T}: {said}" + (f"; without {args.before}" if args.before else ""))
    for arch in args.archs:
        x, _ = M._inputs(arch, args.batch)
        model, _, _ = M.build(arch, "none", args.T, None)
        apply(model, "recompute", **plan)
        with RP._before(args.before) if args.before else contextlib.nullcontext():
            found = peak_phases(model, x)
        print(f"\n| {arch}: phase | most live MiB |\n|---|---|")
        for unit, peak in found.items():
            print(f"| {unit} | {peak / M.MiB:,.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
