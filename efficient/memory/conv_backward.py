"""A 2-D convolution whose backward runs over slices of the batch.

Inside a recomputed region the largest stem stage's rerun sets a step's peak, and there the
convolution's backward is the last thing to run: beside the incoming gradient and the input's
gradient (each needed whole), aten's CPU backward reorders the whole input and gradient into its
own layouts (385 MiB of workspace for SDT-2-512's 128 -> 256 channel stage at b64, T=4, where the
stage's output is 256 MiB). Convolution is independent across the batch, so running the backward
a slice of samples at a time gives the same input gradient, the weight gradient as a sum of the
slices' (equal up to summation order), and bounds the workspace by one slice's. An input that is
spikes is kept as bits, packed a slice at a time, and unpacked a slice at a time in backward: the
rerun's input is never whole while the stage's backward runs. On a CPU the forward of a large
convolution runs by batch slices too (`sliced_conv2d`): oneDNN writes a whole call's output into a
buffer of its own as large as the output before copying it out.

Under `torch.compile` the same backward is the opaque op `efficient::conv2d_backward_from_bits`: a
compiled region whose input is spikes keeps their bits (`efficient.memory.recompute`), and its
convolution's backward reads those, unpacking a slice at a time, where aten's backward would need
the rerun's fp32 input whole, beside the widest stage's gradients.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from efficient.kernels import bn_lif
from efficient.kernels.spike_pack import pack_binary, unpack_spikes
from efficient.models.neurons import global_hooks, watched
from efficient.models.replay import given_output, keep_output, keeps_output, rebuild_membrane


def batch_slices(grad: torch.Tensor, limit: int | None = None) -> list[slice]:
    """Slices of dim 0 such that each slice of `grad` has at most `limit` elements (at least one
    sample); by default the rebuilt BatchNorm + LIF backward's chunk (`bn_lif.chunk_limit`)."""
    n = grad.shape[0]
    spans = bn_lif.chunk_spans(n, grad.numel() // max(n, 1), bn_lif.chunk_limit(grad.numel()) if limit is None else limit)
    return [slice(a, b) for a, b in spans]


# Elements of a forward slice's output. oneDNN's CPU convolution computes its output in a buffer of its own,
# as large as the output, and copies it out, so a whole call holds twice its output: inside a rerun
# (in backward, beside the parameter gradients) that buffer set the stable-SNN VGG's step peak. Slices of
# about a million elements (4 MiB in fp32) were also faster than the whole call at five of VGG-11's six
# shapes on a CPU, and gave its values bit for bit at all six (bench/conv_slices.py).
FORWARD_SLICE = 1 << 20


def _forward_spans(shape: Sequence[int], device: torch.device, weight: Tensor, stride, padding,
                   dilation) -> list[tuple[int, int]]:
    """The batch spans a convolution's forward takes (`sliced_conv2d`): one on a device other than a CPU,
    else spans of at most `FORWARD_SLICE` output elements."""
    n = shape[0]
    if device.type != "cpu" or len(shape) != 4 or n < 2:
        return [(0, n)]
    return bn_lif.chunk_spans(n, math.prod(_out_shape(shape, weight, stride, padding, dilation)[1:]), FORWARD_SLICE)


def _out_shape(shape: Sequence[int], weight: Tensor, stride, padding, dilation) -> tuple[int, int, int, int]:
    """The output shape of a 2-D convolution of an input of `shape` [N, C, H, W] (numeric padding)."""
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
    kh, kw = weight.shape[2:]
    ho = (shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return shape[0], weight.shape[0], ho, wo


def _conv_by_spans(x_of: Callable[[int, slice], Tensor], spans: list[tuple[int, int]], weight: Tensor,
                   bias: Tensor | None, stride, padding, dilation, groups) -> Tensor:
    """F.conv2d of the input whose batch span i `x_of(i, slice)` gives, one call per span, written into one output."""
    if len(spans) == 1:
        return F.conv2d(x_of(0, slice(*spans[0])), weight, bias, stride, padding, dilation, groups)
    out = None
    for i, (a, b) in enumerate(spans):
        part = F.conv2d(x_of(i, slice(a, b)), weight, bias, stride, padding, dilation, groups)
        if out is None:
            out = part.new_empty((spans[-1][1], *part.shape[1:]))
        out[a:b] = part
        del part
    return out


def sliced_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation, groups) -> Tensor:
    """F.conv2d(x, ...) [N, C, H, W]; on a CPU, an output of more than `FORWARD_SLICE` elements is computed
    a slice of the batch at a time into one tensor (a convolution is independent across samples), so the
    call holds one slice's buffer beside the output, not a second output."""
    spans = _forward_spans(x.shape, x.device, weight, stride, padding, dilation)
    return _conv_by_spans(lambda i, s: x[s], spans, weight, bias, stride, padding, dilation, groups)


def _bits_reader(bits: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Callable[[int, slice], Tensor]:
    """`x_of(i, slice)`: a batch slice of the input `shape` packed whole by `pack_spikes` / `pack_binary`
    (`bits`), unpacked as `dtype`; where a sample's bits do not start on a byte, the input unpacked once."""
    per = math.prod(shape[1:])
    if per % 8:
        whole = unpack_spikes(bits, shape, dtype)
        return lambda i, s: whole[s]
    return lambda i, s: unpack_spikes(bits[s.start * per // 8:s.stop * per // 8], (s.stop - s.start, *shape[1:]), dtype)


class _BatchSlicedConv2d(torch.autograd.Function):
    """F.conv2d forward (by batch slices where large, `sliced_conv2d`); backward (input, weight and bias
    gradients) one slice of the batch at a time. `spikes`: x holds only 0 and 1 (a neuron's output), so a
    rerun keeps it as bits. `given`: the output, kept from the region's forward (no convolution here)."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, spikes, given=None):
        out = sliced_conv2d(x, weight, bias, stride, padding, dilation, groups) if given is None else given
        ctx.slices = batch_slices(out)
        ctx.conv = (stride, padding, dilation, groups)
        ctx.bias_shape = None if bias is None else list(bias.shape)
        # packed in the region's first pass too, whose saves the checkpoint drops: its rerun must
        # save tensors of the same kinds
        ctx.bits = bool(spikes)
        if ctx.bits:
            ctx.x_meta = (x.shape, x.dtype)
            ctx.save_for_backward(weight, *(pack_binary(x[s]) for s in ctx.slices))
        else:
            ctx.save_for_backward(weight, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, *kept = ctx.saved_tensors
        mask = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                bool(ctx.needs_input_grad[2]) and ctx.bias_shape is not None]
        if ctx.bits:
            shape, dtype = ctx.x_meta
            x_of = lambda i, s: unpack_spikes(kept[i], (s.stop - s.start, *shape[1:]), dtype)  # noqa: E731
        else:
            shape, dtype = kept[0].shape, kept[0].dtype
            x_of = lambda i, s: kept[0][s]  # noqa: E731
        gx, gw, gb = _sliced_backward(grad, x_of, shape, dtype, weight, ctx.bias_shape, ctx.conv, mask, ctx.slices)
        return gx, gw, gb, None, None, None, None, None, None


def _sliced_backward(grad: Tensor, x_of: Callable[[int, slice], Tensor], shape: Sequence[int], dtype: torch.dtype,
                     weight: Tensor, bias_shape: list[int] | None, conv: tuple, mask: list[bool],
                     slices: list[slice]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(input, weight, bias) gradients of a convolution, aten's backward run on one slice of the
    batch at a time (`x_of(i, slice)`: the input's slice i); None where `mask` says not wanted."""
    stride, padding, dilation, groups = conv
    gx = grad.new_empty(shape, dtype=dtype) if mask[0] else None
    gw = gb = None
    for i, s in enumerate(slices):
        xs = x_of(i, s)
        a, b, c = torch.ops.aten.convolution_backward(
            grad[s], xs, weight, bias_shape if mask[2] else None, stride, padding, dilation, False,
            [0] * len(stride), groups, mask)
        del xs
        if mask[0]:
            gx[s] = a
        del a
        if mask[1]:
            gw = b if gw is None else gw.add_(b)
        if mask[2]:
            gb = c if gb is None else gb.add_(c)
    return gx, gw, gb


# --- the same backward for compiled regions: one opaque op over the input's bits

@torch.library.custom_op("efficient::conv2d_backward_from_bits", mutates_args=())
def conv2d_backward_from_bits(
    grad: Tensor, bits: Tensor, x_shape: Sequence[int], x_dtype: torch.dtype, weight: Tensor, bias: bool,
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int, mask: Sequence[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad input, grad weight, grad bias) of a convolution whose input `x_shape` was packed whole
    by `pack_spikes` (`bits`), one slice of the batch at a time (`batch_slices`); an unwanted
    gradient (`mask`) is an empty tensor."""
    shape, mask = list(x_shape), [bool(m) for m in mask]
    x_of = _bits_reader(bits, shape, x_dtype)
    bias_shape = [weight.shape[0]] if bias else None
    mask[2] = mask[2] and bias
    gx, gw, gb = _sliced_backward(grad, x_of, shape, x_dtype, weight, bias_shape,
                                  (list(stride), list(padding), list(dilation), groups), mask, batch_slices(grad))
    empty = weight.new_empty(0)
    return (empty if gx is None else gx, empty.clone() if gw is None else gw.contiguous(),
            empty.clone() if gb is None else gb)


@conv2d_backward_from_bits.register_fake
def _(grad, bits, x_shape, x_dtype, weight, bias, stride, padding, dilation, groups, mask):
    return (grad.new_empty(list(x_shape), dtype=x_dtype) if mask[0] else weight.new_empty(0),
            weight.new_empty(weight.shape) if mask[1] else weight.new_empty(0),
            weight.new_empty(weight.shape[0]) if mask[2] and bias else weight.new_empty(0))


class _BitsKeptConv2d(torch.autograd.Function):
    """`out`, F.conv2d of a compiled region's spike input `x` (computed by the caller from detached
    operands), with x's, the weight's and the bias's gradients from `bits` (what the region keeps of its
    input, `conv2d_backward_from_bits`): x itself is not kept. The convolution runs outside this function
    so that the compiler tags it as the region's to rerun (torch 2.11 left an op inside an
    autograd.Function nested in a checkpoint region untagged, and kept its output instead)."""

    @staticmethod
    def forward(ctx, out, x, bits, weight, bias, stride, padding, dilation, groups):
        ctx.save_for_backward(bits, weight)
        ctx.meta = (list(x.shape), x.dtype, bias is not None, stride, padding, dilation, groups)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        bits, weight = ctx.saved_tensors
        shape, dtype, bias, stride, padding, dilation, groups = ctx.meta
        need = [bool(ctx.needs_input_grad[i]) for i in (1, 3, 4)]
        gx, gw, gb = torch.ops.efficient.conv2d_backward_from_bits(grad, bits, shape, dtype, weight, bias, stride,
                                                                    padding, dilation, groups, need)
        return (None, gx if need[0] else None, None, gw if need[1] else None, gb if need[2] and bias else None,
                None, None, None, None)


class _BitsInputConv2d(torch.autograd.Function):
    """A convolution whose input a recomputed region keeps as bits (`bits`: `pack_binary` of the input):
    forward and backward read the input from the bits a batch slice at a time (`_bits_reader`; the forward's
    spans are `sliced_conv2d`'s), so it is never whole in fp32. `x` is the input in the region's forward, or a
    placeholder of its shape and dtype in the rerun (`recompute`: the rerun of a unit whose input is spikes,
    `recompute_input_from_bits`); only its shape and dtype are read, and its gradient is returned. `dtype`:
    the dtype the convolution runs in (autocast's, or x's). `given`: the output, kept from the region's forward
    (no convolution here)."""

    @staticmethod
    def forward(ctx, x, bits, weight, bias, dtype, stride, padding, dilation, groups, given=None):
        shape = tuple(x.shape)
        if given is None:
            spans = _forward_spans(shape, x.device, weight, stride, padding, dilation)
            out = _conv_by_spans(_bits_reader(bits, shape, dtype), spans, weight, bias, stride, padding, dilation,
                                 groups)
        else:
            out = given
        ctx.meta = (shape, x.dtype, dtype, (stride, padding, dilation, groups),
                    None if bias is None else list(bias.shape))
        ctx.save_for_backward(weight, bits)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, bits = ctx.saved_tensors
        shape, x_dtype, dtype, conv, bias_shape = ctx.meta
        mask = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[2]),
                bool(ctx.needs_input_grad[3]) and bias_shape is not None]
        gx, gw, gb = _sliced_backward(grad, _bits_reader(bits, shape, dtype), shape, x_dtype, weight, bias_shape, conv,
                                      mask, batch_slices(grad))
        return gx, None, gw, gb, None, None, None, None, None, None


_bits_state = threading.local()  # how many convolutions read their input from a region's bits (`bits_reads`)


def bits_reads() -> int:
    """How many convolutions have read their input from a recomputed region's bits in this thread: a region
    that hands a unit a placeholder input checks that the unit's convolution read the bits instead."""
    return getattr(_bits_state, "reads", 0)


def plain_conv(conv: nn.Module) -> bool:
    """An nn.Conv2d with zero padding given as numbers and nothing watching it (a hook, such as the
    profiler's, must see the module called)."""
    return (type(conv) is nn.Conv2d and conv.padding_mode == "zeros" and isinstance(conv.padding, tuple)
            and not (watched(conv) or global_hooks()))


def region_conv2d(conv: nn.Module, x: torch.Tensor, spikes: bool = False,
                  bits: torch.Tensor | None = None) -> torch.Tensor:
    """`conv(x)` for a stem stage's convolution; inside a recomputed region, whose rerun runs in
    backward, the convolution whose backward takes the batch a slice at a time (`batch_slices`; one
    slice when its output has at most `bn_lif.RECOMPUTE_CHUNK` elements), and whose forward does too
    on a CPU where its output is large (`sliced_conv2d`, in the region's forward and its rerun alike). `spikes`: the caller
    knows x is a neuron's output (0 and 1 only), so the rerun keeps it as bits. Under autocast it
    runs in the autocast dtype, as `conv(x)` would. `bits`: x's bits, which the region keeps; the
    convolution reads its input from them (eager: x may be a placeholder, `recompute_input_from_bits`),
    or its backward does (under torch.compile, where only a region's spike input takes this path). An eager
    region told to keep this convolution's output (`efficient.models.replay.KEEP_OUTPUT_MARK` on `conv`) keeps it
    from its forward and hands it to the rerun, which skips the convolution (the same backward)."""
    compiling, grad, keeps = torch.compiler.is_compiling(), torch.is_grad_enabled(), keeps_output(conv)
    # (a region that keeps this convolution's output takes this path also where it keeps its membrane traces: its
    # backward then runs by batch slices, whose weight gradient equals aten's whole one up to summation order)
    if not ((rebuild_membrane(conv) or keeps) and (bits is not None or not compiling)
            and (grad or not compiling) and x.dim() == 4 and x.shape[0] > 0 and plain_conv(conv)):
        return conv(x)
    dev = x.device.type
    amp = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    w, b = conv.weight, conv.bias
    if amp is not None:
        w, b = w.to(amp), None if b is None else b.to(amp)
    # (keeps: eager only) the output kept from the region's forward, in its rerun
    given = given_output(conv, _out_shape(x.shape, w, conv.stride, conv.padding, conv.dilation)) if keeps else None
    flops_per_output = 2 * math.prod(w.shape[1:])
    with torch.autocast(dev, enabled=False):
        if bits is not None and not compiling:
            # an eager region's unit whose input is spikes kept as bits (`recompute`): in its rerun x is a
            # placeholder, so the input is read from the bits (in the autocast dtype, as `conv(x)` would run)
            _bits_state.reads = bits_reads() + 1
            out = _BitsInputConv2d.apply(x, bits, w, b, amp or x.dtype, conv.stride, conv.padding, conv.dilation,
                                         conv.groups, given)
            if keeps:
                keep_output(conv, out, flops_per_output * out.numel())
            return out
        if amp is not None:
            x = x.to(amp)
        if not grad:
            # the region's forward, run without autograd, computes z as its rerun will (`sliced_conv2d`): the
            # same values bit for bit, so the rerun's spikes are the forward's
            out = sliced_conv2d(x, w, b, conv.stride, conv.padding, conv.dilation, conv.groups)
            if keeps:
                keep_output(conv, out, flops_per_output * out.numel())
            return out
        if compiling:
            out = F.conv2d(x.detach(), w.detach(), None if b is None else b.detach(), conv.stride, conv.padding,
                           conv.dilation, conv.groups)
            return _BitsKeptConv2d.apply(out, x, bits, w, b, conv.stride, conv.padding, conv.dilation, conv.groups)
        return _BatchSlicedConv2d.apply(x, w, b, conv.stride, conv.padding, conv.dilation, conv.groups, spikes, given)
