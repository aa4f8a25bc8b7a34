"""BatchNorm then a 2-D max-pool, a chunk of channels at a time: a conv stage that pools real values.

`pool(bn(z))` with autograd keeps z (for BatchNorm), BatchNorm's whole output (the pool's input) and one
int64 index per pooled output, and its backward makes the pool's input gradient and then z's, each as large
as z. BatchNorm's statistics and the pool are per channel, so a chunk of channels computes exactly what the
whole call does for those channels: here each chunk is normalised and pooled and its normalised values
dropped, and only z, BatchNorm's two numbers per channel and each output's argmax as a small offset in its
window (`efficient.kernels.pool_offsets`, 8 bits for a 3x3 window) are kept. Backward routes a chunk's
gradient through the pool with aten's kernel and runs BatchNorm's backward on it; given a fresh z nothing
else reads (`donate`), it writes z's gradient into z, so it never holds z and its gradient apart.

Values, running statistics and gradients are those of the separate aten calls, channel for channel, on any
device (aten ops only: the chunks are the saving, not a kernel of ours). The Spike-driven Transformer's stem
pools its last convolution's BatchNorm output this way (real-valued tokens), and spikingjelly 2.0's
Spikformer pools every stage's BatchNorm output before its LIF; memory level `recompute` reruns such a
stage in backward, where its whole BatchNorm output and both gradients were the step's peak.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from efficient.kernels._backend import eager_call
from efficient.kernels.bn_lif import _bn_backward, _channel_chunks
from efficient.kernels.pool_offsets import PoolArgs, max_pool_offsets, max_pool_offsets_backward

__all__ = ["bn_max_pool"]


def _forward(z: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor, momentum: float,
             eps: float, pool: PoolArgs) -> tuple[Tensor, Tensor, Tensor]:
    """(pooled output, argmax offsets, BatchNorm's [mean; invstd] per channel) of a training call, a chunk
    of channels at a time; the running statistics are updated in place on each chunk's slices, as
    BatchNorm does for the whole."""
    out = offsets = None
    stats = torch.empty((2, z.shape[1]), dtype=weight.dtype, device=z.device)  # as aten's BatchNorm keeps them
    for c0, c1 in _channel_chunks(z):
        y, mean, invstd = torch.native_batch_norm(z[:, c0:c1].contiguous(), weight[c0:c1], bias[c0:c1],
                                                  running_mean[c0:c1], running_var[c0:c1], True, momentum, eps)
        o, off = max_pool_offsets(y, pool)
        del y
        if out is None:
            out = o.new_empty((o.shape[0], z.shape[1], *o.shape[2:]))
            offsets = off.new_empty(out.shape)
        out[:, c0:c1], offsets[:, c0:c1] = o, off
        stats[0, c0:c1], stats[1, c0:c1] = mean, invstd
    return out, offsets, stats


class _BNMaxPool(torch.autograd.Function):
    """Keeps z, the argmax offsets and the statistics; backward by chunks of channels (see the module)."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor,
                momentum: float, eps: float, pool: PoolArgs, donate: bool) -> Tensor:
        with torch._C.DisableTorchFunction():  # modes that let the op through (`eager_call`) see nothing inside it
            out, offsets, stats = _forward(z, weight, bias, running_mean, running_var, momentum, eps, pool)
        ctx.save_for_backward(z, weight, offsets, stats)
        ctx.eps, ctx.pool, ctx.donate = eps, pool, donate
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        if grad is None:
            return (None,) * 9
        z, weight, offsets, stats = ctx.saved_tensors
        need = ctx.needs_input_grad
        # a donated z is overwritten in place: its version moves on, so a second backward through this
        # graph (retain_graph) fails autograd's saved-tensor check instead of reading gradients
        gz = z.detach() if ctx.donate and need[0] else torch.empty_like(z)
        gw, gb = torch.empty_like(weight), torch.empty_like(weight)
        for c0, c1 in _channel_chunks(z):
            zc = z[:, c0:c1].contiguous()
            gy = max_pool_offsets_backward(grad[:, c0:c1].contiguous(), offsets[:, c0:c1].contiguous(), ctx.pool,
                                           zc.shape)
            gzc, gw[c0:c1], gb[c0:c1] = _bn_backward(gy, zc, weight[c0:c1], stats[:, c0:c1].contiguous(), True,
                                                     ctx.eps)
            del gy, zc
            gz[:, c0:c1] = gzc
            del gzc
        return (gz if need[0] else None, gw if need[1] else None, gb if need[2] else None) + (None,) * 6


def bn_max_pool(z: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor, pool: PoolArgs,
                momentum: float = 0.1, eps: float = 1e-5, donate: bool = False) -> Optional[Tensor]:
    """`max_pool2d(batch_norm(z, ..., training=True), *pool)` for z [N, C, H, W] (`pool`: aten's kernel,
    stride, padding, dilation, ceil_mode; `momentum`: the factor BatchNorm would use this call; its batch
    counter stays with the caller), by chunks of channels each way, keeping z, the statistics and small
    argmax offsets (see the module). `donate=True`: nothing else reads z (a convolution's fresh output), and
    backward writes z's gradient into z.

    Returns None where this path does not apply and the caller runs BatchNorm and the pool: a call that
    something must see as ops (torch.compile, a dispatch mode, a function mode that follows this op), an input of fewer than two
    chunks, or z in another dtype than BatchNorm's parameters (autocast: the separate calls' dtype policy)."""
    if z.dim() != 4:
        raise ValueError(f"bn_max_pool: z must be a conv stage's [N, C, H, W], got {tuple(z.shape)}")
    if weight.shape != (z.shape[1],) or bias.shape != weight.shape:
        raise ValueError(f"bn_max_pool: weight and bias must have one entry per channel of z ({z.shape[1]}), "
                         f"got {tuple(weight.shape)} and {tuple(bias.shape)}")
    if (not eager_call(z, op="bn_max_pool") or len(_channel_chunks(z)) < 2 or not z.is_floating_point()
            or not z.dtype == weight.dtype == bias.dtype == running_mean.dtype):
        return None
    return _BNMaxPool.apply(z, weight, bias, running_mean, running_var, float(momentum), float(eps),
                            tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in pool), bool(donate))
