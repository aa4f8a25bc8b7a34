"""linear_ce kernel: chunked fused linear cross-entropy vs the full-logits reference, values and
gradients (Triton under TRITON_INTERPRET=1 in a subprocess)."""

from __future__ import annotations


import pytest
import torch

from efficient.kernels.linear_ce import linear_ce, linear_ce_reference

# (N, D, V, chunk, confidence_weighted): chunks that do not divide N, vocab not a multiple of the tile
CASES = [(13, 32, 300, 5, False), (8, 16, 128, 8, True), (6, 24, 77, 4, False)]

_INTERP = r"""
import json, sys, torch
from efficient.kernels.linear_ce import linear_ce, linear_ce_reference
out = []
for N, D, V, chunk, conf in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(N + V)
    h = (torch.randn(N, D, generator=g) / D**0.5).requires_grad_()
    w = torch.randn(V, D, generator=g).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[1] = -100
    loss = linear_ce(h, w, t, confidence_weighted=conf, chunk_size=chunk, backend="triton")
    gh, gw = torch.autograd.grad(loss, (h, w))
    ref = linear_ce_reference(h, w, t, confidence_weighted=conf)
    rh, rw = torch.autograd.grad(ref, (h, w))
    out.append({"loss": float(loss), "ref": float(ref), "dh": float((gh - rh).abs().max()), "dw": float((gw - rw).abs().max()),
                "dh_row1": float(gh[1].abs().max()), "scale": float(rw.abs().max())})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    from _interpreter import run_interpreted

    return run_interpreted(_INTERP, CASES)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_triton_matches_reference(interpreted, i):
    res = interpreted[i]
    assert abs(res["loss"] - res["ref"]) <= 1e-5 * max(1.0, abs(res["ref"]))
    assert res["dh"] <= 1e-6 and res["dw"] <= 1e-6 and res["scale"] > 1e-3
    assert res["dh_row1"] == 0.0  # the ignored target's row gets no gradient


@pytest.mark.parametrize("N,D,V,chunk,conf", CASES)
def test_torch_path_matches_reference(N, D, V, chunk, conf):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g, dtype=torch.double).requires_grad_()
    w = torch.randn(V, D, generator=g, dtype=torch.double).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[0] = -100
    loss = linear_ce(h, w, t, confidence_weighted=conf, chunk_size=chunk, backend="torch")
    ref = linear_ce_reference(h, w, t, confidence_weighted=conf)
    torch.testing.assert_close(loss, ref)
    for a, b in zip(torch.autograd.grad(3 * loss, (h, w)), torch.autograd.grad(3 * ref, (h, w))):
        torch.testing.assert_close(a, b)


def test_leading_dims_bf16_and_no_grad():
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(2, 5, 16, generator=g), torch.randn(50, 16, generator=g)
    t = torch.randint(0, 50, (2, 5), generator=g)
    ref = torch.nn.functional.cross_entropy((h @ w.T).flatten(0, 1), t.flatten())
    torch.testing.assert_close(linear_ce(h, w, t, chunk_size=3), ref)
    torch.testing.assert_close(linear_ce(h.bfloat16(), w.bfloat16(), t), ref, atol=5e-2, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(linear_ce(h.requires_grad_(), w, t), ref)


def test_all_targets_ignored_is_zero():
    h = torch.randn(4, 8, requires_grad=True)
    loss = linear_ce(h, torch.randn(10, 8), torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().sum() == 0


def test_custom_op_registration():
    h, w, t = torch.randn(6, 8), torch.randn(10, 8), torch.randint(0, 10, (6,))
    torch.library.opcheck(torch.ops.efficient.linear_ce, (h, w, t, -100, False, 4, "torch", True), test_utils=("test_schema", "test_faketensor"))


def test_bad_input():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="share D"):
        linear_ce(h, torch.randn(10, 9), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="target shape"):
        linear_ce(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer class ids"):
        linear_ce(h, w, torch.zeros(4))
    with pytest.raises(ValueError, match="chunk_size"):
        linear_ce(h, w, torch.zeros(4, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        linear_ce(h, w, torch.zeros(4, dtype=torch.long), backend="liger")
