"""Spiking self-attention (no softmax) that also emits STATA's token scores in the same pass.

    y = scale * Q K^T V                                   (per t, b, head; Q, K, V binary spikes)
    s(j) = sum_h <q_{h,anchor}, k_{h,j}>                   anchor score of every non-anchor token j
    c(j) = sum_h <mean_{i != anchor} q_{h,i}, k_{h,j}>     column mean of Q K^T over the patch queries

c is exactly the column mean of the full Q K^T map (summed over heads) but costs O(N d), so the
scores need no N x N map. Without an anchor (`anchor=False`) s is c. Layout `[T, B, H, N, d]`.
Parts: torch reference (the spec), a Triton forward kernel, and a `torch.library` custom op with a
fake implementation and an analytic backward (plain torch matmuls). The public function runs the
reference as plain aten ops on the torch backend (so profilers count its matmuls) and the custom op
on the Triton backend. `spiking_attention_unit` is the attention as one op each way with the heads
merged on output (`efficient::ssa_unit`), what the zoo's eager training steps run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from efficient.kernels._backend import eager_call, eager_function, register_flops
from efficient.kernels.token_select import HAS_TRITON, _next_pow2, resolve_backend

if HAS_TRITON:
    import triton
    import triton.language as tl


# ----------------------------------------------------------------------------- torch reference


def attention_ref(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """scale * Q K^T V in the cheaper association order. For spikes every partial sum is an integer,
    so both orders give bit-identical fp32 results (scale is a power of two in Spikformer)."""
    n, d = q.shape[-2:]
    if n > d:
        return q @ (k.transpose(-2, -1) @ v) * scale
    return (q @ k.transpose(-2, -1)) @ v * scale


# The operands are contiguous copies whatever the head count (with one head a reshape could be a strided
# view): a bmm's rounding follows its operands' layout, and memory level `bits` hands bmm contiguous
# copies of spike operands (efficient.memory.spikes), so any other layout would round otherwise there.


def _contraction_rows(a: Tensor) -> Tensor:
    """A query row `[T, B, H, d]` as the `[T B, 1, d H]` left operand of `_score_of` (d major, h minor)."""
    T, B, H, d = a.shape
    return a.permute(0, 1, 3, 2).reshape(T * B, 1, d * H).contiguous()


def _contraction_keys(kp: Tensor) -> Tensor:
    """Keys `[T, B, H, m, d]` as the `[T B, d H, m]` right operand of `_score_of`."""
    T, B, H, m, d = kp.shape
    return kp.permute(0, 1, 4, 2, 3).reshape(T * B, d * H, m).contiguous()


def _score_of(a: Tensor, kp: Tensor) -> Tensor:
    """`einsum("tbhd,tbhmd->tbm", a, kp)` as the one bmm torch's einsum lowers it to (contraction over
    (d, h), d major). Written out so that the unit's backward (`_score_grads`) can run autograd's own
    bmms of this product on the same operands: the same gradients bit for bit, on any torch release."""
    T, B, H, m, d = kp.shape
    return torch.bmm(_contraction_rows(a), _contraction_keys(kp)).view(T, B, m)


def scores_ref(q: Tensor, k: Tensor, anchor: bool) -> tuple[Tensor, Tensor]:
    """(s, c), each `[T, B, N - anchor]`: anchor-query scores and mean-patch-query scores."""
    p = int(anchor)
    kp = k[..., p:, :]
    c = _score_of(q[..., p:, :].mean(-2), kp)
    s = _score_of(q[..., 0, :], kp) if anchor else c
    return s, c


def ssa_ref(q: Tensor, k: Tensor, v: Tensor, scale: float = 0.125, anchor: bool = False, scores: bool = False):
    y = attention_ref(q, k, v, scale)
    if not scores:
        return y, None, None
    s, c = scores_ref(q, k, anchor)
    return y, s, c


# --------------------------------------------------------------------------------- Triton kernel

if HAS_TRITON:

    @triton.jit
    def _rows_tl(ptr, rn, sn, rd, msk):
        """Rows `rn` (stride `sn`) of a head, columns `rd`, as fp32 (masked entries 0)."""
        return tl.load(ptr + rn[:, None] * sn + rd[None, :], mask=msk, other=0.0).to(tl.float32)

    @triton.jit
    def _ssa_fwd_kernel(
        q_ptr, k_ptr, v_ptr, y_ptr, s_ptr, c_ptr, H, N, D, scale,
        sq_tb, sq_h, sq_n, sk_tb, sk_h, sk_n, sv_tb, sv_h, sv_n, sy_tb, sy_h, sy_n,
        P: tl.constexpr, SCORES: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        # program (t*B*H + b*H + h, e): columns [e*BLOCK_E, (e+1)*BLOCK_E) of y for one head, in three
        # passes over fixed-size row blocks so registers and shared memory do not grow with N:
        #   1. (scores only) sum of the patch queries -> mean query; the anchor query (P == 1)
        #   2. over key/value blocks: M[:, cols] += K_blk^T V_blk[:, cols]; scores of the block's keys
        #   3. over query blocks: y_blk[:, cols] = scale * Q_blk M[:, cols]
        # All products run in fp32 with IEEE precision: on binary spikes every partial sum is an
        # integer, so y is bit-identical to the reference. q, k, v and y are `[T B, H, N, d]` views with
        # unit stride along d and any strides s*_tb, s*_h, s*_n: heads split off a `[T, B, N, H d]`
        # tensor, or slices of the fused Q/K/V unit's output, are read in place, and y may be written
        # with its heads merged.
        pid = tl.program_id(0).to(tl.int64)
        e0 = tl.program_id(1) * BLOCK_E
        hh = pid % H
        tb = pid // H
        q_ptr += tb * sq_tb + hh * sq_h
        k_ptr += tb * sk_tb + hh * sk_h
        v_ptr += tb * sv_tb + hh * sv_h
        y_ptr += tb * sy_tb + hh * sy_h
        rb = tl.arange(0, BLOCK_N)
        rd = tl.arange(0, BLOCK_D)
        re = e0 + tl.arange(0, BLOCK_E)
        d_ok = rd < D
        e_ok = re < D
        if SCORES:
            qsum = tl.zeros([BLOCK_D], dtype=tl.float32)
            for n0 in range(P, N, BLOCK_N):
                rn = n0 + rb
                msk = (rn[:, None] < N) & d_ok[None, :]
                qq = _rows_tl(q_ptr, rn, sq_n, rd, msk)
                qsum += tl.sum(qq, 0)
            cnt = tl.zeros([BLOCK_D], dtype=tl.float32) + (N - P)
            qbar = tl.math.div_rn(qsum, cnt)
            if P == 1:
                qa = tl.load(q_ptr + rd, mask=d_ok, other=0.0).to(tl.float32)
            else:
                qa = qbar
            score_base = pid * (N - P) - P
        m = tl.zeros([BLOCK_D, BLOCK_E], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + rb
            rows = rn[:, None] < N
            kk = _rows_tl(k_ptr, rn, sk_n, rd, rows & d_ok[None, :])
            vv = _rows_tl(v_ptr, rn, sv_n, re, rows & e_ok[None, :])
            m += tl.dot(tl.trans(kk), vv, input_precision="ieee")
            if SCORES:
                out = (rn >= P) & (rn < N) & (e0 == 0)  # the first column block writes the scores
                tl.store(c_ptr + score_base + rn, tl.sum(kk * qbar[None, :], 1), mask=out)
                if P == 1:
                    tl.store(s_ptr + score_base + rn, tl.sum(kk * qa[None, :], 1), mask=out)
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + rb
            rows = rn[:, None] < N
            qq = _rows_tl(q_ptr, rn, sq_n, rd, rows & d_ok[None, :])
            y = tl.dot(qq, m, input_precision="ieee") * scale
            tl.store(y_ptr + rn[:, None] * sy_n + re[None, :], y.to(y_ptr.dtype.element_ty), mask=rows & e_ok[None, :])

    @triton.jit
    def _ssa_bwd_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, dq_ptr, dk_ptr, dv_ptr, H, N, D, scale,
        sq_tb, sq_h, sq_n, sk_tb, sk_h, sk_n, sv_tb, sv_h, sv_n, sg_tb, sg_h, sg_n, so_tb, so_h, so_n,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # program t*B*H + b*H + h: the gradients of y = scale * Q (K^T V) for one head, in four passes over
        # fixed-size row blocks, so that one [d, d] fp32 tile is live at a time (registers do not grow
        # with N, and the d = 64 tile does not spill; the row blocks read are as many as with two passes):
        #   1. M = K^T V            2. dQ = scale * G M^T
        #   3. dM = scale * Q^T G   4. dK = V dM^T, dV = K dM
        # Strided reads and writes as the forward's (unit stride along d); dQ, dK, dV share a layout.
        pid = tl.program_id(0).to(tl.int64)
        hh = pid % H
        tb = pid // H
        q_ptr += tb * sq_tb + hh * sq_h
        k_ptr += tb * sk_tb + hh * sk_h
        v_ptr += tb * sv_tb + hh * sv_h
        g_ptr += tb * sg_tb + hh * sg_h
        out = tb * so_tb + hh * so_h
        rb = tl.arange(0, BLOCK_N)
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < D
        m = tl.zeros([BLOCK_D, BLOCK_D], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + rb
            msk = (rn[:, None] < N) & d_ok[None, :]
            kk = _rows_tl(k_ptr, rn, sk_n, rd, msk)
            vv = _rows_tl(v_ptr, rn, sv_n, rd, msk)
            m += tl.dot(tl.trans(kk), vv, input_precision="ieee")
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + rb
            msk = (rn[:, None] < N) & d_ok[None, :]
            gg = _rows_tl(g_ptr, rn, sg_n, rd, msk)
            dq = tl.dot(gg, tl.trans(m), input_precision="ieee") * scale
            tl.store(dq_ptr + out + rn[:, None] * so_n + rd[None, :], dq.to(dq_ptr.dtype.element_ty), mask=msk)
        dm = tl.zeros([BLOCK_D, BLOCK_D], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + rb
            msk = (rn[:, None] < N) & d_ok[None, :]
            qq = _rows_tl(q_ptr, rn, sq_n, rd, msk)
            gg = _rows_tl(g_ptr, rn, sg_n, rd, msk)
            dm += tl.dot(tl.trans(qq), gg, input_precision="ieee")
        dm = dm * scale
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + rb
            msk = (rn[:, None] < N) & d_ok[None, :]
            at = out + rn[:, None] * so_n + rd[None, :]
            vv = _rows_tl(v_ptr, rn, sv_n, rd, msk)
            tl.store(dk_ptr + at, tl.dot(vv, tl.trans(dm), input_precision="ieee").to(dk_ptr.dtype.element_ty), mask=msk)
            kk = _rows_tl(k_ptr, rn, sk_n, rd, msk)
            tl.store(dv_ptr + at, tl.dot(kk, dm, input_precision="ieee").to(dv_ptr.dtype.element_ty), mask=msk)


# the backward kernel holds a [d, d] fp32 tile whole: up to this head dim (wider heads: torch's bmm)
SSA_BWD_MAX_D = 64


def ssa_blocks(d: int) -> dict:
    """Launch parameters of `_ssa_fwd_kernel` for head dim `d`: fixed row blocks (independent of N),
    the whole head dim as the contraction block, at most 64 output columns per program. From head
    dim 64 up: 8 warps and 16-row blocks (4 warps, or 32-row blocks, hold the 64 x 64 fp32 tile and
    the score terms only by spilling on sm_80/sm_90). On spikes every partial sum is an integer, so
    the row block does not change a single output bit."""
    block_d = max(16, _next_pow2(d))
    wide = block_d >= 64
    return {"BLOCK_N": 16 if wide else 32, "BLOCK_D": block_d, "BLOCK_E": min(64, block_d), "num_warps": 8 if wide else 4}


def _kernel_layout(t: Tensor) -> Tensor:
    """`[T, B, H, N, d]` t itself where the kernel reads it in place (unit stride along d, and T and B one
    axis of stride B * stride(B), as in any view of a tensor whose leading axes are T, B), else a copy."""
    T, B = t.shape[:2]
    d_ok = t.stride(4) == 1 or t.shape[4] == 1
    tb_ok = T == 1 or B == 1 or t.stride(0) == B * t.stride(1)
    return t if d_ok and tb_ok else t.contiguous()


def _tb_h_n_strides(t: Tensor) -> tuple[int, int, int]:
    """Strides of the merged T B axis, H and N of a `_kernel_layout` tensor."""
    T, B = t.shape[:2]
    return (t.stride(1) if B > 1 or T == 1 else t.stride(0)), t.stride(2), t.stride(3)


def ssa_triton(q: Tensor, k: Tensor, v: Tensor, scale: float, anchor: bool, scores: bool,
               out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`ssa_ref` by the Triton kernel; q, k, v `[T, B, H, N, d]` in any layout with unit stride along d
    (others are copied); `out`: where y goes (a `[T, B, H, N, d]` view, such as a heads-merged buffer's),
    else a new contiguous tensor."""
    T, B, H, N, D = q.shape
    q, k, v = _kernel_layout(q), _kernel_layout(k), _kernel_layout(v)
    p = int(anchor)
    y = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    m = N - p if scores else 0
    s_h = torch.empty(T, B, H, m, device=q.device, dtype=torch.float32)
    c_h = torch.empty(T, B, H, m, device=q.device, dtype=torch.float32)
    blocks = ssa_blocks(D)
    grid = (T * B * H, triton.cdiv(D, blocks["BLOCK_E"]))
    if _kernel_layout(y) is not y:
        raise ValueError(f"ssa_triton: out must be a [T, B, H, N, d] view with unit stride along d and T, B foldable, "
                         f"got strides {y.stride()}")
    strides = [st for t in (q, k, v, y) for st in _tb_h_n_strides(t)]
    _ssa_fwd_kernel[grid](q, k, v, y, s_h, c_h, H, N, D, scale, *strides, P=p, SCORES=scores, **blocks)
    if not scores:  # empty placeholders in the input dtype, as the fake implementation says
        return y, q.new_empty(0), q.new_empty(0)
    c = c_h.sum(2).to(q.dtype)
    s = s_h.sum(2).to(q.dtype) if anchor else c
    return y, s, c


def ssa_backward_triton(g: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float,
                        out: tuple[Tensor, Tensor, Tensor]) -> None:
    """dQ, dK, dV of y = scale * Q (K^T V) by the Triton kernel, written into `out` (three `[T, B, H, N, d]`
    views of one layout, unit stride along d); g, q, k, v `[T, B, H, N, d]` in any layout with unit stride
    along d (others are copied). Head dims up to `SSA_BWD_MAX_D`."""
    T, B, H, N, D = q.shape
    if D > SSA_BWD_MAX_D:
        raise ValueError(f"ssa_backward_triton: head dim {D} > {SSA_BWD_MAX_D}; use the torch backward")
    g, q, k, v = (_kernel_layout(t) for t in (g, q, k, v))
    dq, dk, dv = out
    if any(_kernel_layout(t) is not t for t in out) or not (dq.stride() == dk.stride() == dv.stride()):
        raise ValueError("ssa_backward_triton: out must be three [T, B, H, N, d] views of one layout with unit "
                         "stride along d")
    strides = [st for t in (q, k, v, g, dq) for st in _tb_h_n_strides(t)]
    _ssa_bwd_kernel[(T * B * H,)](q, k, v, g, dq, dk, dv, H, N, D, scale, *strides, **ssa_bwd_blocks(D))


def ssa_bwd_blocks(d: int) -> dict:
    """Launch parameters of `_ssa_bwd_kernel` for head dim `d`: 16-row blocks (32-row blocks spill the fp32
    head dim 32 case on sm_80), the whole head dim, 8 warps from head dim 64 up."""
    block_d = max(16, _next_pow2(d))
    return {"BLOCK_N": 16, "BLOCK_D": block_d, "num_warps": 8 if block_d >= 64 else 4}


# ------------------------------------------------------------------------------------- custom op


@torch.library.custom_op("efficient::ssa", mutates_args=())
def _ssa_op(q: Tensor, k: Tensor, v: Tensor, scale: float, anchor: bool, scores: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _ssa_impl(q, k, v, scale, anchor, scores, backend)


def _ssa_impl(q: Tensor, k: Tensor, v: Tensor, scale: float, anchor: bool, scores: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    if backend == "triton":
        y, s, c = ssa_triton(q, k, v, scale, anchor, scores)
    else:
        y, s, c = ssa_ref(q, k, v, scale, anchor, scores)
        if not scores:
            s = c = q.new_empty(0)
    # outputs must not alias each other (s is c without an anchor)
    return y, s.clone() if s is c else s, c


@_ssa_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float, anchor: bool, scores: bool, backend: str):
    T, B, H, N, D = q.shape
    m = N - int(anchor)
    shape = (T, B, m) if scores else (0,)
    return q.new_empty(q.shape), q.new_empty(shape), q.new_empty(shape)  # contiguous, as both real paths return y


@torch.library.custom_op("efficient::ssa_backward", mutates_args=())
def _ssa_backward_op(gy: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV `[T, B, H, N, d]` of y = scale * Q (K^T V): what compiled graphs call on the Triton backend."""
    return _attention_grads(gy, q, k, v, scale, backend)


@_ssa_backward_op.register_fake
def _(gy: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


def _attention_grads(gy: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of y = scale * Q (K^T V): the Triton kernel on that backend (head dims up to
    `SSA_BWD_MAX_D`), else torch's matmuls."""
    if backend == "triton" and q.shape[-1] <= SSA_BWD_MAX_D:
        out = tuple(torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
        ssa_backward_triton(gy, q, k, v, scale, out=out)
        return out
    m = k.transpose(-2, -1) @ v  # [.., d, d]
    dm = q.transpose(-2, -1) @ gy * scale
    return gy @ m.transpose(-2, -1) * scale, v @ dm.transpose(-2, -1), k @ dm


def _ssa_setup(ctx, inputs, output) -> None:
    q, k, v, scale, anchor, scores, backend = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scale, ctx.anchor, ctx.scores, ctx.backend = scale, anchor, scores, backend


def _ssa_backward(ctx, gy: Tensor, gs: Tensor | None, gc: Tensor | None):
    """Analytic gradients of y = scale*Q(K^T V) and of the score sums (see module docstring)."""
    q, k, v = ctx.saved_tensors
    scale = ctx.scale
    if ctx.backend == "triton":  # one kernel (an op of its own where a graph is traced)
        grads = _attention_grads if eager_call(gy, op="ssa_backward") else torch.ops.efficient.ssa_backward
        dq, dk, dv = grads(gy, q, k, v, scale, "triton")
    else:
        dq, dk, dv = _attention_grads(gy, q, k, v, scale, "torch")
    if ctx.scores:  # materialized gradients: an unused score's are zeros, which add nothing
        dq, dk = _score_grads(dq, dk, q, k, gs, gc, ctx.anchor)
    return dq, dk, dv, None, None, None, None


_ssa_op.register_autograd(_ssa_backward, setup_context=_ssa_setup)
_EagerSSA = eager_function("_EagerSSA", _ssa_impl, _ssa_setup, _ssa_backward)  # eager calls: no op dispatch


# ------------------------------------------------------------------- the attention as one unit op
# `efficient::ssa_unit` is the attention between Q, K, V with their heads merged, `[T, B, N, H d]` as the
# Q/K/V units give them, and returns y the same way, what the projection reads: forward and backward
# are one op each, where the plain path dispatches some twenty reshapes, copies and matmuls each way. It
# keeps only its inputs (the spikes) and reruns the small product (K^T V, or Q K^T for N <= d) in
# backward. Its matmuls are those torch.matmul forms from the heads-split views (contiguous
# `[T B H, ., .]` copies, then bmm), so on the torch backend the output and every gradient of the
# attention equal the plain path's bit for bit (the scores' gradients to rounding).


def _split(x: Tensor, heads: int) -> Tensor:
    """`[T, B, N, H d]` -> the `[T, B, H, N, d]` view."""
    T, B, N, C = x.shape
    return x.reshape(T, B, N, heads, C // heads).transpose(2, 3)


def _merge(y: Tensor) -> Tensor:
    """`[T, B, H, N, d]` -> `[T, B, N, H d]` (a copy unless y is such a view)."""
    T, B, H, n, d = y.shape
    return y.transpose(2, 3).reshape(T, B, n, H * d)


def _bmm_operands(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The 3-D operands torch.matmul forms from `[T, B, H, N, d]` views: Q and V as `[T B H, N, d]`,
    K^T as `[T B H, d, N]` (copies where the views are strided, as matmul's own reshape makes them)."""
    n, d = q.shape[-2:]
    return q.reshape(-1, n, d), k.transpose(-2, -1).reshape(-1, d, n), v.reshape(-1, n, d)


@torch.library.custom_op("efficient::ssa_unit", mutates_args=())
def _ssa_unit_op(q: Tensor, k: Tensor, v: Tensor, heads: int, scale: float, anchor: bool, scores: bool,
                 backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _ssa_unit_impl(q, k, v, heads, scale, anchor, scores, backend)


def _ssa_unit_impl(q: Tensor, k: Tensor, v: Tensor, heads: int, scale: float, anchor: bool, scores: bool,
                   backend: str) -> tuple[Tensor, Tensor, Tensor]:
    q5, k5, v5 = _split(q, heads), _split(k, heads), _split(v, heads)
    if backend == "triton":  # the kernel reads the heads in place and writes y with its heads merged
        y = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        T, B, N, C = q.shape
        _, s, c = ssa_triton(q5, k5, v5, scale, anchor, scores, out=y.view(T, B, N, heads, C // heads).transpose(2, 3))
        return y, s.clone() if s is c else s, c
    y5, s, c = _ssa_impl(q5, k5, v5, scale, anchor, scores, backend)
    return _merge(y5), s, c


@_ssa_unit_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, heads: int, scale: float, anchor: bool, scores: bool, backend: str):
    T, B, N, C = q.shape
    shape = (T, B, N - int(anchor)) if scores else (0,)
    return q.new_empty(q.shape), q.new_empty(shape), q.new_empty(shape)


@torch.library.custom_op("efficient::ssa_unit_backward", mutates_args=())
def _ssa_unit_backward_op(gy: Tensor, gs: Tensor | None, gc: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                          heads: int, scale: float, anchor: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _ssa_unit_backward_impl(gy, gs, gc, q, k, v, heads, scale, anchor, backend)


def _triton_backward(backend: str, q: Tensor, heads: int) -> bool:
    """Whether the unit's backward runs the Triton kernel: the Triton backend and a head dim it holds."""
    return backend == "triton" and q.shape[-1] // heads <= SSA_BWD_MAX_D


def _ssa_unit_backward_impl(gy: Tensor, gs: Tensor | None, gc: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                            heads: int, scale: float, anchor: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV `[T, B, N, H d]` from y's gradient `gy` (and the scores' `gs`, `gc`, None when they get
    none). On the Triton backend one kernel writes them with their heads merged; otherwise autograd's own
    matmuls of the plain path: y = (Q (K^T V)) * scale for N > d, ((Q K^T) V) * scale otherwise."""
    if _triton_backward(backend, q, heads):
        grads = tuple(torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
        views = tuple(_split(t, heads) for t in grads)
        q5, k5 = _split(q, heads), _split(k, heads)
        ssa_backward_triton(_split(gy, heads), q5, k5, _split(v, heads), scale, out=views)
        if gs is not None or gc is not None:
            _score_grads(views[0], views[1], q5, k5, gs, gc, anchor, inplace=True)
        return grads
    q, k, v = _split(q, heads), _split(k, heads), _split(v, heads)
    T, B, H, n, d = q.shape
    g3 = _split(gy, heads).reshape(-1, n, d).mul_(scale)  # (gy * scale) element for element
    q3, kt3, v3 = _bmm_operands(q, k, v)
    # each operand copy is dropped after the last product that reads it, and each gradient merged one at a
    # time: beside its inputs the backward holds at most four tensors of Q's size and the two small products
    # ([d, d] or [n, n]), where it held ten and them (the attention's backward sets a recomputed spiking
    # transformer step's peak); the same products, so the same bits
    if n > d:
        m3 = torch.bmm(kt3, v3)
        dm3 = q3.transpose(1, 2).bmm(g3)
        del q3
        dq3 = g3.bmm(m3.transpose(1, 2))
        del g3, m3
        dkt3 = dm3.bmm(v3.transpose(1, 2))
        del v3
        dv3 = kt3.transpose(1, 2).bmm(dm3)
        del kt3, dm3
    else:
        a3 = torch.bmm(q3, kt3)
        da3 = g3.bmm(v3.transpose(1, 2))
        del v3
        dv3 = a3.transpose(1, 2).bmm(g3)
        del a3, g3
        dq3 = da3.bmm(kt3.transpose(1, 2))
        del kt3
        dkt3 = q3.transpose(1, 2).bmm(da3)
        del q3, da3
    grads = [dq3.view(q.shape), dkt3.view(T, B, H, d, n).transpose(-2, -1), dv3.view(q.shape)]
    del dq3, dkt3, dv3
    if gs is not None or gc is not None:  # into the products' own tensors, which nothing else holds
        grads[0], grads[1] = _score_grads(grads[0], grads[1], q, k, gs, gc, anchor, inplace=True)
    for i in range(3):
        grads[i] = _merge(grads[i])
    return grads[0], grads[1], grads[2]


def _score_grads(dq: Tensor, dk: Tensor, q: Tensor, k: Tensor, gs: Tensor | None, gc: Tensor | None,
                 anchor: bool, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """dQ, dK `[T, B, H, N, d]` plus the gradients of the anchor and mean-query scores (module docstring);
    `inplace`: added into dq and dk themselves. The bmms, their operands and the order of the sums are
    autograd's for `scores_ref`, so the result equals the plain path's bit for bit: per score
    x = a . kp, da = g kp^T and dkp = a^T g; the two scores' dkp are summed before they reach dK; the
    mean query's gradient is da / n, broadcast over its rows."""
    p = int(anchor)
    kp = k[..., p:, :]
    T, B, H, m, d = kp.shape
    if not anchor and gs is not None:  # s is c: their gradients add
        gc, gs = (gs if gc is None else gc + gs), None
    if not inplace:
        dq, dk = dq.clone(), dk.clone()
    keys = _contraction_keys(kp)
    dkp = None
    # (gradient, query row, whether the row is the mean of the patch queries)
    terms = ([(gc, q[..., p:, :].mean(-2), True)] if gc is not None else []) + (
        [(gs, q[..., 0, :], False)] if gs is not None else [])
    for g, a, mean in terms:
        g3 = g.reshape(T * B, 1, m)
        da = torch.bmm(g3, keys.transpose(1, 2)).view(T, B, d, H).permute(0, 1, 3, 2)
        dk3 = torch.bmm(_contraction_rows(a).transpose(1, 2), g3)
        dkp = dk3 if dkp is None else dkp + dk3
        if mean:
            dq[..., p:, :] += da.unsqueeze(-2) / (q.shape[-2] - p)
        else:
            dq[..., 0, :] += da
    if dkp is not None:
        dk[..., p:, :] += dkp.view(T, B, d, H, m).permute(0, 1, 3, 4, 2)
    return dq, dk


@_ssa_unit_backward_op.register_fake
def _(gy: Tensor, gs: Tensor | None, gc: Tensor | None, q: Tensor, k: Tensor, v: Tensor, heads: int, scale: float,
      anchor: bool, backend: str):
    if _triton_backward(backend, q, heads):  # the kernel writes three contiguous heads-merged tensors
        return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)
    T, B, n, C = q.shape
    d = C // heads
    # dK leaves its matmul as (dK)^T, `[T, B, H, d, N]`; merged back, the heads fold into a strided view
    dk = _merge(q.new_empty(T, B, heads, d, n).transpose(-2, -1))
    return q.new_empty(q.shape), dk, q.new_empty(q.shape)


def _ssa_unit_setup(ctx, inputs, output) -> None:
    q, k, v, heads, scale, anchor, scores, backend = inputs
    ctx.save_for_backward(q, k, v)
    ctx.heads, ctx.scale, ctx.anchor, ctx.scores, ctx.backend = heads, scale, anchor, scores, backend
    ctx.set_materialize_grads(False)


def _ssa_unit_backward(ctx, gy: Tensor | None, gs: Tensor | None, gc: Tensor | None, backward_fn=_ssa_unit_backward_op):
    q, k, v = ctx.saved_tensors
    if gy is None:
        gy = torch.zeros_like(q, memory_format=torch.contiguous_format)
    if not ctx.scores:
        gs = gc = None
    dq, dk, dv = backward_fn(gy.contiguous(), gs, gc, q, k, v, ctx.heads, ctx.scale, ctx.anchor, ctx.backend)
    return dq, dk, dv, None, None, None, None, None


_ssa_unit_op.register_autograd(_ssa_unit_backward, setup_context=_ssa_unit_setup)
_EagerSSAUnit = eager_function(
    "_EagerSSAUnit", _ssa_unit_impl, _ssa_unit_setup,
    lambda ctx, gy, gs, gc: _ssa_unit_backward(ctx, gy, gs, gc, backward_fn=_ssa_unit_backward_impl))


def _one_product(x_shape, heads: int) -> int:
    """Flops of one [n, d] x [d, d] (or [n, d] x [d, n]) product over every head of `[T, B, n, H d]`
    (2 per multiply-add, as bmm counts)."""
    T, B, n, C = x_shape
    return 2 * T * B * n * C * min(n, C // heads)


def _score_flops(x_shape, anchor: bool) -> int:
    """Flops of one score per token: a dot product over the H d channels."""
    T, B, n, C = x_shape
    return 2 * T * B * C * (n - int(anchor))


def _unit_flops(q_shape, k_shape, v_shape, heads, scale, anchor, scores, *args, out_shape=None, **kwargs) -> int:
    return 2 * _one_product(q_shape, heads) + (1 + int(anchor)) * _score_flops(q_shape, anchor) * int(scores)


def _unit_backward_flops(gy_shape, gs_shape, gc_shape, q_shape, k_shape, v_shape, heads, scale, anchor, *args,
                         out_shape=None, **kwargs) -> int:
    # the four products of the plain path's backward and the rerun of K^T V; each score's gradient two more
    score_grads = sum(2 * _score_flops(q_shape, anchor) for g in (gs_shape, gc_shape) if g is not None)
    return 5 * _one_product(q_shape, heads) + score_grads


register_flops((torch.ops.efficient.ssa_unit, _unit_flops),
               (torch.ops.efficient.ssa_unit_backward, _unit_backward_flops))


# ------------------------------------------------------------------------------------ public API


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, merged: bool = False) -> None:
    """Errors that name the argument: rank, heads, shape and dtype of q, k, v, heads split off
    (`[T, B, H, N, d]`) or `merged` (`[T, B, N, H*d]`)."""
    rank, dims, layout = (4, "T, B, N, H*d", "heads merged") if merged else (5, "T, B, H, N, d", "heads split off")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D [{dims}] ({layout}), got {t.dim()}-D shape {list(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor (spikes as 0/1 values), got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if not merged and t.shape[2] != q.shape[2]:
            raise ValueError(f"{name} has {t.shape[2]} heads but q has {q.shape[2]}: q, k, v must share a [{dims}] shape")
        if t.shape != q.shape:
            raise ValueError(f"{name} has shape {list(t.shape)} but q has {list(q.shape)}: q, k, v must share a [{dims}] shape")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} is {t.dtype} but q is {q.dtype}: q, k, v must share a dtype")

def spiking_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float = 0.125, anchor: bool = False, scores: bool = False, backend: str = "auto"
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`(y, s, c)`: attention output `[T, B, H, N, d]` and, if `scores`, the `[T, B, N - anchor]`
    anchor / mean-query scores (None otherwise). `anchor` means token 0 is the anchor."""
    _check_qkv(q, k, v)
    if scores and q.shape[-2] <= int(anchor):
        raise ValueError("scores need at least one token besides the anchor")
    if resolve_backend(backend, q, "ssa") == "torch":
        # plain aten ops: autograd differentiates the reference and op counters see its matmuls
        return ssa_ref(q, k, v, float(scale), bool(anchor), bool(scores))
    y, s, c = (_EagerSSA.apply if eager_call(q, op="ssa") else _ssa_op)(q, k, v, float(scale), bool(anchor), bool(scores), "triton")
    if not scores:
        return y, None, None
    return y, s, c


def spiking_attention_unit(
    q: Tensor, k: Tensor, v: Tensor, heads: int, scale: float = 0.125, anchor: bool = False, scores: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`spiking_attention` on Q, K, V with their `heads` merged, `[T, B, N, H d]`: `(y [T, B, N, H d],
    s, c)`, one op forward and one backward on every backend (`efficient::ssa_unit`)."""
    _check_qkv(q, k, v, merged=True)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or q.shape[-1] % heads:
        raise ValueError(f"heads must be a positive int dividing the {q.shape[-1]} channels of q, got {heads!r}")
    if scores and q.shape[-2] <= int(anchor):
        raise ValueError("scores need at least one token besides the anchor")
    impl = resolve_backend(backend, q, "ssa")
    y, s, c = (_EagerSSAUnit.apply if eager_call(q, op="ssa_unit") else _ssa_unit_op)(
        q, k, v, int(heads), float(scale), bool(anchor), bool(scores), impl)
    if not scores:
        return y, None, None
    return y, s, c
