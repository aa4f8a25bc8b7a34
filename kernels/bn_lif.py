"""BatchNorm then a multi-step LIF, as one op: the Conv/Linear -> BatchNorm -> LIF unit of every
spiking transformer of the zoo after its matmul, or with the Linear inside too, the whole unit
(`efficient::linear_bn_lif_*`: the matmuls as nn.Linear and autograd compute them).

A unit's BatchNorm and neuron cost a training step some twenty dispatched ops and six autograd
nodes (the BatchNorm call and its buffers, the reshapes between the two layouts, the neuron op, and
the same again in backward). Here they are one custom op with one backward: on a GPU, where a small
step waits on the host, that is the launch and dispatch cost the step does not pay.

Layout: `z` is what BatchNorm takes, time folded into the batch, `[T*R, C, *spatial]` (a Linear
unit's `[T*B*N, C]`, a conv unit's `[T*B, C, H, W]`); the neuron runs over T on `[T, R*C*S]`.

Parts (as `efficient.kernels.lif`):

1. `bn_lif_reference`: the spec, `F.batch_norm` then `lif_reference`.
2. A Triton kernel that normalises and runs the neuron over all T in one pass, and also writes
   the statistics the backward takes and the new running statistics: with the batch's mean and
   variance from one reduction before it, a training forward is two launches (eval: one), where
   BatchNorm and LIF take three and the per-channel arithmetic between them one each.
3. Custom ops `efficient::bn_lif_forward` / `efficient::bn_lif_backward` (fake implementations,
   autograd formula, flop formula). On CPU the forward runs aten's `native_batch_norm` and the
   LIF's own loop, the backward the LIF's backward and `native_batch_norm_backward`: outputs,
   running statistics and gradients are bit for bit those of the separate BatchNorm and `lif` calls.
   With Triton the backward is the LIF's Triton kernel and the same BatchNorm backward.
4. `bn_lif`: the public entry, `backend=` as `lif`'s ("torch" runs the reference).
5. `bn_lif_max_pool`: a conv stage's BatchNorm -> LIF -> 2-D max-pool a chunk of channels at a
   time, forward and backward, so the stage's spikes and membrane trace never exist whole (memory
   level `recompute` runs a stem stage's rerun with it); given a fresh z (`donate`), the backward writes
   z's gradient into z (compiled: `efficient::bn_lif_max_pool_backward_into`, which mutates z).
6. `bn_gain_lif`: BatchNorm -> a learnable per-step gain -> LIF with leak (the stable-SNN's DLIF) a
   chunk of channels at a time each way, from the LIF's own implementations (memory level
   `recompute` reruns the stable-SNN VGG's and WRN's units with it), donating a fresh z as 5.

`bn_lif` updates the running statistics in place, as BatchNorm does in training (`momentum` is
the factor BatchNorm would use; its batch counter stays with the caller); the op itself returns
them, as autograd needs a functional op, and its eager path (no dispatch) writes them in place. In eval mode it normalises
with the running statistics. Only LIF's constant-tau charges are fused in one op (PLIF's learnable
rate stays with the separate calls; DLIF's gain is `bn_gain_lif`'s, by chunks).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from efficient.kernels import lif as _lif
from efficient.kernels._backend import eager_call, eager_function, graph_kept, register_flops
from efficient.kernels.lif_common import (
    _BLOCK, _NUM_WARPS, HAS_TRITON, IMPLS, _check_compiler, _choose_impl, _register_flops, _surrogate_id,
    _triton_ready, default_alpha,
)
from efficient.kernels.pool_offsets import PoolArgs, max_pool_offsets, max_pool_offsets_backward, offset_dtype, pool_args

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["bn_gain_lif", "bn_lif", "bn_lif_max_pool", "bn_lif_reference"]


def _check_z(z: Tensor, steps: int, weight: Tensor, bias: Tensor, channels: Optional[int] = None) -> None:
    """z must be BatchNorm's input with T folded into its batch (or the Linear's input before it,
    whose output has `channels` channels); weight and bias one per channel."""
    if not isinstance(z, Tensor) or z.dim() < 2 or not z.is_floating_point():
        raise ValueError(
            f"bn_lif takes BatchNorm's input [T*R, C, ...] (floating point, at least 2 dims), got "
            f"{tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__}"
        )
    if steps < 1 or z.shape[0] % steps:
        raise ValueError(
            f"bn_lif: the first dim of z ({z.shape[0]}) must be T*R for T={steps} time steps; fold time into "
            "the batch first, e.g. x.flatten(0, 1) for [T, B, C, H, W]"
        )
    C = z.shape[1] if channels is None else channels
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (C,):
            raise ValueError(f"bn_lif: {name} must hold one value per channel ({C}), got {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------
# 1. reference
# ---------------------------------------------------------------------------------------------


def bn_lif_reference(
    z: Tensor, steps: int, weight: Tensor, bias: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
    training: bool = True, momentum: float = 0.1, eps: float = 1e-5, **lif_kwargs,
) -> tuple[Tensor, Tensor]:
    """F.batch_norm on `z` [T*R, C, ...], then `lif_reference` over T: (spikes shaped like z, H [T, ...])."""
    y = F.batch_norm(z, running_mean, running_var, weight, bias, training, momentum, eps)
    s, h = _lif.lif_reference(y.reshape(steps, -1, *y.shape[1:]), **lif_kwargs)
    return s.reshape(z.shape), h


# ---------------------------------------------------------------------------------------------
# 2. Triton: normalise with per-channel scale/shift and run the neuron, all T in one kernel
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    from efficient.kernels.lif import _TL_DECAY_INPUT, _TL_LEAK, _lif_grad_h_tl, _lif_step_tl

    @triton.jit
    def _bn_lif_fwd_kernel(
        z_ptr, mean_ptr, var_ptr, w_ptr, b_ptr, rm_ptr, rv_ptr, stats_ptr, new_rm_ptr, new_rv_ptr, s_ptr, h_ptr,
        N, T, C, S, eps, momentum, unbias, c, v_th, v_reset,
        TRAINING: tl.constexpr, CHARGE: tl.constexpr, HARD: tl.constexpr, STORE_H: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # mean/var: the batch's mean and biased variance in training, the running ones in eval.
        # STORE_H False: H is not written (the backward rebuilds it, `_bn_lif_recompute_bwd_kernel`).
        # The programs whose index range [pid*BLOCK, pid*BLOCK + BLOCK) meets the channels write
        # those channels' stats for the backward (training: mean, 1/sqrt(var + eps); eval: the
        # running mean and variance) and, in training, the running statistics moved towards the
        # batch's by `momentum` (unbiased variance) -- the per-channel work that would otherwise
        # be a handful of tiny launches.
        pid = tl.program_id(0)
        if pid * BLOCK < C:
            cofs = pid * BLOCK + tl.arange(0, BLOCK)
            cmask = cofs < C
            mu = tl.load(mean_ptr + cofs, mask=cmask, other=0.0).to(tl.float32)
            var = tl.load(var_ptr + cofs, mask=cmask, other=1.0).to(tl.float32)
            if TRAINING:
                tl.store(stats_ptr + cofs, mu.to(stats_ptr.dtype.element_ty), mask=cmask)
                tl.store(stats_ptr + C + cofs, tl.rsqrt(var + eps).to(stats_ptr.dtype.element_ty), mask=cmask)
                rm = tl.load(rm_ptr + cofs, mask=cmask, other=0.0).to(tl.float32)
                rv = tl.load(rv_ptr + cofs, mask=cmask, other=0.0).to(tl.float32)
                tl.store(new_rm_ptr + cofs, (rm + momentum * (mu - rm)).to(new_rm_ptr.dtype.element_ty), mask=cmask)
                tl.store(new_rv_ptr + cofs, (rv + momentum * (var * unbias - rv)).to(new_rv_ptr.dtype.element_ty),
                         mask=cmask)
            else:
                tl.store(stats_ptr + cofs, mu.to(stats_ptr.dtype.element_ty), mask=cmask)
                tl.store(stats_ptr + C + cofs, var.to(stats_ptr.dtype.element_ty), mask=cmask)
        # one program owns BLOCK neurons of a step's N = R*C*S and walks them through all T; the
        # element at offset n of a step belongs to channel (n // S) % C
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        ch = (offs // S) % C
        scale = tl.load(w_ptr + ch, mask=mask, other=0.0).to(tl.float32) * tl.rsqrt(
            tl.load(var_ptr + ch, mask=mask, other=1.0).to(tl.float32) + eps)
        shift = tl.load(b_ptr + ch, mask=mask, other=0.0).to(tl.float32) - tl.load(
            mean_ptr + ch, mask=mask, other=0.0).to(tl.float32) * scale
        v = tl.zeros([BLOCK], dtype=tl.float32) + v_reset  # v_reset is 0.0 for soft reset
        for _t in range(T):
            x = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale + shift
            h, spike, v = _lif_step_tl(x, v, 0.0, c, v_th, v_reset, CHARGE, False, HARD)
            if STORE_H:
                tl.store(h_ptr + offs, h, mask=mask)
                h_ptr += N
            tl.store(s_ptr + offs, spike.to(s_ptr.dtype.element_ty), mask=mask)
            z_ptr += N
            s_ptr += N


    @triton.jit
    def _bn_lif_recompute_bwd_kernel(
        z_ptr, gs_ptr, stats_ptr, w_ptr, b_ptr, gy_ptr, N, T, C, S, eps, c, v_th, v_reset, alpha,
        TRAINING: tl.constexpr, CHARGE: tl.constexpr, HARD: tl.constexpr, DETACH: tl.constexpr,
        SURROGATE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # The LIF's backward for a unit whose forward kept z but not H: each program rebuilds its
        # neurons' H over all T exactly as `_bn_lif_fwd_kernel` made it (stats: the batch's mean and
        # invstd in training, which the forward kernel computed as rsqrt(var + eps) and stored in fp32;
        # the running mean and variance in eval), parks it in the gradient's own buffer (fp32), then
        # walks back over T overwriting each step's H with its gradient: z, grad spikes and grad y are
        # the only full-size tensors.
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        ch = (offs // S) % C
        second = tl.load(stats_ptr + C + ch, mask=mask, other=1.0).to(tl.float32)
        if TRAINING:
            inv = second
        else:
            inv = tl.rsqrt(second + eps)
        scale = tl.load(w_ptr + ch, mask=mask, other=0.0).to(tl.float32) * inv
        shift = tl.load(b_ptr + ch, mask=mask, other=0.0).to(tl.float32) - tl.load(
            stats_ptr + ch, mask=mask, other=0.0).to(tl.float32) * scale
        v = tl.zeros([BLOCK], dtype=tl.float32) + v_reset
        for t in range(T):
            x = tl.load(z_ptr + t * N + offs, mask=mask, other=0.0).to(tl.float32) * scale + shift
            h, spike, v = _lif_step_tl(x, v, 0.0, c, v_th, v_reset, CHARGE, False, HARD)
            tl.store(gy_ptr + t * N + offs, h, mask=mask)
        carry = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(T):
            t = T - 1 - i
            h = tl.load(gy_ptr + t * N + offs, mask=mask, other=0.0)
            gs = tl.load(gs_ptr + t * N + offs, mask=mask, other=0.0).to(tl.float32)
            gh = _lif_grad_h_tl(h, gs, carry, v_th, v_reset, alpha, HARD, DETACH, SURROGATE)
            if CHARGE == _TL_DECAY_INPUT:
                gx = tl.math.div_rn(gh, c)
                carry = gh - gx
            else:
                gx = gh
                if CHARGE == _TL_LEAK:
                    carry = gh * c
                else:
                    carry = gh - tl.math.div_rn(gh, c)
            tl.store(gy_ptr + t * N + offs, gx, mask=mask)


def _no_running(running_mean: Tensor) -> tuple[Tensor, Tensor]:
    """The op's two running-statistics outputs in eval: empty (and distinct: outputs may not alias)."""
    return running_mean.new_empty(0), running_mean.new_empty(0)


def _triton_forward(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_th, v_reset,
                    charge, spike_dtype, inplace=False, keep_membrane=True):
    _triton_ready(z)
    z = z.contiguous()
    C = z.shape[1]
    if training:  # the batch's mean and biased variance: one reduction, the kernel does the rest
        var, mean = torch.var_mean(z.float(), dim=[0, *range(2, z.dim())], correction=0)
        if inplace:  # each program reads its channels' statistics before it writes them
            new_mean, new_var = running_mean, running_var
        else:
            new_mean, new_var = torch.empty_like(running_mean), torch.empty_like(running_var)
        n = z.numel() // C
        unbias = n / max(n - 1, 1)
    else:
        mean, var, unbias = running_mean, running_var, 1.0
        new_mean, new_var = _no_running(running_mean)
    # saved as aten's BatchNorm saves them (in the parameters' dtype)
    stats = torch.empty((2, C), dtype=weight.dtype, device=z.device)
    N = z.numel() // steps
    s = torch.empty(z.shape, dtype=spike_dtype, device=z.device)
    h = torch.empty((steps, N), dtype=torch.float32, device=z.device) if keep_membrane else _no_membrane(z)
    hard = v_reset is not None
    S = math.prod(z.shape[2:])  # elements per channel and sample (1 for a Linear unit)
    _bn_lif_fwd_kernel[(triton.cdiv(N, _BLOCK),)](
        z, mean, var, weight, bias, running_mean, running_var, stats, new_mean, new_var, s, h, N, steps, C, S,
        float(eps), float(momentum), float(unbias), float(c), float(v_th), float(v_reset) if hard else 0.0,
        TRAINING=bool(training), CHARGE=charge, HARD=hard, STORE_H=bool(keep_membrane), BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
    )
    if inplace:
        new_mean, new_var = _no_running(running_mean)
    return s, h, stats, new_mean, new_var


# ---------------------------------------------------------------------------------------------
# 3. custom op: efficient::bn_lif_forward / efficient::bn_lif_backward
# ---------------------------------------------------------------------------------------------


# Inductor may hand these ops a convolution's output in its own layout (channels-last on CPU). They
# take any strides: each copies what it reads contiguous itself (the whole z, or a chunk of channels
# at a time), so results do not depend on the layout and outputs are contiguous, where inductor would
# otherwise copy z whole for every op that reads it and keep those copies alive in a region's rerun.
# (`custom_op` takes tags only in recent torch releases; with an older one the ops keep the default
# layout rule: the same values, with inductor's copies.)
LAYOUT_TAGS = ("tags" in inspect.signature(torch.library.custom_op).parameters
               and hasattr(torch.Tag, "flexible_layout"))
_ANY_LAYOUT = {"tags": (torch.Tag.flexible_layout,)} if LAYOUT_TAGS else {}


def _dense(*ts: Tensor) -> tuple[Tensor, ...]:
    """The small per-channel arguments of an `_ANY_LAYOUT` op as contiguous tensors (the Triton
    kernels index them as such; the big ones are copied whole or by chunks where they are read)."""
    return tuple(t.contiguous() for t in ts)


def _check_op(z: Tensor, steps: int, weight: Tensor, bias: Tensor, impl: str) -> None:
    _check_z(z, steps, weight, bias)
    if impl not in IMPLS:
        raise ValueError(f"efficient::bn_lif_forward: unknown impl {impl!r}; choose one of {IMPLS}")


@torch.library.custom_op("efficient::bn_lif_forward", mutates_args=(), **_ANY_LAYOUT)
def bn_lif_forward_op(
    z: Tensor,
    steps: int,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    training: bool,
    momentum: float,
    eps: float,
    c: float,
    v_threshold: float,
    v_reset: Optional[float],
    charge: int,
    surrogate: int,
    alpha: float,
    detach_reset: bool,
    spike_dtype: torch.dtype,
    impl: str,
    keep_membrane: bool = True,
    rebuild_whole: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """z [T*R, C, ...] -> (spikes shaped like z, H [T, R*C*S] fp32, stats [2, C], new running mean
    [C], new running variance [C]): stats are what BatchNorm's backward takes (the batch's mean and
    invstd in training, the running mean and variance in eval; in weight's dtype, as aten's
    BatchNorm keeps them), one tensor for the pair because every output autograd saves costs a
    detach per step. The new running statistics are BatchNorm's update in training (empty in
    eval); the op is functional (autograd needs that), so `bn_lif` copies them into the buffers.
    surrogate/alpha/detach_reset serve the backward; `keep_membrane` False: autograd keeps z but not
    H, and the backward recomputes H from z (`bn_lif_backward_recompute`), by chunks of channels or, with
    `rebuild_whole`, in one piece."""
    z = z.contiguous()  # BatchNorm's sums in one order, whatever layout inductor gave z (`_ANY_LAYOUT`)
    weight, bias, running_mean, running_var = _dense(weight, bias, running_mean, running_var)
    return _forward_impl(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_threshold,
                         v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, keep_membrane=keep_membrane)


def _forward_impl(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_threshold, v_reset,
                  charge, surrogate, alpha, detach_reset, spike_dtype, impl, keep_membrane=True, rebuild_whole=False,
                  inplace=False, by_chunks=True):
    """The op's implementation (`rebuild_whole` is for the backward: the autograd context reads it).
    `inplace` (the eager path, which need not be functional): the running statistics are updated in
    the caller's buffers, as BatchNorm does, and the two running-statistics outputs are empty; no copies.
    `by_chunks` False: z is already a caller's chunk of channels, run in one piece."""
    _check_op(z, steps, weight, bias, impl)
    if impl == "triton":
        return _triton_forward(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c,
                               v_threshold, v_reset, charge, spike_dtype, inplace, keep_membrane)
    # aten's own BatchNorm (what nn.BatchNorm calls), then the LIF's loop: bit for bit the separate calls
    z = z.contiguous()  # BatchNorm's sums in one order whatever layout inductor gave z
    if by_chunks and FORWARD_BY_CHUNKS and not keep_membrane and z.dim() > 2 and len(chunks := _channel_chunks(z)) > 1:
        return _chunked_forward(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c,
                                v_threshold, v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, inplace,
                                chunks)
    if training:  # updated in place by native_batch_norm: the buffers, or the op's new statistics
        new_mean, new_var = (running_mean, running_var) if inplace else (running_mean.clone(), running_var.clone())
        y, mean, invstd = torch.native_batch_norm(z, weight, bias, new_mean, new_var, True, momentum, eps)
        stats = torch.stack([mean, invstd])
        if inplace:
            new_mean, new_var = _no_running(running_mean)
    else:  # native_batch_norm keeps no statistics in eval; the backward needs the running ones
        y, _, _ = torch.native_batch_norm(z, weight, bias, running_mean, running_var, False, momentum, eps)
        stats = torch.stack([running_mean, running_var]).to(weight.dtype)
        new_mean, new_var = _no_running(running_mean)
    # y is BatchNorm's new output, read by nothing after the LIF: H is written over it
    s, h = _lif._run_forward(y.reshape(steps, -1), None, c, v_threshold, v_reset, charge, spike_dtype, impl,
                             membrane=keep_membrane, over=True)
    del y
    return s.view(z.shape), (h if keep_membrane else _no_membrane(z)), stats, new_mean, new_var


def _chunked_forward(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_threshold,
                     v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, inplace, chunks):
    """`_forward_impl` without H for a conv unit's z, a chunk of channels at a time (BatchNorm's
    statistics and the LIF are per channel, so each chunk's values are the whole call's bit for bit):
    beside z and the spikes, BatchNorm's output and the LIF's temporaries exist for one chunk only,
    where whole they would take 2.5x z at once (a stem stage's rerun sets a step's peak there)."""
    # each chunk updates its slice of the buffers (or of copies) in place
    new_mean, new_var = (running_mean.clone(), running_var.clone()) if training and not inplace else (running_mean,
                                                                                                     running_var)
    s = torch.empty(z.shape, dtype=spike_dtype, device=z.device)
    stats = torch.empty((2, z.shape[1]), dtype=weight.dtype, device=z.device)
    for c0, c1 in chunks:
        s[:, c0:c1], _, stats[:, c0:c1], _, _ = _forward_impl(
            z[:, c0:c1].contiguous(), steps, weight[c0:c1], bias[c0:c1], new_mean[c0:c1], new_var[c0:c1], training,
            momentum, eps, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl,
            keep_membrane=False, inplace=True, by_chunks=False)
    if inplace or not training:
        new_mean, new_var = _no_running(running_mean)
    return s, _no_membrane(z), stats, new_mean, new_var


def _no_membrane(z: Tensor) -> Tensor:
    """The op's H output where the backward rebuilds H (`keep_membrane=False`): empty."""
    return z.new_empty(0, dtype=torch.float32)


@bn_lif_forward_op.register_fake
def _fake_forward(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_threshold, v_reset,
                  charge, surrogate, alpha, detach_reset, spike_dtype, impl, keep_membrane=True, rebuild_whole=False):
    _check_op(z, steps, weight, bias, impl)
    C = z.shape[1]
    return (z.new_empty(z.shape, dtype=spike_dtype),
            z.new_empty((steps, z.numel() // steps) if keep_membrane else (0,), dtype=torch.float32),
            weight.new_empty((2, C)), running_mean.new_empty(C if training else 0),
            running_var.new_empty(C if training else 0))


@torch.library.custom_op("efficient::bn_lif_backward", mutates_args=())
def bn_lif_backward_op(
    grad_spikes: Tensor,
    z: Tensor,
    h: Tensor,
    weight: Tensor,
    stats: Tensor,
    training: bool,
    eps: float,
    c: float,
    v_threshold: float,
    v_reset: Optional[float],
    charge: int,
    surrogate: int,
    alpha: float,
    detach_reset: bool,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad z, grad weight, grad bias): the LIF's backward from H, then BatchNorm's."""
    return _backward_impl(grad_spikes, z, h, weight, stats, training, eps, c, v_threshold, v_reset, charge, surrogate,
                          alpha, detach_reset, impl)


def _backward_impl(grad_spikes, z, h, weight, stats, training, eps, c, v_threshold, v_reset, charge, surrogate, alpha,
                   detach_reset, impl, overwrite=False, over_z=False):
    """`overwrite`: nothing reads H after this backward, so the LIF's gradient is written over it (one
    tensor of z's size fewer while BatchNorm's backward runs); `over_z`: nor z (the unit made it), so
    where it is large z's gradient is written over z (`_bn_backward_over_z`)."""
    steps = h.shape[0]
    gy, _, _ = _lif._run_backward(grad_spikes.contiguous().view(steps, -1), None, h, None, c, v_threshold, v_reset,
                                  charge, surrogate, alpha, detach_reset, z.dtype, impl, overwrite=overwrite)
    if over_z and _over_z_pays(z):
        return _bn_backward_over_z(gy.view(z.shape), z, weight, stats, training, eps)
    return _bn_backward(gy.view(z.shape), z, weight, stats, training, eps)


def _bn_backward(gy, z, weight, stats, training, eps):
    """BatchNorm's own backward: from the batch's saved mean and invstd in training, from the running
    mean and variance in eval."""
    if training:
        return torch.ops.aten.native_batch_norm_backward(gy, z, weight, None, None, stats[0], stats[1], True, eps,
                                                         [True, True, True])
    return torch.ops.aten.native_batch_norm_backward(gy, z, weight, stats[0], stats[1], None, None, False, eps,
                                                     [True, True, True])


# Elements of z from which BatchNorm's backward is written over z by chunks of channels on a CPU. aten's CPU
# kernel allocates its input gradient (and, unwritten, a second buffer of that size) for the whole call; by
# chunks, the backward holds a chunk's copies instead, and at 64 MiB and more it was also faster than the
# whole call (a 96 MiB [16384, 1536] z: 31.7 against 38.6 ms), where a 24 MiB z, in cache whole, was not.
BN_BACKWARD_OVER_Z_MIN = 1 << 24


# A 2-D z's chunks start at multiples of this many channels: aten's CPU kernel runs each row's channels in
# vectors from the row's start and the last few apart, so chunks that start on a multiple of every vector
# width leave the same channels to that tail as the whole call does (chunks of 6 of 96 channels did not
# give its bits)
OVER_Z_ALIGN = 64


def _over_z_chunks(z: Tensor) -> list[tuple[int, int]]:
    """`_channel_chunks`; for a 2-D z, spans of whole groups of `OVER_Z_ALIGN` channels."""
    if z.dim() != 2:
        return _channel_chunks(z)
    C, A = z.shape[1], OVER_Z_ALIGN
    groups = chunk_spans(-(-C // A), z.shape[0] * A, chunk_limit(z.numel()))
    return [(a * A, min(b * A, C)) for a, b in groups]


def _over_z_pays(z: Tensor) -> bool:
    return (z.device.type == "cpu" and z.dim() >= 2 and z.is_contiguous() and z.numel() >= BN_BACKWARD_OVER_Z_MIN
            and len(_over_z_chunks(z)) > 1)


def _bn_backward_over_z(gy, z, weight, stats, training, eps):
    """`_bn_backward` a chunk of channels at a time (`_over_z_chunks`), each chunk's gradient written over
    z's channels (z is returned as the gradient): BatchNorm is per channel, so each chunk's values are the
    whole call's bit for bit, and the backward never holds z's gradient whole beside z and gy."""
    gw, gb = torch.empty_like(weight), torch.empty_like(weight)
    z = z.detach()
    for c0, c1 in _over_z_chunks(z):
        zc, gyc = z[:, c0:c1].contiguous(), gy[:, c0:c1].contiguous()
        gzc, gw[c0:c1], gb[c0:c1] = _bn_backward(gyc, zc, weight[c0:c1], stats[:, c0:c1].contiguous(), training, eps)
        del zc, gyc
        z[:, c0:c1] = gzc
        del gzc
    return z, gw, gb


@functools.lru_cache(maxsize=None)
def _unit_variance(eps: float) -> Optional[float]:
    """A float32 variance v with 1 / sqrt(v + eps) exactly 1 in float32 arithmetic (aten's eval-mode
    BatchNorm forms its per-channel scale so on CPU), or None if no float next to 1 - eps gives that."""
    v = torch.tensor(1.0, dtype=torch.float32) - eps
    for cand in (v, torch.nextafter(v, torch.tensor(2.0)), torch.nextafter(v, torch.tensor(0.0))):
        if float(cand) >= 0 and bool((1 / torch.sqrt(cand + eps)) == 1):
            return float(cand)
    return None


def _bn_rebuild(z: Tensor, weight: Tensor, bias: Tensor, stats: Tensor, eps: float) -> Tensor:
    """Training BatchNorm's output of a contiguous z again, from the batch's saved mean and invstd
    (`stats`) instead of a second pass over z for them.

    aten's CPU kernel turns BatchNorm into z * a + b with a = invstd * weight, b = bias - mean * a per
    channel, in training from the saved statistics and in eval from the running ones (invstd =
    1 / sqrt(var + eps)). Its eval call with weight' = invstd * weight, mean' = mean and a variance
    whose invstd is exactly 1 therefore forms the training call's very a and b (a' = 1 * weight'), and
    its output is the training output bit for bit, at one read of z where training takes three.
    Elsewhere (other devices or dtypes, a strided z, an eps without such a variance) BatchNorm's
    training call runs again, which is exact too."""
    unit = _unit_variance(float(eps))
    if (z.device.type == "cpu" and z.is_contiguous() and unit is not None
            and z.dtype == weight.dtype == bias.dtype == stats.dtype == torch.float32):
        var = torch.full_like(stats[0], unit)
        return torch.native_batch_norm(z, stats[1] * weight, bias, stats[0], var, False, 0.0, eps)[0]
    return torch.native_batch_norm(z, weight, bias, None, None, True, 0.0, eps)[0]


@bn_lif_backward_op.register_fake
def _(grad_spikes, z, h, weight, stats, training, eps, c, v_threshold, v_reset, charge, surrogate, alpha,
      detach_reset, impl):
    return z.new_empty(z.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


# --- the backward of a unit that kept z but not H (`keep_membrane=False`)

# Channels are taken a chunk at a time, so that beside z, the spikes' gradient and z's gradient
# (whole), the rebuilt BatchNorm output, H and the chunk's gradients exist for one chunk only.
RECOMPUTE_CHUNK = 1 << 22  # at most this many elements of z per chunk of channels (at least one channel)
RECOMPUTE_PARTS = 16  # and at most this fraction of z ...
RECOMPUTE_CHUNK_MIN = 1 << 20  # ... down to this many elements
# a conv unit's forward without H takes the same chunks (`_chunked_forward`; bench/rebuild_paths.py times it whole)
FORWARD_BY_CHUNKS = True


def chunk_limit(numel: int) -> int:
    """Elements per chunk of a tensor of `numel` elements. A rebuilding backward holds about nine
    chunk-sized buffers (the rebuilt BatchNorm output and trace, the LIF backward's own) beside z and its
    gradient: a chunk of at most 1/`RECOMPUTE_PARTS` of z keeps them near half of z, where a fixed chunk
    could hold more than z itself; at most `RECOMPUTE_CHUNK`, and no fewer elements than
    `RECOMPUTE_CHUNK_MIN` (nor than `RECOMPUTE_CHUNK` if that is smaller), so a small tensor is not cut
    into many calls."""
    return min(RECOMPUTE_CHUNK, max(RECOMPUTE_CHUNK_MIN, numel // RECOMPUTE_PARTS))


def chunk_spans(n: int, per_item: int, limit: int) -> list[tuple[int, int]]:
    """[start, stop) spans of n items, `per_item` elements each, of at most `limit` elements per
    span (at least one item)."""
    width = max(1, min(n, limit // max(per_item, 1)))
    return [(i, min(n, i + width)) for i in range(0, n, width)]


def _channel_chunks(z: Tensor) -> list[tuple[int, int]]:
    C = z.shape[1]
    return chunk_spans(C, z.numel() // max(C, 1), chunk_limit(z.numel()))


def _recompute_chunk(gs, z, steps, weight, bias, stats, training, eps, c, v_threshold, v_reset, charge, surrogate,
                     alpha, detach_reset, impl):
    """(grad z, grad weight, grad bias) of one contiguous chunk of channels, H rebuilt from z."""
    if impl == "triton":
        _triton_ready(z)
        N = z.numel() // steps
        gy = torch.empty((steps, N), dtype=torch.float32, device=z.device)  # H's buffer first, then grad y
        hard = v_reset is not None
        _bn_lif_recompute_bwd_kernel[(triton.cdiv(N, _BLOCK),)](
            z, gs, stats, weight, bias, gy, N, steps, z.shape[1], math.prod(z.shape[2:]), float(eps), float(c),
            float(v_threshold), float(v_reset) if hard else 0.0, float(alpha), TRAINING=bool(training), CHARGE=charge,
            HARD=hard, DETACH=bool(detach_reset), SURROGATE=surrogate, BLOCK=_BLOCK, num_warps=_NUM_WARPS,
        )
        gy = gy.to(z.dtype)
    else:
        # aten's BatchNorm again, from the forward's statistics (per channel, so a chunk's are its channels'):
        # y, and H after it, are the forward's bit for bit
        if training:
            y = _bn_rebuild(z, weight, bias, stats, eps)
        else:
            y = torch.native_batch_norm(z, weight, bias, stats[0], stats[1], False, 0.0, eps)[0]
        # H alone, step by step into one buffer (the spikes are not needed again): beside y, one tensor of z's size
        _, h = _lif._run_forward(y.view(steps, -1), None, c, v_threshold, v_reset, charge, z.dtype, impl, spikes=False)
        del y
        gy, _, _ = _lif._run_backward(gs.view(steps, -1), None, h, None, c, v_threshold, v_reset, charge, surrogate,
                                      alpha, detach_reset, z.dtype, impl, overwrite=True)  # H is this chunk's own
        del h
    return _bn_backward(gy.view(z.shape), z, weight, stats, training, eps)


def _chunked_recompute(grad_of, z, steps, weight, bias, stats, *args, whole: bool = False, donate: bool = False):
    """(grad z, grad weight, grad bias), H rebuilt a chunk of channels at a time (`whole`: in one piece,
    the very calls of a backward from a kept H on the same shapes, so its results bit for bit);
    `grad_of(c0, c1, shape)` gives the spikes' gradient of channels [c0, c1) (contiguous, `shape`: the
    chunk's z). `donate`: z is the caller's to overwrite, and z's gradient is written into z's storage,
    each chunk's channels once they have been read (the returned gradient is z), so the backward never
    holds z and its gradient whole at once."""
    chunks = [(0, z.shape[1])] if whole else _channel_chunks(z)
    if len(chunks) == 1:
        zc = z.contiguous()
        gz, gw, gb = _recompute_chunk(grad_of(0, z.shape[1], zc.shape), zc, steps, weight, bias, stats, *args)
        return (z.detach().copy_(gz), gw, gb) if donate else (gz, gw, gb)
    gz = z.detach() if donate else torch.empty(z.shape, dtype=z.dtype, device=z.device)
    gw, gb = torch.empty_like(weight), torch.empty_like(weight)
    for c0, c1 in chunks:
        zc = z[:, c0:c1].contiguous()
        gzc, gwc, gbc = _recompute_chunk(grad_of(c0, c1, zc.shape), zc, steps, weight[c0:c1], bias[c0:c1],
                                         stats[:, c0:c1].contiguous(), *args)
        del zc
        gz[:, c0:c1] = gzc
        gw[c0:c1], gb[c0:c1] = gwc, gbc
        del gzc
    return gz, gw, gb


def _recompute_backward_impl(grad_spikes, z, steps, weight, bias, stats, training, eps, c, v_threshold, v_reset, charge,
                             surrogate, alpha, detach_reset, impl, whole=False, donate=False):
    return _chunked_recompute(lambda c0, c1, _: grad_spikes[:, c0:c1].contiguous(), z, steps, weight, bias, stats,
                              training, eps, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, impl,
                              whole=whole, donate=donate)


@torch.library.custom_op("efficient::bn_lif_backward_recompute", mutates_args=(), **_ANY_LAYOUT)
def bn_lif_backward_recompute_op(
    grad_spikes: Tensor,
    z: Tensor,
    steps: int,
    weight: Tensor,
    bias: Tensor,
    stats: Tensor,
    training: bool,
    eps: float,
    c: float,
    v_threshold: float,
    v_reset: Optional[float],
    charge: int,
    surrogate: int,
    alpha: float,
    detach_reset: bool,
    impl: str,
    whole: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad z, grad weight, grad bias) as `bn_lif_backward`, without H: BatchNorm's output and H are
    rebuilt from z (H bit for bit the forward's), a chunk of channels at a time (`whole`: in one piece)."""
    weight, bias, stats = _dense(weight, bias, stats)
    return _recompute_backward_impl(grad_spikes, z, steps, weight, bias, stats, training, eps, c, v_threshold, v_reset,
                                    charge, surrogate, alpha, detach_reset, impl, whole)


@bn_lif_backward_recompute_op.register_fake
def _(grad_spikes, z, steps, weight, bias, stats, training, eps, c, v_threshold, v_reset, charge, surrogate, alpha,
      detach_reset, impl, whole=False):
    return z.new_empty(z.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    z, steps, weight, bias, rm, rv, training, momentum, eps, c, v_th, v_reset, charge, surrogate, alpha, detach, sd, impl = inputs[:18]
    keep = inputs[18] if len(inputs) > 18 else True
    ctx.whole = bool(inputs[19]) if len(inputs) > 19 else False
    _, h, stats, new_mean, new_var = output
    # only the spikes carry a gradient: marking the rest spares autograd a detach each way per saved output
    ctx.mark_non_differentiable(h, stats, new_mean, new_var)
    ctx.keep_membrane, ctx.steps = keep, steps
    if keep:
        ctx.save_for_backward(z, h, weight, stats)  # what BatchNorm and the LIF keep, no more
    else:  # H is rebuilt from z in backward: BatchNorm's bias comes along for that
        ctx.save_for_backward(z, bias, weight, stats)
    ctx.params = (training, eps, c, v_th, v_reset, charge, surrogate, alpha, detach, impl)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_spikes, *_grads_of_statistics, backward_fn=bn_lif_backward_op,
              recompute_fn=None):
    if grad_spikes is None:
        return (None,) * (len(ctx.needs_input_grad))
    if ctx.keep_membrane:
        z, h, weight, stats = ctx.saved_tensors
        gz, gw, gb = backward_fn(grad_spikes, z, h, weight, stats, *ctx.params)
    else:
        z, bias, weight, stats = ctx.saved_tensors
        gz, gw, gb = (recompute_fn or torch.ops.efficient.bn_lif_backward_recompute)(
            grad_spikes, z, ctx.steps, weight, bias, stats, *ctx.params, ctx.whole)
    need = ctx.needs_input_grad
    return (gz if need[0] else None, None, gw if need[2] else None, gb if need[3] else None) + (None,) * (len(need) - 4)


bn_lif_forward_op.register_autograd(_backward, setup_context=_setup_context)

def _kept_h_backward(*args):
    """The eager backward from a kept H, which it writes the LIF's gradient over unless the graph is kept
    for another backward (the op's own backward cannot: it declares no mutation)."""
    return _backward_impl(*args, overwrite=not graph_kept())


_EagerBNLIF = eager_function("_EagerBNLIF", functools.partial(_forward_impl, inplace=True), _setup_context,
                             lambda ctx, gs, *rest: _backward(ctx, gs, backward_fn=_kept_h_backward,
                                                              recompute_fn=_recompute_backward_impl))

# flops as the separate calls count them, so a profile does not change with the path: the LIF's 6
# per element and step forward and 13 backward (torch's counter has no BatchNorm formula)
_register_flops(torch.ops.efficient.bn_lif_forward, 6)
_register_flops(torch.ops.efficient.bn_lif_backward, 13)
# without H the backward runs the LIF's forward again before its backward: 6 + 13 per element and step
_register_flops(torch.ops.efficient.bn_lif_backward_recompute, 19)


# --- with the Linear in front: the whole Linear -> BatchNorm -> LIF unit as one op pair


@torch.library.custom_op("efficient::linear_bn_lif_forward", mutates_args=())
def linear_bn_lif_forward_op(
    x: Tensor,
    lin_weight: Tensor,
    lin_bias: Optional[Tensor],
    steps: int,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    training: bool,
    momentum: float,
    eps: float,
    c: float,
    v_threshold: float,
    v_reset: Optional[float],
    charge: int,
    surrogate: int,
    alpha: float,
    detach_reset: bool,
    spike_dtype: torch.dtype,
    impl: str,
    keep_membrane: bool = True,
    rebuild_whole: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [T*M, D_in] -> z = x @ lin_weight.T + lin_bias [T*M, C], then `bn_lif_forward` on z:
    (spikes [T*M, C], H, stats, new running mean, new running variance, z). z is returned for the
    backward (BatchNorm's input); `keep_membrane` and `rebuild_whole` as `bn_lif_forward`'s."""
    return _linear_forward_impl(x, lin_weight, lin_bias, steps, weight, bias, running_mean, running_var, training,
                                momentum, eps, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset,
                                spike_dtype, impl, keep_membrane)


def _linear_forward_impl(x, lin_weight, lin_bias, steps, weight, bias, running_mean, running_var, training, momentum, eps,
                         c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl,
                         keep_membrane=True, rebuild_whole=False, inplace=False, given=None):
    if x.dim() != 2 or lin_weight.dim() != 2 or x.shape[1] != lin_weight.shape[1]:
        raise ValueError(f"efficient::linear_bn_lif_forward: x [T*M, D_in] and lin_weight [C, D_in] expected, got "
                         f"{tuple(x.shape)} and {tuple(lin_weight.shape)}")
    # what nn.Linear computes (addmm), bit for bit; `given`: that output, computed already (a recomputed
    # region's kept output, `bn_lif(lin_out=...)`)
    z = F.linear(x, lin_weight, lin_bias) if given is None else given
    return (*_forward_impl(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_threshold,
                           v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, keep_membrane,
                           inplace=inplace), z)


@linear_bn_lif_forward_op.register_fake
def _(x, lin_weight, lin_bias, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_threshold,
      v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, keep_membrane=True, rebuild_whole=False):
    z = x.new_empty((x.shape[0], lin_weight.shape[0]))
    return (*_fake_forward(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_threshold,
                           v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, keep_membrane), z)


@torch.library.custom_op("efficient::linear_bn_lif_backward", mutates_args=())
def linear_bn_lif_backward_op(
    grad_spikes: Tensor,
    x: Tensor,
    lin_weight: Tensor,
    z: Tensor,
    h: Tensor,
    weight: Tensor,
    stats: Tensor,
    training: bool,
    eps: float,
    c: float,
    v_threshold: float,
    v_reset: Optional[float],
    charge: int,
    surrogate: int,
    alpha: float,
    detach_reset: bool,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(grad x, grad lin_weight, grad lin_bias, grad weight, grad bias): `bn_lif_backward`, then
    the Linear's backward as autograd computes addmm's (so bit for bit the module's)."""
    return _linear_backward_impl(grad_spikes, x, lin_weight, z, h, weight, stats, training, eps, c, v_threshold, v_reset,
                                 charge, surrogate, alpha, detach_reset, impl)


def _linear_backward_impl(grad_spikes, x, lin_weight, z, h, weight, stats, training, eps, c, v_threshold, v_reset, charge,
                          surrogate, alpha, detach_reset, impl):
    gz, gw, gb = _backward_impl(grad_spikes, z, h, weight, stats, training, eps, c, v_threshold, v_reset, charge,
                                surrogate, alpha, detach_reset, impl)
    return (*_linear_grads(gz, x, lin_weight), gw, gb)


def _linear_grads(gz: Tensor, x: Tensor, lin_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(grad x, grad lin_weight, grad lin_bias) of z = x @ lin_weight.T + lin_bias."""
    # addmm(b, x, W.t())'s backward: grad x = gz @ (W.t()).t(); for W.t(), a column-major operand, aten's
    # mm_mat2_backward computes (gz.t() @ x).t(), so W's gradient is gz.t() @ x: the same mm, so the same
    # bits on every CPU (x.t() @ gz transposed back agrees only where the BLAS blocks both alike)
    return gz.mm(lin_weight), gz.t().mm(x), gz.sum(0)


@linear_bn_lif_backward_op.register_fake
def _(grad_spikes, x, lin_weight, z, h, weight, stats, training, eps, c, v_threshold, v_reset, charge, surrogate, alpha,
      detach_reset, impl):
    C = lin_weight.shape[0]
    return (x.new_empty(x.shape), lin_weight.new_empty(lin_weight.shape), z.new_empty(C),
            weight.new_empty(weight.shape), weight.new_empty(weight.shape))


def _linear_setup_context(ctx, inputs, output) -> None:
    x, lw, lb, steps, weight, bias, rm, rv, training, momentum, eps, c, v_th, v_reset, charge, surrogate, alpha, detach, sd, impl = inputs[:20]
    keep = inputs[20] if len(inputs) > 20 else True
    ctx.whole = bool(inputs[21]) if len(inputs) > 21 else False
    _, h, stats, new_mean, new_var, z = output
    ctx.mark_non_differentiable(h, stats, new_mean, new_var, z)  # only the spikes carry a gradient
    ctx.keep_membrane, ctx.steps = keep, steps
    # what Linear, BatchNorm and the LIF keep; without H, BatchNorm's bias to rebuild it
    ctx.save_for_backward(x, lw, z, h if keep else bias, weight, stats)
    ctx.params = (training, eps, c, v_th, v_reset, charge, surrogate, alpha, detach, impl)
    ctx.set_materialize_grads(False)


def _linear_backward(ctx, grad_spikes, *_grads_of_statistics):
    """The op pair's backward (the eager call's is `_eager_linear_backward`)."""
    if grad_spikes is None:
        return (None,) * len(ctx.needs_input_grad)
    x, lw, z, h_or_bias, weight, stats = ctx.saved_tensors
    if ctx.keep_membrane:
        gx, glw, glb, gw, gb = linear_bn_lif_backward_op(grad_spikes, x, lw, z, h_or_bias, weight, stats, *ctx.params)
    else:
        gz, gw, gb = torch.ops.efficient.bn_lif_backward_recompute(
            grad_spikes, z, ctx.steps, weight, h_or_bias, stats, *ctx.params, ctx.whole)
        gx, glw, glb = _linear_grads(gz, x, lw)
    need = ctx.needs_input_grad
    return (gx if need[0] else None, glw if need[1] else None, glb if need[2] else None, None,
            gw if need[4] else None, gb if need[5] else None) + (None,) * (len(need) - 6)


linear_bn_lif_forward_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)

def _linear_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """The unit op's flops: the Linear's matmul (2 M D_in C, as addmm counts) plus the LIF's per element."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[0] + 6 * x_shape[0] * w_shape[0]


def _linear_backward_flops(g_shape, x_shape, *args, out_shape=None, **kwargs) -> int:
    """Twice the forward's matmul (input and weight gradients, as mm counts) plus the LIF backward's per element."""
    return 4 * x_shape[0] * x_shape[1] * g_shape[1] + 13 * g_shape[0] * g_shape[1]


register_flops((torch.ops.efficient.linear_bn_lif_forward, _linear_flops),
               (torch.ops.efficient.linear_bn_lif_backward, _linear_backward_flops))

def _eager_linear_backward(ctx, grad_spikes, *_grads_of_statistics):
    """`_linear_backward` of an eager call, the same calls in an order that holds less: unless the graph is
    kept for another backward, the LIF's gradient is written over H and BatchNorm's over z (the unit's own
    Linear output, which nothing else reads), and the Linear's input (unpacked from bits at the memory
    levels) is read for the weight's gradient and dropped before the input's gradient exists."""
    if grad_spikes is None:
        return (None,) * len(ctx.needs_input_grad)
    x, lw, z, h_or_bias, weight, stats = ctx.saved_tensors
    over = not graph_kept()
    if ctx.keep_membrane:
        gz, gw, gb = _backward_impl(grad_spikes, z, h_or_bias, weight, stats, *ctx.params, overwrite=over, over_z=over)
    else:  # H rebuilt by chunks of channels, each chunk's gradient written over z's where the graph is not kept
        gz, gw, gb = _recompute_backward_impl(grad_spikes, z, ctx.steps, weight, h_or_bias, stats, *ctx.params,
                                              whole=ctx.whole, donate=over)
    del z, h_or_bias
    need = ctx.needs_input_grad
    glw = gz.t().mm(x) if need[1] else None  # the mm of `_linear_grads`
    del x  # this frame held the only reference: freed before the input's gradient is made
    gx = gz.mm(lw) if need[0] else None
    glb = gz.sum(0) if need[2] else None
    return (gx, glw, glb, None, gw if need[4] else None, gb if need[5] else None) + (None,) * (len(need) - 6)


_EagerLinearBNLIF = eager_function("_EagerLinearBNLIF", functools.partial(_linear_forward_impl, inplace=True),
                                   _linear_setup_context, _eager_linear_backward)


def _given_linear_forward(*inputs):
    """The eager unit's forward on its inputs and, last, the Linear's output already computed: no matmul."""
    *args, z = inputs
    return _linear_forward_impl(*args, inplace=True, given=z)


# the same unit with its Linear output given: the same saved tensors and backward (the extra input gets no gradient)
_EagerGivenLinearBNLIF = eager_function("_EagerGivenLinearBNLIF", _given_linear_forward, _linear_setup_context,
                                        _eager_linear_backward)


# ---------------------------------------------------------------------------------------------
# 4. public entry point
# ---------------------------------------------------------------------------------------------


def bn_lif(
    z: Tensor,
    steps: int,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    tau: float = 2.0,
    v_threshold: float = 1.0,
    v_reset: Optional[float] = 0.0,
    detach_reset: bool = True,
    decay_input: bool = True,
    surrogate: str = "sigmoid",
    alpha: Optional[float] = None,
    spike_dtype: Optional[torch.dtype] = None,
    backend: str = "auto",
    impl: Optional[str] = None,
    lin_weight: Optional[Tensor] = None,
    lin_bias: Optional[Tensor] = None,
    lin_out: Optional[Tensor] = None,
    running_out: Optional[Sequence[Tensor]] = None,
    keep_membrane: bool = True,
    rebuild_whole: bool = False,
) -> Tensor:
    """BatchNorm over `z` [T*R, C, ...] (time folded into the batch, `steps` = T) with `weight`,
    `bias` and running statistics (updated in place in training, with BatchNorm's `momentum`
    factor), then LIF over T from rest. Returns spikes shaped like z (dtype `spike_dtype`, default
    z.dtype). LIF options and `backend` / `impl` as `efficient.kernels.lif.lif`.

    With `lin_weight` [C, D_in] (and `lin_bias`), `z` is the Linear's input [T*M, D_in] and the
    Linear runs inside the same op: the whole unit, one op forward and one backward. `lin_out`: that
    Linear's output [T*M, C], computed already (a recomputed region keeps it from forward for its rerun,
    `efficient.models.replay.linear_output`): the eager call skips the matmul, and the unit keeps and computes
    what it would have, gradients included; it takes lin_out over as its own output, so its backward may write
    BatchNorm's gradient over it unless the graph is kept (the op path, under torch.compile or a dispatch mode,
    and the torch backend compute the output again).

    `running_out`: in training, the buffers that receive the new running statistics instead of
    `running_mean` and `running_var`: k means, then k variances, of k BatchNorms whose channels
    were concatenated into these, as a fused unit of several layers keeps them.

    `keep_membrane=False`: autograd keeps z but not the membrane trace H; the backward rebuilds H
    from z (bit for bit the forward's) a chunk of channels at a time, so it holds z, the spikes'
    gradient and z's gradient whole and nothing else of the unit's size (a unit of fewer than
    2 x `RECOMPUTE_CHUNK` elements, two of the largest chunks, keeps H). It costs a BatchNorm and a LIF forward in
    backward; memory level `recompute` uses it in its reruns, where the largest rerun sets a step's
    peak (`efficient.models.replay.rebuild_membrane`).

    `rebuild_whole=True` (with `keep_membrane=False`): the backward rebuilds H in one piece, whatever the
    unit's size, with the calls and shapes of a backward from a kept H, so the gradients are that
    backward's bit for bit; the unit's temporaries are whole while its own backward runs, and H is
    not kept from forward to backward. Memory level `bits` uses it (`efficient.models.replay.rebuild_exact`):
    a step keeps one fp32 tensor per unit less and its gradients stay level `none`'s."""
    if running_out is not None and (len(running_out) % 2 or not running_out
                                    or sum(t.numel() for t in running_out) != 2 * running_mean.numel()):
        raise ValueError(f"bn_lif: running_out must hold k means then k variances covering the {running_mean.numel()} "
                         f"channels, got {len(running_out)} tensors")
    if lin_weight is not None:
        if z.dim() != 2 or lin_weight.dim() != 2 or z.shape[1] != lin_weight.shape[1]:
            raise ValueError(f"bn_lif: with lin_weight [C, D_in] the input must be [T*M, D_in], got {tuple(z.shape)} "
                             f"and lin_weight {tuple(lin_weight.shape)}")
    _check_z(z, steps, weight, bias, channels=None if lin_weight is None else lin_weight.shape[0])
    lif_args = _lif_args(tau, v_threshold, v_reset, detach_reset, decay_input, surrogate, alpha)
    alpha, vr = lif_args[5], lif_args[2]
    spike_dtype = spike_dtype or z.dtype
    chosen, impl = _choose_impl(backend, impl, z)
    if lin_out is not None and lin_weight is None:
        raise ValueError("bn_lif: lin_out is a Linear's output and comes with lin_weight (and lin_bias); got no lin_weight")
    if lin_out is not None and lin_out.shape != (z.shape[0], lin_weight.shape[0]):
        raise ValueError(f"bn_lif: lin_out must be the Linear's output [T*M, C] = {(z.shape[0], lin_weight.shape[0])}, "
                         f"got {tuple(lin_out.shape)}")
    if lin_weight is not None and (chosen == "torch" or z.numel() == 0):
        z = F.linear(z, lin_weight, lin_bias)  # (lin_out holds no graph to the Linear's parameters)
    if chosen == "torch" or z.numel() == 0:
        s = bn_lif_reference(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, tau=tau,
                             v_threshold=v_threshold, v_reset=vr, detach_reset=detach_reset, decay_input=decay_input,
                             surrogate=surrogate, alpha=alpha, spike_dtype=spike_dtype)[0]
        if training and running_out is not None:
            _store_running(running_out, running_mean, running_var)
        return s
    _check_compiler(impl, z)
    args = (int(steps), weight, bias, running_mean, running_var, bool(training), float(momentum), float(eps),
            *lif_args, spike_dtype, impl)
    eager = eager_call(z, op="bn_lif_forward" if lin_weight is None else "linear_bn_lif_forward")
    # rebuilt in one piece, H and the loop's temporaries would take what was not kept: a unit smaller
    # than two of the largest chunks (2 x RECOMPUTE_CHUNK elements) keeps H
    out_numel = z.numel() if lin_weight is None else z.shape[0] * lin_weight.shape[0]
    whole = bool(rebuild_whole) and not keep_membrane
    args = (*args, bool(keep_membrane) or (not whole and out_numel < 2 * RECOMPUTE_CHUNK), whole)
    if lin_weight is not None:
        args = (z, lin_weight, lin_bias, *args)
        if not eager:
            out = torch.ops.efficient.linear_bn_lif_forward(*args)
        elif lin_out is not None:
            out = _EagerGivenLinearBNLIF.apply(*args, lin_out)
        else:
            out = _EagerLinearBNLIF.apply(*args)
    else:
        out = _EagerBNLIF.apply(z, *args) if eager else torch.ops.efficient.bn_lif_forward(z, *args)
    if training:  # BatchNorm's update of its running statistics, into the caller's buffers
        if not eager:  # the functional op returned them
            _store_running([running_mean, running_var] if running_out is None else running_out, out[3], out[4])
        elif running_out is not None:  # the eager path updated running_mean / running_var in place
            _store_running(running_out, running_mean, running_var)
    return out[0]


def _lif_args(tau, v_threshold, v_reset, detach_reset, decay_input, surrogate, alpha) -> tuple:
    """The LIF's options as the ops take them: (c, v_threshold, v_reset, charge, surrogate id, alpha,
    detach_reset); a bad tau or surrogate is named."""
    if not tau > 0:
        raise ValueError(f"tau must be > 0 (got {tau})")
    sid = _surrogate_id(surrogate)
    charge = _lif.CHARGE_DECAY_INPUT if decay_input else _lif.CHARGE_NO_DECAY
    return (float(tau), float(v_threshold), None if v_reset is None else float(v_reset), charge, sid,
            float(default_alpha(surrogate, alpha)), bool(detach_reset))


def _store_running(dest: Sequence[Tensor], new_mean: Tensor, new_var: Tensor) -> None:
    """Copy new running statistics into `dest` (k means, then k variances): one multi-tensor copy."""
    k = len(dest) // 2
    widths = [t.numel() for t in dest[:k]]
    src = [new_mean, new_var] if k == 1 else [*new_mean.split(widths), *new_var.split(widths)]
    with torch.no_grad():
        torch._foreach_copy_(list(dest), src)


# ---------------------------------------------------------------------------------------------
# 5. with a 2-D max-pool after the LIF: a conv stage that never holds its spikes or membrane whole
# ---------------------------------------------------------------------------------------------


def _pooled_forward(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_threshold, v_reset,
                    charge, surrogate, alpha, detach_reset, spike_dtype, impl, pool):
    """(pooled spikes, argmax offsets, stats) of BatchNorm -> LIF -> max-pool, a chunk of channels at a
    time (BatchNorm's statistics, the LIF and the pool are all per channel, so a chunk is the whole
    tensor's): each chunk's spikes are pooled and dropped before the next chunk runs."""
    chunks = _channel_chunks(z)
    out = offsets = None
    stats = torch.empty((2, z.shape[1]), dtype=weight.dtype, device=z.device)
    for c0, c1 in chunks:
        s, _, st, _, _ = _forward_impl(z[:, c0:c1].contiguous(), steps, weight[c0:c1], bias[c0:c1], running_mean[c0:c1],
                                       running_var[c0:c1], training, momentum, eps, c, v_threshold, v_reset, charge,
                                       surrogate, alpha, detach_reset, spike_dtype, impl, keep_membrane=False,
                                       inplace=True, by_chunks=False)
        o, off = max_pool_offsets(s, pool)
        del s
        if out is None:
            out = o.new_empty((o.shape[0], z.shape[1], *o.shape[2:]))
            offsets = off.new_empty(out.shape)
        out[:, c0:c1], offsets[:, c0:c1], stats[:, c0:c1] = o, off, st
    return out, offsets, stats


class _BNLIFMaxPool(torch.autograd.Function):
    """`bn_lif_max_pool`'s autograd on the CPU paths: keeps z alone (and BatchNorm's statistics, two
    numbers per channel, outside autograd's saved tensors); backward runs each chunk of channels'
    BatchNorm, LIF and pool forward again, keeping its H and spikes, and then its backward
    (`_pooled_rerun_backward`), so only z and its gradient are whole. `compute` False: nothing reads the
    output (a recomputed region's rerun, which serves only its backward), so the forward computes
    nothing and returns zeros of the output's shape that own no memory; its backward, lacking the
    statistics, takes them from each chunk again (per channel, so the forward's bit for bit). Triton:
    the forward keeps the argmax offsets and the statistics, and backward rebuilds only H
    (`_pooled_backward`, whose fused kernel reads the statistics)."""

    @staticmethod
    def forward(ctx, z, weight, bias, running_mean, running_var, steps, training, momentum, eps, c, v_threshold,
                v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, pool, donate, compute):
        ctx.stats = offsets = None
        if compute:
            with torch._C.DisableTorchFunction():  # as the op would: modes see the call, not its insides
                out, offsets, ctx.stats = _pooled_forward(z, steps, weight, bias, running_mean, running_var, training,
                                                          momentum, eps, c, v_threshold, v_reset, charge, surrogate,
                                                          alpha, detach_reset, spike_dtype, impl, pool)
        else:
            out = _unread_output(z, pool, spike_dtype)
        if impl == "triton":
            ctx.save_for_backward(z, weight, bias, ctx.stats, offsets)
            ctx.stats = None
        else:
            ctx.save_for_backward(z, weight, bias)
        ctx.steps, ctx.pool, ctx.spike_dtype, ctx.donate = steps, pool, spike_dtype, donate
        ctx.params = (training, eps, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, impl)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 21
        need = ctx.needs_input_grad
        # a donated z is overwritten in place: its version moves on, so a second backward through
        # this graph (retain_graph) fails autograd's saved-tensor check instead of reading gradients
        donate = ctx.donate and need[0]
        if ctx.params[-1] == "triton":  # impl: the forward kept the statistics and argmax offsets
            gz, gw, gb = _pooled_backward(grad, *ctx.saved_tensors, ctx.steps, ctx.pool, ctx.spike_dtype, *ctx.params,
                                          donate=donate)
        else:
            gz, gw, gb = _pooled_rerun_backward(grad, *ctx.saved_tensors, ctx.stats, ctx.steps, ctx.pool,
                                                ctx.spike_dtype, *ctx.params, donate=donate)
        return (gz if need[0] else None, gw if need[1] else None, gb if need[2] else None) + (None,) * 18


def _unread_output(z: Tensor, pool: PoolArgs, spike_dtype: torch.dtype) -> Tensor:
    """Zeros of the pooled output's shape that own no memory (stride 0): a rerun's output nothing reads."""
    shape = torch.ops.aten.max_pool2d_with_indices(torch.empty(z.shape, device="meta"), *pool)[0].shape
    return z.new_zeros((), dtype=spike_dtype).expand(shape)


def _pooled_rerun_backward(grad, z, weight, bias, stats, steps, pool, spike_dtype, training, eps, c, v_threshold,
                           v_reset, charge, surrogate, alpha, detach_reset, impl, donate=False):
    """(grad z, grad weight, grad bias) of `bn_lif_max_pool` from z alone: a chunk of channels'
    BatchNorm output (from `stats`, or, None, from the chunk in training), its LIF's spikes and H, the
    pool's argmax over those spikes, then the pool's, LIF's and BatchNorm's backward. Per channel, so
    each chunk's values are the whole forward's bit for bit. `donate`: z's gradient written into z."""
    gz = z.detach() if donate else torch.empty(z.shape, dtype=z.dtype, device=z.device)
    gw, gb = torch.empty_like(weight), torch.empty_like(weight)
    for c0, c1 in _channel_chunks(z):
        zc = z[:, c0:c1].contiguous()
        w, b = weight[c0:c1], bias[c0:c1]
        if stats is not None:
            st = stats[:, c0:c1].contiguous()
            y = (_bn_rebuild(zc, w, b, st, eps) if training
                 else torch.native_batch_norm(zc, w, b, st[0], st[1], False, 0.0, eps)[0])
        else:
            y, mean, invstd = torch.native_batch_norm(zc, w, b, None, None, True, 0.0, eps)
            st = torch.stack([mean, invstd])
        s, h = _lif._run_forward(y.view(steps, -1), None, c, v_threshold, v_reset, charge, spike_dtype, impl)
        del y
        _, offsets = max_pool_offsets(s.view(zc.shape), pool)
        del s
        gs = max_pool_offsets_backward(grad[:, c0:c1].contiguous(), offsets, pool, zc.shape, dtype=spike_dtype)
        del offsets
        gy, _, _ = _lif._run_backward(gs.view(steps, -1), None, h, None, c, v_threshold, v_reset, charge, surrogate,
                                      alpha, detach_reset, z.dtype, impl, overwrite=True)  # H is this chunk's own
        del gs, h
        gzc, gw[c0:c1], gb[c0:c1] = _bn_backward(gy.view(zc.shape), zc, w, st, training, eps)
        del gy, zc
        gz[:, c0:c1] = gzc
        del gzc
    return gz, gw, gb


def _pooled_backward(grad, z, weight, bias, stats, offsets, steps, pool, spike_dtype, *params, donate=False):
    """(grad z, grad weight, grad bias) of `bn_lif_max_pool`: the pooled gradient routed back to a chunk
    of channels' spikes, that chunk's H rebuilt, its LIF and BatchNorm backward run (`_chunked_recompute`;
    `donate`: z's gradient written into z)."""

    def grad_of(c0: int, c1: int, shape) -> Tensor:
        return max_pool_offsets_backward(grad[:, c0:c1].contiguous(), offsets[:, c0:c1].contiguous(), pool, shape,
                                         dtype=spike_dtype)

    return _chunked_recompute(grad_of, z, steps, weight, bias, stats, *params, donate=donate)


# the same pair as custom ops, for compiled steps (a compiled region of memory level `recompute` runs
# it where the eager rerun does): functional, the new running statistics are outputs as `bn_lif_forward`'s

@torch.library.custom_op("efficient::bn_lif_max_pool_forward", mutates_args=(), **_ANY_LAYOUT)
def bn_lif_max_pool_forward_op(
    z: Tensor, steps: int, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor, training: bool,
    momentum: float, eps: float, c: float, v_threshold: float, v_reset: Optional[float], charge: int, surrogate: int,
    alpha: float, detach_reset: bool, spike_dtype: torch.dtype, impl: str, kernel: Sequence[int], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], ceil_mode: bool, donate: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(pooled spikes, argmax offsets, BatchNorm's statistics, new running mean, new running variance).
    `donate` tells the backward that nothing else reads z (`bn_lif_max_pool_backward_into`)."""
    weight, bias, running_mean, running_var = _dense(weight, bias, running_mean, running_var)
    # in training the chunks update copies of the running statistics in place, which are returned
    running = (running_mean.clone(), running_var.clone()) if training else (running_mean, running_var)
    out, offsets, stats = _pooled_forward(z, steps, weight, bias, *running, training, momentum, eps, c, v_threshold,
                                          v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl,
                                          (kernel, stride, padding, dilation, ceil_mode))
    return out, offsets, stats, *(running if training else _no_running(running_mean))


@bn_lif_max_pool_forward_op.register_fake
def _(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, c, v_threshold, v_reset, charge,
      surrogate, alpha, detach_reset, spike_dtype, impl, kernel, stride, padding, dilation, ceil_mode, donate=False):
    _check_z(z, steps, weight, bias)
    out = torch.ops.aten.max_pool2d_with_indices(z.new_empty(z.shape, dtype=spike_dtype), kernel, stride, padding,
                                                 dilation, ceil_mode)[0]
    offsets = out.new_empty(out.shape, dtype=offset_dtype(z.shape[-1], kernel, dilation))
    running = ((running_mean.new_empty(running_mean.shape), running_var.new_empty(running_var.shape)) if training
               else (running_mean.new_empty(0), running_mean.new_empty(0)))
    return out, offsets, weight.new_empty((2, z.shape[1])), *running


@torch.library.custom_op("efficient::bn_lif_max_pool_backward", mutates_args=(), **_ANY_LAYOUT)
def bn_lif_max_pool_backward_op(
    grad: Tensor, z: Tensor, weight: Tensor, bias: Tensor, stats: Tensor, offsets: Tensor, steps: int, training: bool,
    eps: float, c: float, v_threshold: float, v_reset: Optional[float], charge: int, surrogate: int, alpha: float,
    detach_reset: bool, spike_dtype: torch.dtype, impl: str, kernel: Sequence[int], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], ceil_mode: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad z, grad weight, grad bias) of `bn_lif_max_pool_forward`, H rebuilt a chunk of channels at a time."""
    weight, bias, stats = _dense(weight, bias, stats)
    return _pooled_backward(grad, z, weight, bias, stats, offsets, steps, (kernel, stride, padding, dilation, ceil_mode),
                            spike_dtype, training, eps, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset,
                            impl)


@bn_lif_max_pool_backward_op.register_fake
def _(grad, z, weight, bias, stats, offsets, steps, training, eps, c, v_threshold, v_reset, charge, surrogate, alpha,
      detach_reset, spike_dtype, impl, kernel, stride, padding, dilation, ceil_mode):
    return z.new_empty(z.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


@torch.library.custom_op("efficient::bn_lif_max_pool_backward_into", mutates_args=("z",), **_ANY_LAYOUT)
def bn_lif_max_pool_backward_into_op(
    grad: Tensor, z: Tensor, weight: Tensor, bias: Tensor, stats: Tensor, offsets: Tensor, steps: int, training: bool,
    eps: float, c: float, v_threshold: float, v_reset: Optional[float], charge: int, surrogate: int, alpha: float,
    detach_reset: bool, spike_dtype: torch.dtype, impl: str, kernel: Sequence[int], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], ceil_mode: bool,
) -> tuple[Tensor, Tensor]:
    """(grad weight, grad bias) of `bn_lif_max_pool_forward`, z's gradient written into z, each chunk of
    channels once it has been read: for a z nothing else reads (a convolution's fresh output, which a
    compiled region reruns in backward), so the backward never holds z and its gradient whole at once."""
    weight, bias, stats = _dense(weight, bias, stats)
    _, gw, gb = _pooled_backward(grad, z, weight, bias, stats, offsets, steps, (kernel, stride, padding, dilation,
                                 ceil_mode), spike_dtype, training, eps, c, v_threshold, v_reset, charge, surrogate,
                                 alpha, detach_reset, impl, donate=True)
    return gw, gb


@bn_lif_max_pool_backward_into_op.register_fake
def _(grad, z, weight, bias, stats, offsets, steps, training, eps, c, v_threshold, v_reset, charge, surrogate, alpha,
      detach_reset, spike_dtype, impl, kernel, stride, padding, dilation, ceil_mode):
    return weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _pooled_setup_context(ctx, inputs, output) -> None:
    z, steps, weight, bias, _rm, _rv, training, _momentum, eps, c, v_th, v_reset, charge, surrogate, alpha, detach, sd, \
        impl, *pool = inputs
    ctx.donate = bool(pool[5]) if len(pool) > 5 else False
    _, offsets, stats, new_mean, new_var = output
    ctx.mark_non_differentiable(offsets, stats, new_mean, new_var)  # only the pooled spikes carry a gradient
    ctx.save_for_backward(z, weight, bias, stats, offsets)
    ctx.rest = (steps, training, eps, c, v_th, v_reset, charge, surrogate, alpha, detach, sd, impl, *pool[:5])
    ctx.set_materialize_grads(False)


def _pooled_op_backward(ctx, grad, *_grads_of_the_rest):
    need = ctx.needs_input_grad
    if grad is None:
        return (None,) * len(need)
    saved = ctx.saved_tensors  # unpacked once
    if ctx.donate and need[0]:  # z's gradient in z's storage: the op mutates z, which is then the gradient
        gw, gb = torch.ops.efficient.bn_lif_max_pool_backward_into(grad, *saved, *ctx.rest)
        gz = saved[0]
    else:
        gz, gw, gb = torch.ops.efficient.bn_lif_max_pool_backward(grad, *saved, *ctx.rest)
    return (gz if need[0] else None, None, gw if need[2] else None, gb if need[3] else None) + (None,) * (len(need) - 4)


bn_lif_max_pool_forward_op.register_autograd(_pooled_op_backward, setup_context=_pooled_setup_context)
_register_flops(torch.ops.efficient.bn_lif_max_pool_forward, 6)  # as `bn_lif_forward` (the pool's compares aside)
_register_flops(torch.ops.efficient.bn_lif_max_pool_backward, 19)  # as `bn_lif_backward_recompute`
_register_flops(torch.ops.efficient.bn_lif_max_pool_backward_into, 19)


def bn_lif_max_pool(
    z: Tensor,
    steps: int,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    pool: PoolArgs,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    tau: float = 2.0,
    v_threshold: float = 1.0,
    v_reset: Optional[float] = 0.0,
    detach_reset: bool = True,
    decay_input: bool = True,
    surrogate: str = "sigmoid",
    alpha: Optional[float] = None,
    spike_dtype: Optional[torch.dtype] = None,
    backend: str = "auto",
    impl: Optional[str] = None,
    donate: bool = False,
    compute: bool = True,
) -> Optional[Tensor]:
    """`max_pool2d(bn_lif(z, ...), *pool)` for a conv stage's z [T*R, C, H, W] (`pool`: aten's kernel,
    stride, padding, dilation, ceil_mode), computed a chunk of channels at a time in forward and in
    backward, so neither the spikes nor the membrane trace ever exist whole: autograd keeps z and
    BatchNorm's statistics (Triton: and one small argmax offset per output, `efficient.kernels.pool_offsets`),
    and backward holds z, its gradient and one chunk. The values are `bn_lif`'s and the pool's (on the CPU
    bit for bit; the gradients within the rounding of the surrogate's exp, as `keep_membrane=False`).
    Running statistics are updated in place as `bn_lif` does; `backend` / `impl` as `bn_lif`'s.

    Under torch.compile it runs as the op pair `efficient::bn_lif_max_pool_forward` / `_backward`
    (the same code; the new running statistics come back as outputs and are stored as `bn_lif` does).

    `donate=True` says nothing else reads z once this call has it (a convolution's fresh output): the
    backward then writes z's gradient into z's storage, a chunk of channels at a time, so it holds z
    and its gradient as one tensor (compiled: `efficient::bn_lif_max_pool_backward_into`, which
    mutates z).

    `compute=False` says nothing will read the output (a recomputed region's rerun, which serves only
    its backward): eager in training on the CPU paths, the call then computes nothing (nor updates the
    running statistics) and returns zeros that own no memory, and its backward runs each chunk's
    forward once, keeping its H and spikes, before that chunk's backward. Elsewhere it is ignored.

    Returns None where this path does not apply, and the caller runs `bn_lif` and its pool: the
    "torch" backend (the reference), an eager call that a dispatch or function mode must see as ops
    (the eager chunked path has no custom op), an input of fewer than two chunks (`chunk_limit`)."""
    _check_z(z, steps, weight, bias)
    if z.dim() != 4:
        raise ValueError(f"bn_lif_max_pool: z must be a conv stage's [T*R, C, H, W], got {tuple(z.shape)}")
    chosen, impl = _choose_impl(backend, impl, z)
    if chosen == "torch" or len(_channel_chunks(z)) < 2:
        return None
    compiling = torch.compiler.is_compiling()
    if not compiling and not eager_call(z, op="bn_lif_forward"):
        return None
    lif_args = _lif_args(tau, v_threshold, v_reset, detach_reset, decay_input, surrogate, alpha)
    _check_compiler(impl, z)
    if compiling:  # the op pair: the compiler sees one op each way
        out, _, _, new_mean, new_var = torch.ops.efficient.bn_lif_max_pool_forward(
            z, int(steps), weight, bias, running_mean, running_var, bool(training), float(momentum), float(eps),
            *lif_args, spike_dtype or z.dtype, impl, *pool_args(*pool), bool(donate))
        if training:
            _store_running([running_mean, running_var], new_mean, new_var)
        return out
    return _BNLIFMaxPool.apply(z, weight, bias, running_mean, running_var, int(steps), bool(training), float(momentum),
                               float(eps), *lif_args, spike_dtype or z.dtype, impl, pool_args(*pool), bool(donate),
                               bool(compute) or not training or impl == "triton")


# ---------------------------------------------------------------------------------------------
# 6. with a learnable per-step gain between BatchNorm and the neuron (the stable-SNN's DLIF), by chunks
# ---------------------------------------------------------------------------------------------


def _dlif_args(leak: float, v_threshold: float, surrogate: int, alpha: float) -> tuple:
    """The DLIF's options as the LIF implementations take them: leak charge, hard reset to 0, not detached."""
    return (float(leak), float(v_threshold), 0.0, _lif.CHARGE_LEAK, int(surrogate), float(alpha), False)


def _gain_forward(z, steps, gain, weight, bias, running_mean, running_var, momentum, eps, lif_args, impl, spike_dtype,
                  spikes=True):
    """(spikes, stats) of BatchNorm -> x * gain[t] -> LIF, a chunk of channels at a time; the running
    statistics are updated in place on the given tensors' slices, as BatchNorm does. `spikes` False:
    the statistics only (the same calls, bit for bit), and zeros of the spikes' shape that own no
    memory (stride 0) in place of the spikes."""
    c, v_th, v_reset, charge = lif_args[:4]
    stats = torch.empty((2, z.shape[1]), dtype=weight.dtype, device=z.device)
    out = torch.empty(z.shape, dtype=spike_dtype, device=z.device) if spikes else None
    g = gain.to(z.dtype).view(steps, 1)
    for c0, c1 in _channel_chunks(z):
        zc = z[:, c0:c1].contiguous()
        y, mean, invstd = torch.native_batch_norm(zc, weight[c0:c1], bias[c0:c1], running_mean[c0:c1],
                                                  running_var[c0:c1], True, momentum, eps)
        stats[0, c0:c1], stats[1, c0:c1] = mean, invstd
        if out is None:
            continue
        # the DLIF's x * gain[t], then the LIF's own loop: the separate calls' values
        s, _ = _lif._run_forward(y.view(steps, -1) * g, None, c, v_th, v_reset, charge, spike_dtype, impl,
                                 membrane=False)
        del y
        out[:, c0:c1] = s.view(zc.shape)
    return (z.new_zeros((), dtype=spike_dtype).expand(z.shape) if out is None else out), stats


def _gain_backward(grad, z, gain, weight, bias, stats, steps, eps, lif_args, impl, donate=False):
    """(grad z, grad gain, grad weight, grad bias) of `_gain_forward`: a chunk's BatchNorm output,
    current and membrane trace rebuilt at a time; the gain's gradient sums the chunks' partial sums.
    `donate`: z is the caller's to overwrite, and z's gradient is written into z's storage, a chunk's
    channels once they have been read, so the unit's backward never holds z and its gradient at once."""
    c, v_th, v_reset, charge, surrogate, alpha, detach = lif_args
    g = gain.to(z.dtype).view(steps, 1)
    gz = z.detach() if donate else torch.empty(z.shape, dtype=z.dtype, device=z.device)
    gw, gb = torch.empty_like(weight), torch.empty_like(weight)
    ggain = torch.zeros(steps, dtype=torch.float32, device=z.device)
    for c0, c1 in _channel_chunks(z):
        zc = z[:, c0:c1].contiguous()
        # aten's BatchNorm again from the forward's statistics of the chunk's channels: forward's output bit for bit
        y = _bn_rebuild(zc, weight[c0:c1], bias[c0:c1], stats[:, c0:c1].contiguous(), eps).view(steps, -1)
        _, h = _lif._run_forward(y * g, None, c, v_th, v_reset, charge, z.dtype, impl, spikes=False)
        gcur, _, _ = _lif._run_backward(grad[:, c0:c1].contiguous().view(steps, -1), None, h, None, c, v_th, v_reset,
                                        charge, surrogate, alpha, detach, z.dtype, impl, overwrite=True)
        del h
        ggain += (gcur * y).sum(1, dtype=torch.float32)  # d current / d gain[t] = y[t]
        gzc, gwc, gbc = _bn_backward((gcur * g).view(zc.shape), zc, weight[c0:c1], stats[:, c0:c1], True, eps)
        del y, gcur
        gz[:, c0:c1], gw[c0:c1], gb[c0:c1] = gzc, gwc, gbc
        del gzc
    return gz, ggain.to(gain.dtype), gw, gb


class _BNGainLIF(torch.autograd.Function):
    """BatchNorm -> x * gain[t] -> LIF over a conv unit's z [T*R, C, ...], a chunk of channels at a
    time each way (BatchNorm's statistics, the gain and the neuron are per channel or per element):
    autograd keeps z and BatchNorm's statistics, and backward rebuilds one chunk's BatchNorm output,
    current and membrane trace at a time. The LIF runs its own implementations (`impl`), so it is the
    neuron's own call on each chunk."""

    @staticmethod
    def forward(ctx, z, gain, weight, bias, running_mean, running_var, steps, momentum, eps, lif_args, impl,
                spike_dtype, donate, spikes):
        with torch._C.DisableTorchFunction():  # modes see the call, not its insides (as the ops)
            out, stats = _gain_forward(z, steps, gain, weight, bias, running_mean, running_var, momentum, eps,
                                       lif_args, impl, spike_dtype, spikes)
        ctx.save_for_backward(z, gain, weight, bias, stats)
        ctx.steps, ctx.eps, ctx.lif_args, ctx.impl, ctx.donate = steps, eps, lif_args, impl, donate
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 14
        # a donated z is overwritten in place: its version moves on, so a second backward through
        # this graph (retain_graph) fails autograd's saved-tensor check instead of reading gradients
        gz, ggain, gw, gb = _gain_backward(grad, *ctx.saved_tensors, ctx.steps, ctx.eps, ctx.lif_args, ctx.impl,
                                           donate=ctx.donate and ctx.needs_input_grad[0])
        need = ctx.needs_input_grad
        return (gz if need[0] else None, ggain if need[1] else None, gw if need[2] else None,
                gb if need[3] else None) + (None,) * 10


# the same pair as custom ops, for compiled regions (functional: the new running statistics are outputs)

@torch.library.custom_op("efficient::bn_gain_lif_forward", mutates_args=(), **_ANY_LAYOUT)
def bn_gain_lif_forward_op(
    z: Tensor, steps: int, gain: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor,
    momentum: float, eps: float, leak: float, v_threshold: float, surrogate: int, alpha: float,
    spike_dtype: torch.dtype, impl: str, donate: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(spikes, BatchNorm's statistics, new running mean, new running variance) of training-mode
    BatchNorm -> x * gain[t] -> DLIF over z [T*R, C, ...], by chunks of channels. `donate` tells the
    backward that nothing else reads z (`bn_gain_lif_backward_into`)."""
    _check_z(z, steps, weight, bias)
    gain, weight, bias, running_mean, running_var = _dense(gain, weight, bias, running_mean, running_var)
    new_mean, new_var = running_mean.clone(), running_var.clone()  # updated in place by the chunks
    out, stats = _gain_forward(z, steps, gain, weight, bias, new_mean, new_var, momentum, eps,
                               _dlif_args(leak, v_threshold, surrogate, alpha), impl, spike_dtype)
    return out, stats, new_mean, new_var


@bn_gain_lif_forward_op.register_fake
def _(z, steps, gain, weight, bias, running_mean, running_var, momentum, eps, leak, v_threshold, surrogate, alpha,
      spike_dtype, impl, donate=False):
    _check_z(z, steps, weight, bias)
    return (z.new_empty(z.shape, dtype=spike_dtype), weight.new_empty((2, z.shape[1])),
            running_mean.new_empty(running_mean.shape), running_var.new_empty(running_var.shape))


@torch.library.custom_op("efficient::bn_gain_lif_backward", mutates_args=(), **_ANY_LAYOUT)
def bn_gain_lif_backward_op(
    grad: Tensor, z: Tensor, gain: Tensor, weight: Tensor, bias: Tensor, stats: Tensor, steps: int, eps: float,
    leak: float, v_threshold: float, surrogate: int, alpha: float, impl: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad z, grad gain, grad weight, grad bias) of `bn_gain_lif_forward`, rebuilt a chunk of channels at a time."""
    gain, weight, bias, stats = _dense(gain, weight, bias, stats)
    return _gain_backward(grad, z, gain, weight, bias, stats, steps, eps, _dlif_args(leak, v_threshold, surrogate, alpha),
                          impl)


@bn_gain_lif_backward_op.register_fake
def _(grad, z, gain, weight, bias, stats, steps, eps, leak, v_threshold, surrogate, alpha, impl):
    return z.new_empty(z.shape), gain.new_empty(gain.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


@torch.library.custom_op("efficient::bn_gain_lif_backward_into", mutates_args=("z",), **_ANY_LAYOUT)
def bn_gain_lif_backward_into_op(
    grad: Tensor, z: Tensor, gain: Tensor, weight: Tensor, bias: Tensor, stats: Tensor, steps: int, eps: float,
    leak: float, v_threshold: float, surrogate: int, alpha: float, impl: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad gain, grad weight, grad bias) of `bn_gain_lif_forward`, z's gradient written into z, each chunk of
    channels once it has been read: for a z nothing else reads (a convolution's fresh output, which a compiled
    region reruns in backward)."""
    gain, weight, bias, stats = _dense(gain, weight, bias, stats)
    _, ggain, gw, gb = _gain_backward(grad, z, gain, weight, bias, stats, steps, eps,
                                      _dlif_args(leak, v_threshold, surrogate, alpha), impl, donate=True)
    return ggain, gw, gb


@bn_gain_lif_backward_into_op.register_fake
def _(grad, z, gain, weight, bias, stats, steps, eps, leak, v_threshold, surrogate, alpha, impl):
    return gain.new_empty(gain.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _gain_setup_context(ctx, inputs, output) -> None:
    z, steps, gain, weight, bias, _rm, _rv, _momentum, eps, leak, v_th, surrogate, alpha, _sd, impl, *donate = inputs
    ctx.donate = bool(donate[0]) if donate else False
    ctx.mark_non_differentiable(*output[1:])  # only the spikes carry a gradient
    ctx.save_for_backward(z, gain, weight, bias, output[1])
    ctx.rest = (steps, eps, leak, v_th, surrogate, alpha, impl)
    ctx.set_materialize_grads(False)


def _gain_op_backward(ctx, grad, *_grads_of_the_rest):
    need = ctx.needs_input_grad
    if grad is None:
        return (None,) * len(need)
    z, gain, weight, bias, stats = ctx.saved_tensors
    if ctx.donate and need[0]:  # z's gradient in z's storage: the op mutates z, which is then the gradient
        ggain, gw, gb = torch.ops.efficient.bn_gain_lif_backward_into(grad, z, gain, weight, bias, stats, *ctx.rest)
        gz = z
    else:
        gz, ggain, gw, gb = torch.ops.efficient.bn_gain_lif_backward(grad, z, gain, weight, bias, stats, *ctx.rest)
    return (gz if need[0] else None, None, ggain if need[2] else None, gw if need[3] else None,
            gb if need[4] else None) + (None,) * (len(need) - 5)


bn_gain_lif_forward_op.register_autograd(_gain_op_backward, setup_context=_gain_setup_context)
_register_flops(torch.ops.efficient.bn_gain_lif_forward, 7)  # `bn_lif_forward`'s and the gain's multiply
_register_flops(torch.ops.efficient.bn_gain_lif_backward, 22)  # `bn_lif_backward_recompute`'s, the gain's two
_register_flops(torch.ops.efficient.bn_gain_lif_backward_into, 22)


def bn_gain_lif(
    z: Tensor,
    steps: int,
    gain: Tensor,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    momentum: float,
    eps: float,
    *,
    leak: float,
    v_threshold: float = 1.0,
    surrogate: str = "triangle",
    alpha: Optional[float] = None,
    spike_dtype: Optional[torch.dtype] = None,
    backend: str = "auto",
    donate: bool = False,
    spikes: bool = True,
) -> Optional[Tensor]:
    """Training spikes of BatchNorm(z) * gain[t] -> LIF with leak (the stable-SNN's DLIF: hard reset to 0,
    not detached) over a conv unit's z [T*R, C, ...], computed a chunk of channels at a time in forward
    and in backward (`_BNGainLIF`), so neither the BatchNorm output, the current nor the membrane
    trace ever exists whole; for units memory level `recompute` reruns in backward. On the CPU the
    spikes and running statistics are the separate calls' bit for bit; z's and the parameters'
    gradients are within rounding (the gain's sums its chunks' partial sums). Running statistics are
    updated in place. Returns None where this path does not apply and the caller runs the separate
    calls: the "torch" backend (the reference), an eager call that a dispatch or function mode must
    see as ops. Under torch.compile it runs as the op pair `efficient::bn_gain_lif_forward` / `_backward`
    (the same code; the new running statistics come back as outputs and are stored in the buffers).

    `donate=True` says nothing else reads z once this call has it (a convolution's fresh output): the
    backward then writes z's gradient into z's storage, the unit's largest saving in backward (compiled:
    `efficient::bn_gain_lif_backward_into`, which mutates z). `spikes=False` says the caller never reads
    the spikes (a recomputed unit's rerun, which serves only its backward): the eager call computes
    BatchNorm's statistics alone and returns zeros of the spikes' shape that own no memory; its backward
    is the same. The compiled op pair computes the spikes regardless."""
    _check_z(z, steps, weight, bias)
    if gain.shape != (steps,):
        raise ValueError(f"bn_gain_lif: gain must have one value per step ({steps}), got {tuple(gain.shape)}")
    chosen, impl = _choose_impl(backend, None, z)
    if chosen == "torch":
        return None
    compiling = torch.compiler.is_compiling()
    if not compiling and not eager_call(z, op="bn_lif_forward"):
        return None
    _check_compiler(impl, z)
    sid, a = _surrogate_id(surrogate), float(default_alpha(surrogate, alpha))
    if compiling:  # the op pair: the compiler sees one op each way
        out, _, new_mean, new_var = torch.ops.efficient.bn_gain_lif_forward(
            z, int(steps), gain, weight, bias, running_mean, running_var, float(momentum), float(eps), float(leak),
            float(v_threshold), sid, a, spike_dtype or z.dtype, impl, bool(donate))
        _store_running([running_mean, running_var], new_mean, new_var)
        return out
    return _BNGainLIF.apply(z, gain, weight, bias, running_mean, running_var, int(steps), float(momentum), float(eps),
                            _dlif_args(leak, v_threshold, sid, a), impl, spike_dtype or z.dtype, bool(donate),
                            bool(spikes))
