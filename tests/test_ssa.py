"""Spiking self-attention kernel with anchor scores: reference identities, custom op, Triton (interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from efficient.kernels import ssa


def spikes(*shape: int, p: float = 0.3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) < p).float()


@pytest.mark.parametrize("anchor", [True, False])
def test_mean_query_score_is_the_column_mean_of_qk(anchor: bool):
    q, k = spikes(2, 3, 4, 11, 8, seed=1), spikes(2, 3, 4, 11, 8, seed=2)
    s, c = ssa.scores_ref(q, k, anchor)
    p = int(anchor)
    a = (q @ k.transpose(-2, -1)).sum(2)  # [T, B, N, N], summed over heads
    torch.testing.assert_close(c, a[:, :, p:, p:].mean(2), rtol=1e-6, atol=0)
    if anchor:
        assert torch.equal(s, a[:, :, 0, 1:])  # the anchor's row of the map
    else:
        assert torch.equal(s, c)


@pytest.mark.parametrize("n, d", [(40, 8), (6, 16)])
def test_both_association_orders_are_bit_identical_on_spikes(n: int, d: int):
    q, k, v = (spikes(2, 2, 3, n, d, seed=i) for i in range(3))
    y = ssa.attention_ref(q, k, v, 0.125)
    assert torch.equal(y, (q @ k.transpose(-2, -1)) @ v * 0.125)
    assert torch.equal(y, q @ (k.transpose(-2, -1) @ v) * 0.125)


@pytest.mark.parametrize("anchor", [True, False])
def test_custom_op_backward_matches_autograd_of_reference(anchor: bool):
    q, k, v = (spikes(2, 2, 2, 9, 8, seed=i).requires_grad_() for i in range(3))
    g = torch.Generator().manual_seed(5)
    y, s, c = ssa.ssa_ref(q, k, v, 0.125, anchor, True)
    gy, gs, gc = (torch.randn(t.shape, generator=g) for t in (y, s, c))
    ref = torch.autograd.grad((y * gy).sum() + (s * gs).sum() + (c * gc).sum(), (q, k, v))
    y2, s2, c2 = ssa._ssa_op(q, k, v, 0.125, anchor, True, "torch")
    assert torch.equal(y, y2) and torch.equal(s, s2) and torch.equal(c, c2)
    got = torch.autograd.grad((y2 * gy).sum() + (s2 * gs).sum() + (c2 * gc).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if anchor:  # fake impl, schema and autograd registration (slow: once is enough)
        checks = ("test_schema", "test_autograd_registration", "test_faketensor")
        torch.library.opcheck(ssa._ssa_op, (q, k, v, 0.125, anchor, True, "torch"), test_utils=checks)


def test_public_function_shapes_and_errors():
    q = spikes(2, 1, 2, 5, 4)
    y, s, c = ssa.spiking_attention(q, q, q, anchor=True, scores=True, backend="torch")
    assert y.shape == q.shape and s.shape == c.shape == (2, 1, 4)
    assert ssa.spiking_attention(q, q, q, backend="torch")[1] is None
    with pytest.raises(ValueError, match="share a"):
        ssa.spiking_attention(q, q[..., :3, :], q)
    with pytest.raises(ValueError, match="besides the anchor"):
        ssa.spiking_attention(q[..., :1, :], q[..., :1, :], q[..., :1, :], anchor=True, scores=True)


TRITON_SCRIPT = textwrap.dedent(
    """
    import torch
    from efficient.kernels import ssa
    g = torch.Generator().manual_seed(0)
    for T, B, H, N, D in [(1, 2, 2, 9, 16), (2, 1, 1, 40, 8), (1, 1, 1, 17, 32)]:
        for anchor in (True, False):
            q, k, v = ((torch.rand(T, B, H, N, D, generator=g) < 0.3).float().requires_grad_() for _ in range(3))
            y1, s1, c1 = ssa.spiking_attention(q, k, v, 0.125, anchor, True, backend="torch")
            y2, s2, c2 = ssa.spiking_attention(q, k, v, 0.125, anchor, True, backend="triton")
            assert torch.equal(y1, y2), "y"
            assert torch.equal(s1, s2) if anchor else True
            torch.testing.assert_close(c1, c2, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(s1, s2, rtol=1e-6, atol=1e-6)
            gy, gs, gc = (torch.randn(t.shape, generator=g) for t in (y1, s1, c1))
            r1 = torch.autograd.grad((y1 * gy).sum() + (s1 * gs).sum() + (c1 * gc).sum(), (q, k, v))
            r2 = torch.autograd.grad((y2 * gy).sum() + (s2 * gs).sum() + (c2 * gc).sum(), (q, k, v))
            for a, b in zip(r1, r2):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            y3, s3, c3 = ssa.spiking_attention(q, k, v, 0.125, anchor, False, backend="triton")
            assert torch.equal(y3, y1) and s3 is None
            # strided reads: heads split off slices of one fused [T, B, N, 3 H d] tensor (read in place),
            # and a q whose d axis is strided (copied first); y written into a heads-merged buffer
            qkv = (torch.rand(T, B, N, 3 * H * D, generator=g) < 0.3).float()
            qs, ks, vs = (t.reshape(T, B, N, H, D).transpose(2, 3) for t in qkv.split(H * D, -1))
            yr, sr, cr = ssa.ssa_ref(qs, ks, vs, 0.125, anchor, True)
            merged = torch.full((T, B, N, H * D), float("nan"))
            yt, st, ct = ssa.ssa_triton(qs, ks, vs, 0.125, anchor, True, out=merged.view(T, B, N, H, D).transpose(2, 3))
            assert torch.equal(yt, yr) and torch.equal(merged, yr.transpose(2, 3).reshape(T, B, N, H * D)), "strided y"
            torch.testing.assert_close(ct, cr, rtol=1e-6, atol=1e-6)
            qd = qs.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)
            assert qd.stride(-1) != 1
            assert torch.equal(ssa.ssa_triton(qd, ks, vs, 0.125, anchor, False)[0], yr), "strided d"
            try:
                ssa.ssa_triton(qs, ks, vs, 0.125, anchor, False, out=torch.empty(T, B, H, D, N).transpose(-1, -2))
                raise AssertionError("an out with a strided d axis was accepted")
            except ValueError as e:
                assert "unit stride along d" in str(e)
            # the backward kernel against autograd's gradients of the reference, on fused-QKV slices,
            # written into a heads-merged layout
            g5 = torch.randn(T, B, H, N, D, generator=g)
            leaves = [t.detach().clone().requires_grad_() for t in (qs, ks, vs)]
            ref = torch.autograd.grad(ssa.attention_ref(*leaves, 0.125), leaves, g5)
            bufs = [torch.full((T, B, N, H * D), float("nan")) for _ in range(3)]
            views = tuple(b.view(T, B, N, H, D).transpose(2, 3) for b in bufs)
            ssa.ssa_backward_triton(g5, qs, ks, vs, 0.125, out=views)
            for got, want in zip(views, ref):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            try:  # outputs of different layouts are refused
                ssa.ssa_backward_triton(g5, qs, ks, vs, 0.125, out=(views[0], views[1], torch.empty(T, B, H, N, D)))
                raise AssertionError("outputs of different layouts were accepted")
            except ValueError as e:
                assert "one layout" in str(e)
            # the unit op on the Triton backend: heads merged, the same values and gradients
            qm, km, vm = (t.detach().transpose(2, 3).reshape(T, B, N, H * D).requires_grad_() for t in (q, k, v))
            y4, s4, c4 = ssa.spiking_attention_unit(qm, km, vm, H, 0.125, anchor, True, backend="triton")
            assert torch.equal(y4, y1.detach().transpose(2, 3).reshape(T, B, N, H * D)), "unit y"
            torch.testing.assert_close(c4, c1, rtol=1e-6, atol=1e-6)
            r4 = torch.autograd.grad((y4 * gy.transpose(2, 3).reshape(y4.shape)).sum() + (s4 * gs).sum() + (c4 * gc).sum(),
                                     (qm, km, vm))
            for a, b in zip(r4, r1):
                torch.testing.assert_close(a, b.transpose(2, 3).reshape(a.shape), rtol=1e-5, atol=1e-5)
    wide = torch.zeros(1, 1, 1, 4, 2 * ssa.SSA_BWD_MAX_D)
    try:  # a head wider than the kernel's tile: the unit's backward takes torch's bmm, the kernel refuses it
        ssa.ssa_backward_triton(wide, wide, wide, wide, 0.125, out=(wide.clone(), wide.clone(), wide.clone()))
        raise AssertionError("a head dim above SSA_BWD_MAX_D was accepted")
    except ValueError as e:
        assert "head dim" in str(e)
    qw = (torch.rand(1, 2, 5, 2 * ssa.SSA_BWD_MAX_D, generator=g) < 0.5).float().requires_grad_()
    yw, _, _ = ssa.spiking_attention_unit(qw, qw, qw, 1, 0.125, backend="triton")
    (gw,) = torch.autograd.grad(yw.sum(), qw)
    yw0, _, _ = ssa.spiking_attention_unit(qw, qw, qw, 1, 0.125, backend="torch")
    (gw0,) = torch.autograd.grad(yw0.sum(), qw)
    assert torch.equal(yw, yw0)
    torch.testing.assert_close(gw, gw0, rtol=1e-5, atol=1e-5)
    # compiled on the Triton backend, a Spikformer block runs the unit op too, with eager's values
    from efficient.models.spikformer import Block
    torch.manual_seed(0)
    block = Block(32, 2, 2.0, {"tau": 2.0}, kernel_backend="triton")
    xb = (torch.rand(2, 2, 9, 32, generator=g) < 0.3).float() * 2
    calls = []
    unit_impl = ssa._ssa_unit_impl  # what the op runs (the eager path holds its own reference)
    outs = []
    for m in (block, torch.compile(block, fullgraph=True)):
        xx = xb.clone().requires_grad_()
        ssa._ssa_unit_impl = lambda *a: calls.append(1) or unit_impl(*a)
        yb = m(xx)
        ssa._ssa_unit_impl = unit_impl
        outs.append((yb.detach(), torch.autograd.grad(yb.sum(), xx)[0]))
    assert len(calls) == 1, calls  # the compiled graph calls the op
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
    print("TRITON-OK")
    """
)


def test_triton_kernel_matches_reference_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "TRITON-OK" in r.stdout, r.stderr[-3000:]


# The zoo's real per-head shapes: Spikformer-4-384 on CIFAR (N=64 tokens, head dim 32), Spikformer-
# 8-512 on ImageNet (196 patches + the anchor = 197, head dim 64) and N=1024; small T, B, H keep the
# interpreter quick. Every loop runs several row blocks (asserted in the script).
REAL_SHAPE_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from efficient.kernels import ssa
    T, B, H, N, D = (int(a) for a in sys.argv[1:6])
    dtype = getattr(torch, sys.argv[6])
    assert N >= 2 * ssa.ssa_blocks(D)["BLOCK_N"], "the case must span several row blocks"
    g = torch.Generator().manual_seed(N + D)
    t0 = time.perf_counter()
    for anchor in (True, False):
        q, k, v = ((torch.rand(T, B, H, N, D, generator=g) < 0.3).to(dtype) for _ in range(3))
        y, s, c = ssa.ssa_triton(q, k, v, 0.125, anchor, True)
        assert y.dtype == s.dtype == c.dtype == dtype and y.shape == q.shape and s.shape == (T, B, N - anchor)
        y_same, _, _ = ssa.ssa_ref(q, k, v, 0.125, anchor, False)  # the reference in the input dtype
        y32, s32, c32 = ssa.ssa_ref(q.float(), k.float(), v.float(), 0.125, anchor, True)
        assert torch.equal(y, y_same), "y differs from the reference in the input dtype"
        assert torch.equal(y, y32.to(dtype)), "y differs from the fp32 reference"  # fp16 rounds above 2048
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-5)  # fp16: one ulp
        torch.testing.assert_close(c.float(), c32, **tol)
        torch.testing.assert_close(s.float(), s32, **tol)
        if anchor:  # anchor scores are integer sums: exact
            assert torch.equal(s.float(), s32.to(dtype).float())
        y2, _, _ = ssa.ssa_triton(q, k, v, 0.125, anchor, False)
        assert torch.equal(y2, y)
    # the backward kernel over several row blocks, against autograd's fp32 gradients of the reference
    gy = torch.randn(T, B, H, N, D, generator=g).to(dtype)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(ssa.attention_ref(*leaves, 0.125), leaves, gy.float())
    got = tuple(torch.empty(T, B, H, N, D, dtype=dtype) for _ in range(3))
    ssa.ssa_backward_triton(gy, q, k, v, 0.125, out=got)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b, **tol)
    print("TRITON-OK", round(time.perf_counter() - t0, 2))
    """
)


@pytest.mark.parametrize(
    "T, B, H, N, D, dtype",
    [
        (2, 2, 2, 64, 32, "float32"),  # CIFAR Spikformer-4-384
        (2, 1, 2, 64, 32, "float16"),
        (1, 2, 2, 197, 64, "float32"),  # ImageNet Spikformer-8-512, anchor included: 13 query blocks of 16
        (1, 1, 2, 197, 64, "float16"),
    ],
)
def test_triton_kernel_at_real_shapes_in_interpreter(T, B, H, N, D, dtype):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = [str(a) for a in (T, B, H, N, D, dtype)]
    r = subprocess.run([sys.executable, "-c", REAL_SHAPE_SCRIPT, *args], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "TRITON-OK" in r.stdout, r.stderr[-3000:]


def test_block_sizes_do_not_grow_with_n():
    b = ssa.ssa_blocks(64)
    assert b["BLOCK_N"] == 16 and b["BLOCK_D"] == 64 and b["BLOCK_E"] == 64
    assert ssa.ssa_blocks(32)["BLOCK_N"] == 32
    assert ssa.ssa_blocks(128)["BLOCK_E"] == 64  # wider heads split over output-column programs


def test_bad_input_names_the_argument():
    q = spikes(2, 1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"k must be 5-D \[T, B, H, N, d\].*got 4-D"):
        ssa.spiking_attention(q, q[:, :, 0], q)
    with pytest.raises(ValueError, match=r"q must be 5-D"):
        ssa.spiking_attention(q.flatten(2, 3), q, q)
    with pytest.raises(ValueError, match=r"v has 1 heads but q has 2"):
        ssa.spiking_attention(q, q, q[:, :, :1])
    with pytest.raises(ValueError, match=r"k has shape \[2, 1, 2, 4, 4\] but q has \[2, 1, 2, 5, 4\]"):
        ssa.spiking_attention(q, q[..., :4, :], q)
    with pytest.raises(ValueError, match=r"v is torch.float16 but q is torch.float32"):
        ssa.spiking_attention(q, q, q.half())
    with pytest.raises(ValueError, match=r"q must be a floating tensor"):
        ssa.spiking_attention(q.bool(), q.bool(), q.bool())


# ------------------------------------------------------------------ the attention as one unit op


def _heads_split(x: torch.Tensor, heads: int) -> torch.Tensor:
    T, B, N, C = x.shape
    return x.reshape(T, B, N, heads, C // heads).transpose(2, 3)


def _plain_unit(qkv: torch.Tensor, heads: int, anchor: bool, scores: bool):
    """What the zoo ran before the unit op: heads split off three slices, the plain attention, heads merged."""
    C = qkv.shape[-1] // 3
    q, k, v = (_heads_split(t, heads) for t in qkv.split(C, -1))
    y, s, c = ssa.spiking_attention(q, k, v, 0.125, anchor, scores, backend="torch")
    T, B, H, N, d = y.shape
    return y.transpose(2, 3).reshape(T, B, N, H * d), s, c


@pytest.mark.parametrize("n, heads, d", [(64, 12, 32), (9, 2, 16), (40, 3, 8)])  # N > d and N <= d
def test_unit_op_equals_the_plain_path_bit_for_bit(n: int, heads: int, d: int):
    """Output and the gradients of Q, K, V (slices of one fused-QKV tensor, as the zoo gives them) equal
    the plain path's bit for bit: the same matmuls on the same operands."""
    qkv = spikes(2, 3, n, 3 * heads * d, seed=n).requires_grad_()
    gy = torch.randn(2, 3, n, heads * d, generator=torch.Generator().manual_seed(7))
    y0, _, _ = _plain_unit(qkv, heads, False, False)
    (g0,) = torch.autograd.grad(y0, qkv, gy)
    y1, s1, c1 = ssa.spiking_attention_unit(*qkv.split(heads * d, -1), heads, 0.125, backend="torch")
    (g1,) = torch.autograd.grad(y1, qkv, gy)
    assert s1 is None and c1 is None and y1.shape == (2, 3, n, heads * d)
    assert torch.equal(y1, y0) and torch.equal(g1, g0)


@pytest.mark.parametrize("scores", [False, True], ids=["plain", "scores"])
@pytest.mark.parametrize("n, heads, d", [(64, 12, 32), (12, 2, 16)])  # N > d and N <= d
def test_unit_op_backward_holds_at_most_four_tensors_of_q_size_and_the_small_products(n: int, heads: int, d: int,
                                                                                      scores: bool):
    """The CPU backward drops each operand copy after the last product that reads it and merges the
    gradients one at a time: beside its inputs at most four tensors of Q's size and the two small
    products ([d, d] per head where N > d, [N, N] otherwise), where the heads-split copies of the gradient
    and of Q, K^T, V, the three products and their merged copies were all alive at its end (ten and the
    small ones): a recomputed spiking transformer's step peak lies in this backward."""
    from efficient.memory.measure import step_peak_bytes

    T, B = 4, 8
    q, k, v = (spikes(T, B, n, heads * d, seed=i) for i in range(3))
    gy = torch.randn(T, B, n, heads * d, generator=torch.Generator().manual_seed(7))
    gs = gc = torch.randn(T, B, n, generator=torch.Generator().manual_seed(8)) if scores else None
    out = []
    peak = step_peak_bytes(lambda: out.append(ssa._ssa_unit_backward_impl(gy, gs, gc, q, k, v, heads, 0.125, False,
                                                                          "torch")))
    size = q.numel() * q.element_size()
    small = size * min(n, d) / max(n, d)
    row = size / n  # the scores' gradient terms are a few rows of one token per sample
    assert 3 * size <= peak <= 4 * size + 2 * small + 4 * row, peak / size  # the three gradients it returns, at least
    # and they are the plain path's, bit for bit
    qkv = torch.cat([q, k, v], -1).requires_grad_()
    outs = _plain_unit(qkv, heads, False, scores)
    (g0,) = torch.autograd.grad(outs[:3 if scores else 1], qkv, [gy, gs, gc] if scores else [gy])
    assert torch.equal(torch.cat(out[0], -1), g0)


@pytest.mark.parametrize("anchor", [True, False])
@pytest.mark.parametrize("n, heads, d", [(11, 2, 8), (64, 12, 32), (5, 3, 16)])
def test_unit_op_scores_and_their_gradients_equal_the_plain_path_bit_for_bit(anchor: bool, n: int, heads: int,
                                                                              d: int):
    """STATA's scoring blocks train through the unit: its score gradients are autograd's of the plain
    path's bmms, summed in the same order, so eager training keeps its trajectory bit for bit."""
    qkv = spikes(2, 2, n, 3 * heads * d, seed=3).requires_grad_()
    g = torch.Generator().manual_seed(8)
    outs0 = _plain_unit(qkv, heads, anchor, True)
    outs1 = ssa.spiking_attention_unit(*qkv.split(heads * d, -1), heads, 0.125, anchor, True, backend="torch")
    weights = [torch.randn(t.shape, generator=g) for t in outs0]
    for a, b in zip(outs0, outs1):
        assert torch.equal(a, b)
    (g0,) = torch.autograd.grad(sum((t * w).sum() for t, w in zip(outs0, weights)), qkv, retain_graph=True)
    (g1,) = torch.autograd.grad(sum((t * w).sum() for t, w in zip(outs1, weights)), qkv, retain_graph=True)
    assert torch.equal(g1, g0)
    # only the scores reach Q and K (gradients that arrive expanded, as a sum's do)
    (gs,) = torch.autograd.grad(outs1[1].sum() + outs1[2].sum(), qkv, retain_graph=True)
    (gs0,) = torch.autograd.grad(outs0[1].sum() + outs0[2].sum(), qkv, retain_graph=True)
    assert torch.equal(gs, gs0)
    # one score alone: the other's gradient is None in the unit
    (g1,) = torch.autograd.grad((outs1[2] * weights[2]).sum(), qkv)
    (g0,) = torch.autograd.grad((outs0[2] * weights[2]).sum(), qkv)
    assert torch.equal(g1, g0)


@pytest.mark.parametrize("anchor", [True, False])
def test_scores_are_the_einsum_of_their_definition(anchor: bool):
    """`scores_ref`'s written-out bmm is the einsum of the module docstring, values and gradients."""
    q, k = (spikes(2, 3, 4, 9, 8, seed=i).requires_grad_() for i in (1, 2))
    s, c = ssa.scores_ref(q, k, anchor)
    p = int(anchor)
    c0 = torch.einsum("tbhd,tbhmd->tbm", q[..., p:, :].mean(-2), k[..., p:, :])
    s0 = torch.einsum("tbhd,tbhmd->tbm", q[..., 0, :], k[..., p:, :]) if anchor else c0
    torch.testing.assert_close(c, c0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, s0, rtol=1e-6, atol=1e-6)
    w = torch.randn(c.shape, generator=torch.Generator().manual_seed(0))
    got = torch.autograd.grad(((s + c) * w).sum(), (q, k))
    ref = torch.autograd.grad(((s0 + c0) * w).sum(), (q, k))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_unit_op_flops_are_the_plain_paths_plus_the_rerun_product():
    """FlopCounterMode sees the unit op's matmuls: forward as the plain path's, backward one product more
    (it reruns K^T V rather than keeping it)."""
    from torch.utils.flop_counter import FlopCounterMode

    heads, d, n = 4, 8, 20
    qkv = spikes(2, 2, n, 3 * heads * d, seed=4).requires_grad_()

    def count(fn):
        with FlopCounterMode(display=False) as fwd:
            y = fn()
        with FlopCounterMode(display=False) as bwd:
            y.sum().backward()
        return fwd.get_total_flops(), bwd.get_total_flops()

    plain = count(lambda: _plain_unit(qkv, heads, False, False)[0])
    unit = count(lambda: ssa.spiking_attention_unit(*qkv.split(heads * d, -1), heads, 0.125, backend="torch")[0])
    product = 2 * 2 * 2 * n * heads * d * d  # one [n, d] x [d, d] product over T, B and the heads
    assert plain == (2 * product, 4 * product)
    assert unit == (2 * product, 5 * product)


def test_the_zoo_attention_runs_as_one_op_unless_something_watches():
    """An eager Spikformer block dispatches the unit op (one each way); a profiler's global hooks see the
    plain matmuls instead; both give the same output and gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from efficient.models.spikformer import Block

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    block = Block(32, 4, 2.0, {"tau": 2.0})
    x = (spikes(2, 2, 9, 32, seed=5) * 2).requires_grad_()

    def run():
        with Names() as mode:
            y = block(x)
            (gx,) = torch.autograd.grad(y.sum(), x)
        return y, gx, mode.names

    y1, g1, names = run()
    assert names.count("ssa_unit.default") == 1 and names.count("ssa_unit_backward.default") == 1
    assert "bmm.default" not in names
    hook = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        y0, g0, names0 = run()
    finally:
        hook.remove()
    assert "ssa_unit.default" not in names0 and "bmm.default" in names0
    assert torch.equal(y1, y0) and torch.equal(g1, g0)
    # STATA's scores on the torch backend: the unit too (its score gradients are the plain path's)
    q, k, v = block.attn.qkv(x, split=False)
    with Names() as mode:
        block.attn.attend(q, k, v, anchor=True, scores=True)
    assert "ssa_unit.default" in mode.names and "bmm.default" not in mode.names


def test_unit_op_bad_input_names_the_argument():
    q = spikes(2, 1, 5, 8)
    with pytest.raises(ValueError, match=r"k must be 4-D \[T, B, N, H\*d\] \(heads merged\), got 5-D"):
        ssa.spiking_attention_unit(q, q[..., None], q, 2)
    with pytest.raises(ValueError, match=r"heads must be a positive int dividing the 8 channels of q, got 3"):
        ssa.spiking_attention_unit(q, q, q, 3)
    with pytest.raises(ValueError, match=r"v has shape \[2, 1, 4, 8\] but q has \[2, 1, 5, 8\]"):
        ssa.spiking_attention_unit(q, q, q[:, :, :4], 2)
    with pytest.raises(ValueError, match=r"k is torch.float16 but q is torch.float32"):
        ssa.spiking_attention_unit(q, q.half(), q, 2)
    with pytest.raises(ValueError, match="besides the anchor"):
        ssa.spiking_attention_unit(q[:, :, :1], q[:, :, :1], q[:, :, :1], 2, anchor=True, scores=True)
