"""A Linear inside a recomputed region whose output the region keeps for its rerun.

A recomputed region (`efficient.memory.recompute`) may keep a costly op's output from its forward, so its
rerun in backward skips that op (`efficient.models.replay.KEEP_OUTPUT_MARK`, chosen by a peak budget's
plan). `region_linear` is that for a plain Linear (SDT's projection and second MLP Linear, a `LinearBN`
with no neuron after it); `region_conv2d` is the same for a convolution, and fused Linear -> BatchNorm ->
LIF units take the kept output through `efficient.models.replay.linear_output`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as M

from efficient.kernels.bn_lif import _linear_grads
from efficient.models.neurons import watched
from efficient.models.replay import given_output, keep_output, keeps_output


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


def region_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` for a 2-D x; inside an eager recomputed region told to keep this Linear's output
    (`KEEP_OUTPUT_MARK` on `linear`), the forward keeps it and the rerun takes it back instead of the matmul,
    with the same gradients. A plain call elsewhere, and where a hook must see `linear` called (as for a
    region's convolution, `efficient.memory.conv_backward.plain_conv`)."""
    if (not keeps_output(linear) or x.dim() != 2 or type(linear) is not nn.Linear or watched(linear)
            or M._global_forward_hooks or M._global_forward_pre_hooks):
        return linear(x)
    z = given_output(linear, (x.shape[0], linear.out_features))
    if z is None:
        z = linear(x)
        keep_output(linear, z, 2 * x.shape[0] * x.shape[1] * linear.out_features)
        return z
    return _GivenLinear.apply(x, linear.weight, linear.bias, z)


__all__ = ["region_linear"]
