"""Spikes kept as bits: every tensor autograd saves for backward whose storage holds a spiking
neuron's output is stored packed 8 per byte (`efficient.kernels.spike_pack`) and unpacked exactly,
with its original strides, when backward needs it.

A neuron's output is binary by construction, so no value is ever inspected (inspecting would cost a
pass and a device sync per tensor): the neurons of a model report their outputs to a `SpikeTracker`
(forward hooks), and the saved-tensor pack hook asks the tracker whether a tensor's storage is one
of them. A view of a spike tensor (a reshape, a head split, one of the q/k/v slices of a fused
unit) shares that storage and is packed as itself. The tracker holds weak references only: a spike
tensor freed after the forward drops out, so its memory, if reused, is never mistaken for spikes.

A training-mode BatchNorm output that backward needs (a stable-SNN neuron multiplies it by its
per-step gain) is not kept either: BatchNorm keeps its input for its own backward anyway, and the
output is that input's normalisation, recomputed from it by the same call (`RecomputedNorm`), so
the values backward reads are the forward's, bit for bit. A 2-D max-pool keeps only where each
output's maximum was, as small window offsets (`_CompactMaxPool2d`): not its input, not int64
indices.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from efficient.kernels.pool_offsets import max_pool_offsets, max_pool_offsets_backward, pool_args
from efficient.kernels.spike_pack import pack_binary, unpack_spikes
from efficient.models.replay import in_region, rebuild_membrane


def is_neuron(m: nn.Module) -> bool:
    """Whether `m` emits binary spikes: our `SpikingNeuron`s, spikingjelly's nodes and snntorch's
    neurons (whose graded-spike factor must be 1)."""
    from efficient.models.neurons import SpikingNeuron

    if isinstance(m, SpikingNeuron):
        return True
    for cls in type(m).__mro__:
        mod = cls.__module__ or ""
        if cls.__name__ == "BaseNode" and mod.startswith("spikingjelly.activation_based.neuron"):
            return True
        if cls.__name__ == "SpikingNeuron" and mod.startswith("snntorch"):
            g = getattr(m, "graded_spikes_factor", 1.0)
            return not isinstance(g, nn.Parameter) and float(g) == 1.0
    return False


def _first_tensor(out: Any) -> torch.Tensor | None:
    """The spikes in a neuron's output: the tensor itself, or the first element of a tuple
    (snntorch returns (spikes, membrane); ours (spikes, H) with return_membrane)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _version(t: torch.Tensor | None) -> int:
    """The tensor's version counter (bumped by every in-place write to its storage); inference
    tensors have none, and nothing of theirs is saved for backward."""
    return -1 if t is None or t.is_inference() else t._version


def _trackable(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.numel() > 0 and t.layout == torch.strided


class SpikeTracker:
    """Which live storages hold spikes or small counts of them. `watch(model)` hooks its neurons;
    `bound(t)` answers with the largest value `t` can hold (1 for spikes; every tracked tensor holds
    non-negative integers up to its bound), or None for a tensor that is not tracked."""

    def __init__(self) -> None:
        self._live: dict[tuple[str, int], tuple[list[weakref.ref[torch.Tensor]], int, int]] = {}  # refs, bound, version
        self._norms: dict[tuple[str, int], tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], tuple]] = {}
        self._handles: list[Any] = []

    def watch(self, model: nn.Module) -> int:
        """Hook every neuron of `model`; returns how many."""
        from efficient.models.neurons import spike_observer

        n = 0
        for m in model.modules():
            if is_neuron(m):  # an observer: the zoo's BatchNorm + LIF units stay one op (same kernels as level none)
                self._handles.append(m.register_forward_hook(spike_observer(self._record)))
                n += 1
        return n

    def _record(self, module: nn.Module, args: Any, out: Any) -> None:
        if torch.compiler.is_compiling():  # a compiled step's partitioner decides what it saves
            return
        s = _first_tensor(out)
        if s is not None:
            self.add(s)

    def add(self, s: torch.Tensor, bound: int = 1) -> None:
        if not _trackable(s):
            return
        key = _storage_key(s)
        refs = self._alive(key)
        if refs:  # another view of a tracked storage: any live view keeps the record
            self._live[key] = ([*refs, weakref.ref(s)], max(self._live[key][1], bound), _version(s))
        else:
            self._live[key] = ([weakref.ref(s)], bound, _version(s))

    def _alive(self, key: tuple[str, int]) -> list[weakref.ref[torch.Tensor]]:
        """The live references recorded for `key` whose tensor still holds that storage (a
        storage freed and reallocated at the same address is another tensor's memory) and has not
        been written since it was recorded (views share one version counter): a write this tracker
        was not told keeps its bound (`SpikePropagation`, which records again) drops the record, so
        an op that ran while the propagation was suspended can never leave scaled spikes tracked."""
        entry = self._live.get(key)
        if entry is None:
            return []
        refs = [r for r in entry[0] if (t := r()) is not None and t.untyped_storage().data_ptr() == key[1]]
        if not refs or _version(refs[0]()) != entry[2]:
            del self._live[key]
            return []
        return refs

    def discard(self, t: torch.Tensor) -> None:
        """Forget `t`'s storage: something wrote into it that may break its bound."""
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            self._live.pop(_storage_key(t), None)

    def bound(self, t: torch.Tensor) -> int | None:
        if not _trackable(t):
            return None
        key = _storage_key(t)
        return self._live[key][1] if self._alive(key) else None

    def is_spikes(self, t: torch.Tensor) -> bool:
        return self.bound(t) == 1

    def add_norm(self, out: torch.Tensor, x: torch.Tensor, call: tuple) -> None:
        """`out` is BatchNorm's training-mode output for the input `x`; `call` = (weight, bias,
        running_mean, running_var, momentum, eps, autocast state) rebuilds it (`RecomputedNorm`)."""
        if _trackable(out) and isinstance(x, torch.Tensor):
            self._norms[_storage_key(out)] = (weakref.ref(out), weakref.ref(x), call)

    def norm_of(self, t: torch.Tensor) -> RecomputedNorm | None:
        """The recipe for `t` (a view of a live BatchNorm output whose input is alive), or None."""
        if not _trackable(t) or not self._norms:
            return None
        key = _storage_key(t)
        entry = self._norms.get(key)
        if entry is None:
            return None
        out, x = entry[0](), entry[1]()
        if out is None or x is None or out.untyped_storage().data_ptr() != key[1] or out._version != entry[2][-1]:
            del self._norms[key]  # freed, reused or written since: no longer the normalisation of x
            return None
        w, b, rm, rv, momentum, eps, amp, x_version, _ = entry[2]
        return RecomputedNorm(x, w, b, rm, rv, momentum, eps, amp, tuple(t.shape), tuple(t.stride()),
                              t.storage_offset() - out.storage_offset(), t.dtype, x_version)

    def forget(self) -> None:
        """Drop every record (between steps: the tensors are gone anyway)."""
        self._live.clear()
        self._norms.clear()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._live.clear()
        self._norms.clear()


# Functions whose output holds only values of their tensor inputs: views and copies, casts to another
# float dtype, max-pooling, gathers and concatenation. Spikes in, spikes out; counts in, counts out.
VALUE_PRESERVING = frozenset({
    "reshape", "view", "view_as", "reshape_as", "flatten", "unflatten", "transpose", "permute", "movedim", "contiguous",
    "clone", "squeeze", "unsqueeze", "expand", "expand_as", "repeat", "narrow", "flip", "roll", "split", "chunk",
    "unbind", "__getitem__", "to", "float", "half", "bfloat16", "double", "type_as", "cat", "concat", "stack",
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "gather", "index_select", "take_along_dim", "token_gather",
})
# Products of non-negative integers (spikes AND spikes stay spikes) and sums of them (a residual
# stream that adds spikes holds counts: Spikformer's, SEW-ResNet's).
PRODUCTS = frozenset({"mul", "__mul__", "__rmul__", "mul_", "__imul__"})
SUMS = frozenset({"add", "__add__", "__radd__", "add_", "__iadd__"})
# Matrix products of counts are counts (bound: the operands' bounds times the contraction length).
MATMULS = frozenset({"matmul", "__matmul__", "bmm"})
# The largest bound kept as integers: any float rounding of an integer up to it fits int16.
MAX_BOUND = 16383


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `obj`, a tensor or a (nested) tuple, list or dict of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def _count(x: Any) -> int | None:
    """A Python number usable in a bound: a non-negative integer (True counts as 1), else None."""
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int) and x >= 0:
        return x
    if isinstance(x, float) and x >= 0 and x.is_integer():
        return int(x)
    return None


def _operands(tracker: SpikeTracker, name: str, args: tuple, kwargs: dict) -> int | None:
    """The bound of `name(*args, **kwargs)`'s output, or None when it is not a tracked count."""
    bounds: list[int] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_floating_point():
                if name in VALUE_PRESERVING:  # an index, a mask
                    continue
                return None
            b = tracker.bound(a)
            if b is None:
                return None
            bounds.append(b)
        elif isinstance(a, (tuple, list)) and name in VALUE_PRESERVING:
            for t in tensors_in(a):
                if t.is_floating_point():
                    b = tracker.bound(t)
                    if b is None:
                        return None
                    bounds.append(b)
        elif name in PRODUCTS or name in SUMS:
            c = _count(a)
            if c is None:
                return None
            bounds.append(c)
    if not bounds:
        return None
    if name in VALUE_PRESERVING:
        return max(bounds)
    if name in PRODUCTS:
        out = 1
        for b in bounds:
            out *= b
        return out
    alpha = _count(kwargs.get("alpha", 1))
    if alpha is None or len(bounds) != 2:
        return None
    return bounds[0] + alpha * bounds[1]


# The names `SpikePropagation` looks at (without keyword arguments, any other name that is not
# in-place passes straight through).
_SEEN = VALUE_PRESERVING | PRODUCTS | SUMS | MATMULS | frozenset({"__setitem__", "max_pool2d", "batch_norm"})

# In-place methods that leave values as they are.
_NO_VALUE_WRITE = frozenset({"requires_grad_", "detach_", "share_memory_", "record_stream", "retain_grad"})


def _in_place(name: str) -> bool:
    """An in-place method's name (`add_`, `__iadd__`; not a dunder such as `__get__`)."""
    return (name.endswith("_") and not name.startswith("__")) or name.startswith("__i")


def _written(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors that `name(*args, **kwargs)` writes into: `self` of an in-place method, an `out=`
    argument, the input of a functional called with `inplace=True`."""
    written = list(tensors_in(kwargs.get("out")))
    if name in _NO_VALUE_WRITE:
        return written
    inplace = _in_place(name) or name == "__setitem__"
    if (inplace or kwargs.get("inplace") is True) and args and isinstance(args[0], torch.Tensor):
        written.append(args[0])
    return written


class _CompactMaxPool2d(torch.autograd.Function):
    """2-D max-pool that keeps neither its input nor int64 argmax indices, only each output's argmax as
    a small offset in its window (`efficient.kernels.pool_offsets`): 8 bits per output for a 3x3
    window where aten keeps 64, and its input not at all. Backward routes the gradient with aten's
    own kernel, so it is bitwise autograd's; nothing reruns. With the input gone, a BatchNorm output
    that only a max-pool reads is not kept either."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *pool: Any) -> torch.Tensor:
        out, offsets = max_pool_offsets(x, pool)
        ctx.save_for_backward(offsets)
        ctx.pool = pool
        ctx.like = (tuple(x.shape), None if x.is_contiguous() else tuple(x.stride()), x.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (offsets,) = ctx.saved_tensors
        shape, stride, dtype = ctx.like
        gx = max_pool_offsets_backward(grad, offsets, ctx.pool, shape, stride, dtype)
        return (gx, *([None] * len(ctx.pool)))


def _pool2d_args(args: tuple, kwargs: dict) -> tuple | None:
    """`F.max_pool2d`'s arguments as aten's (kernel, stride, padding, dilation, ceil_mode), or None
    when indices are asked for (the caller keeps them anyway)."""
    names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
    given = {**dict(zip(names, args[1:])), **kwargs}
    if given.pop("return_indices", False):
        return None
    return pool_args(**given)


class SpikePropagation(TorchFunctionMode):
    """Follows spikes and counts of spikes through the ops that keep them non-negative integers: a
    max-pool of spikes or a gather of spike tokens is spikes, a sum of spikes is a count. A tensor
    something writes into (an in-place op, `out=`) keeps its bound only when the write provably
    keeps it; otherwise it is no longer tracked, so a scaled or shifted spike tensor is never packed.

    Two ops are given what autograd should keep: a matrix product of tracked operands multiplies
    contiguous copies (made here, so they are tracked; `matmul` would otherwise copy a strided
    operand itself and keep that untracked copy dense), and a 2-D max-pool keeps its argmax as
    small window offsets instead of its input and int64 indices (`_CompactMaxPool2d`)."""

    def __init__(self, tracker: SpikeTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def sees_op(self, name: str) -> bool:
        """Whether the kernels must call op `name` through its dispatch so that this mode sees it
        (`kernels._backend.eager_call`): only the ops it follows by name; the neurons' and the
        attention's run their implementation directly (their outputs reach the tracker by hooks)."""
        return name in _SEEN

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        # most calls (attribute reads, linear, the neurons' ops) neither carry a bound, nor write into
        # a tensor, nor are rerouted: call them at once. The mode sees every torch call of a forward,
        # so on a fast device this is most of what the level costs the host.
        if not kwargs and name not in _SEEN and not _in_place(name):
            return func(*args)
        kwargs = kwargs or {}
        written = _written(name, args, kwargs)
        bound = None
        if name in VALUE_PRESERVING or name in PRODUCTS or name in SUMS:
            bound = _operands(self.tracker, name, args, {k: v for k, v in kwargs.items() if k != "out"})
        elif name == "__setitem__" and len(args) == 3:
            target, value = self.tracker.bound(args[0]), args[2]
            v = self.tracker.bound(value) if isinstance(value, torch.Tensor) else _count(value)
            bound = max(target, v) if target is not None and v is not None else None
        if in_region():  # nothing in a recomputed region is saved, and its rerun runs outside this mode
            pass
        elif name in MATMULS and not written and len(args) == 2:
            out = self._matmul(func, *args)
            if out is not None:
                return out
        elif name == "max_pool2d" and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad \
                and args[0].is_floating_point() and torch.is_grad_enabled() \
                and (pool := _pool2d_args(args, kwargs)) is not None:
            out = _CompactMaxPool2d.apply(args[0], *pool)
            if bound is not None and bound <= MAX_BOUND:  # as every other tracked output
                self.tracker.add(out, bound)
            return out
        out = func(*args, **kwargs)
        if name == "batch_norm" and not in_region():
            self._record_norm(out, args, kwargs)
        for t in written:
            self.tracker.discard(t)
        if bound is not None and bound <= MAX_BOUND:
            targets = written if written else [t for t in tensors_in(out)]
            for t in targets:
                if t.is_floating_point():
                    self.tracker.add(t, bound)
        return out


    def _record_norm(self, out: Any, args: tuple, kwargs: dict) -> None:
        """Remember a training-mode `F.batch_norm` output that autograd records, with its call."""
        names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        given = {**dict(zip(names, args)), **kwargs}
        x = given.get("input")
        if not (isinstance(out, torch.Tensor) and out.requires_grad and given.get("training")
                and isinstance(x, torch.Tensor) and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            return
        dev = x.device.type
        amp = (dev, torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
        rm, rv = given.get("running_mean"), given.get("running_var")
        call = (given.get("weight"), given.get("bias"), rm, rv, given.get("momentum", 0.1), given.get("eps", 1e-5), amp,
                x._version, out._version)
        self.tracker.add_norm(out, x, call)

    def _matmul(self, func: Any, a: Any, b: Any) -> torch.Tensor | None:
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2 or b.dim() < 2:
            return None
        ba, bb = self.tracker.bound(a), self.tracker.bound(b)
        if ba is None or bb is None:
            return None
        a, b = a.contiguous(), b.contiguous()
        self.tracker.add(a, ba)
        self.tracker.add(b, bb)
        out = func(a, b)
        if ba * bb * a.shape[-1] <= MAX_BOUND:
            self.tracker.add(out, ba * bb * a.shape[-1])
        return out


def _top_propagation() -> SpikePropagation | None:
    """The `SpikePropagation` mode on top of the torch-function mode stack, if that is the top."""
    n = torch._C._len_torch_function_stack()
    top = torch._C._get_function_stack_at(n - 1) if n else None
    return top if isinstance(top, SpikePropagation) else None


def active_tracker() -> SpikeTracker | None:
    """The tracker of the model whose forward is running at level bits or recompute (its
    `SpikePropagation` mode is on top of the stack), else None."""
    mode = _top_propagation()
    return None if mode is None else mode.tracker


@contextlib.contextmanager
def propagation_suspended() -> Iterator[None]:
    """Run without the `SpikePropagation` on top of the mode stack: a recomputed region's forward
    saves nothing, so following its ops buys nothing there, and the mode costs the host a Python
    frame per torch call (a third of level recompute's extra host time at toy width). Spikes a
    neuron emits are still recorded (its hook), and a storage written meanwhile drops out of the
    tracker by its version. A mode above it (someone else's) keeps this one on."""
    if _top_propagation() is None:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


@dataclass(frozen=True)
class PackedSaved:
    """A saved spike tensor (`bound` 1) as bits, or a saved tensor of small counts as uint8/int16,
    with what it takes to rebuild it exactly (shape, strides, dtype)."""

    data: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    bound: int = 1

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def unpack(self) -> torch.Tensor:
        if self.bound == 1:
            dense = unpack_spikes(self.data, self.shape, self.dtype)
        else:
            dense = self.data.to(self.dtype).view(self.shape)
        if dense.stride() == self.stride or dense.numel() <= 1:
            return dense
        # the same strides as the saved tensor, so backward's kernels see the layout forward gave them
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=dense.device)
        return out.copy_(dense)


def pack_counts(t: torch.Tensor, bound: int) -> PackedSaved:
    """`t` (non-negative integers up to `bound`) as bits, uint8 or int16, whichever holds it."""
    if bound == 1:  # a tracked spike tensor holds only 0 and 1
        return PackedSaved(pack_binary(t), tuple(t.shape), tuple(t.stride()), t.dtype)
    small = torch.uint8 if bound <= 255 else torch.int16
    return PackedSaved(t.contiguous().to(small).view(-1), tuple(t.shape), tuple(t.stride()), t.dtype, bound)


@dataclass(frozen=True)
class RecomputedNorm:
    """A saved training-mode BatchNorm output (or a view of it) kept as its input `x` (which the
    BatchNorm keeps for its own backward: no bytes of its own) and rebuilt by the same call in
    backward. The batch statistics come from `x` alone, so the rebuilt values are the forward's."""

    x: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    momentum: float | None
    eps: float
    autocast: tuple[str, torch.dtype] | None
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    x_version: int  # x's version counter at the forward: a later in-place write makes the rebuild wrong

    @property
    def data(self) -> torch.Tensor:
        return self.x

    def unpack(self) -> torch.Tensor:
        if self.x._version != self.x_version:
            raise RuntimeError(
                "memory level 'bits': the input of a BatchNorm whose output backward needs was modified in place "
                f"after the forward (version {self.x_version} -> {self.x._version}), so that output cannot be "
                "rebuilt; write into a copy instead (or use memory level 'none')")
        # copies of the running statistics when the forward had some, so the call takes the same
        # kernel and leaves the model's alone (they do not change a training-mode output)
        rm = None if self.running_mean is None else self.running_mean.detach().clone()
        rv = None if self.running_var is None else self.running_var.detach().clone()
        amp = torch.autocast(self.autocast[0], self.autocast[1]) if self.autocast else contextlib.nullcontext()
        with torch.no_grad(), amp:
            y = torch.nn.functional.batch_norm(self.x, rm, rv, self.weight, self.bias, True, self.momentum, self.eps)
        return y.as_strided(self.shape, self.stride, self.offset)


class BitsHooks:
    """`torch.autograd.graph.saved_tensors_hooks` that keep tracked spikes as bits and tracked counts
    as uint8/int16 (exact: both are integers); other tensors pass through untouched. `packed` /
    `bytes_saved` count what was packed (for reports).

    `observer`, when set, is called as `observer(tensor, kept)` after every pack with what autograd
    will keep for that tensor (a `PackedSaved` or the tensor itself). Saved-tensor hooks do not nest
    (the innermost pair alone runs), so these hooks, entered inside the model's forward, hide every
    save there from hooks entered outside it: `efficient.memory.measure` counts through this."""

    def __init__(self, tracker: SpikeTracker) -> None:
        self.tracker = tracker
        self.packed = 0
        self.bytes_saved = 0
        self.observer: Callable[[torch.Tensor, Any], None] | None = None

    def pack(self, t: torch.Tensor) -> Any:
        # bookkeeping, not the model's computation: `SpikePropagation` (active in the same forward)
        # need not see its calls, and skipping it halves what a save costs the host
        with torch._C.DisableTorchFunction():
            kept = self._pack(t)
        if self.observer is not None:
            self.observer(t, kept)
        return kept

    def _pack(self, t: torch.Tensor) -> Any:
        norm = self.tracker.norm_of(t)
        if norm is not None:
            self.packed += 1
            self.bytes_saved += t.numel() * t.element_size()
            return norm
        bound = self.tracker.bound(t)
        if bound is None or (bound > 1 and t.element_size() <= (1 if bound <= 255 else 2)):
            return t  # untracked, or already as small as its counts allow
        self.packed += 1
        self.bytes_saved += t.numel() * t.element_size()
        return pack_counts(t, bound)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.unpack() if isinstance(saved, (PackedSaved, RecomputedNorm)) else saved

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def region_max_pool(pool: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`pool(x)` for a model's max-pool; inside a recomputed region (its forward and its rerun alike,
    so both keep the same tensors) the max-pool that keeps window offsets instead of its input and
    int64 indices (`_CompactMaxPool2d`, bitwise autograd's): a stem stage's rerun in backward then
    holds no copy of its spikes for the pool. The bits level gives every other max-pool the same."""
    if (isinstance(pool, nn.MaxPool2d) and not pool.return_indices and rebuild_membrane() and torch.is_grad_enabled()
            and x.requires_grad and x.is_floating_point()):
        return _CompactMaxPool2d.apply(x, *pool_args(pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                                                     pool.ceil_mode))
    return pool(x)



def iter_neurons(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return ((n, m) for n, m in model.named_modules() if is_neuron(m))
