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


@pytest.mark.parametrize("conf", [False, True])
def test_eager_path_equals_the_custom_op(conf):
    """A plain eager call skips the op's dispatch (`_EagerLinearCE`); the loss and both gradients
    are the op's bit for bit, ignored targets and several chunks included; a dispatch mode sees the op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import efficient.kernels.linear_ce as K

    torch.manual_seed(0)
    h, w = torch.randn(10, 8, requires_grad=True), torch.randn(12, 8, requires_grad=True)
    t = torch.randint(0, 12, (10,))
    t[3] = -100
    args = (h, w, t, -100, conf, 4, "torch", True)
    outs = []
    for fn in (K._EagerLinearCE.apply, torch.ops.efficient.linear_ce):
        loss = fn(*args)[0]
        outs.append((loss, torch.autograd.grad(loss * 1.5, (h, w))))
    (l1, g1), (l2, g2) = outs
    assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        linear_ce(h, w, t, confidence_weighted=conf, chunk_size=4)
    assert "linear_ce.default" in seen.ops


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


def test_bf16_counts_valid_targets_exactly():
    """1001 valid targets: a bf16 count would round to 1000 and scale every gradient by 1.001."""
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(1001, 16, generator=g) / 4).bfloat16().requires_grad_()
    w = torch.randn(64, 16, generator=g).bfloat16()
    t = torch.randint(0, 64, (1001,), generator=g)
    gh, = torch.autograd.grad(linear_ce(h, w, t, chunk_size=256, backend="torch"), h)
    h32 = h.detach().float().requires_grad_()
    rh, = torch.autograd.grad(linear_ce_reference(h32, w.float(), t), h32)
    scale = float((gh.float() * rh).sum() / (rh * rh).sum())  # least-squares gain: rounding noise averages out
    assert abs(scale - 1.0) < 3e-4, scale


def test_out_of_range_targets_are_rejected():
    """Checked in the op's body, before either backend touches a row (the 32k-vocab interpreter run
    checks the Triton backend too)."""
    backend = "torch"
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    for bad in (10, -1, -101):
        with pytest.raises(ValueError, match=rf"class id {bad} at position 1, outside the vocabulary \[0, V=10\)"):
            linear_ce(h, w, torch.tensor([0, bad, -100, 9]), backend=backend)
    linear_ce(h, w, torch.tensor([0, -7, 3, 9]), ignore_index=-7, backend=backend)  # ignore_index itself is fine


def test_target_check_on_an_accelerator_asserts_on_the_device_without_reading_back():
    """On CUDA the check may not make the host wait (a captured CUDA-graph step cannot): it is a device-side
    assert, which on this CPU raises at once; no tensor is read back as a Python bool or number."""
    from torch.overrides import TorchFunctionMode

    from efficient.kernels.linear_ce import _check_targets

    class ReadBacks(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("__bool__", "item", "__int__", "__float__", "tolist", "__index__"):
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    t = torch.tensor([0, 12, -100, 9])
    with ReadBacks() as mode, pytest.raises(RuntimeError, match=r"outside the vocabulary \[0, V=10\) and is not ignore_index=-100"):
        _check_targets(t, t != -100, 10, -100, sync_free=True)
    ok = torch.tensor([0, 3, -100, 9])
    with ReadBacks() as quiet:
        _check_targets(ok, ok != -100, 10, -100, sync_free=True)
    assert mode.names == [] and quiet.names == []
    with ReadBacks() as host:  # the CPU check reads back, and names the position
        with pytest.raises(ValueError, match="class id 12 at position 1"):
            _check_targets(t, t != -100, 10, -100, sync_free=False)
    assert "__bool__" in host.names


@pytest.mark.parametrize("conf", [False, True])
def test_gradients_made_in_backward_equal_those_made_in_forward(conf):
    """grads="backward" keeps only the inputs and runs the chunks again in backward: the loss and both
    gradients of grads="forward" bit for bit (ignored targets, several chunks, a ragged last one)."""
    g = torch.Generator().manual_seed(3)
    h0, w0 = torch.randn(2, 11, 24, generator=g), torch.randn(50, 24, generator=g) * 0.5
    t = torch.randint(0, 50, (2, 11), generator=g)
    t[0, 3] = t[1, 7] = -100
    out = {}
    for mode in ("forward", "backward"):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = linear_ce(h, w, t, confidence_weighted=conf, chunk_size=4, grads=mode)
        (loss * 1.7).backward()
        out[mode] = (loss.detach(), h.grad, w.grad)
    for a, b in zip(out["forward"], out["backward"]):
        assert torch.equal(a, b)
    ref = linear_ce_reference(h0.reshape(-1, 24), w0, t.reshape(-1), confidence_weighted=conf)
    torch.testing.assert_close(out["backward"][0], ref, rtol=1e-6, atol=1e-6)
    # bf16 (the loss's gradient scales bf16 gradients): the same too
    out = {}
    for mode in ("forward", "backward"):
        h, w = h0.bfloat16().requires_grad_(), w0.bfloat16().requires_grad_()
        (linear_ce(h, w, t, confidence_weighted=conf, chunk_size=4, grads=mode) * 1.7).backward()
        out[mode] = (h.grad, w.grad)
    assert all(torch.equal(a, b) for a, b in zip(out["forward"], out["backward"]))


def test_where_the_gradients_are_made_and_what_is_kept():
    """auto: in forward where the [V, D] weight gradient is at most a quarter of the [N, V] logits
    (4 D <= N), else in backward, which keeps nothing but the inputs for it; a bad value is named."""
    from efficient.kernels.linear_ce import grads_in_forward

    assert grads_in_forward(4096, 1024) and not grads_in_forward(4095, 1024)
    assert grads_in_forward(8, 1024, "forward") and not grads_in_forward(10**6, 8, "backward")

    def kept(n: int, d: int) -> int:
        g = torch.Generator().manual_seed(0)
        h, w = torch.randn(n, d, generator=g, requires_grad=True), torch.randn(64, d, generator=g, requires_grad=True)
        own = {h.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
        extra = []

        def pack(x):
            if x.untyped_storage().data_ptr() not in own and x.is_floating_point():
                extra.append(x.numel() * x.element_size())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            linear_ce(h, w, torch.randint(0, 64, (n,), generator=g))
        return sum(extra)

    assert kept(64, 8) >= 64 * 8 * 4  # 4 D <= N: forward's weight gradient (and dh) held for backward
    assert kept(16, 32) == 0  # 4 D > N: nothing beyond the inputs
    with pytest.raises(ValueError, match=r"grads must be one of \('auto', 'forward', 'backward'\), got 'later'"):
        linear_ce(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]), grads="later")


# ee-gpt-small's 32k vocab: many vocab tiles per row (N kept small: the interpreter runs row by row)
REAL_VOCAB = r"""
import json, sys, torch
from efficient.kernels.linear_ce import linear_ce, linear_ce_reference, ce_blocks
N, D, V, dtype, conf = json.loads(sys.argv[1])
dt = getattr(torch, dtype)
assert V >= 8 * ce_blocks(V, cuda=False)["BLOCK_V"]
g = torch.Generator().manual_seed(V)
h = (torch.randn(N, D, generator=g) / D**0.5).to(dt).requires_grad_()
w = torch.randn(V, D, generator=g).to(dt).requires_grad_()
t = torch.randint(0, V, (N,), generator=g)
t[2] = -100
loss = linear_ce(h, w, t, confidence_weighted=conf, chunk_size=2, backend="triton")
gh, gw = torch.autograd.grad(loss, (h, w))
ref = linear_ce(h, w, t, confidence_weighted=conf, chunk_size=2, backend="torch")
th, tw = torch.autograd.grad(ref, (h, w))
try:
    linear_ce(h, w, torch.tensor([0, V, -100]), backend="triton")
    err = None
except ValueError as e:
    err = str(e)
print(json.dumps({"loss": float(loss), "torch": float(ref), "dh": float((gh.float() - th.float()).abs().max()),
                  "dw": float((gw.float() - tw.float()).abs().max()), "scale": float(tw.float().abs().max()),
                  "dtypes": [str(loss.dtype), str(gh.dtype), str(gw.dtype)], "err": err}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype, conf", [("float32", False), ("float16", True)])
def test_triton_at_32k_vocab_in_interpreter(dtype, conf):
    pytest.importorskip("triton")
    from _interpreter import run_interpreted

    r = run_interpreted(REAL_VOCAB, [3, 32, 32000, dtype, conf])
    # the Triton and torch paths share the matmuls and differ only in the fp32 row CE
    assert abs(r["loss"] - r["torch"]) <= 1e-5 * max(1.0, abs(r["torch"])), r
    tol = 1e-6 if dtype == "float32" else 1e-3 * r["scale"]
    assert r["dh"] <= tol and r["dw"] <= tol and r["scale"] > 0, r
    assert r["dtypes"] == ["torch.float32", f"torch.{dtype}", f"torch.{dtype}"]
    assert r["err"] and "class id 32000 at position 1, outside the vocabulary [0, V=32000)" in r["err"]
