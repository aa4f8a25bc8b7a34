"""Spikes kept as bits: every tensor autograd saves for backward whose storage holds a spiking
neuron's output is stored packed 8 per byte (`efficient.kernels.spike_pack`) and unpacked exactly,
with its original strides, when backward needs it.

A neuron's output is binary by construction, so no value is ever inspected (inspecting would cost a
pass and a device sync per tensor): the neurons of a model report their outputs to a `SpikeTracker`
(forward hooks), and the saved-tensor pack hook asks the tracker whether a tensor's storage is one
of them. A view of a spike tensor (a reshape, a head split, one of the q/k/v slices of a fused
unit) shares that storage and is packed as itself. The tracker holds weak references only: a spike
tensor freed after the forward drops out, so its memory, if reused, is never mistaken for spikes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from efficient.kernels.spike_pack import pack_spikes, unpack_spikes


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


class SpikeTracker:
    """Which live storages hold spikes. `watch(model)` hooks its neurons; `is_spikes(t)` answers."""

    def __init__(self) -> None:
        self._live: dict[tuple[str, int], weakref.ref[torch.Tensor]] = {}
        self._handles: list[Any] = []

    def watch(self, model: nn.Module) -> int:
        """Hook every neuron of `model`; returns how many."""
        n = 0
        for m in model.modules():
            if is_neuron(m):
                self._handles.append(m.register_forward_hook(self._record))
                n += 1
        return n

    def _record(self, module: nn.Module, args: Any, out: Any) -> None:
        if torch.compiler.is_compiling():  # a compiled step's partitioner decides what it saves
            return
        s = _first_tensor(out)
        if s is not None:
            self.add(s)

    def add(self, s: torch.Tensor) -> None:
        if s.is_floating_point() and s.numel() and s.layout == torch.strided:
            self._live[_storage_key(s)] = weakref.ref(s)

    def is_spikes(self, t: torch.Tensor) -> bool:
        if not t.is_floating_point() or not t.numel() or t.layout != torch.strided:
            return False
        ref = self._live.get(_storage_key(t))
        if ref is None:
            return False
        s = ref()
        if s is None or s.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            del self._live[_storage_key(t)]
            return False
        return True

    def forget(self) -> None:
        """Drop every record (between steps: the tensors are gone anyway)."""
        self._live.clear()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._live.clear()


# Functions whose output is spikes when every tensor they take is: views and copies, casts to another
# float dtype, max-pooling, gathers and concatenation of spikes, and products of spikes (AND).
SPIKE_PRESERVING = frozenset({
    "reshape", "view", "view_as", "reshape_as", "flatten", "unflatten", "transpose", "permute", "movedim", "contiguous",
    "clone", "squeeze", "unsqueeze", "expand", "expand_as", "repeat", "narrow", "flip", "roll", "split", "chunk",
    "unbind", "__getitem__", "to", "float", "half", "bfloat16", "double", "type_as", "cat", "concat", "stack",
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "gather", "index_select", "take_along_dim", "mul", "__mul__", "__rmul__", "logical_and", "token_gather",
})


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


class SpikePropagation(TorchFunctionMode):
    """Follows spikes through the ops that keep them binary (`SPIKE_PRESERVING`): a max-pool of
    spikes, a reshape that copies, a gather of spike tokens are spikes too, and are tracked as such."""

    def __init__(self, tracker: SpikeTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in SPIKE_PRESERVING:
            inputs = [t for t in tensors_in(args) if t.is_floating_point()]
            if inputs and all(self.tracker.is_spikes(t) for t in inputs):
                for t in tensors_in(out):
                    if t.is_floating_point():
                        self.tracker.add(t)
        return out


@dataclass(frozen=True)
class PackedSaved:
    """A saved spike tensor as bits, with what it takes to rebuild it exactly (shape, strides, dtype)."""

    bits: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.bits.numel()

    def unpack(self) -> torch.Tensor:
        dense = unpack_spikes(self.bits, self.shape, self.dtype)
        if dense.stride() == self.stride or dense.numel() <= 1:
            return dense
        # the same strides as the saved tensor, so backward's kernels see the layout forward gave them
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=dense.device)
        return out.copy_(dense)


class BitsHooks:
    """`torch.autograd.graph.saved_tensors_hooks` that keep tracked spikes as bits; other tensors
    pass through untouched. `packed` / `bytes_saved` count what was packed (for reports).

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
        kept = self._pack(t)
        if self.observer is not None:
            self.observer(t, kept)
        return kept

    def _pack(self, t: torch.Tensor) -> Any:
        if not self.tracker.is_spikes(t):
            return t
        self.packed += 1
        self.bytes_saved += t.numel() * t.element_size()
        return PackedSaved(pack_spikes(t), tuple(t.shape), tuple(t.stride()), t.dtype)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.unpack() if isinstance(saved, PackedSaved) else saved

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def iter_neurons(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return ((n, m) for n, m in model.named_modules() if is_neuron(m))
