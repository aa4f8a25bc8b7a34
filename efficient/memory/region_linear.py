"""A Linear inside a recomputed region whose output the region keeps for its rerun.

A recomputed region (`efficient.memory.recompute`) may keep a costly op's output from its forward, so its
rerun in backward skips that op (`efficient.models.replay.KEEP_OUTPUT_MARK`, chosen by a peak budget's
plan). `region_linear` is that for a plain Linear (SDT's projection and second MLP Linear, a `LinearBN`
with no neuron after it); `region_conv2d` is the same for a convolution, and fused Linear -> BatchNorm ->
LIF units take the kept output through `efficient.models.replay.linear_output`.

A rerun's Linear whose input is spikes (SDT's second MLP Linear and projection) keeps that input as bits
for its backward (`_BitsInputLinear`), where autograd would keep it in fp32 until the rerun's backward
reaches it: in SDT's MLP rerun the spikes of the hidden layer (four times the stream's width) were held
beside the first Linear's output and the gradient of those spikes, the step's peak.
"""

from __future__ import annotations

import torch
from torch import nn

from efficient.kernels.bn_lif import _linear_grads, chunk_limit, chunk_spans
from efficient.kernels.spike_pack import pack_binary, unpack_spikes
from efficient.models.neurons import global_hooks, watched
from efficient.models.replay import given_output, keep_output, keeps_output, rebuild_membrane


class _GivenLinear(torch.autograd.Function):
    """`z`, the output of F.linear(x, weight, bias) kept from a region's forward, with that Linear's
    backward: a rerun that skips the matmul has the same gradients. Under autocast z is in the autocast
    dtype, and the backward multiplies in it, as autocast's casts before the matmul would."""

    @staticmethod
    def forward(ctx, x, weight, bias, z):
        ctx.save_for_backward(x, weight)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return z

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx = gw = gb = None
        if any(need[:3]):
            # F.linear's backward formulas, bit for bit
            gx, gw, gb = _linear_grads(grad, x.to(grad.dtype), weight.to(grad.dtype))
            gx, gw = gx.to(ctx.dtypes[0]), gw.to(ctx.dtypes[1])
            gb = None if ctx.dtypes[2] is None else gb.to(ctx.dtypes[2])
        return gx if need[0] else None, gw if need[1] else None, gb if need[2] else None, None


class _BitsInputLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) of a binary x (a neuron's spikes), keeping x for backward as bits (one bit
    where fp32 keeps 32), or `z`, that output kept from the region's forward. Backward: x's gradient as
    Linear's; the weight's from the bits unpacked a chunk of rows at a time (`chunk_limit` elements), so x is
    never whole in fp32 again: the sum over rows split by chunks, equal to Linear's within rounding."""

    @staticmethod
    def forward(ctx, x, weight, bias, z):
        ctx.save_for_backward(pack_binary(x.detach()), weight)
        ctx.shape, ctx.dtype = tuple(x.shape), x.dtype
        return torch.nn.functional.linear(x, weight, bias) if z is None else z

    @staticmethod
    def backward(ctx, grad):
        bits, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        rows, width = ctx.shape
        gw = None
        if need[1]:
            per_byte = width // 8  # rows start on whole bytes (`_bits_rerun` asks for a width of a multiple of 8)
            for r0, r1 in chunk_spans(rows, width, chunk_limit(rows * width)):
                xr = unpack_spikes(bits[r0 * per_byte:r1 * per_byte], (r1 - r0, width), ctx.dtype)
                part = grad[r0:r1].t().mm(xr)  # as `_linear_grads`' gz.t() @ x
                gw = part if gw is None else gw.add_(part)
                del xr, part
        gx = grad.mm(weight) if need[0] else None
        gb = grad.sum(0) if need[2] else None
        return gx, gw, gb, None


def _bits_rerun(x: torch.Tensor, linear: nn.Linear) -> bool:
    """Whether a Linear of spikes keeps them as bits: inside a recomputed region (lean), recorded for
    backward, x fp32 with rows of whole bytes, and no autocast (whose casts would change what is kept)."""
    return (rebuild_membrane() and torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad)
            and x.dtype == linear.weight.dtype == torch.float32 and x.shape[1] % 8 == 0
            and not torch.is_autocast_enabled(x.device.type))


def region_linear(linear: nn.Linear, x: torch.Tensor, spikes: bool = False) -> torch.Tensor:
    """`linear(x)` for a 2-D x; inside an eager recomputed region told to keep this Linear's output
    (`KEEP_OUTPUT_MARK` on `linear`), the forward keeps it and the rerun takes it back instead of the matmul,
    with the same gradients. `spikes`: x is a neuron's spikes (0 and 1), which a recorded call inside a
    region keeps as bits (`_BitsInputLinear`). A plain call elsewhere, and where a hook must see `linear`
    called (as for a region's convolution, `efficient.memory.conv_backward.plain_conv`)."""
    if x.dim() != 2 or type(linear) is not nn.Linear or watched(linear) or global_hooks():
        return linear(x)
    keeping, bits = keeps_output(linear), spikes and _bits_rerun(x, linear)
    z = given_output(linear, (x.shape[0], linear.out_features)) if keeping else None
    if keeping and z is None:  # the region's forward (eager light regions run it without autograd)
        z = linear(x)
        keep_output(linear, z, 2 * x.shape[0] * x.shape[1] * linear.out_features)
        return z
    if bits:
        return _BitsInputLinear.apply(x, linear.weight, linear.bias, z)
    return linear(x) if z is None else _GivenLinear.apply(x, linear.weight, linear.bias, z)


__all__ = ["region_linear"]
