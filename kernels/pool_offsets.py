"""2-D max-pool that keeps each output's argmax as a small offset inside its window, not int64 indices.

aten's max-pool keeps, for backward, its input and one int64 index per output. The index's offset
from its window's first element (flat in the input plane) fits the narrowest integer type that
holds the largest offset, (kH - 1) dH W + (kW - 1) dW: uint8 for a 3x3 window on planes up to 127
wide, 8 bits per output where aten keeps 64. Backward adds the window origins back and routes the
gradient with aten's own kernel, so the gradient is bit for bit autograd's.

Used by memory level `bits` for max-pools of spikes (`efficient.memory.spikes`) and by the fused
BatchNorm + LIF + max-pool of a recomputed stem stage (`efficient.kernels.bn_lif.bn_lif_max_pool`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import Tensor
from torch.nn.modules.utils import _pair

__all__ = ["PoolArgs", "max_pool_offsets", "max_pool_offsets_backward", "offset_dtype", "pool_args", "window_origins"]

# aten's max_pool2d arguments: kernel, stride, padding, dilation (each [h, w]) and ceil_mode
PoolArgs = tuple[Sequence[int], Sequence[int], Sequence[int], Sequence[int], bool]


def pool_args(kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False) -> PoolArgs:
    """`F.max_pool2d`'s (or `nn.MaxPool2d`'s) arguments as aten's: [h, w] lists, stride defaulting to the kernel."""
    kernel = list(_pair(kernel_size))
    stride = kernel if stride is None or stride == [] else list(_pair(stride))
    return kernel, stride, list(_pair(padding)), list(_pair(dilation)), bool(ceil_mode)


def window_origins(out_hw: tuple[int, int], width: int, kernel: tuple[int, ...], stride: tuple[int, ...],
                   padding: tuple[int, ...], dilation: tuple[int, ...], device: torch.device
                   ) -> tuple[Tensor, torch.dtype]:
    """[OH, OW] flat plane index of each window's first element, (oh*s - p) * W + (ow*s - p) (negative
    where padding overhangs), and the integer type that holds every argmax's offset from it.

    Kept for reuse on the CPU only: on a GPU the call may run inside a CUDA graph's capture or
    warm-up (a compiled `reduce-overhead` step), whose memory pool the graphs reuse, so a tensor
    kept past the call could be overwritten; there it is made afresh (a few tiny kernels)."""
    cpu = torch.device(device).type == "cpu"
    origins = _cpu_origins(out_hw, width, stride, padding) if cpu else _make_origins(out_hw, width, stride, padding, device)
    return origins, offset_dtype(width, kernel, dilation)


def _make_origins(out_hw: tuple[int, int], width: int, stride: tuple[int, ...], padding: tuple[int, ...],
                  device: torch.device) -> Tensor:
    rows = torch.arange(out_hw[0], device=device) * stride[0] - padding[0]
    cols = torch.arange(out_hw[1], device=device) * stride[1] - padding[1]
    return rows[:, None] * width + cols[None, :]


@functools.lru_cache(maxsize=64)
def _cpu_origins(out_hw: tuple[int, int], width: int, stride: tuple[int, ...], padding: tuple[int, ...]) -> Tensor:
    return _make_origins(out_hw, width, stride, padding, torch.device("cpu"))


def offset_dtype(width: int, kernel: Sequence[int], dilation: Sequence[int]) -> torch.dtype:
    """The narrowest integer type that holds every argmax's offset from its window's first element,
    (kH - 1) dH W + (kW - 1) dW, on planes `width` wide."""
    span = (kernel[0] - 1) * dilation[0] * width + (kernel[1] - 1) * dilation[1]
    return next(t for t in (torch.uint8, torch.int16, torch.int32, torch.int64) if span <= torch.iinfo(t).max)


def _origins(out: Tensor, x_width: int, pool: PoolArgs) -> tuple[Tensor, torch.dtype]:
    return window_origins(tuple(out.shape[-2:]), int(x_width), tuple(pool[0]), tuple(pool[1]), tuple(pool[2]),
                          tuple(pool[3]), out.device)


def max_pool_offsets(x: Tensor, pool: PoolArgs) -> tuple[Tensor, Tensor]:
    """(max-pool of x [..., H, W], each output's argmax as its offset in its window, small integers)."""
    out, idx = torch.ops.aten.max_pool2d_with_indices(x, *pool)
    origin, small = _origins(out, x.shape[-1], pool)
    return out, idx.sub_(origin).to(small)  # in place: no second int64 tensor of the output's size


def max_pool_offsets_backward(grad: Tensor, offsets: Tensor, pool: PoolArgs, shape: Sequence[int],
                              stride: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """The gradient of the pool's input (sizes `shape`; `stride` where it was not contiguous) from the
    gradient of its output and the offsets `max_pool_offsets` returned."""
    origin, _ = _origins(grad, shape[-1], pool)
    idx = offsets + origin  # int64 (type promotion), a new tensor: the saved offsets stay as they are
    dtype = grad.dtype if dtype is None else dtype
    # aten's kernel reads only its `self` argument's sizes and memory format: a contiguous input is stood
    # in for by one element expanded to its sizes (no bytes allocated), any other layout by an
    # uninitialised tensor with the input's strides (its pages are never touched on a CPU)
    if stride is None:
        like = torch.empty((), dtype=dtype, device=grad.device).expand(tuple(shape))
    else:
        like = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=grad.device)
    return torch.ops.aten.max_pool2d_with_indices_backward(grad, like, *pool, idx)
