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


# --- matmul and convolution outputs a recomputed region keeps from its forward for its rerun

# set by `efficient.memory.levels.apply` on a rerun unit's modules whose outputs its region keeps: the neuron of a
# fused Linear -> BatchNorm -> LIF unit (for that Linear's output), a Linear or a convolution (for its own)
KEEP_OUTPUT_MARK = "_efficient_keeps_output"


class KeptOutputs:
    """The matmul and convolution outputs an eager recomputed region (`efficient.memory.recompute._Region`)
    keeps: filled in call order by its forward, handed back in the same order to its rerun (`given`), each
    dropped from here once handed back."""

    def __init__(self, given: tuple[torch.Tensor, ...] | None = None) -> None:
        self.tensors: list[torch.Tensor | None] = list(given or ())
        self.rerun, self.at = given is not None, 0

    def next(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.at >= len(self.tensors):
            raise RuntimeError(f"memory level recompute: a unit's rerun asked for {self.at + 1} kept outputs, its "
                               f"forward kept {len(self.tensors)}; the rerun must call the units its forward called")
        z, self.tensors[self.at] = self.tensors[self.at], None
        self.at += 1
        if z is None or tuple(z.shape) != tuple(shape):
            raise RuntimeError(f"memory level recompute: a unit's rerun asked for a kept output of shape {tuple(shape)}, "
                               f"its forward kept {None if z is None else tuple(z.shape)} there")
        return z

    def check_done(self) -> None:
        if self.rerun and self.at != len(self.tensors):
            raise RuntimeError(f"memory level recompute: a unit's rerun used {self.at} of the {len(self.tensors)} "
                               "outputs its forward kept; the rerun must call the units its forward called")


@contextlib.contextmanager
def keeping_outputs(store: KeptOutputs) -> Iterator[KeptOutputs]:
    """Run a region's forward (which fills `store`) or rerun (which reads it)."""
    outer = getattr(region_state, "outputs", None)
    region_state.outputs = store
    try:
        yield store
    finally:
        region_state.outputs = outer


_recorded_outputs = threading.local()  # (owner, bytes, FLOPs) of each output kept, while `recording_outputs` runs


@contextlib.contextmanager
def recording_outputs(keep: bool = True) -> Iterator[list[tuple[nn.Module, int, int]]]:
    """Collect (owner, bytes, FLOPs saved) of every output the regions' forwards keep while the block runs (the
    owner: the module marked `KEEP_OUTPUT_MARK`). `keep` False: list them without keeping them, so listing every
    candidate costs no memory (run a forward only then: a rerun would find nothing kept)."""
    seen: list[tuple[nn.Module, int, int]] = []
    _recorded_outputs.seen, _recorded_outputs.keep = seen, keep
    try:
        yield seen
    finally:
        _recorded_outputs.seen = None


def _store_for(owner: nn.Module) -> KeptOutputs | None:
    """The running region's store where `owner` keeps its output there (eager only), else None."""
    if torch.compiler.is_compiling() or not owner.__dict__.get(KEEP_OUTPUT_MARK, False):
        return None
    return getattr(region_state, "outputs", None)  # None outside a region, or in one under torch's checkpoint


def keeps_output(owner: nn.Module) -> bool:
    """Whether the running eager region keeps `owner`'s output for its rerun (`given_output`, `keep_output`)."""
    return _store_for(owner) is not None


def given_output(owner: nn.Module, shape: tuple[int, ...]) -> torch.Tensor | None:
    """In the rerun of an eager recomputed region whose forward kept `owner`'s output (of `shape`): that
    output, handed back (the caller skips computing it). None elsewhere."""
    store = _store_for(owner)
    return store.next(shape) if store is not None and store.rerun else None


def keep_output(owner: nn.Module, out: torch.Tensor, flops: int) -> None:
    """In the forward of an eager recomputed region told to keep `owner`'s output: keep `out` (which cost
    `flops` to compute) for the rerun. Nothing elsewhere."""
    store = _store_for(owner)
    if store is None or store.rerun:
        return
    if (seen := getattr(_recorded_outputs, "seen", None)) is not None:
        seen.append((owner, out.numel() * out.element_size(), flops))
        if not _recorded_outputs.keep:
            return
    store.tensors.append(out)


def linear_output(neuron: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """For the fused Linear -> BatchNorm -> LIF unit that `neuron` fires in, inside an eager recomputed region
    whose forward keeps that unit's Linear output (`neuron` marked `KEEP_OUTPUT_MARK`): in the forward, the
    output `F.linear(x, weight, bias)`, kept; in the rerun, the kept output handed back (no matmul). None
    elsewhere (the unit computes it). The rerun's gradients are the same: the unit's backward reads the kept
    output exactly where it would have read the one computed again."""
    if not keeps_output(neuron):
        return None
    z = given_output(neuron, (x.shape[0], weight.shape[0]))
    if z is None:
        z = torch.nn.functional.linear(x, weight, bias)  # (a region's forward runs without autograd)
        keep_output(neuron, z, 2 * x.shape[0] * x.shape[1] * weight.shape[0])
    return z
