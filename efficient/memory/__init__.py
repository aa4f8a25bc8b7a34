"""Activation memory of a training step: what autograd keeps for backward, and how to keep less.

    plan = efficient.memory.optimize(model, "recompute")   # or "bits", or "none" to undo

Levels (recipe key `train.memory`):
- `none`: every saved activation dense, as autograd keeps it.
- `bits`: binary spike tensors saved for backward are kept packed 8 per byte and unpacked exactly
  in backward (`spikes.py`): gradients are bitwise those of `none`.
- `recompute`: `bits`, and every unit (a spiking transformer block, a spiking stem, a Linear/Conv ->
  BatchNorm -> neuron unit, a neuron on its own) keeps only its input and recomputes the rest in
  backward (`recompute.py`): gradients
  equal `none`'s up to floating-point rounding; BatchNorm running statistics update once per step.

Works on any model whose neurons are ours, spikingjelly's or snntorch's (a plain `nn.Module`
tree; units of those libraries' models are their neurons). `measure.py` counts the bytes a step
keeps, per layer and block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.memory.recompute import is_wrapped, units, unwrap, wrap
from efficient.memory.spikes import BitsHooks, SpikePropagation, SpikeTracker, iter_neurons

Level = Literal["none", "bits", "recompute"]
LEVELS: tuple[str, ...] = ("none", "bits", "recompute")


@dataclass
class MemoryPlan:
    """What `optimize` did to a model: the level, the neurons whose outputs are kept as bits, the
    recomputed units, and (after steps) how many saved tensors were packed."""

    level: str
    neurons: list[str] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    hooks: BitsHooks | None = None
    note: str = ""

    def summary(self) -> str:
        if self.level == "none":
            return "memory: none (every activation kept dense)"
        if self.note:
            return f"memory: {self.level}: {self.note}"
        text = f"memory: {self.level}: outputs of {len(self.neurons)} neurons kept as bits"
        if self.level == "recompute":
            text += f", {len(self.units)} units recomputed in backward"
        return text


class _State:
    """What `optimize` attached to a model, so that a second call (or level `none`) undoes it."""

    def __init__(self, tracker: SpikeTracker, hooks: BitsHooks, handles: list[Any], wrapped: list[nn.Module]) -> None:
        self.tracker, self.hooks, self.handles, self.wrapped = tracker, hooks, handles, wrapped
        self.active: list[Any] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        contexts = (self.hooks.context(), SpikePropagation(self.tracker))
        for ctx in contexts:
            ctx.__enter__()
        self.active.append(contexts)

    def exit(self, module: nn.Module, args: Any, out: Any) -> None:
        if torch.compiler.is_compiling() or not self.active:
            return
        for ctx in reversed(self.active.pop()):
            ctx.__exit__(None, None, None)
        if not self.active:
            self.tracker.forget()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.tracker.close()
        for m in self.wrapped:
            unwrap(m)


def check_level(level: str, where: str = "memory level") -> str:
    if level not in LEVELS:
        raise ConfigError(f"{where}: {level!r} is not a memory level; choose one of {', '.join(LEVELS)} "
                          "(none: dense; bits: spikes saved as bits, same gradients; recompute: units recomputed in backward)")
    return level


def optimize(model: nn.Module, level: Level | str = "bits") -> MemoryPlan:
    """Apply memory level `level` to `model` in place (replacing any level applied before) and say
    what was done. `model` must not be compiled yet: compile after optimizing."""
    check_level(level)
    old = getattr(model, "_efficient_memory", None)
    if old is not None:
        old.close()
        del model._efficient_memory
    if level == "none":
        return MemoryPlan("none")
    neurons = [name for name, _ in iter_neurons(model)]
    regions = units(model) if level == "recompute" else []
    if not neurons and not regions:
        return MemoryPlan(level, note=f"nothing to do: {type(model).__name__} has no spiking neuron this toolkit knows "
                                      "(ours, spikingjelly's, snntorch's) and no recompute unit")
    tracker = SpikeTracker()
    tracker.watch(model)
    hooks = BitsHooks(tracker)
    wrapped: list[nn.Module] = []
    plan = MemoryPlan(level, neurons, hooks=hooks)
    if level == "recompute":
        for name, m in regions:
            if not is_wrapped(m):
                wrap(m)
                wrapped.append(m)
                plan.units.append(name)
    state = _State(tracker, hooks, [], wrapped)
    state.handles.append(model.register_forward_pre_hook(state.enter))
    state.handles.append(model.register_forward_hook(state.exit, always_call=True))
    model._efficient_memory = state  # type: ignore[assignment]
    return plan


__all__ = ["LEVELS", "Level", "MemoryPlan", "check_level", "optimize"]
