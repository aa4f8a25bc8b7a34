"""Whether the running forward is a replay: activation recomputation (`efficient.memory`'s
`recompute` level) reruns a unit in backward, and what that rerun records about itself (STATA's
scores, kept indices and counts) was already recorded by the forward it repeats. Also whether the
running code is inside a recomputed region at all (its forward or its rerun), which decides what
the zoo's fused units keep for backward there."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn

_state = threading.local()


def replaying() -> bool:
    return bool(getattr(_state, "units", None))


@contextlib.contextmanager
def replay(unit: nn.Module | None = None) -> Iterator[None]:
    """Mark the code inside as a replay of a forward that already ran: the rerun of `unit`, whose
    outputs the rerun does not read (`replays_whole`)."""
    units = _state.__dict__.setdefault("units", [])  # the reruns enclosing the running code, innermost last
    units.append(unit)
    try:
        yield
    finally:
        units.pop()


def replays_whole(unit: nn.Module) -> bool:
    """Whether the running code is the rerun of `unit` itself (the innermost replay): a recomputed
    region's rerun serves only its backward, so values `unit` returns are never read (its outputs
    root the rerun's graph), and an op producing them may leave them uncomputed."""
    units = getattr(_state, "units", None)
    return bool(units) and units[-1] is unit


region_state = threading.local()  # how deep the running code is inside recomputed regions (`recompute.py`)


def in_region() -> bool:
    return getattr(region_state, "depth", 0) > 0


level_state = threading.local()  # how deep the running forward is inside a memory level's step (`efficient.memory`)


@contextlib.contextmanager
def memory_level_step() -> Iterator[None]:
    """Mark a model's forward run at memory level `bits` or `recompute` (eager; the level enters it in the
    model's forward pre-hook): its fused BatchNorm + LIF units leave their membrane traces to their
    backward to rebuild (`rebuild_exact`)."""
    level_state.depth = getattr(level_state, "depth", 0) + 1
    try:
        yield
    finally:
        level_state.depth -= 1


KEEP_TRACE_MARK = "_efficient_keeps_trace"  # set by `efficient.memory.levels.apply` on a plain unit's modules
_rebuilds = threading.local()  # the neurons `rebuild_exact` said yes for, while `recording_rebuilds` runs


@contextlib.contextmanager
def recording_rebuilds() -> Iterator[set[int]]:
    """Collect the ids of the neurons whose fused units leave their traces to their backward to rebuild
    (`rebuild_exact(neuron)` True) while the block runs: the units that have a trace to keep."""
    seen: set[int] = set()
    _rebuilds.seen = seen
    try:
        yield seen
    finally:
        _rebuilds.seen = None


def rebuild_exact(module: nn.Module | None = None) -> bool:
    """Whether a fused BatchNorm + LIF unit called now should keep z but not its membrane trace, which its
    backward rebuilds from z (`bn_lif(keep_membrane=False)`): at a memory level's eager step. The rebuilt
    trace is the forward's bit for bit, and BatchNorm's backward runs per channel, so the gradients are
    those of a unit that kept it: the level's promise (level `bits`: `none`'s gradients exactly) holds,
    while a step keeps one fp32 tensor less per unit. Not inside a recomputed region, whose forward and
    rerun (in backward, outside the level's step) must keep the same tensors: `rebuild_membrane` decides
    there. Not for `module` (the neuron) of a unit run plainly that a peak budget lets keep its trace
    (`KEEP_TRACE_MARK`). Not under torch.compile, where the level enters nothing and inductor decides what a
    step keeps."""
    rebuild = (not torch.compiler.is_compiling() and getattr(level_state, "depth", 0) > 0 and not in_region()
               and not (module is not None and module.__dict__.get(KEEP_TRACE_MARK, False)))
    if rebuild and module is not None and (seen := getattr(_rebuilds, "seen", None)) is not None:
        seen.add(id(module))
    return rebuild


REGION_MARK = "_efficient_region_lean"  # set by `recompute.wrap` on every module of a recomputed unit


def rebuild_membrane(module: nn.Module | None = None) -> bool:
    """Whether a fused BatchNorm + LIF unit called now should leave its membrane trace to its backward
    to rebuild (`bn_lif(keep_membrane=False)`): inside a recomputed region, whose rerun runs in
    backward, where what it keeps lives only until its own backward and the largest rerun sets the
    step's peak. A unit wrapped with `lean=False` (`recompute.wrap`) keeps what it keeps outside a
    region (for comparison in bench/).

    Under torch.compile the region is known from `module` (the neuron), which `recompute.wrap`
    marked when the level was applied (a constant to the compiler, where a thread-local set while
    tracing would break the graph): True for a marked module in training. Without `module`, False
    under compile: the batch-sliced convolution backward and the bits level's max-pool stay eager-only."""
    if torch.compiler.is_compiling():
        return module is not None and module.training and bool(getattr(module, REGION_MARK, False))
    return in_region() and getattr(region_state, "lean", True)
