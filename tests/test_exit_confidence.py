"""exit_confidence kernel: p_max / argmax vs softmax of the full logits (Triton under
TRITON_INTERPRET=1 in a subprocess, so the interpreter never leaks into other tests)."""

from __future__ import annotations


import pytest
import torch

from efficient.kernels.exit_confidence import exit_confidence, exit_confidence_reference, exit_confidence_torch

# (N, D, V): vocab sizes that are not multiples of the 32-wide vocab tile, N not a multiple of 16; N <= 4
# (a decode step's rows) runs the few-rows kernel, N = 3 padded to 4 rows, D not a multiple of its tile
CASES = [(1, 32, 256), (19, 48, 301), (5, 16, 97), (3, 40, 101), (4, 72, 130), (2, 16, 33)]

_INTERP = r"""
import json, sys, torch
from efficient.kernels.exit_confidence import exit_confidence, exit_confidence_reference
out = []
for N, D, V in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(N * 1000 + V)
    h = torch.randn(N, D, generator=g) / D**0.5
    w = torch.randn(V, D, generator=g) * 3
    p, a = exit_confidence(h, w, backend="triton")
    pr, ar = exit_confidence_reference(h, w)
    out.append({"perr": float((p - pr).abs().max()), "arg_equal": bool((a == ar).all()), "pmin": float(pr.min()), "pmax": float(pr.max()),
                "dtypes": [str(p.dtype), str(a.dtype)]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    from _interpreter import run_interpreted

    return run_interpreted(_INTERP, CASES)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_triton_matches_reference(interpreted, i):
    res = interpreted[i]
    assert res["perr"] <= 1e-6 and res["arg_equal"]
    assert res["dtypes"] == ["torch.float32", "torch.int64"]
    if CASES[i][0] > 1:
        assert res["pmin"] < 0.9 * res["pmax"]  # a spread of confidences, not all saturated


@pytest.mark.parametrize("N,D,V", CASES)
@pytest.mark.parametrize("chunk", [7, 64, 4096])
def test_torch_path_matches_reference(N, D, V, chunk):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(N, D, generator=g) / D**0.5, torch.randn(V, D, generator=g) * 3
    p, a = exit_confidence_torch(h, w, chunk=chunk)
    pr, ar = exit_confidence_reference(h, w)
    torch.testing.assert_close(p, pr, atol=1e-6, rtol=0)
    assert torch.equal(a, ar)


def test_bf16_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 3, 32, generator=g) / 32**0.5, torch.randn(200, 32, generator=g) * 3
    p, a = exit_confidence(h.bfloat16(), w.bfloat16(), backend="torch")
    pr, ar = exit_confidence_reference(h.bfloat16().reshape(-1, 32), w.bfloat16())
    assert p.shape == a.shape == (2, 3) and p.dtype == torch.float32
    torch.testing.assert_close(p.reshape(-1), pr, atol=2e-2, rtol=0)  # bf16 logits round at ~3 digits
    pf, _ = exit_confidence_reference(h.reshape(-1, 32), w)
    torch.testing.assert_close(p.reshape(-1), pf, atol=5e-2, rtol=0)


def test_fp64_and_custom_op_registration():
    h, w = torch.randn(4, 8, dtype=torch.double), torch.randn(10, 8, dtype=torch.double)
    p, a = exit_confidence(h, w)
    pr, ar = exit_confidence_reference(h, w)
    assert p.dtype == torch.double and torch.allclose(p, pr, atol=1e-12) and torch.equal(a, ar)
    torch.library.opcheck(torch.ops.efficient.exit_confidence, (h.float(), w.float(), "torch"), test_utils=("test_schema", "test_faketensor"))


def test_bad_input():
    with pytest.raises(ValueError, match="share D"):
        exit_confidence(torch.randn(2, 8), torch.randn(10, 9))
    with pytest.raises(ValueError, match="share a dtype"):
        exit_confidence(torch.randn(2, 8), torch.randn(10, 8).double())
    with pytest.raises(ValueError, match="backend must be one of"):
        exit_confidence(torch.randn(2, 8), torch.randn(10, 8), backend="cuda")
    with pytest.raises(ValueError, match="fp64"):
        exit_confidence(torch.randn(2, 8).double(), torch.randn(10, 8).double(), backend="triton")


# ee-gpt-small: D=512 spans several D tiles (32 wide for fp32, 64 for half), V=300 several vocab
# tiles, N=20 two row blocks; N=3, a decode step's rows, the few-rows kernel
REAL_D = r"""
import json, sys, torch
from efficient.kernels.exit_confidence import (FEW_ROWS, exit_confidence, exit_confidence_reference, exit_conf_blocks,
                                               exit_conf_few_blocks)
N, D, V, dtype = json.loads(sys.argv[1])
dt = getattr(torch, dtype)
b = exit_conf_few_blocks(N, D, cuda=False, dtype=dt) if N <= FEW_ROWS else exit_conf_blocks(D, cuda=False, dtype=dt)
assert D >= 8 * b["BLOCK_D"] and V >= 4 * b["BLOCK_V"] and (N > b["BLOCK_N"] or N <= FEW_ROWS)
g = torch.Generator().manual_seed(D + V)
h = (torch.randn(N, D, generator=g) / D**0.5).to(dt)
w = (torch.randn(V, D, generator=g) * 3).to(dt)
p, a = exit_confidence(h, w, backend="triton")
pr, ar = exit_confidence_reference(h, w)
print(json.dumps({"perr": float((p - pr).abs().max()), "arg_equal": bool((a == ar).all()), "spread": float(pr.max() - pr.min()),
                  "dtypes": [str(p.dtype), str(a.dtype)]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("n, dtype", [(20, "float32"), (20, "float16"), (3, "float16")])
def test_triton_at_d512_in_interpreter(n, dtype):
    pytest.importorskip("triton")
    from _interpreter import run_interpreted

    r = run_interpreted(REAL_D, [n, 512, 300, dtype])
    assert r["arg_equal"] and r["perr"] <= (1e-5 if dtype == "float32" else 1e-3), r
    assert r["spread"] > 0.1 and r["dtypes"] == ["torch.float32", "torch.int64"]
