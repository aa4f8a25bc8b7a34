"""What the memory levels cost the host per training step: a zoo model's structure at toy width
(the arithmetic is next to nothing, so what is left is the levels' Python work: the spike tracker,
the saved-tensor hooks, the torch-function mode that follows spikes through ops), none / bits /
recompute interleaved step by step, and recompute with every unit under torch's checkpoint (as before
units ran as `recompute._Region`s). On a GPU the same work is what a level adds to a step whose
kernels take a few milliseconds (BENCHMARKS.md `## gpu`).

    python bench/memory_host_cost.py                                   # spikformer-4-384, sdt-2-512
    python bench/memory_host_cost.py --models sdt-2-512 --rounds 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from efficient import memory
from efficient.zoo import create
from memory import rewrap, train_step  # bench/memory.py: units wrapped again; zero_grad, forward, CE, backward
from step import OpCounter  # bench/step.py: ops dispatched, and those that do work

# toy widths of each model: the same units, blocks and saved tensors per step as the full model
TOY = {
    "spikformer-4-384": ({"embed_dim": 32, "num_heads": 2, "img_size": 16}, (3, 16, 16)),
    "sdt-2-512": ({"embed_dim": 32, "num_heads": 2, "img_size": 16}, (3, 16, 16)),
}
# "recompute-checkpoint": every unit under torch's checkpoint; "recompute-whole-blocks": each transformer block
# one unit, as Spikformer's were before they reran by halves
LEVELS = ("none", "bits", "recompute", "recompute-checkpoint", "recompute-whole-blocks")


def measure(name: str, rounds: int) -> dict:
    kw, shape = TOY[name]
    x = torch.rand(1, *shape, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1])
    models = {}
    for level in LEVELS:
        torch.manual_seed(0)
        m = create(name, **kw).train()
        if level == "recompute-whole-blocks":
            for blk in m.blocks:
                blk.recompute_parts = list
        models[level] = (m, memory.optimize(m, level.split("-")[0]) if level != "none" else None)
        if level == "recompute-checkpoint":
            rewrap(m, models[level][1], light=False)

    def step(m: torch.nn.Module) -> None:
        train_step(m, x, y)

    for m, _ in models.values():
        for _ in range(3):
            step(m)
    times: dict[str, list[float]] = {level: [] for level in LEVELS}
    for r in range(rounds):  # interleaved, rotating the order: drift hits every level alike
        order = LEVELS[r % len(LEVELS):] + LEVELS[:r % len(LEVELS)]
        for level in order:
            t = time.perf_counter()
            step(models[level][0])
            times[level].append(time.perf_counter() - t)
    plan = models["bits"][1]
    plan.hooks.packed = 0
    step(models["bits"][0])
    packed = plan.hooks.packed
    work = {}
    for level, (m, _) in models.items():  # ops that launch a kernel on a GPU, per step
        counter = OpCounter()
        with counter:
            step(m)
        work[level] = counter.work
    med = {level: 1e3 * statistics.median(v) for level, v in times.items()}
    # per round: the step with the blocks' halves over the step with each block one unit
    halves = statistics.median(a / b for a, b in zip(times["recompute"], times["recompute-whole-blocks"]))
    return {"model": name, "toy": kw, "median_ms": med, "packed_per_step": packed,
            "over_none_ms": {level: med[level] - med["none"] for level in LEVELS[1:]}, "work_ops": work,
            "recompute_over_whole_blocks": halves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["spikformer-4-384", "sdt-2-512"], choices=list(TOY))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# bench/memory_host_cost.py -- torch {torch.__version__}, load {os.getloadavg()[0]:.2f}, 1 thread")
    print("| model (toy width) | none ms | bits ms | recompute ms | recompute, checkpoint ms | bits - none ms | "
          "recompute - none ms | recompute, checkpoint - none ms | recompute, whole blocks - none ms | "
          "recompute / whole blocks, median of rounds | packed / step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.models:
        r = measure(name, args.rounds)
        rows.append(r)
        m, o = r["median_ms"], r["over_none_ms"]
        print(f"| {name} | {m['none']:.2f} | {m['bits']:.2f} | {m['recompute']:.2f} | {m['recompute-checkpoint']:.2f} | "
              f"{o['bits']:.2f} | {o['recompute']:.2f} | {o['recompute-checkpoint']:.2f} | {o['recompute-whole-blocks']:.2f} | "
              f"{r['recompute_over_whole_blocks']:.3f} | {r['packed_per_step']} |")
    print("\n| model (toy width) | " + " | ".join(f"{level} work ops / step" for level in LEVELS) + " |")
    print("|---|" + "---|" * len(LEVELS))
    for r in rows:
        print(f"| {r['model']} | " + " | ".join(str(r["work_ops"][level]) for level in LEVELS) + " |")
    print(f"# load at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
