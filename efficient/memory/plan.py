"""Which matmul and convolution outputs a `recompute` step keeps, under a byte budget.

A unit rerun whole keeps only its input, at the price of its forward again, and its matmuls and
convolutions are most of that price. Keeping the output of one of them saves rerunning it, for its
output's bytes. Starting from every unit rerun whole (the least memory), outputs are kept in the
order of FLOPs saved per byte (a 512-channel convolution of a 4x4 map before a 3-channel one of a
32x32 image), while the step stays within the budget: a fraction of what level `none` keeps. What
reruns is then the cheap elementwise work (BatchNorm, neurons, pools) and the costly ops whose
outputs are large for their cost.

Bytes are counted by `efficient.memory.measure` on example inputs and FLOPs by torch's formulas:
both depend on shapes, not values, so every process and a resumed run choose the same ops. Planning
takes three forwards of the example (none, every unit whole while listing its costly ops, the
chosen plan) and one more per correction, once, before training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.memory.levels import apply
from efficient.memory.measure import activation_memory
from efficient.memory.recompute import KeptOps, require_budget_support, units


@dataclass
class BudgetChoice:
    """What the planner measured and chose: per unit, the positions of the costly ops whose outputs
    are kept; the bytes of `none` and of the chosen plan on the example; the FLOPs of the units'
    costly ops in all and of those still rerun."""

    budget: float
    keep: dict[str, list[int]]
    none_bytes: int
    kept_bytes: int
    flops: int = 0
    rerun_flops: int = 0
    ops: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return self.kept_bytes / self.none_bytes if self.none_bytes else 0.0


def check_budget(budget: Any) -> float:
    """The budget as a float, or a ConfigError saying what a budget is."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ConfigError(f"memory budget: {budget!r} is not a fraction in [0, 1] of level none's activation bytes "
                          "(0: every unit reruns whole; 1: every matmul and convolution output is kept)")
    return float(budget)


def choose_kept(model: nn.Module, example: Any, budget: float,
                loss_fn: Callable[[Any], torch.Tensor] | None = None) -> BudgetChoice:
    """The costly-op outputs to keep so that a step keeps at most `budget` x level none's bytes on
    `example` (none when even every unit rerun whole does not fit). Leaves `model` at level none."""
    budget = check_budget(budget)
    require_budget_support()

    def measure(level: str = "recompute", keep: dict[str, list[int]] | None = None) -> int:
        apply(model, level, keep=keep)
        return activation_memory(model, example, loss_fn, backward=False).total_bytes

    try:
        none = measure("none")
        # every unit whole (it keeps nothing more while it lists its costly ops): the floor
        apply(model, "recompute")
        ops: dict[str, list[tuple[int, int, int]]] = {}
        for name, m in units(model):
            ops[name] = []
            m.__dict__["_efficient_kept"] = KeptOps(record=ops[name])
        floor = activation_memory(model, example, loss_fn, backward=False).total_bytes
    finally:
        apply(model, "none")
    target = budget * none
    # most FLOPs saved per byte kept first; ties in model order
    ranked = sorted(((name, i, size, fl) for name, found in ops.items() for i, size, fl in found if size),
                    key=lambda o: -o[3] / o[2])
    chosen: list[tuple[str, int, int, int]] = []
    estimate = floor
    for op in ranked:
        if estimate + op[2] > target:
            continue  # a smaller one further down may still fit
        chosen.append(op)
        estimate += op[2]

    def keep_of(ch: list[tuple[str, int, int, int]]) -> dict[str, list[int]]:
        keep: dict[str, list[int]] = {}
        for name, i, _, _ in ch:
            keep.setdefault(name, []).append(i)
        return {name: sorted(v) for name, v in keep.items()}

    try:
        # outputs that share storage with something already kept count once, or more than once
        # when a view keeps its base: check, and drop the last kept outputs while over the budget
        total = measure(keep=keep_of(chosen)) if chosen else floor
        while total > target and chosen:
            chosen.pop()
            total = measure(keep=keep_of(chosen)) if chosen else floor
    finally:
        apply(model, "none")
    flops = sum(fl for found in ops.values() for _, _, fl in found)
    return BudgetChoice(budget, keep_of(chosen), none, total, flops, flops - sum(o[3] for o in chosen), ops)


__all__ = ["BudgetChoice", "check_budget", "choose_kept"]
