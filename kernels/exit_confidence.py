"""Exit confidence: max softmax probability and argmax of `hidden @ weight.T` without the logits.

An early-exit decoder asks every exit "how sure are you?" for each new token. The answer needs
only max_v softmax(z)_v = 1 / sum_v exp(z_v - max z) and the argmax, which an online softmax
(Milakov & Gimelshein, 2018) gets in one pass over vocab tiles, so the [N, V] logits are never
stored. Parts: torch reference, chunked torch path (CPU), Triton kernels (one for a decode step's few rows,
one with `tl.dot` tiles of 16 rows for more), custom op `efficient::exit_confidence`.
"""

from __future__ import annotations

import torch

from efficient.kernels._backend import BACKENDS, resolve_backend  # noqa: F401 - BACKENDS: the accepted values

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency; the torch paths work without it
    triton = None


def exit_confidence_reference(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec: full fp32 (fp64 for fp64 inputs) logits, softmax, max -> (p_max [N], argmax int64 [N])."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    p = torch.softmax(hidden.to(acc) @ weight.to(acc).T, dim=-1)
    pmax, arg = p.max(dim=-1)
    return pmax, arg


def exit_confidence_torch(hidden: torch.Tensor, weight: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax over vocab chunks: memory O(N * chunk) instead of O(N * V)."""
    N = hidden.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 math for half inputs, fp64 stays fp64
    if weight.shape[0] <= chunk:  # one chunk holds the whole vocab: three ops per decode step
        return torch.softmax((hidden @ weight.T).to(acc), dim=-1).max(dim=-1)
    m = torch.full((N,), float("-inf"), device=hidden.device, dtype=acc)
    s = torch.zeros(N, device=hidden.device, dtype=acc)
    arg = torch.zeros(N, dtype=torch.long, device=hidden.device)
    for v0 in range(0, weight.shape[0], chunk):
        z = (hidden @ weight[v0 : v0 + chunk].T).to(acc)
        zm, za = z.max(dim=-1)
        m_new = torch.maximum(m, zm)
        s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(-1)
        arg = torch.where(zm > m, za + v0, arg)  # strict: the first maximum wins, as in torch.max
        m = m_new
    return 1.0 / s, arg


if triton is not None:

    @triton.jit
    def _fold_tile_tl(acc, cmask, v0, m, s, arg):
        """Fold one vocabulary tile's logits `acc` [rows, BLOCK_V] (columns `cmask` real, starting at id
        `v0`) into each row's running max `m`, sum of exp relative to it `s`, and argmax `arg`."""
        acc = tl.where(cmask[None, :], acc, float("-inf"))
        zm = tl.max(acc, axis=1)
        za = tl.argmax(acc, axis=1).to(tl.int64) + v0
        m_new = tl.maximum(m, zm)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(acc - m_new[:, None]), axis=1)
        arg = tl.where(zm > m, za, arg)
        return m_new, s, arg

    @triton.jit
    def _slice_start_tl(split, V_PER_SPLIT, V, BLOCK_N: tl.constexpr):
        """A program's vocabulary slice [v_start, v_end) and its rows' empty running state (max, sum, argmax)."""
        v_start = split * V_PER_SPLIT
        v_end = tl.minimum(v_start + V_PER_SPLIT, V)
        m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        return v_start, v_end, m, tl.zeros((BLOCK_N,), tl.float32), tl.zeros((BLOCK_N,), tl.int64)

    @triton.jit
    def _store_partials_tl(m_ptr, s_ptr, arg_ptr, split, N, rows, rmask, m, s, arg):
        """A vocabulary slice's partial (max, sum of exp, argmax) per row, combined on the host side."""
        out = split.to(tl.int64) * N + rows
        tl.store(m_ptr + out, m, mask=rmask)
        tl.store(s_ptr + out, s, mask=rmask)
        tl.store(arg_ptr + out, arg, mask=rmask)

    @triton.jit
    def _exit_conf_kernel(
        h_ptr, w_ptr, m_ptr, s_ptr, arg_ptr, N, V, D, V_PER_SPLIT,
        stride_hn, stride_wv,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # program (row block, vocab split): online softmax over its slice of the vocabulary, writing
        # the partial (max, sum of exp relative to it, argmax); the splits are combined afterwards,
        # so a decode step (N = 1) still spreads the V x D weight over many programs
        pid = tl.program_id(0)
        split = tl.program_id(1)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        # int64 row and column offsets: V * D (and N * D) pass 2^31 at a 32k vocab and D = 8192
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hn
        v_start, v_end, m, s, arg = _slice_start_tl(split, V_PER_SPLIT, V, BLOCK_N)
        for v0 in range(v_start, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            cmask = cols < v_end
            w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wv
            acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
            for d0 in range(0, D, BLOCK_D):
                ds = d0 + tl.arange(0, BLOCK_D)
                dmask = ds < D
                h = tl.load(h_rows + ds[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
                w = tl.load(w_rows + ds[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0)
                acc += tl.dot(h, tl.trans(w), input_precision="ieee")
            m, s, arg = _fold_tile_tl(acc, cmask, v0, m, s, arg)
        _store_partials_tl(m_ptr, s_ptr, arg_ptr, split, N, rows, rmask, m, s, arg)


    @triton.jit
    def _exit_conf_few_kernel(
        h_ptr, w_ptr, m_ptr, s_ptr, arg_ptr, N, V, D, V_PER_SPLIT,
        stride_hn, stride_wv,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # a decode step's few rows (N <= BLOCK_N <= FEW_ROWS): one program per vocabulary slice holds
        # every row, so each weight tile is read once for all of them, in wide contiguous runs along D;
        # the products are multiply-adds over the tile (no tl.dot, whose tiles start at 16 rows)
        split = tl.program_id(0)
        rows = tl.arange(0, BLOCK_N)
        rmask = rows < N
        v_start, v_end, m, s, arg = _slice_start_tl(split, V_PER_SPLIT, V, BLOCK_N)
        for v0 in range(v_start, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            cmask = cols < v_end
            w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wv
            acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
            for d0 in range(0, D, BLOCK_D):
                ds = d0 + tl.arange(0, BLOCK_D)
                dmask = ds < D
                w = tl.load(w_rows + ds[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
                for n in tl.static_range(BLOCK_N):
                    h = tl.load(h_ptr + n * stride_hn + ds, mask=dmask & (n < N), other=0.0).to(tl.float32)
                    z = tl.sum(w * h[None, :], axis=1)  # [BLOCK_V]: row n's logits over this D tile
                    acc = tl.where(rows[:, None] == n, acc + z[None, :], acc)
            m, s, arg = _fold_tile_tl(acc, cmask, v0, m, s, arg)
        _store_partials_tl(m_ptr, s_ptr, arg_ptr, split, N, rows, rmask, m, s, arg)


FEW_ROWS = 4  # up to this many rows (a decode step's tokens) take `_exit_conf_few_kernel`


def vocab_splits(n: int, v: int, block_n: int, block_v: int, cuda: bool) -> int:
    """How many vocabulary slices to give each row block: on CUDA enough programs to fill the device
    (about 4 per SM), never slices narrower than one vocab tile; in the interpreter a few, so that
    tests run the combining step."""
    tiles = -(-v // block_v)
    if not cuda:
        return min(tiles, 3)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    row_blocks = -(-n // block_n)
    return max(1, min(tiles, -(-4 * sms // row_blocks)))


def exit_confidence_triton(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if triton is None:
        raise RuntimeError("exit_confidence backend='triton' needs the triton package")
    N, D = hidden.shape
    V = weight.shape[0]
    hidden, weight = hidden.contiguous(), weight.contiguous()
    few = N <= FEW_ROWS
    blocks = (exit_conf_few_blocks(N, D, hidden.is_cuda, hidden.dtype) if few
              else exit_conf_blocks(D, hidden.is_cuda, hidden.dtype))
    splits = vocab_splits(N, V, blocks["BLOCK_N"], blocks["BLOCK_V"], hidden.is_cuda)
    per_split = -(-(-(-V // splits)) // blocks["BLOCK_V"]) * blocks["BLOCK_V"]  # whole tiles per slice
    splits = -(-V // per_split)
    m = torch.empty(splits, N, device=hidden.device, dtype=torch.float32)
    s = torch.empty_like(m)
    arg = torch.empty(splits, N, device=hidden.device, dtype=torch.long)
    kernel = _exit_conf_few_kernel[(splits,)] if few else _exit_conf_kernel[(triton.cdiv(N, blocks["BLOCK_N"]), splits)]
    kernel(hidden, weight, m, s, arg, N, V, D, per_split, hidden.stride(0), weight.stride(0), **blocks)
    # combine the slices: the global max, each slice's sum rescaled to it; ties between slices go to
    # the first one (torch.max returns the first maximal index), i.e. the lowest vocabulary id
    top, first = m.max(dim=0)
    total = (s * torch.exp(m - top)).sum(dim=0)
    return 1.0 / total, arg.gather(0, first[None]).squeeze(0)


def exit_conf_blocks(d: int, cuda: bool = True, dtype: torch.dtype = torch.float32) -> dict:
    """Launch parameters of `_exit_conf_kernel` for hidden size `d`: 16 rows, a 64-wide vocab tile
    (32 in the interpreter, where smaller tiles run faster), D in tiles of at most 64 (32 for fp32
    inputs: a 64 x 64 fp32 weight tile spills on sm_80 and sm_90), 4 warps."""
    widest = 32 if dtype == torch.float32 else 64
    return {"BLOCK_N": 16, "BLOCK_V": 64 if cuda else 32, "BLOCK_D": min(widest, max(16, _next_pow2(d))), "num_warps": 4}


def exit_conf_few_blocks(n: int, d: int, cuda: bool = True, dtype: torch.dtype = torch.float32) -> dict:
    """Launch parameters of `_exit_conf_few_kernel` for `n` <= FEW_ROWS rows: the rows padded to a power
    of two, 16 vocabulary rows by 512 bytes of D per weight tile (128 fp32 or 256 half elements), 4
    warps; compiled for sm_80 / sm_90 that holds 40-128 registers a thread, no spills (wider tiles or 8
    warps took 200-255 and spilled in bf16: `bench/kernel_resources.py`); smaller tiles in the interpreter."""
    if not cuda:
        return {"BLOCK_N": _next_pow2(n), "BLOCK_V": 16, "BLOCK_D": min(32, max(16, _next_pow2(d))), "num_warps": 4}
    wide = 128 if dtype == torch.float32 else 256
    return {"BLOCK_N": _next_pow2(n), "BLOCK_V": 16, "BLOCK_D": min(wide, max(16, _next_pow2(d))), "num_warps": 4}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pick_backend(backend: str, device: torch.device) -> str:
    """The path to run, triton or torch, for any documented backend value (efficient.kernels._backend),
    except that 'auto' stays on torch on CUDA: on an H200 the kernel was slower than cuBLAS + softmax in
    every measured configuration (one program per row block over the whole vocabulary: up to 540x; split
    over the vocabulary: 3.8-7.7x; BENCHMARKS.md, gpu). The few-rows kernel of a decode step has not
    been timed on a GPU yet; ask for backend='triton' explicitly to run it."""
    return resolve_backend(backend, device, "exit_confidence", cuda_auto="torch")


@torch.library.custom_op("efficient::exit_confidence", mutates_args=())
def _exit_confidence_op(hidden: torch.Tensor, weight: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        if hidden.dtype == torch.float64:
            raise ValueError("exit_confidence: the Triton kernel takes fp32/fp16/bf16; use backend='torch' for fp64")
        return exit_confidence_triton(hidden, weight)
    return exit_confidence_torch(hidden, weight)


@_exit_confidence_op.register_fake
def _(hidden, weight, backend):
    N = hidden.shape[0]
    return hidden.new_empty(N, dtype=torch.promote_types(hidden.dtype, torch.float32)), hidden.new_empty(N, dtype=torch.long)


try:  # let FLOP counters see the projection inside the op (2 flops per MAC)
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.efficient.exit_confidence)
    def _flops(hidden_shape, weight_shape, *args, **kwargs) -> int:
        return 2 * hidden_shape[0] * hidden_shape[1] * weight_shape[0]
except Exception:  # pragma: no cover - older torch without the registry
    pass


def exit_confidence(hidden: torch.Tensor, weight: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(p_max [...] in fp32 (fp64 for fp64 inputs), argmax int64 [...]) of softmax(hidden @ weight.T) for hidden [..., D],
    weight [V, D]. Not differentiable (a decoding-time decision)."""
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"exit_confidence: hidden [..., D] and weight [V, D] must share D, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"exit_confidence: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    lead = hidden.shape[:-1]
    kind = _pick_backend(backend, hidden.device)
    if kind == "torch" and not torch.compiler.is_compiling():
        # eager CPU decoding calls this once per token: skip the custom-op dispatch (~10x the math here)
        pmax, arg = exit_confidence_torch(hidden.detach().reshape(-1, hidden.shape[-1]), weight.detach())
        return pmax.reshape(lead), arg.reshape(lead)
    pmax, arg = _exit_confidence_op(hidden.detach().reshape(-1, hidden.shape[-1]), weight.detach(), kind)
    return pmax.reshape(lead), arg.reshape(lead)
