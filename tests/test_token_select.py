"""Token selection / gather kernels: torch reference vs NumPy, invariances, custom op, Triton (interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from efficient.kernels import token_select as ts


def numpy_select(scores: np.ndarray, k: int, eps: float = 1e-6) -> np.ndarray:
    """Independent reference: per-timestep z-scores (population std), mean over t, stable top-k."""
    s = scores.astype(np.float64)
    z = (s - s.mean(-1, keepdims=True)) / (s.std(-1, keepdims=True) + eps)
    z = z.mean(0)
    out = []
    for row in z:
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))  # ties -> lower index
        out.append(sorted(order[:k]))
    return np.array(out)


@pytest.mark.parametrize("T, B, N, k", [(1, 2, 7, 3), (4, 3, 64, 45), (2, 1, 20, 20)])
def test_selection_matches_numpy(T, B, N, k):
    g = torch.Generator().manual_seed(N)
    s = torch.randn(T, B, N, generator=g)
    idx, z = ts.select_tokens(s, k, backend="torch")
    assert idx.dtype == torch.int64 and idx.shape == (B, k)
    np.testing.assert_array_equal(idx.numpy(), numpy_select(s.numpy(), k))


def test_ties_go_to_the_lower_index_and_silent_samples_keep_index_order():
    s = torch.zeros(3, 2, 8)
    s[:, 0, 5] = 1.0  # sample 0: one clear winner, the rest tied
    idx, _ = ts.select_tokens(s, 3, backend="torch")
    assert idx[0].tolist() == [0, 1, 5]
    assert idx[1].tolist() == [0, 1, 2]  # every timestep abstains: index order


def test_selection_is_invariant_to_per_timestep_affine_rescaling_but_raw_sum_is_not():
    g = torch.Generator().manual_seed(3)
    s = torch.randint(0, 9, (4, 5, 30), generator=g).float()
    scale = torch.tensor([1.0, 10.0, 0.1, 3.0])[:, None, None]
    shift = torch.tensor([0.0, -5.0, 7.0, 2.0])[:, None, None]
    s2 = s * scale + shift
    a, _ = ts.select_tokens(s, 12, backend="torch")
    b, _ = ts.select_tokens(s2, 12, backend="torch")
    assert torch.equal(a, b)
    ra, _ = ts.select_tokens(s, 12, standardize=False, backend="torch")
    rb, _ = ts.select_tokens(s2, 12, standardize=False, backend="torch")
    assert not torch.equal(ra, rb)  # raw scores follow whichever timestep is loudest


def test_gather_backward_gives_pruned_tokens_zero_gradient():
    x = torch.randn(2, 3, 10, 4, requires_grad=True)
    idx = torch.tensor([[0, 3, 9], [1, 2, 4], [5, 6, 7]])
    y = ts.gather_tokens(x, idx, backend="torch")
    for b in range(3):
        assert torch.equal(y[:, b], x[:, b, idx[b]])
    y.backward(torch.ones_like(y))
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[torch.arange(3)[:, None], idx] = True
    assert torch.all(x.grad[:, mask] == 1) and torch.all(x.grad[:, ~mask] == 0)


def test_custom_ops_pass_opcheck_and_compile():
    x = torch.randn(2, 3, 10, 4, requires_grad=True)
    s = torch.randn(2, 3, 10)
    idx, _ = ts.select_tokens(s, 4, backend="torch")
    torch.library.opcheck(ts._gather_op, (x, idx, "torch"))
    torch.library.opcheck(ts._select_op, (s, 4, 1e-6, True, "torch"))

    def f(x, s):
        i, _ = ts.select_tokens(s, 4, backend="torch")
        return ts.gather_tokens(x, i, backend="torch")

    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(x, s), f(x, s))


def test_bad_arguments():
    with pytest.raises(ValueError, match="k must be in 1..N"):
        ts.select_tokens(torch.randn(2, 1, 5), 6)
    with pytest.raises(ValueError, match="backend must be one of"):
        ts.select_tokens(torch.randn(2, 1, 5), 2, backend="cuda")
    with pytest.raises(ValueError, match=r"\[T, B, N, D\]"):
        ts.gather_tokens(torch.randn(2, 5, 3), torch.zeros(1, 2, dtype=torch.long))


TRITON_SCRIPT = textwrap.dedent(
    """
    import torch
    from efficient.kernels import token_select as ts
    g = torch.Generator().manual_seed(0)
    for T, B, N, k in [(1, 2, 7, 3), (3, 2, 24, 10), (2, 1, 17, 17)]:
        s = torch.randn(T, B, N, generator=g)
        s_int = torch.randint(0, 4, (T, B, N), generator=g).float()  # spike counts: exact ties
        s_int[:, 0] = 0  # a silent sample
        for sc in (s, s_int):
            for std in (True, False):
                i1, z1 = ts.select_tokens(sc, k, standardize=std, backend="torch")
                i2, z2 = ts.select_tokens(sc, k, standardize=std, backend="triton")
                assert torch.equal(i1, i2), (T, B, N, k, std, i1, i2)
                torch.testing.assert_close(z1, z2, rtol=1e-6, atol=1e-6)
        x = torch.randn(T, B, N, 8, generator=g, requires_grad=True)
        i1, _ = ts.select_tokens(s, k, backend="torch")
        y1 = ts.gather_tokens(x, i1, backend="torch")
        y2 = ts.gather_tokens(x, i1, backend="triton")
        assert torch.equal(y1, y2)
        w = torch.randn(y1.shape, generator=g)
        g1, = torch.autograd.grad((y1 * w).sum(), x)
        g2, = torch.autograd.grad((y2 * w).sum(), x)
        assert torch.equal(g1, g2)
    print("TRITON-OK")
    """
)


def test_triton_kernels_match_reference_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "TRITON-OK" in r.stdout, r.stderr[-3000:]


# Real sizes: ImageNet Spikformer-8-512 ranks 196 patches, and N=1024 spans many rank tiles; N=300
# keeps every token (k == N) with N not a power of two.
REAL_SHAPE_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from efficient.kernels import token_select as ts
    T, B, N, k = (int(a) for a in sys.argv[1:5])
    assert N > 2 * ts.RANK_BLOCK
    g = torch.Generator().manual_seed(N)
    s = torch.randn(T, B, N, generator=g)
    s_int = torch.randint(0, 4, (T, B, N), generator=g).float()  # spike counts: many exact ties
    s_int[:, 0] = 0  # a silent sample keeps its first k tokens
    cases = [(s, True), (s_int, True), (s.half(), True), (s, False)]
    for sc, std in cases:
        i1, z1 = ts.select_tokens_ref(sc, k, standardize=std)
        i2, z2 = ts.select_tokens(sc, k, standardize=std, backend="triton")
        assert i2.dtype == torch.int64 and i2.shape == (B, k)
        assert torch.equal(i1, i2), (sc.dtype, std, (i1 != i2).nonzero()[:5])
        torch.testing.assert_close(z1, z2, rtol=1e-6, atol=1e-6)
    assert torch.equal(ts.select_tokens(s_int, k, backend="triton")[0][0], torch.arange(k))
    print("TRITON-OK")
    """
)


@pytest.mark.parametrize(
    "T, B, N, k", [(4, 1, 196, 98), pytest.param(2, 1, 1024, 700, marks=pytest.mark.slow), (2, 1, 300, 300)]
)
def test_triton_selection_at_real_sizes_in_interpreter(T, B, N, k):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", REAL_SHAPE_SCRIPT, *map(str, (T, B, N, k))], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "TRITON-OK" in r.stdout, r.stderr[-3000:]


REPEATED_INDEX_GRADS = textwrap.dedent(
    """
    import sys
    import torch
    from efficient.kernels import token_select as ts
    backend = BACKEND  # noqa: F821 - set by the caller
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 10, 4, generator=g, requires_grad=True)
    idx = torch.tensor([[1, 1, 3, 1], [0, 9, 0, 5], [2, 2, 2, 2]])
    w = torch.randn(2, 3, 4, 4, generator=g)
    got, = torch.autograd.grad((ts.gather_tokens(x, idx, backend=backend) * w).sum(), x)
    plain = torch.stack([x[:, b, idx[b]] for b in range(3)], 1)  # autograd of plain indexing
    ref, = torch.autograd.grad((plain * w).sum(), x)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ref[:, 2, 2], torch.zeros(2, 4))  # the repeated row really carries a sum
    print("TRITON-OK")
    """
)


def test_gather_backward_accumulates_repeated_indices():
    exec(REPEATED_INDEX_GRADS, {"BACKEND": "torch"})


def test_triton_gather_backward_accumulates_repeated_indices_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", "BACKEND = 'triton'\n" + REPEATED_INDEX_GRADS], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "TRITON-OK" in r.stdout, r.stderr[-3000:]


BF16_GRADS = textwrap.dedent(
    """
    import torch
    from efficient.kernels import token_select as ts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 10, 4, generator=g).bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(10, generator=g)[:6] for _ in range(3)])  # distinct, as STATA keeps
    w = torch.randn(2, 3, 6, 4, generator=g).bfloat16()
    got, = torch.autograd.grad((ts.gather_tokens(x, idx, backend="triton") * w).sum(), x)
    ref, = torch.autograd.grad((ts.gather_tokens(x, idx, backend="torch") * w).sum(), x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    print("TRITON-OK")
    """
)


def test_triton_gather_backward_in_bf16_in_interpreter():
    """bf16 gradients (autocast steps) through the Triton scatter, whose atomics the interpreter
    runs in fp32: the reference's values exactly, for distinct indices."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", BF16_GRADS], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "TRITON-OK" in r.stdout, r.stderr[-3000:]


def test_gather_rejects_out_of_range_indices():
    x = torch.randn(2, 1, 5, 3)
    for bad in (5, -1):
        with pytest.raises(ValueError, match=r"idx must lie in \[0, N=5\)"):
            ts.gather_tokens(x, torch.tensor([[0, bad]]), backend="torch")


def test_bad_input_names_the_argument():
    x, s = torch.randn(2, 3, 10, 4), torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match=r"scores must be 3-D \[T, B, N\].*got 4-D"):
        ts.select_tokens(s[:, :, None], 3)
    with pytest.raises(ValueError, match=r"k must be in 1..N=10 \(k=0 asks for an empty keep set\)"):
        ts.select_tokens(s, 0)
    with pytest.raises(ValueError, match=r"scores must be a floating tensor"):
        ts.select_tokens(s.long(), 3)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5]])
    with pytest.raises(ValueError, match=r"x must be 4-D \[T, B, N, D\], got 3-D"):
        ts.gather_tokens(x[0], idx)
    with pytest.raises(ValueError, match=r"idx must be 2-D \[B, k\].*got 1-D"):
        ts.gather_tokens(x, idx[0])
    with pytest.raises(ValueError, match=r"idx has 2 keep sets but x has batch size B=3"):
        ts.gather_tokens(x, idx[:2])
    with pytest.raises(ValueError, match=r"idx is an empty keep set \(k=0\)"):
        ts.gather_tokens(x, idx[:, :0])
    with pytest.raises(ValueError, match=r"idx must hold integer token indices, got torch.float32"):
        ts.gather_tokens(x, idx.float())
    with pytest.raises(ValueError, match=r"idx must lie in \[0, N=10\); got values from 0 to 10"):
        ts.gather_tokens(x, idx + torch.tensor([[0, 5]]))


def test_out_of_range_indices_are_rejected_in_compiled_graphs():
    """The range check sits in the op's body, which runs on real tensors under torch.compile too."""
    x = torch.randn(2, 1, 5, 3)
    f = torch.compile(lambda x, i: ts.gather_tokens(x, i, backend="torch"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(x, torch.tensor([[0, 4]])), x[:, :, [0, 4]])
    with pytest.raises(Exception, match=r"idx must lie in \[0, N=5\)"):
        f(x, torch.tensor([[0, 5]]))
