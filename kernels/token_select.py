"""STATA token selection: standardized anchor scores -> one top-k set shared by all timesteps -> gather.

Two ops, each a plain-torch reference (the spec), Triton kernels and a `torch.library` custom op
with a fake implementation:

* `select_tokens(scores [T, B, N], k)` -> (`idx [B, k]` ascending, `z [B, N]`). Per sample and
  timestep the scores are standardized over the N candidates, z_t = (s_t - mean) / (std + eps)
  (population std, fp32, no gradient), averaged over time, and the k largest are kept; ties go to
  the lower index, so a timestep whose scores are constant (anchor silent) abstains with z_t = 0 and
  an all-abstaining sample keeps the first k tokens in order.
* `gather_tokens(x [T, B, N, D], idx [B, k])` -> `[T, B, k, D]`, the same tokens at every t; its
  backward adds the gradient back into the picked rows (pruned tokens get zero, a token picked twice
  gets the sum of both gradients). Indices must lie in [0, N).

The Triton kernels work on fixed-size blocks, so registers and shared memory do not grow with N:
selection standardizes in row blocks, ranks tile by tile (no N x N matrix) and places each kept
token by a running prefix sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from efficient.kernels import _backend
from efficient.kernels._backend import BACKENDS, eager_call, eager_function  # noqa: F401 - BACKENDS: the accepted values

try:  # Triton is optional: the torch path covers CPU
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with torch on Linux
    HAS_TRITON = False

def resolve_backend(backend: str, t: Tensor, kernel: str = "token_select") -> str:
    """triton or torch for any documented backend value (efficient.kernels._backend); 'auto' picks
    Triton on CUDA, and on CPU when TRITON_INTERPRET=1 asks for the interpreter."""
    chosen = _backend.resolve_backend(backend, t.device, kernel, interpreter_auto=True)
    if chosen == "triton" and not (HAS_TRITON and (t.is_cuda or _backend.interpreter_on())):
        raise ValueError(f"{kernel}: backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU); use backend='torch'")
    return chosen


# ----------------------------------------------------------------------------- torch reference


def standardized_scores(scores: Tensor, eps: float = 1e-6, standardize: bool = True) -> Tensor:
    """mean_t z_t over `[T, B, N]` scores -> `[B, N]` in fp32, or float64 for float64 scores (raw
    mean_t s_t if not `standardize`)."""
    s = scores.detach().to(torch.promote_types(scores.dtype, torch.float32))
    if standardize:
        mu = s.mean(-1, keepdim=True)
        sd = s.std(-1, correction=0, keepdim=True)
        s = (s - mu) / (sd + eps)
    return s.mean(0)


def topk_lower_index(z: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row of `z`, ties to the lower index, sorted ascending."""
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


def select_tokens_ref(scores: Tensor, k: int, eps: float = 1e-6, standardize: bool = True) -> tuple[Tensor, Tensor]:
    z = standardized_scores(scores, eps, standardize)
    return topk_lower_index(z, k), z


def gather_tokens_ref(x: Tensor, idx: Tensor) -> Tensor:
    T, B, N, D = x.shape
    return x.gather(2, idx[None, :, :, None].expand(T, B, idx.shape[1], D))


def scatter_tokens_ref(g: Tensor, idx: Tensor, n: int) -> Tensor:
    T, B, k, D = g.shape
    out = g.new_zeros(T, B, n, D)
    # scatter_add, not scatter: a token picked twice receives the sum of both gradients
    return out.scatter_add(2, idx[None, :, :, None].expand(T, B, k, D), g)


# --------------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:

    @triton.jit
    def _zscore_kernel(s_ptr, z_ptr, T, B, N, eps, STANDARDIZE: tl.constexpr, BLOCK: tl.constexpr):
        # one program per sample, fixed row blocks: per timestep a pass for the mean, one for the
        # population std, one adding z_t into z (zero-initialised); then z /= T. Exact division and
        # square root (div_rn, sqrt_rn) as torch computes them, so near-ties resolve the same way.
        b = tl.program_id(0).to(tl.int64)
        rb = tl.arange(0, BLOCK)
        nf = tl.zeros([BLOCK], dtype=tl.float32) + N
        for t in range(T):
            row = s_ptr + (t * B + b) * N
            if STANDARDIZE:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for n0 in range(0, N, BLOCK):
                    rn = n0 + rb
                    acc += tl.load(row + rn, mask=rn < N, other=0.0).to(tl.float32)
                mu = tl.math.div_rn(tl.zeros([BLOCK], dtype=tl.float32) + tl.sum(acc, 0), nf)
                acc2 = tl.zeros([BLOCK], dtype=tl.float32)
                for n0 in range(0, N, BLOCK):
                    rn = n0 + rb
                    x = tl.load(row + rn, mask=rn < N, other=0.0).to(tl.float32)
                    d = tl.where(rn < N, x - mu, 0.0)
                    acc2 += d * d
                sd = tl.sqrt_rn(tl.math.div_rn(tl.zeros([BLOCK], dtype=tl.float32) + tl.sum(acc2, 0), nf))
                den = sd + eps
            for n0 in range(0, N, BLOCK):
                rn = n0 + rb
                x = tl.load(row + rn, mask=rn < N, other=0.0).to(tl.float32)
                if STANDARDIZE:
                    x = tl.math.div_rn(x - mu, den)
                zp = z_ptr + b * N + rn
                tl.store(zp, tl.load(zp, mask=rn < N, other=0.0) + x, mask=rn < N)
            tl.debug_barrier()
        tf = tl.zeros([BLOCK], dtype=tl.float32) + T
        for n0 in range(0, N, BLOCK):
            rn = n0 + rb
            zp = z_ptr + b * N + rn
            tl.store(zp, tl.math.div_rn(tl.load(zp, mask=rn < N, other=0.0), tf), mask=rn < N)

    @triton.jit
    def _rank_kernel(z_ptr, kept_ptr, N, K, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
        # program (b, i-block): rank_i = #{j: z_j > z_i or (z_j == z_i and j < i)}, counted tile by
        # tile over j; token i is kept iff rank_i < K (ties go to the lower index)
        b = tl.program_id(0).to(tl.int64)
        ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        zi = tl.load(z_ptr + b * N + ri, mask=ri < N, other=0.0)
        rank = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(0, N, BLOCK_J):
            rj = j0 + tl.arange(0, BLOCK_J)
            zj = tl.load(z_ptr + b * N + rj, mask=rj < N, other=0.0)
            ahead = (zj[None, :] > zi[:, None]) | ((zj[None, :] == zi[:, None]) & (rj[None, :] < ri[:, None]))
            rank += tl.sum((ahead & (rj[None, :] < N)).to(tl.int32), 1)
        tl.store(kept_ptr + b * N + ri, (rank < K).to(tl.int32), mask=ri < N)

    @triton.jit
    def _slot_kernel(kept_ptr, idx_ptr, N, K, BLOCK: tl.constexpr):
        # one program per sample: a kept token goes to slot = number of kept tokens before it, so
        # the indices come out ascending (a running prefix sum over row blocks)
        b = tl.program_id(0).to(tl.int64)
        rb = tl.arange(0, BLOCK)
        carry = tl.zeros([BLOCK], dtype=tl.int32)
        for n0 in range(0, N, BLOCK):
            rn = n0 + rb
            kept = tl.load(kept_ptr + b * N + rn, mask=rn < N, other=0)
            pos = carry + tl.cumsum(kept, 0) - kept
            tl.store(idx_ptr + b * K + pos, rn.to(tl.int64), mask=(kept != 0) & (rn < N))
            carry += tl.sum(kept, 0)

    @triton.jit
    def _gather_kernel(src_ptr, idx_ptr, out_ptr, B, N_SRC, K, D, SCATTER: tl.constexpr, BLOCK_D: tl.constexpr):
        # program (t*B + b, p): copies row idx[b, p] of src to row p of out, or for SCATTER adds row
        # p of src into row idx[b, p] of out (atomically: repeated indices accumulate their gradients).
        # Indices outside [0, N_SRC) touch nothing (the public function rejects them first).
        tb = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1).to(tl.int64)
        b = tb % B
        j = tl.load(idx_ptr + b * K + p)
        ok = (j >= 0) & (j < N_SRC)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            m = (offs < D) & ok
            if SCATTER:
                v = tl.load(src_ptr + (tb * K + p) * D + offs, mask=m)
                tl.atomic_add(out_ptr + (tb * N_SRC + j) * D + offs, v, mask=m)
            else:
                v = tl.load(src_ptr + (tb * N_SRC + j) * D + offs, mask=m)
                tl.store(out_ptr + (tb * K + p) * D + offs, v, mask=m)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


SELECT_BLOCK = 256  # row block of the z-score and slot kernels
RANK_BLOCK = 64  # i and j tile of the rank kernel


def select_tokens_triton(scores: Tensor, k: int, eps: float = 1e-6, standardize: bool = True) -> tuple[Tensor, Tensor]:
    T, B, N = scores.shape
    s = scores.detach().contiguous()
    z = torch.zeros(B, N, device=s.device, dtype=torch.float32)
    kept = torch.empty(B, N, device=s.device, dtype=torch.int32)
    idx = torch.empty(B, k, device=s.device, dtype=torch.int64)
    _zscore_kernel[(B,)](s, z, T, B, N, eps, STANDARDIZE=standardize, BLOCK=SELECT_BLOCK)
    _rank_kernel[(B, triton.cdiv(N, RANK_BLOCK))](z, kept, N, k, BLOCK_I=RANK_BLOCK, BLOCK_J=RANK_BLOCK)
    _slot_kernel[(B,)](kept, idx, N, k, BLOCK=SELECT_BLOCK)
    return idx, z


def _gather_triton(src: Tensor, idx: Tensor, n_out: int, scatter: bool) -> Tensor:
    T, B, n_in, D = src.shape
    src = src.contiguous()
    idx = idx.contiguous()
    k = idx.shape[1]
    block_d = min(1024, _next_pow2(D))
    if scatter:  # src is [T, B, k, D] -> out [T, B, n_out, D]; atomics need a zeroed output
        out = src.new_zeros(T, B, n_out, D)
        _gather_kernel[(T * B, k)](src, idx, out, B, n_out, k, D, SCATTER=True, BLOCK_D=block_d)
    else:
        out = src.new_empty(T, B, k, D)
        _gather_kernel[(T * B, k)](src, idx, out, B, n_in, k, D, SCATTER=False, BLOCK_D=block_d)
    return out


# ------------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("efficient::stata_select", mutates_args=())
def _select_op(scores: Tensor, k: int, eps: float, standardize: bool, backend: str) -> tuple[Tensor, Tensor]:
    return _select_impl(scores, k, eps, standardize, backend)


def _select_impl(scores: Tensor, k: int, eps: float, standardize: bool, backend: str) -> tuple[Tensor, Tensor]:
    if backend == "triton":
        return select_tokens_triton(scores, k, eps, standardize)
    return select_tokens_ref(scores, k, eps, standardize)


@_select_op.register_fake
def _(scores: Tensor, k: int, eps: float, standardize: bool, backend: str) -> tuple[Tensor, Tensor]:
    T, B, N = scores.shape
    return scores.new_empty(B, k, dtype=torch.int64), scores.new_empty(B, N, dtype=torch.float32)


def _check_index_range(idx: Tensor, n: int) -> None:
    """Out-of-range indices are an error on every backend (the kernel never reads them). Checked in
    the op's body, which runs on real tensors in compiled graphs too. On an accelerator the check is
    an asynchronous device assert: reading the range back would make every step wait for the device."""
    if not idx.numel():
        return
    if idx.device.type != "cpu":
        torch._assert_async(((idx >= 0) & (idx < n)).all(), f"token index out of range: idx must lie in [0, N={n})")
        return
    lo, hi = torch.aminmax(idx)
    if lo.item() < 0 or hi.item() >= n:
        raise ValueError(f"idx must lie in [0, N={n}); got values from {lo.item()} to {hi.item()}")


@torch.library.custom_op("efficient::token_gather", mutates_args=())
def _gather_op(x: Tensor, idx: Tensor, backend: str) -> Tensor:
    return _gather_impl(x, idx, backend)


def _gather_impl(x: Tensor, idx: Tensor, backend: str) -> Tensor:
    _check_index_range(idx, x.shape[2])
    if backend == "triton":
        return _gather_triton(x, idx, idx.shape[1], scatter=False)
    return gather_tokens_ref(x, idx)


@_gather_op.register_fake
def _(x: Tensor, idx: Tensor, backend: str) -> Tensor:
    T, B, N, D = x.shape
    return x.new_empty(T, B, idx.shape[1], D)


@torch.library.custom_op("efficient::token_scatter", mutates_args=())
def _scatter_op(g: Tensor, idx: Tensor, n: int, backend: str) -> Tensor:
    return _scatter_impl(g, idx, n, backend)


def _scatter_impl(g: Tensor, idx: Tensor, n: int, backend: str) -> Tensor:
    # gather's backward: idx was checked by the forward (the kernel skips out-of-range rows anyway)
    if backend == "triton":
        if g.dtype == torch.bfloat16 and _backend.interpreter_on():
            # Triton's CPU interpreter has no bf16 atomics: the kernel runs on fp32 and rounds once
            # (exact where the indices are distinct, as STATA's kept tokens are; a repeated index's
            # sum is rounded once instead of per add)
            return _gather_triton(g.float(), idx, n, scatter=True).to(g.dtype)
        return _gather_triton(g, idx, n, scatter=True)
    return scatter_tokens_ref(g, idx, n)


@_scatter_op.register_fake
def _(g: Tensor, idx: Tensor, n: int, backend: str) -> Tensor:
    T, B, k, D = g.shape
    return g.new_empty(T, B, n, D)


def _gather_setup(ctx, inputs, output) -> None:
    x, idx, backend = inputs
    ctx.save_for_backward(idx)
    ctx.n, ctx.backend = x.shape[2], backend


def _gather_backward(ctx, g: Tensor, scatter=_scatter_op):
    (idx,) = ctx.saved_tensors
    return scatter(g.contiguous(), idx, ctx.n, ctx.backend), None, None


_gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)
# eager calls: the same implementation and saved index, the scatter called directly in backward
_EagerGather = eager_function("_EagerGather", _gather_impl, _gather_setup,
                              lambda ctx, g: _gather_backward(ctx, g, scatter=_scatter_impl))


def _scatter_setup(ctx, inputs, output) -> None:
    g, idx, n, backend = inputs
    ctx.save_for_backward(idx)
    ctx.backend = backend


def _scatter_backward(ctx, gg: Tensor):
    (idx,) = ctx.saved_tensors
    return _gather_op(gg.contiguous(), idx, ctx.backend), None, None, None


_scatter_op.register_autograd(_scatter_backward, setup_context=_scatter_setup)


# ------------------------------------------------------------------------------------ public API


def select_tokens(
    scores: Tensor, k: int, eps: float = 1e-6, standardize: bool = True, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Kept indices `[B, k]` (ascending, shared by all T) and the selection score `[B, N]` (fp32)."""
    if scores.dim() != 3:
        raise ValueError(f"scores must be 3-D [T, B, N] (summed over heads), got {scores.dim()}-D shape {list(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a floating tensor, got {scores.dtype}")
    if not 1 <= k <= scores.shape[-1]:
        what = "an empty keep set" if k < 1 else "more tokens than there are"
        raise ValueError(f"k must be in 1..N={scores.shape[-1]} (k={k} asks for {what})")
    select = _select_impl if eager_call(scores, function_modes=False) else _select_op  # no gradient: no autograd node
    return select(scores.detach(), int(k), float(eps), bool(standardize), resolve_backend(backend, scores))


def gather_tokens(x: Tensor, idx: Tensor, backend: str = "auto") -> Tensor:
    """`x[:, b, idx[b]]` for every t: `[T, B, N, D]`, `[B, k]` -> `[T, B, k, D]` (differentiable in x)."""
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D [T, B, N, D], got {x.dim()}-D shape {list(x.shape)}")
    if idx.dim() != 2:
        raise ValueError(f"idx must be 2-D [B, k] (one keep set per sample), got {idx.dim()}-D shape {list(idx.shape)}")
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise ValueError(f"idx must hold integer token indices, got {idx.dtype}")
    if idx.shape[0] != x.shape[1]:
        raise ValueError(f"idx has {idx.shape[0]} keep sets but x has batch size B={x.shape[1]}: idx must be [B, k]")
    if idx.shape[1] < 1:
        raise ValueError("idx is an empty keep set (k=0): keep at least one token per sample")
    gather = _EagerGather.apply if eager_call(x) else _gather_op
    return gather(x, idx.to(torch.int64), resolve_backend(backend, x))
