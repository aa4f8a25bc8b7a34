"""The spiking attention as one op each way (`efficient::ssa_unit`) against the plain path it replaced
(heads split off, the plain attention's matmuls, heads merged back), on this CPU, side by side:

- ops per training step: what a dispatch mode sees (the count of `bench/step.py`) and what runs (the
  outermost aten calls a `torch.profiler` trace of a real eager step records, inside our ops too);
- the eager step time, paired rounds alternating the two paths in one process;
- the saved-for-backward bytes of one step (deduplicated by storage).

`--change concat`: instead, the fused Q/K/V unit's parameter concatenations as one autograd node
(`spikformer.concat_parameters`, one split per group backward) against a `torch.cat` per group.

    python bench/attention_unit.py --models spikformer-4-384 spikformer-stata --batch 8 --rounds 8
    python bench/attention_unit.py --change concat --models spikformer-stata --batch 8 --rounds 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step as step_bench  # noqa: E402
from host_memory import geo_ci  # noqa: E402 - geometric mean of ratios, 95 % t-interval

from efficient.models import spikformer  # noqa: E402


def use_unit(on: bool) -> None:
    """Route the zoo's eager attention through the unit op (on) or the plain path (off)."""
    spikformer._one_call_allowed = _ORIGINAL if on else (lambda *modules: False)


_ORIGINAL = spikformer._one_call_allowed
_CONCAT = spikformer.concat_parameters


def use_concat(on: bool) -> None:
    """The fused Q/K/V unit's parameters concatenated by one node (on) or by a `torch.cat` each (off)."""
    spikformer.concat_parameters = _CONCAT if on else (lambda groups: [torch.cat(g) for g in groups])


def executed_ops(step) -> int:
    """Outermost aten calls of one step: an aten op whose callers include no aten op."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        n += p is None
    return n


def saved_bytes(step) -> int:
    """Bytes autograd saves for backward in one step, each storage counted once."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["spikformer-4-384", "spikformer-stata"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--change", choices=("unit", "concat"), default="unit",
                    help="what the two paths differ in: the attention op (unit) or the parameter concatenation")
    args = ap.parse_args()
    use = use_unit if args.change == "unit" else use_concat
    labels = ("plain", "unit op") if args.change == "unit" else ("a cat per group", "one node")
    print(f"# {' '.join(['python bench/attention_unit.py', *sys.argv[1:]])}")
    print(f"# torch {torch.__version__}, {os.cpu_count()} cores, load before {os.getloadavg()[0]:.2f}")
    rows = []
    for name in args.models:
        step, _, _ = step_bench._ours(name, args.batch)
        res = {}
        for on in (False, True):
            use(on)
            step()
            with step_bench.OpCounter() as c:
                step()
            res[on] = {"dispatched": c.n, "work": c.work, "executed": executed_ops(step), "saved": saved_bytes(step)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                use(on)
                t0 = time.perf_counter()
                step()
                times[on].append(time.perf_counter() - t0)
        use(True)
        g, lo, hi = geo_ci([a / b for a, b in zip(times[True], times[False])])
        rows.append((name, res, {k: statistics.median(v) for k, v in times.items()}, (g, lo, hi)))
    print(f"# load after {os.getloadavg()[0]:.2f}\n")
    print("| model, batch %d | path | ops a dispatch mode sees (do work) | aten ops run | saved for backward MiB "
          "| eager step s |" % args.batch)
    print("|---|---|---|---|---|---|")
    for name, res, med, (g, lo, hi) in rows:
        for on, label in zip((False, True), labels):
            r = res[on]
            print(f"| {name} | {label} | {r['dispatched']} ({r['work']}) | {r['executed']} | {r['saved'] / 2**20:.1f} | {med[on]:.3f} |")
        print(f"| {name} | {labels[1]} / {labels[0]} | | | | {g:.3f} [{lo:.3f}, {hi:.3f}] |")


if __name__ == "__main__":
    main()
