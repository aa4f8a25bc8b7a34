"""Chunked fused linear cross-entropy: mean CE of `hidden @ weight.T` against targets, computed
row-chunk by row-chunk so a K-exit model never holds K full [N, V] logit tensors.

Each chunk's logits are turned into their gradient (softmax - onehot) in place right after the
loss is taken, and the input/weight gradients are accumulated in the forward pass (the
Liger-Kernel recipe), so backward is a scale. Parts: torch reference, chunked torch path, Triton
row kernel for the in-place CE, custom op `efficient::linear_ce` with autograd.

`confidence_weighted=True` multiplies each token's CE by its detached max softmax probability
(EE-Tuning's dynamic token weights); no gradient flows through the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from efficient.kernels._backend import BACKENDS, eager_call, eager_function, resolve_backend  # noqa: F401 - BACKENDS: the accepted values

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def linear_ce_reference(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, confidence_weighted: bool = False
) -> torch.Tensor:
    """The spec, via full logits: sum_i c_i * CE_i / #valid, c_i = detached p_max_i or 1."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logp = F.log_softmax((hidden @ weight.T).to(acc), dim=-1)
    valid = target != ignore_index
    ce = -logp.gather(-1, target.clamp(min=0)[:, None])[:, 0]
    if confidence_weighted:
        ce = ce * logp.detach().amax(-1).exp()
    return torch.where(valid, ce, 0).sum() / valid.sum().clamp(min=1)


def _ce_chunk_torch(z: torch.Tensor, t: torch.Tensor, ignore_index: int, conf: bool) -> torch.Tensor:
    """Per-row CE of logits `z` (fp32, [n, V]); overwrites `z` with d(sum of row losses)/dz.
    Everything is in place on `z`, so a chunk costs one [n, V] buffer."""
    valid = t != ignore_index
    tc = t.clamp(min=0)
    rows = torch.arange(len(t), device=z.device)
    zt = z[rows, tc]
    m = z.amax(-1)
    z.sub_(m[:, None]).exp_()
    s = z.sum(-1)  # p_max = exp(m - lse) = 1 / s
    loss = m + s.log() - zt
    c = torch.where(valid, s.reciprocal() if conf else torch.ones_like(s), 0)
    z.div_(s[:, None])
    z[rows, tc] -= 1
    z.mul_(c[:, None])
    return loss * c


if triton is not None:

    @triton.jit
    def _ce_rows_kernel(z_ptr, t_ptr, loss_ptr, stride, V, ignore_index, CONF: tl.constexpr, BLOCK_V: tl.constexpr):
        """One program per row: online max/sum-exp over the row, then the gradient in place."""
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * stride
        t = tl.load(t_ptr + row)
        m = float("-inf")
        s = 0.0
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        valid = t != ignore_index
        tc = tl.where(valid, t, 0)
        zt = tl.load(base + tc).to(tl.float32)
        c = tl.exp(m - lse) if CONF else 1.0
        c = tl.where(valid, c, 0.0)
        tl.store(loss_ptr + row, (lse - zt) * c)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = (tl.exp(z - lse) - tl.where(cols == tc, 1.0, 0.0)) * c
            tl.store(base + cols, g, mask=cols < V)


def _ce_chunk_triton(z: torch.Tensor, t: torch.Tensor, ignore_index: int, conf: bool) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("linear_ce backend='triton' needs the triton package")
    loss = torch.empty(z.shape[0], device=z.device, dtype=torch.float32)
    _ce_rows_kernel[(z.shape[0],)](z, t, loss, z.stride(0), z.shape[1], ignore_index, CONF=conf, **ce_blocks(z.shape[1], z.is_cuda))
    return loss


def ce_blocks(v: int, cuda: bool = True) -> dict:
    """Launch parameters of `_ce_rows_kernel` for vocab size `v`: one row per program, the vocab in
    tiles of up to 4096 (128 in the interpreter)."""
    return {"BLOCK_V": min(4096 if cuda else 128, 1 << max(0, (v - 1).bit_length())), "num_warps": 4}


def _check_targets(target: torch.Tensor, valid: torch.Tensor, V: int, ignore_index: int, sync_free: bool) -> None:
    """Every target that is not `ignore_index` must be a class id in [0, V). On a CPU the error names the
    first bad position; `sync_free` (an accelerator) asserts on the device instead, as `F.cross_entropy`
    does there: reading the answer back would make the host wait in every step and cannot happen
    inside a captured CUDA graph."""
    bad = valid & ((target < 0) | (target >= V))
    if sync_free:
        torch._assert_async(~bad.any(), f"linear_ce: a target is outside the vocabulary [0, V={V}) and is not "
                                        f"ignore_index={ignore_index}")
        return
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"linear_ce: target holds class id {int(target[i])} at position {i}, outside the vocabulary [0, V={V}); "
            f"only ignore_index={ignore_index} may lie outside it"
        )


def _linear_ce_chunked(hidden, weight, target, ignore_index, conf, chunk_size, backend, need_grad):
    """Loss (0-dim, fp32) and, if `need_grad`, d loss / d hidden and d loss / d weight."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)
    valid = target != ignore_index
    if target.numel():  # checked in the op's body, which runs on real tensors in compiled graphs too
        _check_targets(target, valid, V, ignore_index, sync_free=target.device.type != "cpu")
    # counted as an integer and divided in fp32 (or fp64): a half-precision count rounds (bf16: 1001 -> 1000)
    n_valid = valid.sum().clamp(min=1).to(acc)
    total = torch.zeros((), device=hidden.device, dtype=acc)
    dh = torch.empty_like(hidden) if need_grad else hidden.new_empty(0)
    dw = torch.zeros(weight.shape, device=weight.device, dtype=acc) if need_grad else weight.new_empty(0)
    ce_rows = _ce_chunk_triton if backend == "triton" else _ce_chunk_torch
    for s in range(0, N, chunk_size):
        h = hidden[s : s + chunk_size]
        z = (h @ weight.T).to(acc).contiguous()
        total += ce_rows(z, target[s : s + chunk_size].contiguous(), ignore_index, conf).sum()
        if need_grad:
            g = z.div_(n_valid).to(hidden.dtype)  # the mean's 1/#valid, applied in fp32 before any rounding
            dh[s : s + chunk_size] = g @ weight
            dw.addmm_(g.T.to(acc), h.to(acc))
    if need_grad:
        dw = dw.to(weight.dtype)
    return (total / n_valid).to(torch.float32 if acc == torch.float32 else acc), dh, dw


def _pick_backend(backend: str, device: torch.device) -> str:
    """The path to run, triton or torch, for any documented backend value (efficient.kernels._backend)."""
    return resolve_backend(backend, device, "linear_ce")


@torch.library.custom_op("efficient::linear_ce", mutates_args=())
def _linear_ce_op(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, confidence_weighted: bool, chunk_size: int, backend: str, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_ce_chunked(hidden, weight, target, ignore_index, confidence_weighted, chunk_size, backend, need_grad)


@_linear_ce_op.register_fake
def _(hidden, weight, target, ignore_index, confidence_weighted, chunk_size, backend, need_grad):
    acc = torch.promote_types(hidden.dtype, torch.float32)
    dh = torch.empty_like(hidden) if need_grad else hidden.new_empty(0)
    dw = torch.empty_like(weight) if need_grad else weight.new_empty(0)
    return hidden.new_empty((), dtype=acc), dh, dw


def _setup_context(ctx, inputs, output) -> None:
    _, dh, dw = output
    ctx.mark_non_differentiable(dh, dw)  # gradients computed in forward: only the loss carries one
    ctx.save_for_backward(dh, dw)


def _backward(ctx, g_loss, g_dh, g_dw):
    dh, dw = ctx.saved_tensors
    if dh.numel() == 0:
        raise RuntimeError("linear_ce was called without gradients enabled; call it with requires_grad inputs to backpropagate")
    return (g_loss * dh).to(dh.dtype), (g_loss * dw).to(dw.dtype), None, None, None, None, None, None


_linear_ce_op.register_autograd(_backward, setup_context=_setup_context)


def _eager_setup(ctx, inputs, output) -> None:
    _setup_context(ctx, inputs, output)
    ctx.set_materialize_grads(False)  # the gradients outputs dh, dw get none: no zeros of their size


# eager calls (`_backend.eager_call`): the op's implementation and autograd formula without its dispatch
_EagerLinearCE = eager_function("_EagerLinearCE", _linear_ce_chunked, _eager_setup, _backward)

try:
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.efficient.linear_ce)
    def _flops(hidden_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
        n, d = hidden_shape
        need_grad = args[-1] if args else kwargs.get("need_grad", True)
        return 2 * n * d * weight_shape[0] * (3 if need_grad else 1)
except Exception:  # pragma: no cover
    pass


def _chunks_in(hidden, weight, target, ignore_index, conf, chunk_size, backend, need_grad):
    """The chunked pass: the op's implementation eagerly (no dispatch), the op where a graph is traced."""
    args = (hidden, weight, target, ignore_index, conf, chunk_size, backend, need_grad)
    return _linear_ce_chunked(*args) if eager_call(hidden) else _linear_ce_op(*args)


class _LinearCERerun(torch.autograd.Function):
    """linear_ce keeping only its inputs: forward takes the loss, and backward runs the same chunks again
    with their gradients (the same ops, so the same gradients bit for bit as when forward makes them)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, conf, chunk_size, backend):
        loss, _, _ = _chunks_in(hidden, weight, target, ignore_index, conf, chunk_size, backend, False)
        ctx.save_for_backward(hidden, weight, target)
        ctx.options = (ignore_index, conf, chunk_size, backend)
        return loss

    @staticmethod
    def backward(ctx, g_loss):
        hidden, weight, target = ctx.saved_tensors
        _, dh, dw = _chunks_in(hidden, weight, target, *ctx.options, True)
        # scaled in place where the dtypes agree (fresh tensors of this call): a copy of the [V, D] weight
        # gradient would be the largest tensor of the step's head. In half precision an in-place product
        # rounds g_loss to the half type first, so there the copies keep forward's values
        if dh.dtype == dw.dtype == g_loss.dtype:
            return dh.mul_(g_loss), dw.mul_(g_loss), None, None, None, None, None
        return (g_loss * dh).to(dh.dtype), (g_loss * dw).to(dw.dtype), None, None, None, None, None


GRADS = ("auto", "forward", "backward")


def grads_in_forward(n: int, d: int, grads: str = "auto") -> bool:
    """Whether linear_ce makes its gradients in forward (one pass over the logits, Liger-Kernel's
    recipe) or in backward (a second pass: one more matmul). Forward's gradients are held until
    backward, a [V, D] weight gradient in fp32 per call among them, which at a hidden size D near the
    row count N outweighs the [N, V] logits the op exists to avoid (on an H200, three exits at
    N=1024, D=4096 held 1.6x the plain path's peak). "auto": in forward where that weight gradient
    is at most a quarter of the logits' size (4 D <= N)."""
    if grads not in GRADS:
        raise ValueError(f"linear_ce: grads must be one of {GRADS}, got {grads!r}")
    return grads == "forward" or (grads == "auto" and 4 * d <= n)


def linear_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    confidence_weighted: bool = False,
    chunk_size: int = 1024,
    backend: str = "auto",
    grads: str = "auto",
) -> torch.Tensor:
    """Mean cross-entropy of logits `hidden @ weight.T` (hidden [..., D], weight [V, D], target
    [...] int64) over targets != ignore_index, without storing the logits. Differentiable in
    hidden and weight; `grads` says where the gradients are made (`grads_in_forward`)."""
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_ce: hidden [..., D] and weight [V, D] must share D, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_ce: target shape {tuple(target.shape)} must equal hidden's leading shape {tuple(hidden.shape[:-1])}")
    if target.dtype not in (torch.long, torch.int32):
        raise ValueError(f"linear_ce: target must hold integer class ids, got {target.dtype}")
    if chunk_size < 1:
        raise ValueError(f"linear_ce: chunk_size must be >= 1, got {chunk_size}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_ce: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).long()
    in_forward = grads_in_forward(h2.shape[0], h2.shape[1], grads)  # also names a bad `grads`
    be = _pick_backend(backend, hidden.device)
    if be == "triton" and hidden.dtype == torch.float64:
        raise ValueError("linear_ce: the Triton kernel takes fp32/fp16/bf16; use backend='torch' for fp64")
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if need_grad and not in_forward:
        return _LinearCERerun.apply(h2, weight, t1, ignore_index, confidence_weighted, chunk_size, be)
    args = (h2, weight, t1, ignore_index, confidence_weighted, chunk_size, be, need_grad)
    loss, _, _ = _EagerLinearCE.apply(*args) if eager_call(hidden) else _linear_ce_op(*args)
    return loss
