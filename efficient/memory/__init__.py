"""Activation memory of a training step: what autograd keeps for backward, and how to keep less.

    plan = efficient.memory.optimize(model, "recompute")   # or "bits", or "none" to undo
    plan = efficient.memory.optimize(model, "recompute", budget=0.2, example=x)  # at most 20 % of none
    plan = efficient.memory.optimize(model, "recompute", budget=0.2, example=x, budget_of="peak")

Levels (recipe key `train.memory`):
- `none`: every saved activation dense, as autograd keeps it.
- `bits`: binary spike tensors saved for backward are kept packed 8 per byte and unpacked exactly
  in backward (`spikes.py`): gradients are bitwise those of `none`.
- `recompute`: `bits`, and every unit (a spiking transformer block, a spiking stem, a Linear/Conv ->
  BatchNorm -> neuron unit, a neuron on its own) keeps only its input and recomputes the rest in
  backward (`recompute.py`): gradients
  equal `none`'s up to floating-point rounding; BatchNorm running statistics update once per step.
  With a `budget` (a fraction of `none`'s bytes, measured on example inputs), units also keep the
  outputs of the matmuls and convolutions that save the most rerun FLOPs per byte, as many as the
  budget allows (`plan.py`). With `budget_of="peak"` the budget is a fraction of `none`'s step peak
  of live tensors (what `torch.cuda.max_memory_allocated` reports), and units run plainly (no rerun,
  as at level `bits`) while the step's peak stays within it or within the peak of every unit rerun
  whole, whichever is larger; units whose reruns do not hold the step's peak then rerun keeping their
  membrane traces, as a plain call does, instead of rebuilding them by chunks in backward, and units
  run plainly keep theirs from forward to backward, as at level `none`, where the peak allows it.

Works on any model whose neurons are ours, spikingjelly's or snntorch's (a plain `nn.Module`
tree; units of those libraries' models are their neurons). `measure.py` counts the bytes a step
keeps, per layer and block. `host.py` is the host side of CPU training: glibc's malloc keeping freed
tensors for the next step (`train.host_memory: reuse`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.memory.levels import LEVELS, Level, MemoryPlan, apply, check_level, restore
from efficient.memory.plan import BUDGETS_OF, check_budget, choose_kept, choose_plain_for_peak, peak_phases


def optimize(model: nn.Module, level: Level | str = "bits", *, budget: float | None = None, example: Any = None,
             loss_fn: Callable[[Any], torch.Tensor] | None = None,
             keep: dict[str, Sequence[int]] | None = None, budget_of: str = "saved") -> MemoryPlan:
    """Apply memory level `level` to `model` in place (replacing any level applied before) and say
    what was done. `model` must not be compiled yet: compile after optimizing.

    At level `recompute`, every unit reruns whole unless a `budget` is given: then `example` (the
    model's inputs, as for `activation_memory`; `loss_fn` as there) is measured, and units keep
    the matmul/convolution outputs that save the most rerun FLOPs per byte while the step keeps at
    most `budget` x level none's bytes (see `plan.py`). `budget_of="peak"`: the budget is a fraction
    of level none's step peak of live tensors instead, and the step's peak stays within it or within
    that of every unit rerun whole, whichever is larger, with the units that fit run plainly instead of
    rerun (budget 0: those that cost that peak nothing), the reruns that fit keep their membrane traces, and
    the rerun units' matmul and convolution outputs that fit are kept for the rerun (none of those ops
    there).
    `keep` names them directly (`plan.keep` of an earlier plan: unit -> positions among its costly
    ops, in call order)."""
    check_level(level)
    if budget_of not in BUDGETS_OF:
        raise ConfigError(f"memory budget_of: {budget_of!r} is not one of {', '.join(BUDGETS_OF)} (saved: a fraction of "
                          "level none's saved activation bytes; peak: a fraction of level none's step peak of live tensors)")
    if (budget is not None or keep is not None) and level != "recompute":
        raise ConfigError(f"memory level {level!r}: a budget or kept outputs apply to level recompute only")
    if budget_of != "saved" and budget is None:
        raise ConfigError(f"memory budget_of={budget_of!r} applies with a budget; give budget=... or drop budget_of")
    if budget is not None and keep is not None:
        raise ConfigError("memory: give a budget (the outputs to keep are chosen) or `keep` (they are named), not both")
    if budget is not None:
        check_budget(budget)
        if example is None:
            raise ConfigError("memory budget: pass example inputs (example=...) to measure the budget on, "
                              "or drop the budget to rerun every unit whole")
        choice = (choose_plain_for_peak if budget_of == "peak" else choose_kept)(model, example, budget, loss_fn)
        plan = apply(model, level, keep=choice.keep, plain=choice.plain, keeping=choice.keeping, outputs=choice.outputs)
        plan.budget, plan.kept_fraction, plan.budget_of = choice.budget, choice.fraction, choice.of
        plan.floor_fraction = choice.floor_bytes / choice.none_bytes if choice.none_bytes else None
        plan.rerun_share = choice.rerun_flops / choice.flops if choice.flops else None
        return plan
    return apply(model, level, keep=keep)


__all__ = ["LEVELS", "Level", "MemoryPlan", "check_level", "optimize", "peak_phases", "restore"]
