"""Recomputed units: a unit keeps only its input for backward and recomputes the rest there.

A unit is a module whose class says `recompute_unit = True` (the zoo's spiking transformer blocks,
spiking stems and Linear/Conv -> BatchNorm -> neuron units), or one of our (stateless) spiking
neurons outside any unit. A unit with `recompute_parts()` stands for the smaller units it returns
(Spikformer's stem: its stages), so backward holds one part's rerun at a time. Eager, a unit's call is
a `_Region`: its forward runs without autograd (nothing inside is recorded or saved), its tensor inputs
are saved once (as bits when they are spikes and the bits hooks are on, see `efficient.memory.spikes`),
and backward reruns the unit on them with the forward's RNG state and autocast and takes the gradients
of its inputs and parameters from the rerun. That is torch's non-reentrant checkpoint without its
bookkeeping per saved tensor, which cost the host more than the rerun itself on a toy-width step. Calls
that a `_Region` cannot follow run under `torch.utils.checkpoint` (non-reentrant) instead: an argument
that is an object (it might hold a tensor), a unit with kept outputs (`KeptOps`), and a unit whose
output is large and not a residual stream's (see `_OUT_NUMEL`). A rerun must see what the forward saw and
must not count twice what the forward already counted: every buffer of the unit (BatchNorm's
running statistics and batch count, any other running statistic) is set back to its value before
the forward for the rerun and to its value after the forward once the rerun is done, so the step
updates them exactly once, and the rerun is marked a replay (`efficient.models.replay`), so records
a model keeps of its forward (STATA's scores, kept indices and counts) are not appended twice.

A unit can also keep the outputs of some of its matmuls and convolutions (`KeptOps`, chosen under
a byte budget by `plan.py`): torch's selective checkpointing caches them in forward and the rerun
reads them instead of computing them again, so only the cheap elementwise work between them reruns.
They pass through the saved-tensor hooks around the region, so they are counted and, were they
spikes, packed like any other saved tensor. Lighter still, a unit can keep just some matmul and convolution
outputs (`efficient.models.replay.KEEP_OUTPUT_MARK`, named by a peak budget's plan: a fused Linear -> BatchNorm
-> LIF unit's Linear output under its neuron, a Linear's, a convolution's): the light region saves them beside
its inputs and its rerun reads them instead of running those ops, with the same gradients; such a unit always
runs as a light region (eager only).

Under `torch.compile` the same regions become the compiler's checkpoint regions (recomputed in the
compiled backward; buffer updates happen once, in the forward graph). Each region's input then
passes through an opaque copy (`region_input`): inductor's partitioner may recompute any plain op,
and where a region's input is a view of the region before it (a reshape of a stem stage's spikes)
it recomputed that input too, so the compiled backward reran a whole chain of regions from the
first one's input at once (Spikformer's stem from the image: 39 % of level none's peak at CIFAR
b64, against 17 % eager). A copy it may not recompute is saved, and each region reruns from its
own input, as in eager; a region whose input is spikes (a stem stage after the first) keeps it as
bits, packed by an opaque op before the region and unpacked as the region's first op (rerun with
it), and one whose input is a count of spikes by construction (Spikformer's and QKFormer's residual
streams, as the unit states) keeps it as uint8 the same way (`region_counts`). Inside a compiled
region a BatchNorm + LIF pair also runs as the fused op whose backward
rebuilds the membrane trace a chunk of channels at a time, and a stem stage's BatchNorm + LIF +
max-pool as the chunked op pair, as the eager rerun does (`wrap` marks the modules a unit calls,
which the compiler reads as constants: a flag set while tracing would break the graph); inductor's
own BatchNorm and LIF would hold the whole trace.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, get_device_states,
                                    set_device_states)
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten
from torch.utils.flop_counter import flop_registry

from efficient.errors import ConfigError
from efficient.kernels import bn_lif
from efficient.kernels.spike_pack import pack_binary, pack_spikes, unpack_spikes_ref
from efficient.memory.conv_backward import bits_reads
from efficient.memory.spikes import active_tracker, is_neuron, propagation_suspended
from efficient.models.replay import KEEP_OUTPUT_MARK, REGION_MARK, KeptOutputs, in_region, keeping_outputs, region_state


@torch.library.custom_op("efficient::region_input", mutates_args=())
def region_input(x: torch.Tensor) -> torch.Tensor:
    """A copy of a region's input that inductor's partitioner keeps rather than recomputes (an op
    outside its list of recomputable ones): the region's rerun starts from it."""
    return x.clone()


@region_input.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _pass_through(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return grad


region_input.register_autograd(_pass_through)


class _GradientTo(torch.autograd.Function):
    """`values` (a view of them) carrying `x`'s gradient: a compiled region's input rebuilt from what the
    region keeps (bits, counts) as its first ops, whose gradient is the input's. The rebuilding ops run
    before this function, not inside it: torch 2.11 left the ops inside an autograd.Function nested in a
    checkpoint region without the region's tags, and the partitioner then kept their outputs (the region's
    fp32 input) instead of rerunning them."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return values.view_as(values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


def _from_bits(forward: Callable[..., Any], bits: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A region over spikes: its input rebuilt from the bits by plain shifts and masks, which the compiler fuses
    and reruns in backward from the bits it keeps (exact for 0/1 values, which the unit vouches for,
    `recompute_spike_input`); the unit gets the bits too, which its convolution's backward reads."""
    return forward(_GradientTo.apply(unpack_spikes_ref(bits, x.shape, x.dtype), x), *args, spike_bits=bits, **kwargs)


@torch.library.custom_op("efficient::region_counts", mutates_args=())
def region_counts(x: torch.Tensor) -> torch.Tensor:
    """A compiled region's input that holds small counts of spikes, as uint8: what the partitioner
    keeps (an opaque op: it may not recompute it from x). Exact for whole numbers 0..255 only, which
    the unit vouches for (`recompute_count_bound`)."""
    return x.to(torch.uint8)


@region_counts.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.uint8)


@torch.library.custom_op("efficient::counts_to", mutates_args=())
def counts_to(counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 counts back as `dtype`. Opaque on purpose: inductor would fuse the casts of every block's
    counts (same shape) into one kernel at the start of backward, so all inputs would exist in fp32
    at once; as an extern op each is cast where its region reruns."""
    return counts.to(dtype)


@counts_to.register_fake
def _(counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(counts, dtype=dtype)


def _from_counts(forward: Callable[..., Any], counts: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A region over a count of spikes: its input cast back from the uint8 counts it keeps."""
    return forward(_GradientTo.apply(counts_to(counts, x.dtype), x), *args, **kwargs)


def _tracked(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.requires_grad


def _kept_input(t: torch.Tensor) -> torch.Tensor:
    """A compiled region's input as the tensor its rerun starts from: an activation (one autograd
    tracks) passes through `region_input`; the step's own inputs are kept as they are."""
    return region_input(t) if _tracked(t) else t


def _input_bound(module: nn.Module) -> int | None:
    """What a unit says its first argument holds: 1 for a neuron's spikes (`recompute_spike_input()`;
    such a unit's forward takes `spike_bits`, in a compiled region the bits the region keeps), the
    largest value of a count of spikes that fits a byte (`recompute_count_bound`, set by the model),
    else None."""
    says = getattr(module, "recompute_spike_input", None)
    if says is not None and says():
        return 1
    bound = getattr(module, "recompute_count_bound", None)
    return bound if bound is not None and 0 < bound <= 255 else None


def _vouch(module: nn.Module, args: tuple) -> None:
    """Tell the model's spike tracker what the unit says its first argument holds (spikes, or counts
    of them), so the region keeps it as bits or uint8 whatever ops made it: a region's forward runs
    without the spike propagation (`propagation_suspended`), which would otherwise have followed
    them out of the region before."""
    if not args or not isinstance(args[0], torch.Tensor) or (bound := _input_bound(module)) is None:
        return
    tracker = active_tracker()
    if tracker is not None:
        tracker.add(args[0], bound)


def region_modules(unit: nn.Module) -> list[nn.Module]:
    """Every module a unit's forward calls, each once: its own modules, or for a part that owns
    none (a stem stage calling its stem's modules), those it names (`recompute_modules()`)."""
    named = getattr(unit, "recompute_modules", None)
    seen: dict[int, nn.Module] = {}
    # `Module.modules()`'s order (pre-order, each module once) without its generators and prefixes: a region
    # asks for this on every call, forward and rerun
    stack = list(reversed(named())) if named is not None else [unit]
    while stack:
        m = stack.pop()
        if id(m) not in seen:
            seen[id(m)] = m
            stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return list(seen.values())


def is_unit(m: nn.Module) -> bool:
    return bool(getattr(type(m), "recompute_unit", False))


def _stateless(m: nn.Module) -> bool:
    """Our neurons start every call from rest, so a rerun sees what forward saw. spikingjelly's and
    snntorch's carry their membrane between calls (a rerun would start from forward's end state):
    they keep their outputs as bits but are not rerun."""
    from efficient.models.neurons import SpikingNeuron

    return isinstance(m, SpikingNeuron)


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit recomputed at level `recompute`: declared units and neurons
    outside them, outermost first (nothing inside a unit is wrapped again)."""
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, m: nn.Module) -> None:
        if m is not model and (is_unit(m) or (is_neuron(m) and _stateless(m))):
            # a unit may stand for smaller ones (a stem's stages): backward then holds one at a time
            parts = m.recompute_parts() if is_unit(m) and hasattr(m, "recompute_parts") else []
            if parts:
                found.extend((f"{prefix}.{n}", p) for n, p in parts)
            else:
                found.append((prefix, m))
            return
        for name, child in m.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    return found


class _BufferReplay:
    """The buffers of a unit around its rerun: the rerun starts from what the forward saw (running
    statistics before the forward's update, so anything computed from them is recomputed exactly)
    and ends with what the forward left (so the step updates them once). The rerun is also marked a
    replay (`efficient.models.replay`): what the forward recorded is not recorded again."""

    def __init__(self, module: nn.Module, modules: list[nn.Module] | None = None) -> None:
        self.module, self.modules = module, modules
        self.before: list[torch.Tensor] = []

    def buffers(self) -> list[torch.Tensor]:
        """The buffers of the modules the unit calls (`region_modules`, unless given)."""
        modules = region_modules(self.module) if self.modules is None else self.modules
        return [b for m in modules for b in m._buffers.values() if b is not None]  # `buffers(recurse=False)`

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self.before = _copies(self.buffers())
        yield

    @contextlib.contextmanager
    def rerun(self) -> Iterator[None]:
        from efficient.models.replay import replay

        buffers = self.buffers()
        after = _copies(buffers)
        _copy_into(buffers, self.before)
        try:
            with replay(self.module):
                yield
        finally:
            _copy_into(buffers, after)


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors`: one multi-tensor op (x * 1 is x bit for bit, -0.0 and NaN included) where
    no bool would be promoted, instead of a launch per buffer (a block has a dozen)."""
    if not tensors:
        return []
    if any(t.dtype == torch.bool for t in tensors):
        return [t.detach().clone() for t in tensors]
    with torch.no_grad():
        return list(torch._foreach_mul([t.detach() for t in tensors], 1))


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)


def is_costly(func: Any) -> bool:
    """An op whose output a unit may keep rather than rerun: one torch counts FLOPs for (matmuls,
    convolutions, attention)."""
    return getattr(func, "_overloadpacket", None) in flop_registry


def op_flops(func: Any, out: Any, args: tuple, kwargs: dict) -> int:
    return int(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))


def budget_supported() -> bool:
    """Whether this torch's checkpoint can hand the outputs selective checkpointing keeps (`KeptOps`) to the
    saved-tensor hooks around it (`respect_saved_tensors_hooks`), which count them and pack them where they
    are spikes."""
    return "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters


def require_budget_support() -> None:
    """A ConfigError on a torch whose kept outputs would pass the hooks by: not counted, spikes not packed."""
    if not budget_supported():
        raise ConfigError(f"memory budget: torch {torch.__version__} cannot count or pack the outputs selective "
                          "checkpointing keeps (its checkpoint has no respect_saved_tensors_hooks); upgrade torch, "
                          "or drop the budget to rerun every unit whole")


class KeptOps:
    """Which costly ops of a unit's forward keep their outputs: `keep` holds their positions among
    the unit's costly ops, in call order. With `record` set, every costly op is appended to it as
    (position, output bytes, FLOPs) instead, and none is kept (how `plan.py` sees a unit)."""

    def __init__(self, keep: frozenset[int] = frozenset(), record: list[tuple[int, int, int]] | None = None) -> None:
        self.keep, self.record = frozenset(keep), record

    def policy(self) -> Callable[..., CheckpointPolicy]:
        position = 0

        def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            nonlocal position
            if not is_costly(func):
                return CheckpointPolicy.PREFER_RECOMPUTE
            i, position = position, position + 1
            if self.record is not None:
                out = ctx.op_output
                size = sum(t.numel() * t.element_size() for t in (out if isinstance(out, (tuple, list)) else (out,))
                           if isinstance(t, torch.Tensor))
                self.record.append((i, size, op_flops(func, out, args, kwargs)))
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if i in self.keep else CheckpointPolicy.PREFER_RECOMPUTE

        return decide

    @property
    def selective(self) -> bool:
        return bool(self.keep) or self.record is not None


@contextlib.contextmanager
def _both(outer: contextlib.AbstractContextManager, inner: contextlib.AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


class _EachRerun(contextlib.AbstractContextManager):
    """A rerun's context made afresh each time it is entered: checkpoint enters it once per backward
    through the region, and a retained graph's second backward enters it again."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.make, self.entered = make, []

    def __enter__(self) -> Any:
        cm = self.make()
        self.entered.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.entered.pop().__exit__(*exc)


def _contexts(module: nn.Module, kept: KeptOps | None) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    r = _BufferReplay(module)
    if kept is None or not kept.selective:
        return r.forward(), _EachRerun(r.rerun)
    caching, cached = create_selective_checkpoint_contexts(kept.policy())
    # kept outputs go through the saved-tensor hooks around the region (counted, packed if spikes);
    # checkpoint() sets this itself only on a context it is handed bare
    caching.respect_saved_tensors_hooks = True
    return _both(r.forward(), caching), _EachRerun(lambda: _both(r.rerun(), cached))


def _inside(forward: Callable[..., Any], *args: Any, lean: bool = True, **kwargs: Any) -> Any:
    region_state.depth = getattr(region_state, "depth", 0) + 1
    outer = getattr(region_state, "lean", True)
    region_state.lean = outer and lean
    try:
        return forward(*args, **kwargs)
    finally:
        region_state.depth -= 1
        region_state.lean = outer


# leaves a call or its output may hold besides tensors for the light region (`_Region`): nothing that
# could hide a tensor from it
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)
_TENSOR = object()  # where a tensor goes in a call's or an output's leaves
_NOT_LIGHT = object()  # `_light_region`: this call cannot be one
# A `_Region`'s backward holds the gradient of the unit's outputs for the whole rerun (autograd passes it in
# and keeps it until backward returns), where torch's checkpoint frees it once the unit's last op has used
# it. That costs nothing where the gradient lives on anyway: a residual block or half (`recompute_residual`:
# the stream's gradient reaches the block's input unchanged). Another unit whose outputs are larger than one
# chunk of the chunked units (`bn_lif.RECOMPUTE_CHUNK` elements: a stem stage, a VGG's first units, whose
# reruns set a step's peak) keeps torch's checkpoint, chosen from its previous call's output (its first call
# is a checkpoint's, which measures it; the size stays when a level is applied again).
_OUT_NUMEL = "_efficient_out_numel"
# set by `wrap` on a unit some of whose modules keep their outputs for its rerun (`KEEP_OUTPUT_MARK`): it runs as
# a light region whatever its output's size, the one region that keeps them
_OUTPUTS = "_efficient_keeps_outputs"


def _plain(leaves: list[Any]) -> bool:
    """Whether pytree leaves are all tensors or plain values (nothing that could hide a tensor)."""
    return all(isinstance(v, (torch.Tensor, *_PLAIN)) for v in leaves)


def _skeleton(leaves: list[Any]) -> list[Any]:
    """`leaves` with every tensor replaced by `_TENSOR`: what to fill in again (`tree_unflatten`)."""
    return [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]


class _RegionCall:
    """What a light region's backward needs of its forward: how to call the unit again on the kept
    inputs, the modules it calls (listed once per call), the RNG and autocast state the forward ran
    with, its buffers' values around it (`_BufferReplay`), and the structure of its output. Holds no
    tensor of the call: its inputs are kept by autograd."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any], leaves: list[Any], spec: Any, lean: bool) -> None:
        self.module, self.forward, self.spec, self.lean = module, forward, spec, lean
        self.slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.plain = _skeleton(leaves)
        self.modules = region_modules(module)
        self.buffers = _BufferReplay(module, self.modules)
        self.out_spec: Any = None
        self.out_plain: list[Any] = []

    def call(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.plain)
        for i, t in zip(self.slots, inputs):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, self.spec)
        return _inside(self.forward, *args, lean=self.lean, **kwargs)

    def save_state(self, inputs: tuple[torch.Tensor, ...]) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.devices, self.device_rng = get_device_states(*inputs)
        dev = next((t.device.type for t in inputs), "cpu")
        self.amp = [(d, torch.get_autocast_dtype(d)) for d in {dev, "cpu"} if torch.is_autocast_enabled(d)]

    @contextlib.contextmanager
    def replayed_state(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            set_device_states(self.devices, self.device_rng)
            for d, dtype in self.amp:
                stack.enter_context(torch.autocast(d, dtype))
            yield


def _params(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The trainable parameters of the modules a unit calls (`region_modules`), each once, in a fixed
    order; read when asked, so a backward sees the parameters its rerun uses."""
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m._parameters.values():
            if p is not None and p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


class _Handoff(torch.autograd.Function):
    """`x` as a tensor autograd tracks through `anchor` (no elements); its gradient goes to
    `stash[i]`, `anchor` gets none."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, x: torch.Tensor, stash: list, i: int) -> torch.Tensor:
        ctx.stash, ctx.i = stash, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.stash[ctx.i] = grad
        return None, None, None, None


class _Region(torch.autograd.Function):
    """A unit's call as a recomputed region without `torch.utils.checkpoint`'s bookkeeping: forward runs
    the unit without autograd (nothing inside is recorded or saved) and keeps only its tensor inputs
    (through the saved-tensor hooks around it, so spikes are kept as bits); backward reruns it with
    autograd on those inputs, under the forward's RNG and autocast state and buffer values, and
    returns the gradients of its inputs and of the parameters it uses (`torch.autograd.grad`, so
    they reach `.grad` through the engine, where DDP's and FSDP's hooks see them). The matmul and convolution
    outputs it is told to keep (`efficient.models.replay.KEEP_OUTPUT_MARK`) are saved beside the inputs and
    handed back to the rerun in call order, which skips those ops. On a toy-width step
    it cut the level's extra host cost to about 0.8x of checkpoint's, and to about 0.6x with the forward run
    outside the spike propagation (BENCHMARKS.md `## memory`)."""

    @staticmethod
    def forward(ctx: Any, run: _RegionCall, n_inputs: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = tensors[:n_inputs]
        run.save_state(inputs)
        kept = KeptOutputs()  # the outputs its modules keep for the rerun (`keep_output`)
        with run.buffers.forward(), propagation_suspended(), keeping_outputs(kept):
            out = run.call(inputs)
        leaves, run.out_spec = tree_flatten(out)
        if not _plain(leaves):
            raise TypeError(f"memory level recompute: unit {type(run.module).__name__} returned "
                            f"{sorted({type(v).__name__ for v in leaves if not _plain([v])})}, "
                            "which a recomputed region cannot look into; return tensors (in tuples, lists or dicts)")
        run.out_plain = _skeleton(leaves)
        ctx.run, ctx.n_inputs = run, n_inputs
        ctx.save_for_backward(*inputs, *kept.tensors)
        return tuple(v for v in leaves if isinstance(v, torch.Tensor))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        run, n = ctx.run, ctx.n_inputs
        need = ctx.needs_input_grad[2:]
        # an input whose gradient is wanted enters the rerun through `_Handoff` from a tensor of no
        # elements: nothing here holds it, so the rerun frees it as soon as it is done with it (a
        # convolution that keeps bits), as torch's checkpoint does
        stash: list[torch.Tensor | None] = [None] * n
        anchors: list[torch.Tensor | None] = [None] * n
        saved = ctx.saved_tensors
        inputs, kept = list(saved[:n]), KeptOutputs(saved[n:])
        del saved
        with torch.enable_grad():
            for i in range(n):
                if need[i] and inputs[i].is_floating_point():
                    anchors[i] = inputs[i].new_empty(0).requires_grad_()
                    inputs[i] = _Handoff.apply(anchors[i], inputs[i].detach(), stash, i)
        params = _params(run.modules)
        if len(params) != len(need) - n:
            raise RuntimeError(f"memory level recompute: unit {type(run.module).__name__} has {len(params)} trainable "
                               f"parameters in backward but had {len(need) - n} in its forward; do not change a "
                               "model's parameters between its forward and its backward")
        got: tuple[torch.Tensor | None, ...] = ()
        # the buffers go back to their values after the forward only once the rerun's graph is done with
        # them: BatchNorm's backward node keeps the running statistics it was called with
        with torch.enable_grad(), run.replayed_state(), run.buffers.rerun():
            with keeping_outputs(kept):
                outs = [v for v in tree_flatten(run.call(tuple(inputs)))[0] if isinstance(v, torch.Tensor)]
            kept.check_done()
            del inputs, kept
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wrt = [a for a in anchors if a is not None] + [p for p, w in zip(params, need[n:]) if w]
            if pairs and not run.module.__dict__.get("_efficient_light_checked"):
                _check_leaves(run.module, [o for o, _ in pairs], wrt)
            # the rerun's outputs are only the roots of its graph: backward starts from their graph edges, so
            # an output nothing in the graph saved (a neuron's spikes) is freed before backward runs
            roots = [get_gradient_edge(o) for o, _ in pairs]
            grads_in = [g for _, g in pairs]
            del outs, pairs
            if roots and wrt:
                got = torch.autograd.grad(roots, wrt, grads_in, allow_unused=True)
            del roots, grads_in
        param_grads = iter(got[sum(a is not None for a in anchors):])
        grads_out = (None, None, *stash, *(next(param_grads, None) if w else None for w in need[n:]))
        # `_Handoff`'s contexts hold this list, and a node of the rerun's graph may outlive the step: emptied, it keeps
        # no input gradient alive past this backward (it kept one per call and step where a LIF's backward had
        # written that gradient over its membrane trace)
        stash.clear()
        return grads_out


def _check_leaves(unit: nn.Module, outs: list[torch.Tensor], wrt: list[torch.Tensor]) -> None:
    """Once per unit: that its rerun reaches no trainable tensor but its inputs and its modules'
    parameters, whose gradient `_Region` would otherwise drop (a parameter of a module the unit
    calls without owning it, and does not name in `recompute_modules()`)."""
    known = {id(t) for t in wrt}
    seen: set[int] = set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    stray: list[str] = []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)
        if var is not None and id(var) not in known:
            stray.append(f"{type(var).__name__}{tuple(var.shape)}")
        stack.extend(nxt for nxt, _ in node.next_functions)
    if stray:
        raise RuntimeError(f"memory level recompute: unit {type(unit).__name__} uses trainable tensors that are "
                           f"neither its inputs nor parameters of its modules ({', '.join(stray[:4])}); their gradients "
                           "would be lost. Pass them as arguments, or name the modules that own them in the unit's "
                           "recompute_modules()")
    unit.__dict__["_efficient_light_checked"] = True


def _light_region(module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`forward(*args, **kwargs)` as a `_Region`, or `_NOT_LIGHT` when a call argument is something
    other than tensors and plain values (an object that might hold a tensor the region cannot see)."""
    leaves, spec = tree_flatten((args, kwargs))
    if not _plain(leaves):
        return _NOT_LIGHT
    run = _RegionCall(module, forward, leaves, spec, module.__dict__.get("_efficient_lean", True))
    inputs = tuple(leaves[i] for i in run.slots)
    outs = iter(_Region.apply(run, len(inputs), *inputs, *_params(run.modules)))
    return tree_unflatten([next(outs) if v is _TENSOR else v for v in run.out_plain], run.out_spec)


def recomputed_forward(module: nn.Module, forward: Callable[..., Any], *args: Any, kept_ops: KeptOps | None = None,
                       **kwargs: Any) -> Any:
    """`forward(*args, **kwargs)` as a checkpointed region when autograd records it (training with
    grad enabled), keeping the outputs of the costly ops `kept_ops` names; a plain call otherwise
    (evaluation, no_grad) and inside another region, whose rerun already recomputes it (a nested
    region would be recomputed twice)."""
    if not (module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    if torch.compiler.is_compiling():
        if module.__dict__.get("_efficient_compiled_plain", False):  # see `wrap`: its rerun would read updated buffers
            return forward(*args, **kwargs)
        if (kept_ops is not None and kept_ops.keep) or module.__dict__.get(_OUTPUTS, False):
            # dynamo cannot trace a policy closure as context_fn; inductor decides itself what a region keeps
            raise RuntimeError("a memory budget's kept outputs cannot be compiled yet: optimize with level recompute "
                               "and no budget before torch.compile, or run eager")
        bound = _input_bound(module) if args and isinstance(args[0], torch.Tensor) and _tracked(args[0]) else None
        if bound is not None:
            # spikes: their bits are packed outside the region (an opaque op: kept) and unpacked inside it;
            # counts of spikes (a residual stream of spikes): kept as uint8 the same way, a quarter of fp32
            rest, kwargs = tree_map_only(torch.Tensor, _kept_input, (args[1:], kwargs))
            if bound == 1:
                return checkpoint(functools.partial(_from_bits, forward), pack_spikes(args[0]), args[0], *rest,
                                  use_reentrant=False, **kwargs)
            return checkpoint(functools.partial(_from_counts, forward), region_counts(args[0].detach()), args[0], *rest,
                              use_reentrant=False, **kwargs)
        args, kwargs = tree_map_only(torch.Tensor, _kept_input, (args, kwargs))
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    if in_region():
        return forward(*args, **kwargs)
    _vouch(module, args)
    outputs = module.__dict__.get(_OUTPUTS, False)  # only a light region keeps outputs for its rerun
    if (kept_ops is None or not kept_ops.selective) and module.__dict__.get("_efficient_light", True) \
            and (outputs or getattr(module, "recompute_residual", False)
                 or module.__dict__.get(_OUT_NUMEL, math.inf) <= bn_lif.RECOMPUTE_CHUNK):
        out = _light_region(module, forward, args, kwargs)
        if out is not _NOT_LIGHT:
            return out
        if outputs:
            raise RuntimeError(f"memory level recompute: unit {type(module).__name__} keeps outputs for its rerun, "
                               "which needs its call's arguments to be tensors and plain values; this call passes an "
                               "object: apply the level without outputs for this unit")
    lean = module.__dict__.get("_efficient_lean", True)
    # (not under a memory budget's selective checkpoint, which matches the rerun's ops to the forward's)
    if lean and (kept_ops is None or not kept_ops.selective) and args and _reads_bits(module, args[0]):
        # the unit's input is spikes its convolution reads from bits: the checkpoint keeps the bits, and the
        # rerun hands the unit a placeholder, so the input is not whole in fp32 while the unit reruns
        x = args[0]
        fn = functools.partial(_bits_input, forward, [x], tuple(x.shape), x.dtype, type(module).__name__)
        args = (pack_binary(x.detach()), *args[1:])
    else:
        fn = forward
    out = checkpoint(functools.partial(_inside, fn, lean=lean), *args,
                     use_reentrant=False, context_fn=functools.partial(_contexts, module, kept_ops), **kwargs)
    module.__dict__[_OUT_NUMEL] = sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    return out


def _reads_bits(module: nn.Module, x: Any) -> bool:
    """Whether an eager region may keep the unit's input as bits only and rerun it on a placeholder: the unit
    says its input is spikes that its convolution reads from `spike_bits` (`recompute_input_from_bits()`), and
    the input is a floating tensor autograd tracks (on which the unit's gradient lands)."""
    says = getattr(module, "recompute_input_from_bits", None)
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0 and x.requires_grad
            and callable(says) and bool(says()))


def _bits_input(forward: Callable[..., Any], box: list[torch.Tensor | None], shape: tuple[int, ...],
                dtype: torch.dtype, name: str, bits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A unit's call inside a checkpoint that keeps its spike input as `bits`: the forward gets the input
    itself (`box`, emptied after it, so the checkpoint holds no fp32 copy), the rerun a placeholder of its
    shape (stride 0, no memory); both pass the bits, which the unit's convolution reads
    (`conv_backward.region_conv2d`), so the rerun computes what the forward did and the gradient reaches the
    input through the forward's graph. A unit whose call did not read the bits is an error."""
    x = box[0]
    if x is None:
        x = bits.new_zeros((), dtype=dtype).expand(shape)
    before = bits_reads()
    out = forward(x, *args, spike_bits=bits, **kwargs)
    if bits_reads() == before:
        raise RuntimeError(f"memory level recompute: unit {name} says recompute_input_from_bits() but its call did not "
                           "read its input from spike_bits through region_conv2d; its rerun would read a placeholder")
    box[0] = None
    return out


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return recomputed_forward(module, functools.partial(type(module).forward, module), *args,
                              kept_ops=module.__dict__.get("_efficient_kept"), **kwargs)


def is_wrapped(module: nn.Module) -> bool:
    f = module.__dict__.get("forward")
    return isinstance(f, functools.partial) and f.func is _call


def wrap(module: nn.Module, kept: KeptOps | None = None, lean: bool = True, light: bool = True) -> None:
    """Make calls of `module` recomputed regions that keep the outputs `kept` names (`unwrap` undoes
    it). The instance's `forward` is a partial over the module itself, so copies of the model stay
    wrapped. `lean` False: the region's fused BatchNorm + LIF units keep their membrane traces and
    its max-pools their inputs, as outside a region (`efficient.models.replay.rebuild_membrane`; a comparison).
    `light` False: every eager call runs under torch's checkpoint, never as a `_Region` (a comparison)."""
    module.forward = functools.partial(_call, module)  # type: ignore[method-assign]
    module.__dict__["_efficient_kept"] = kept
    module.__dict__["_efficient_lean"] = lean
    module.__dict__["_efficient_light"] = light
    inside = region_modules(module)
    for m in inside:  # what a compiled step reads to know it is inside a region (`rebuild_membrane`)
        m.__dict__[REGION_MARK] = lean
    module.__dict__[_OUTPUTS] = any(m.__dict__.get(KEEP_OUTPUT_MARK, False) for m in inside)
    # a compiled checkpoint recomputes everything inside the region in backward, reading buffers from the
    # step's inputs, which the forward has since updated in place: a unit whose output reads a running
    # statistic after its own update (Meta-SpikeFormer's RepConv pads with its BatchNorm's) would rerun
    # on other values than its forward's. Such a unit runs as a plain call in a compiled step.
    module.__dict__["_efficient_compiled_plain"] = any(
        getattr(m, "reads_updated_buffers", False) for m in inside)


def unwrap(module: nn.Module) -> None:
    if is_wrapped(module):
        del module.__dict__["forward"]
    # (its output's size stays: a level applied again runs each unit's first call as its later ones)
    for key in ("_efficient_kept", "_efficient_lean", "_efficient_light", "_efficient_light_checked",
                "_efficient_compiled_plain", _OUTPUTS):
        module.__dict__.pop(key, None)
    for m in region_modules(module):
        m.__dict__.pop(REGION_MARK, None)
