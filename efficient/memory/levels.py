"""Memory levels applied to a model: the plan `optimize` returns, and applying or undoing a level
with named kept outputs (the budget planner in `plan.py` and the meter in `measure.py` build on it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.memory.recompute import KeptOps, is_wrapped, region_modules, require_budget_support, units, unwrap, wrap
from efficient.memory.spikes import BitsHooks, SpikePropagation, SpikeTracker, is_neuron, iter_neurons
from efficient.models.replay import KEEP_OUTPUT_MARK, KEEP_TRACE_MARK, memory_level_step

Level = Literal["none", "bits", "recompute"]
LEVELS: tuple[str, ...] = ("none", "bits", "recompute")


@dataclass
class MemoryPlan:
    """What `optimize` did to a model: the level, the neurons whose outputs are kept as bits, the
    recomputed units and, per unit, the positions of the costly ops whose outputs it keeps; under a
    budget, the fraction of `none`'s bytes the plan keeps on the example and the share of the
    units' matmul/convolution FLOPs still rerun; (after steps) how many saved tensors were packed."""

    level: str
    neurons: list[str] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    keep: dict[str, list[int]] = field(default_factory=dict)
    hooks: BitsHooks | None = None
    note: str = ""
    budget: float | None = None
    kept_fraction: float | None = None
    rerun_share: float | None = None
    budget_of: str = "saved"  # "peak": kept_fraction is the step's peak of live tensors over none's
    plain: list[str] = field(default_factory=list)  # units that run plainly (as at level bits), not rerun
    # rerun units whose reruns keep what a plain call keeps (membrane traces, pool inputs, a convolution's
    # backward whole) instead of rebuilding it by chunks, and plain units whose fused BatchNorm + LIF units keep
    # their membrane traces from forward to backward (as at level none) instead of rebuilding them there:
    # a peak budget's choice, where the step's peak allows it
    keeping: list[str] = field(default_factory=list)
    floor_fraction: float | None = None  # the same fraction with every unit rerun whole
    # modules of rerun units whose outputs their regions keep from forward for the rerun, which then skips those
    # matmuls and convolutions: neurons of fused Linear -> BatchNorm -> LIF units (for the Linear's output), Linears
    # and convolutions (`efficient.models.replay.KEEP_OUTPUT_MARK`): a peak budget's choice
    outputs: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.level == "none":
            return "memory: none (every activation kept dense)"
        if self.note:
            return f"memory: {self.level}: {self.note}"
        text = f"memory: {self.level}: outputs of {len(self.neurons)} neurons kept as bits"
        if self.level == "recompute":
            text += f", {len(self.units)} units recomputed in backward"
            if self.plain:
                text += f", {len(self.plain)} run plainly (as at level bits)"
            if reruns := [u for u in self.keeping if u not in self.plain]:
                text += f", {len(reruns)} rerun keeping their membrane traces (no rebuild by chunks)"
            if plains := [u for u in self.keeping if u in self.plain]:
                text += f", {len(plains)} run plainly keeping their membrane traces (no rebuild in backward)"
            if self.outputs:
                text += f", {len(self.outputs)} outputs kept for their reruns (no matmul or convolution there)"
            if self.keep:
                text += (f", {sum(map(len, self.keep.values()))} matmul/convolution outputs kept "
                         f"in {len(self.keep)} of them")
        if self.budget is not None and self.kept_fraction is not None and self.budget_of == "peak":
            floor = 100 * (self.floor_fraction or 0.0)
            verdict = (f"within the budget of {100 * self.budget:g} %" if self.kept_fraction <= self.budget else
                       f"over the budget of {100 * self.budget:g} %: every unit rerun whole peaks at {floor:.1f} %, "
                       "and what it keeps does not raise that")
            text += f"; its step peaks at {100 * self.kept_fraction:.1f} % of level none's on the example, {verdict}"
        elif self.budget is not None and self.kept_fraction is not None:
            verdict = "within" if self.kept_fraction <= self.budget else "over (every unit reruns whole)"
            text += (f"; keeps {100 * self.kept_fraction:.1f} % of level none's activation bytes on the example, "
                     f"{verdict} the budget of {100 * self.budget:g} %")
            if self.rerun_share is not None:
                text += f", reruns {100 * self.rerun_share:.0f} % of the units' matmul/convolution FLOPs"
        return text


class _State:
    """What `optimize` attached to a model, so that a second call (or level `none`) undoes it."""

    def __init__(self, plan: MemoryPlan, tracker: SpikeTracker, hooks: BitsHooks, handles: list[Any],
                 wrapped: list[nn.Module], marked: list[nn.Module] | None = None) -> None:
        self.plan, self.tracker, self.hooks, self.handles, self.wrapped = plan, tracker, hooks, handles, wrapped
        self.marked = marked or []  # modules of plain units that keep their membrane traces
        self.active: list[Any] = []
        # fused BatchNorm + LIF units leave their membrane traces to their backward (`rebuild_exact`); False
        # keeps them, as the level did before (for comparison in bench/)
        self.rebuild = True

    def enter(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        contexts = (self.hooks.context(), SpikePropagation(self.tracker),
                    *((memory_level_step(),) if self.rebuild else ()))
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
        for m in self.marked:
            m.__dict__.pop(KEEP_TRACE_MARK, None)
            m.__dict__.pop(KEEP_OUTPUT_MARK, None)


def check_level(level: str, where: str = "memory level") -> str:
    if level not in LEVELS:
        raise ConfigError(f"{where}: {level!r} is not a memory level; choose one of {', '.join(LEVELS)} "
                          "(none: dense; bits: spikes saved as bits, same gradients; recompute: units recomputed in backward)")
    return level


def apply(model: nn.Module, level: Level | str = "bits", *, keep: dict[str, Sequence[int]] | None = None,
          plain: Sequence[str] | None = None, keeping: Sequence[str] | None = None,
          outputs: Sequence[str] | None = None) -> MemoryPlan:
    """Apply memory level `level` to `model` in place (replacing any level applied before), with
    `keep` naming per recompute unit the costly ops whose outputs it keeps, `plain` the units that
    are not rerun (they keep what they keep at level bits) and `keeping` the rerun units whose reruns
    keep what a plain call keeps in its backward (membrane traces, pool inputs) rather than rebuild it
    by chunks (`recompute.wrap(lean=False)`: faster, more memory while the unit's rerun lasts), and the
    plain units whose fused BatchNorm + LIF units keep their membrane traces from forward to backward,
    as at level none, rather than rebuild them in backward (faster, more memory over the unit's span), and
    `outputs` the modules (names) of rerun units whose outputs the rerun takes from forward, skipping those
    matmuls and convolutions (more memory from forward to the rerun): the neuron of a fused Linear -> BatchNorm
    -> LIF unit (its Linear's output), a Linear or a convolution;
    say what was done.
    `optimize` is the public entry (it checks its arguments and plans a budget); `keep` is read at
    level recompute only."""
    check_level(level)
    old = getattr(model, "_efficient_memory", None)
    if old is not None:
        old.close()
        del model._efficient_memory
    if level == "none":
        return MemoryPlan("none")
    neurons = [name for name, _ in iter_neurons(model)]
    regions = units(model) if level == "recompute" else []
    keep = {name: sorted(set(v)) for name, v in (keep or {}).items() if v}
    plain = sorted(set(plain or ()))
    keeping = sorted(set(keeping or ()))
    unknown = sorted((set(keep) | set(plain) | set(keeping)) - {n for n, _ in regions})
    if unknown:
        raise ConfigError(f"memory: {', '.join(map(repr, unknown))} not a recompute unit of {type(model).__name__} "
                          f"(its units: {', '.join(n for n, _ in regions) or 'none'})")
    if keep:
        require_budget_support()
    if not neurons and not regions:
        return MemoryPlan(level, note=f"nothing to do: {type(model).__name__} has no spiking neuron this toolkit knows "
                                      "(ours, spikingjelly's, snntorch's) and no recompute unit")
    if regions:
        _record_once_under_compile()
    tracker = SpikeTracker()
    tracker.watch(model)
    hooks = BitsHooks(tracker)
    wrapped: list[nn.Module] = []
    plan = MemoryPlan(level, neurons, hooks=hooks, keep=keep, plain=plain, keeping=keeping)
    marked: list[nn.Module] = []
    plan.outputs = sorted(set(outputs or ()))
    if plan.outputs:  # (the planner applies levels many times, mostly without outputs)
        named = dict(model.named_modules())
        _check_outputs(plan.outputs, named, [(n, m) for n, m in regions if n not in plain], keep)
        for name in plan.outputs:
            named[name].__dict__[KEEP_OUTPUT_MARK] = True
            marked.append(named[name])
    for name, m in regions:
        if not is_wrapped(m):
            if name in plain:
                if name in keeping:  # its neurons keep their traces (`rebuild_exact`)
                    for inner in region_modules(m):
                        inner.__dict__[KEEP_TRACE_MARK] = True
                        marked.append(inner)
                continue
            wrap(m, KeptOps(frozenset(keep[name])) if name in keep else None, lean=name not in keeping)
            wrapped.append(m)
            plan.units.append(name)
    state = _State(plan, tracker, hooks, [], wrapped, marked)
    state.handles.append(model.register_forward_pre_hook(state.enter))
    state.handles.append(model.register_forward_hook(state.exit, always_call=True))
    model._efficient_memory = state  # type: ignore[assignment]
    return plan


def _check_outputs(outputs: list[str], named: dict[str, nn.Module], reruns: list[tuple[str, nn.Module]],
                   keep: dict[str, list[int]]) -> None:
    """A ConfigError unless each of `outputs` names a spiking neuron (of a fused Linear -> BatchNorm -> LIF
    unit), a Linear or a convolution called by a rerun unit that keeps no costly-op outputs under selective
    checkpointing (which runs it under torch's checkpoint, where nothing of ours is kept)."""
    owner = {id(inner): name for name, m in reruns for inner in region_modules(m)}
    for name in outputs:
        m = named.get(name)
        unit = None if m is None else owner.get(id(m))
        if m is None or not (is_neuron(m) or type(m) in (nn.Linear, nn.Conv2d)) or unit is None:
            raise ConfigError(f"memory: outputs: {name!r} is not a spiking neuron, Linear or convolution of a rerun unit "
                              f"of this model (rerun units: {', '.join(n for n, _ in reruns) or 'none'}); name the "
                              "neuron of a fused Linear -> BatchNorm -> LIF unit, or the Linear or convolution, as a "
                              "peak budget's plan lists them")
        if unit in keep:
            raise ConfigError(f"memory: unit {unit!r} keeps costly-op outputs (keep) and an output ({name!r}); "
                              "give it one or the other")


def _record_once_under_compile() -> None:
    """A recomputed region's forward may record things outside itself (STATA's scores and kept counts, a
    firing-rate observer), which a rerun must not record again (eager regions mark their reruns as replays).
    Under torch.compile dynamo refuses such a side effect inside a checkpoint (a graph break, after which the
    region runs as eager checkpoint that replays it, BatchNorm's updates included) unless told that backward
    does not replay it, which is the regions' own rule: so it is told, process-wide."""
    import torch._dynamo

    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def restore(model: nn.Module, plan: MemoryPlan) -> MemoryPlan:
    """Apply `plan` (from `optimize` or `apply`) to `model` again: the same units keep the same outputs."""
    again = apply(model, plan.level, keep=plan.keep, plain=plan.plain, keeping=plan.keeping, outputs=plan.outputs)
    again.budget, again.kept_fraction, again.rerun_share = plan.budget, plan.kept_fraction, plan.rerun_share
    again.budget_of, again.floor_fraction = plan.budget_of, plan.floor_fraction
    return again


__all__ = ["LEVELS", "Level", "MemoryPlan", "apply", "check_level", "restore"]
