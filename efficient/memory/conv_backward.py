"""A 2-D convolution whose backward runs over slices of the batch.

Inside a recomputed region the largest stem stage's rerun sets a step's peak, and there the
convolution's backward is the last thing to run: beside the incoming gradient and the input's
gradient (each needed whole), aten's CPU backward reorders the whole input and gradient into its
own layouts (385 MiB of workspace for SDT-2-512's 128 -> 256 channel stage at b64, T=4, where the
stage's output is 256 MiB). Convolution is independent across the batch, so running the backward
a slice of samples at a time gives the same input gradient, the weight gradient as a sum of the
slices' (equal up to summation order), and bounds the workspace by one slice's. An input that is
spikes is kept as bits, packed a slice at a time, and unpacked a slice at a time in backward: the
rerun's input is never whole while the stage's backward runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from efficient.kernels import bn_lif
from efficient.kernels.spike_pack import pack_binary, unpack_spikes
from efficient.models.replay import rebuild_membrane


def batch_slices(grad: torch.Tensor, limit: int | None = None) -> list[slice]:
    """Slices of dim 0 such that each slice of `grad` has at most `limit` elements (at least one
    sample); by default the rebuilt BatchNorm + LIF backward's chunk (`bn_lif.RECOMPUTE_CHUNK`)."""
    n = grad.shape[0]
    spans = bn_lif.chunk_spans(n, grad.numel() // max(n, 1), bn_lif.RECOMPUTE_CHUNK if limit is None else limit)
    return [slice(a, b) for a, b in spans]


class _BatchSlicedConv2d(torch.autograd.Function):
    """F.conv2d forward; backward (input, weight and bias gradients) one slice of the batch at a
    time. `spikes`: x holds only 0 and 1 (a neuron's output), so a rerun keeps it as bits."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, spikes):
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
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
        stride, padding, dilation, groups = ctx.conv
        mask = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]),
                bool(ctx.needs_input_grad[2]) and ctx.bias_shape is not None]
        if ctx.bits:
            shape, dtype = ctx.x_meta
            gx = grad.new_empty(shape, dtype=dtype) if mask[0] else None
        else:
            gx = torch.empty_like(kept[0]) if mask[0] else None
        gw = gb = None
        for i, s in enumerate(ctx.slices):
            xs = unpack_spikes(kept[i], (s.stop - s.start, *shape[1:]), dtype) if ctx.bits else kept[0][s]
            a, b, c = torch.ops.aten.convolution_backward(
                grad[s], xs, weight, ctx.bias_shape if mask[2] else None, stride, padding, dilation, False,
                [0] * len(stride), groups, mask)
            del xs
            if mask[0]:
                gx[s] = a
            del a
            if mask[1]:
                gw = b if gw is None else gw.add_(b)
            if mask[2]:
                gb = c if gb is None else gb.add_(c)
        return gx, gw, gb, None, None, None, None, None


def _plain(conv: nn.Module) -> bool:
    """An nn.Conv2d with zero padding given as numbers and nothing watching it (a hook, such as the
    profiler's, must see the module called)."""
    from torch.nn.modules import module as M

    return (type(conv) is nn.Conv2d and conv.padding_mode == "zeros" and isinstance(conv.padding, tuple)
            and not (conv._forward_hooks or conv._forward_pre_hooks or conv._backward_hooks
                     or conv._backward_pre_hooks or M._global_forward_hooks or M._global_forward_pre_hooks
                     or M._global_backward_hooks or M._global_backward_pre_hooks))


def region_conv2d(conv: nn.Module, x: torch.Tensor, spikes: bool = False) -> torch.Tensor:
    """`conv(x)` for a stem stage's convolution; inside a recomputed region, whose rerun runs in
    backward, the convolution whose backward takes the batch a slice at a time (`batch_slices`; one
    slice when its output has at most `bn_lif.RECOMPUTE_CHUNK` elements). `spikes`: the caller
    knows x is a neuron's output (0 and 1 only), so the rerun keeps it as bits. Under autocast it
    runs in the autocast dtype, as `conv(x)` would."""
    if not (rebuild_membrane() and torch.is_grad_enabled() and x.dim() == 4 and x.shape[0] > 0 and _plain(conv)):
        return conv(x)
    w, b = conv.weight, conv.bias
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
    with torch.autocast(dev, enabled=False):
        return _BatchSlicedConv2d.apply(x, w, b, conv.stride, conv.padding, conv.dilation, conv.groups, spikes)
