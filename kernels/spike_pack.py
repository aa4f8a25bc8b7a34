"""Binary spike tensors packed 8 per byte, and unpacked exactly.

An op whose saved input is a binary spike tensor (0/1 in fp32, bf16, fp16 or fp64) can keep it for
backward as bits: one bit where fp32 keeps 32. Unpacking returns exactly the original values and
dtype, so a backward that unpacks computes the same gradients, bit for bit, as one that kept the
tensor.

Layout: element i of `x.reshape(-1)` (logical, row-major order, whatever the strides) is bit i % 8
of byte i // 8, little-endian within the byte (element 0 is the least significant bit). A nonzero
element packs as 1 (NaN too; -0.0 packs as 0). The last byte's unused high bits are 0.
`pack_spikes(x)` returns ceil(x.numel() / 8) uint8 bytes; `unpack_spikes(bits, shape, dtype)` a
contiguous tensor of that shape and dtype holding 0 and 1.

Parts: the torch reference (the spec); a fast torch path (CPU, and CUDA without Triton); the
Triton kernels; the custom ops `efficient::pack_spikes` / `efficient::unpack_spikes` with fake
implementations, so `torch.compile(fullgraph=True)` traces them; the public functions. Selection:
`backend="auto"|"triton"|"torch"|...` and `EFFICIENT_BACKEND` (`efficient.kernels._backend`);
'auto' runs Triton on CUDA and the fast torch path on CPU (Triton's interpreter under
TRITON_INTERPRET=1). Bits are not differentiable: the public functions detach their input and the
ops have no autograd formula (nor a flop formula: packing does no arithmetic a counter should see).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from efficient.kernels._backend import BACKENDS, eager_call  # noqa: F401 - BACKENDS: the accepted values
from efficient.kernels.token_select import resolve_backend  # triton or torch, as for the STATA kernels

try:  # Triton is optional: the torch path covers CPU
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with torch on Linux
    HAS_TRITON = False

__all__ = ["PackedSpikes", "is_binary", "pack", "pack_binary", "pack_spikes", "unpack_spikes"]


def packed_nbytes(numel: int) -> int:
    """Bytes that hold `numel` spikes: ceil(numel / 8)."""
    return (numel + 7) // 8


# ----------------------------------------------------------------------------- torch reference


def pack_spikes_ref(x: Tensor) -> Tensor:
    """The spec: pad the flattened spikes with zeros to a multiple of 8, and make each row of 8 one
    byte, sum_j bit_j * 2**j."""
    flat = (x.reshape(-1) != 0).to(torch.int64)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8))
    weights = 2 ** torch.arange(8, device=x.device)
    return (flat.reshape(-1, 8) * weights).sum(1).to(torch.uint8)


def unpack_spikes_ref(bits: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """The spec: bit j of byte k is element 8k + j; the padding bits past numel are dropped."""
    n = math.prod(shape)
    shifts = torch.arange(8, device=bits.device)
    flat = (bits.reshape(-1, 1).to(torch.int64) >> shifts) & 1
    return flat.reshape(-1)[:n].to(dtype).reshape(shape)


# ------------------------------------------------------------------------------ fast torch path

_LITTLE_ENDIAN = sys.byteorder == "little"


def pack_spikes_torch(x: Tensor) -> Tensor:
    """The reference's bytes in a handful of ops (about 35x faster on CPU at 6.3M elements).

    `x != 0` is written into a zeroed bool buffer padded to a multiple of 8, in x's logical order
    (no contiguous copy of x). Read 8 bools at a time as one little-endian int64, byte j's 0/1 sits
    at bit 8j; ORing the word with itself shifted right by 7, 14 and 28 bits moves bit 8j to bit j
    (bit 8i shifted by 7k lands on 8(i - k) + k, inside the low byte only for i == k), so the low
    byte is the packed byte. No multiplication, no overflow: values stay below 2**57.
    """
    n = x.numel()
    m = packed_nbytes(n)
    if not _LITTLE_ENDIAN:  # pragma: no cover - the int64 view assumes little-endian bytes
        return pack_spikes_ref(x)
    buf = torch.zeros(8 * m, dtype=torch.bool, device=x.device)
    torch.ne(x, 0, out=buf[:n].view(x.shape))
    v = buf.view(torch.uint8).view(torch.int64)
    v = v | (v >> 7)
    v = v | (v >> 14)
    v = v | (v >> 28)
    return (v & 0xFF).to(torch.uint8)


def unpack_spikes_torch(bits: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Floating dtypes: each byte looks up its 8 values in a [256, 8] table (one gather writes the
    result: 1.3-2.8x faster than shifting on a 2-core x86 CPU at 6-13M elements). Bool: shift and
    mask, `(bits[:, None] >> [0..7]) & 1`. Then drop the padding and reshape (contiguous)."""
    n = math.prod(shape)
    if dtype.is_floating_point:
        flat = torch.nn.functional.embedding(bits.reshape(-1).to(torch.int32), _unpack_table(dtype, bits.device)).reshape(-1)
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
        flat = ((bits.reshape(-1, 1) >> shifts) & 1).to(dtype).reshape(-1)
    return flat[:n].reshape(shape)


@functools.cache
def _unpack_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """Row b holds the 8 bits of byte b as 0/1 of `dtype`, least significant first."""
    b = torch.arange(256, device=device)
    return ((b[:, None] >> torch.arange(8, device=device)) & 1).to(dtype)


@functools.cache
def _bit_weights(dtype: torch.dtype) -> Tensor:
    """1, 2, 4, ..., 128 in `dtype` (CPU)."""
    return (2 ** torch.arange(8)).to(dtype)


def pack_binary(x: Tensor) -> Tensor:
    """`pack_spikes(x)` for an `x` known to hold only 0 and 1 (a neuron's output): on CPU, for a
    floating x whose numel is a multiple of 8, each byte is one dot product of 8 values with the
    bit weights 1, 2, ..., 128, so the whole pack is one matrix-vector product ([n / 8, 8] @ [8])
    and a cast (4-6x faster than `pack_spikes` on a 2-core x86 CPU at 6-13M elements). The sums
    are integers below 256, exact in every floating dtype (bf16 holds them too). Values other than
    0 and 1 give other bytes: use `pack_spikes` where x is not known to be binary. Elsewhere
    (CUDA, other dtypes or sizes) it is `pack_spikes`."""
    if x.device.type != "cpu" or not x.dtype.is_floating_point or x.numel() % 8:
        return pack_spikes(x)
    with torch.autocast("cpu", enabled=False):  # the sums stay in x's dtype
        return (x.detach().reshape(-1, 8) @ _bit_weights(x.dtype)).to(torch.uint8)


# --------------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:

    @triton.jit
    def _pack_kernel(x_ptr, bits_ptr, N, BLOCK: tl.constexpr):
        # program p builds bytes [p*BLOCK, (p+1)*BLOCK) from a [BLOCK, 8] tile of elements: row r,
        # column j is element 8r + j, which becomes bit j of byte r. Offsets are int64 (numel may
        # pass 2**31); elements past N load as 0 (the last byte's padding), bytes past the last
        # one are not stored.
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, 8)
        offs = rows[:, None] * 8 + cols[None, :]
        x = tl.load(x_ptr + offs, mask=offs < N, other=0)
        byte = tl.sum((x != 0).to(tl.int32) << cols[None, :], axis=1)  # distinct bits: sum == or
        tl.store(bits_ptr + rows, byte.to(tl.uint8), mask=rows * 8 < N)

    @triton.jit
    def _unpack_kernel(bits_ptr, out_ptr, N, BLOCK: tl.constexpr):
        # program p reads bytes [p*BLOCK, (p+1)*BLOCK) and writes the [BLOCK, 8] tile of elements
        # they hold, 0 or 1 in the output's dtype; elements past N (the padding bits) are not stored
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, 8)
        byte = tl.load(bits_ptr + rows, mask=rows * 8 < N, other=0).to(tl.int32)  # uint8: zero-extended
        v = (byte[:, None] >> cols[None, :]) & 1
        offs = rows[:, None] * 8 + cols[None, :]
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=offs < N)


# bytes per program: a [256, 8] tile of 2048 elements, one row of 8 per thread at 8 warps. Compiled
# for sm_80 / sm_90 (bench/kernel_resources.py) both kernels take at most 32 registers and no stack,
# so 64 warps reside per SM; 512-byte blocks at 4 warps needed up to 96 registers on sm_90.
PACK_BLOCK = 256
UNPACK_BLOCK = 256
NUM_WARPS = 8


def pack_spikes_triton(x: Tensor) -> Tensor:
    n = x.numel()
    bits = torch.empty(packed_nbytes(n), dtype=torch.uint8, device=x.device)
    if n == 0:
        return bits
    x = x.contiguous()
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    _pack_kernel[(triton.cdiv(bits.numel(), PACK_BLOCK),)](x, bits, n, BLOCK=PACK_BLOCK, num_warps=NUM_WARPS)
    return bits


def unpack_spikes_triton(bits: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    n = math.prod(shape)
    out = torch.empty(shape, dtype=dtype, device=bits.device)
    if n == 0:
        return out
    dst = out.view(torch.uint8) if dtype == torch.bool else out
    bits = bits.reshape(-1).contiguous()
    _unpack_kernel[(triton.cdiv(bits.numel(), UNPACK_BLOCK),)](bits, dst, n, BLOCK=UNPACK_BLOCK, num_warps=NUM_WARPS)
    return out


# ------------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("efficient::pack_spikes", mutates_args=())
def _pack_op(x: Tensor, backend: str) -> Tensor:
    return _pack_impl(x, backend)


def _pack_impl(x: Tensor, backend: str) -> Tensor:
    if backend == "triton":
        return pack_spikes_triton(x)
    return pack_spikes_torch(x)


@_pack_op.register_fake
def _(x: Tensor, backend: str) -> Tensor:
    return x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


@torch.library.custom_op("efficient::unpack_spikes", mutates_args=())
def _unpack_op(bits: Tensor, shape: Sequence[int], dtype: torch.dtype, backend: str) -> Tensor:
    return _unpack_impl(bits, shape, dtype, backend)


def _unpack_impl(bits: Tensor, shape: Sequence[int], dtype: torch.dtype, backend: str) -> Tensor:
    if backend == "triton":
        return unpack_spikes_triton(bits, shape, dtype)
    return unpack_spikes_torch(bits, shape, dtype)


@_unpack_op.register_fake
def _(bits: Tensor, shape: Sequence[int], dtype: torch.dtype, backend: str) -> Tensor:
    return bits.new_empty(shape, dtype=dtype)


# ------------------------------------------------------------------------------------ public API


def _check_spikes(x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"pack_spikes: x must be a tensor, got {type(x).__name__}")
    if x.is_complex():
        raise ValueError(f"pack_spikes: x must hold real 0/1 spikes (floating, integer or bool), got {x.dtype}")


def _check_unpack(bits: Tensor, shape: Sequence[int], dtype: torch.dtype) -> tuple[int, ...]:
    if not isinstance(bits, Tensor) or bits.dtype != torch.uint8:
        got = bits.dtype if isinstance(bits, Tensor) else type(bits).__name__
        raise ValueError(f"unpack_spikes: bits must be the uint8 tensor pack_spikes returned, got {got}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unpack_spikes: dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    if not (dtype.is_floating_point or dtype == torch.bool):
        raise ValueError(f"unpack_spikes: dtype must be a floating dtype (fp32, fp16, bf16, fp64) or torch.bool, got {dtype}")
    try:
        shape = tuple(int(s) if not isinstance(s, torch.SymInt) else s for s in shape)
    except TypeError as e:
        raise TypeError(f"unpack_spikes: shape must be a sequence of ints, got {shape!r}") from e
    if any(s < 0 for s in shape):
        raise ValueError(f"unpack_spikes: shape must have non-negative sizes, got {list(shape)}")
    n = math.prod(shape)
    if bits.numel() != packed_nbytes(n):
        raise ValueError(
            f"unpack_spikes: shape {list(shape)} has {n} elements, which pack into {packed_nbytes(n)} bytes, "
            f"but bits has {bits.numel()} bytes; pass the shape of the tensor that was packed"
        )
    return shape


def pack_spikes(x: Tensor, backend: str = "auto") -> Tensor:
    """Spikes -> uint8 bits `[ceil(numel / 8)]`: element i of `x.reshape(-1)` is bit i % 8 of byte
    i // 8 (little-endian in the byte); nonzero packs as 1. Reads a non-contiguous `x` in logical
    order. Not differentiable (x is detached)."""
    _check_spikes(x)
    # no gradient: eager calls run the implementation directly, without the op's dispatch
    pack = _pack_impl if eager_call(x, function_modes=False) else _pack_op
    return pack(x.detach(), resolve_backend(backend, x, "spike_pack"))


def unpack_spikes(bits: Tensor, shape: Sequence[int], dtype: torch.dtype, backend: str = "auto") -> Tensor:
    """uint8 bits -> a contiguous tensor of `shape` and `dtype` (floating or bool) holding 0 and 1,
    on the device of `bits`. `shape` must be the packed tensor's: its numel must need exactly
    `bits.numel()` bytes."""
    shape = _check_unpack(bits, shape, dtype)
    unpack = _unpack_impl if eager_call(bits, function_modes=False) else _unpack_op
    return unpack(bits, shape, dtype, resolve_backend(backend, bits, "spike_pack"))


def is_binary(x: Tensor) -> bool:
    """Whether every element of `x` is 0 or 1 (the values `unpack_spikes` restores exactly).

    A checking helper for tests and debugging: it reads the answer back to the host, so on CUDA it
    synchronizes the device (and breaks a `torch.compile` graph); keep it out of training steps.
    """
    if x.dtype == torch.bool:
        return True
    return bool(((x == 0) | (x == 1)).all())


@dataclass(frozen=True)
class PackedSpikes:
    """A spike tensor kept as bits: `bits` (uint8, from `pack_spikes`), and the `shape` and `dtype`
    that `unpack()` restores."""

    bits: Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    def unpack(self, backend: str = "auto") -> Tensor:
        return unpack_spikes(self.bits, self.shape, self.dtype, backend)

    @property
    def nbytes(self) -> int:
        """Bytes the packed spikes occupy (against numel * element size unpacked)."""
        return self.bits.numel() * self.bits.element_size()


def pack(x: Tensor, backend: str = "auto", check: bool = False) -> PackedSpikes:
    """`PackedSpikes` of `x`. With `check=True`, first verify that x holds only 0 and 1 (and raise a
    ValueError otherwise): the check syncs the device (`is_binary`), so it is off by default."""
    _check_spikes(x)
    if check and not is_binary(x):
        raise ValueError("pack: x holds values other than 0 and 1; unpacking would return 1 for every nonzero")
    return PackedSpikes(pack_spikes(x, backend), tuple(x.shape), x.dtype)
