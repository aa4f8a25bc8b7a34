"""STATA token selection: standardized anchor scores -> one top-k set shared by all timesteps -> gather.

Two ops, each a plain-torch reference (the spec), Triton kernels and a `torch.library` custom op
with a fake implementation:

* `select_tokens(scores [T, B, N], k)` -> (`idx [B, k]` ascending, `z [B, N]`). Per sample and
  timestep the scores are standardized over the N candidates, z_t = (s_t - mean) / (std + eps)
  (population std, fp32, no gradient), averaged over time, and the k largest are kept; ties go to
  the lower index, so a timestep whose scores are constant (anchor silent) abstains with z_t = 0 and
  an all-abstaining sample keeps the first k tokens in order.
* `gather_tokens(x [T, B, N, D], idx [B, k])` -> `[T, B, k, D]`, the same tokens at every t; its
  backward scatters the gradient back (pruned tokens get zero).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # Triton is optional: the torch path covers CPU
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with torch on Linux
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, t: Tensor) -> str:
    """'auto' -> Triton on CUDA, torch on CPU (unless TRITON_INTERPRET=1 asks for the interpreter)."""
    backend = os.environ.get("EFFICIENT_BACKEND", backend) if backend == "auto" else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "auto":
        return "triton" if HAS_TRITON and (t.is_cuda or interpret) else "torch"
    if backend == "triton" and not (HAS_TRITON and (t.is_cuda or interpret)):
        raise ValueError("backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU); use backend='torch'")
    return backend


# ----------------------------------------------------------------------------- torch reference


def standardized_scores(scores: Tensor, eps: float = 1e-6, standardize: bool = True) -> Tensor:
    """mean_t z_t over `[T, B, N]` scores -> `[B, N]` fp32 (raw mean_t s_t if not `standardize`)."""
    s = scores.detach().float()
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
    return out.scatter(2, idx[None, :, :, None].expand(T, B, k, D), g)


# --------------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:

    @triton.jit
    def _select_kernel(
        s_ptr, z_ptr, idx_ptr, T, B, N, K, eps,
        STANDARDIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # one program per sample: standardize each timestep's row, average over t, rank, write kept indices
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_N)
        valid = offs < N
        z = tl.zeros([BLOCK_N], dtype=tl.float32)
        for t in range(T):
            s = tl.load(s_ptr + (t * B + b) * N + offs, mask=valid, other=0.0).to(tl.float32)
            if STANDARDIZE:
                mu = tl.sum(s, 0) / N
                d = tl.where(valid, s - mu, 0.0)
                sd = tl.sqrt(tl.sum(d * d, 0) / N)
                z += d / (sd + eps)
            else:
                z += s
        z = z / T
        tl.store(z_ptr + b * N + offs, z, mask=valid)
        # rank_i = #{j valid: z_j > z_i or (z_j == z_i and j < i)}; kept iff rank_i < K
        zi = z[:, None]
        zj = z[None, :]
        ii = offs[:, None]
        jj = offs[None, :]
        ahead = ((zj > zi) | ((zj == zi) & (jj < ii))) & (jj < N)
        rank = tl.sum(ahead.to(tl.int32), 1)
        kept = (rank < K) & valid
        # output slot of a kept token = number of kept tokens before it
        before = (kept[None, :] & (jj < ii)).to(tl.int32)
        pos = tl.sum(before, 1)
        tl.store(idx_ptr + b * K + pos, offs.to(tl.int64), mask=kept)

    @triton.jit
    def _gather_kernel(src_ptr, idx_ptr, out_ptr, B, N_SRC, K, D, SCATTER: tl.constexpr, BLOCK_D: tl.constexpr):
        # program (t*B + b, p): copies row idx[b, p] of src to row p of out (or back, for SCATTER)
        tb = tl.program_id(0)
        p = tl.program_id(1)
        b = tb % B
        j = tl.load(idx_ptr + b * K + p)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            m = offs < D
            if SCATTER:
                v = tl.load(src_ptr + (tb * K + p) * D + offs, mask=m)
                tl.store(out_ptr + (tb * N_SRC + j) * D + offs, v, mask=m)
            else:
                v = tl.load(src_ptr + (tb * N_SRC + j) * D + offs, mask=m)
                tl.store(out_ptr + (tb * K + p) * D + offs, v, mask=m)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def select_tokens_triton(scores: Tensor, k: int, eps: float = 1e-6, standardize: bool = True) -> tuple[Tensor, Tensor]:
    T, B, N = scores.shape
    s = scores.detach().contiguous()
    z = torch.empty(B, N, device=s.device, dtype=torch.float32)
    idx = torch.empty(B, k, device=s.device, dtype=torch.int64)
    _select_kernel[(B,)](s, z, idx, T, B, N, k, eps, STANDARDIZE=standardize, BLOCK_N=max(16, _next_pow2(N)))
    return idx, z


def _gather_triton(src: Tensor, idx: Tensor, n_out: int, scatter: bool) -> Tensor:
    T, B, n_in, D = src.shape
    src = src.contiguous()
    idx = idx.contiguous()
    k = idx.shape[1]
    if scatter:  # src is [T, B, k, D] -> out [T, B, n_out, D]
        out = src.new_zeros(T, B, n_out, D)
        _gather_kernel[(T * B, k)](src, idx, out, B, n_out, k, D, SCATTER=True, BLOCK_D=min(1024, _next_pow2(D)))
    else:
        out = src.new_empty(T, B, k, D)
        _gather_kernel[(T * B, k)](src, idx, out, B, n_in, k, D, SCATTER=False, BLOCK_D=min(1024, _next_pow2(D)))
    return out


# ------------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("efficient::stata_select", mutates_args=())
def _select_op(scores: Tensor, k: int, eps: float, standardize: bool, backend: str) -> tuple[Tensor, Tensor]:
    if backend == "triton":
        return select_tokens_triton(scores, k, eps, standardize)
    return select_tokens_ref(scores, k, eps, standardize)


@_select_op.register_fake
def _(scores: Tensor, k: int, eps: float, standardize: bool, backend: str) -> tuple[Tensor, Tensor]:
    T, B, N = scores.shape
    return scores.new_empty(B, k, dtype=torch.int64), scores.new_empty(B, N, dtype=torch.float32)


@torch.library.custom_op("efficient::token_gather", mutates_args=())
def _gather_op(x: Tensor, idx: Tensor, backend: str) -> Tensor:
    if backend == "triton":
        return _gather_triton(x, idx, idx.shape[1], scatter=False)
    return gather_tokens_ref(x, idx)


@_gather_op.register_fake
def _(x: Tensor, idx: Tensor, backend: str) -> Tensor:
    T, B, N, D = x.shape
    return x.new_empty(T, B, idx.shape[1], D)


@torch.library.custom_op("efficient::token_scatter", mutates_args=())
def _scatter_op(g: Tensor, idx: Tensor, n: int, backend: str) -> Tensor:
    if backend == "triton":
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


def _gather_backward(ctx, g: Tensor):
    (idx,) = ctx.saved_tensors
    return _scatter_op(g.contiguous(), idx, ctx.n, ctx.backend), None, None


_gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)


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
        raise ValueError(f"scores must be [T, B, N], got {list(scores.shape)}")
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"k must be in 1..N={scores.shape[-1]}, got {k}")
    return _select_op(scores.detach(), int(k), float(eps), bool(standardize), resolve_backend(backend, scores))


def gather_tokens(x: Tensor, idx: Tensor, backend: str = "auto") -> Tensor:
    """`x[:, b, idx[b]]` for every t: `[T, B, N, D]`, `[B, k]` -> `[T, B, k, D]` (differentiable in x)."""
    if x.dim() != 4 or idx.dim() != 2 or idx.shape[0] != x.shape[1]:
        raise ValueError(f"expected x [T, B, N, D] and idx [B, k]; got {list(x.shape)} and {list(idx.shape)}")
    return _gather_op(x, idx.to(torch.int64), resolve_backend(backend, x))
