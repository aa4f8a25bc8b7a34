"""A recomputed region's Linear of spikes keeps them as bits for its backward (`efficient.memory.region_linear`):
Linear's values and gradients, one bit per spike kept, and the path taken where SDT's units rerun."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from efficient import memory
from efficient.kernels import bn_lif
from efficient.memory import region_linear as rl


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """fn()'s output and the bytes autograd saved for its backward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("given", [False, True], ids=["computed", "kept-output"])
def test_a_linear_of_spikes_keeps_bits_and_has_linears_gradients(given: bool, monkeypatch) -> None:
    """`_BitsInputLinear`: the output and the input's and bias's gradients of F.linear bit for bit, the weight's
    within rounding (its sum over rows taken by chunks: 4 here, the last short); autograd keeps the spikes
    at one bit each beside the weight, where F.linear keeps them in fp32. With the output kept from the
    region's forward (`z`), that output is returned and nothing is multiplied in forward."""
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 7 * 48)  # 7 rows of 48 a chunk: 26 rows in 4 chunks
    g = torch.Generator().manual_seed(0)
    x0 = (torch.rand(26, 48, generator=g) < 0.3).float()
    w0, b0 = torch.randn(20, 48, generator=g), torch.randn(20, generator=g)
    gout = torch.randn(26, 20, generator=g)

    def run(bits: bool):
        x, w, b = x0.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
        if bits:
            z = F.linear(x0, w0, b0) if given else None
            y, saved = _saved_bytes(lambda: rl._BitsInputLinear.apply(x, w, b, z))
            if given:
                assert y.data_ptr() == z.data_ptr()  # the kept output itself, no matmul
        else:
            y, saved = _saved_bytes(lambda: F.linear(x, w, b))
        y.backward(gout)
        return y.detach(), x.grad, w.grad, b.grad, saved

    ref, bits = run(False), run(True)
    assert torch.equal(bits[0], ref[0]) and torch.equal(bits[1], ref[1]) and torch.equal(bits[3], ref[3])
    torch.testing.assert_close(bits[2], ref[2], rtol=1e-6, atol=1e-6)
    assert ref[4] == x0.numel() * 4 + w0.numel() * 4
    assert bits[4] == x0.numel() // 8 + w0.numel() * 4, bits[4]


def test_region_linear_keeps_bits_only_in_a_recorded_region_call() -> None:
    """Outside a region, without `spikes`, under autocast, or for rows that do not fill whole bytes, the
    Linear runs as itself (its fp32 input kept)."""
    from efficient.models.replay import region_state

    lin = torch.nn.Linear(16, 4)
    x = (torch.rand(6, 16) < 0.5).float().requires_grad_()

    def grad_fn(y: torch.Tensor) -> str:
        return type(y.grad_fn).__name__

    assert grad_fn(rl.region_linear(lin, x, spikes=True)) == "AddmmBackward0"  # outside a region
    region_state.depth = getattr(region_state, "depth", 0) + 1
    try:
        assert grad_fn(rl.region_linear(lin, x, spikes=True)) == "_BitsInputLinearBackward"
        assert grad_fn(rl.region_linear(lin, x)) == "AddmmBackward0"
        with torch.autocast("cpu", torch.bfloat16):
            assert grad_fn(rl.region_linear(lin, x, spikes=True)) != "_BitsInputLinearBackward"
        odd = torch.nn.Linear(12, 4)
        assert grad_fn(rl.region_linear(odd, x[:, :12], spikes=True)) == "AddmmBackward0"
        with torch.no_grad():
            assert rl.region_linear(lin, x, spikes=True).grad_fn is None
    finally:
        region_state.depth -= 1


def test_sdt_reruns_keep_the_spikes_of_their_plain_linears_as_bits(monkeypatch) -> None:
    """At level recompute, SDT's reruns keep the spikes their plain Linears read (the MLP's hidden spikes, the
    attention's gated Q) as bits: each rerun's two such Linears take the bits path, and the gradients and
    running statistics are the fp32 path's within rounding (and `none`'s). (At full size this takes the
    hidden spikes, four times the stream's width, off the MLP rerun's peak: BENCHMARKS.md `## memory`.)"""
    from efficient.zoo import create

    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 1 << 14)  # chunks as small as this model makes a full size's
    torch.manual_seed(0)
    base = create("sdt-2-512", embed_dim=64, depth=1, num_heads=2, img_size=32, mlp_ratio=4).train()
    x, y = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    calls = {"forward": 0, "backward": 0}
    forward, backward = rl._BitsInputLinear.forward, rl._BitsInputLinear.backward

    def counted(key, fn):
        def run(ctx, *args):
            calls[key] += 1
            return fn(ctx, *args)
        return staticmethod(run)

    def step(model) -> tuple[dict, dict]:
        F.cross_entropy(model(x), y).backward()
        return ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                copy.deepcopy(model.state_dict()))

    none = step(copy.deepcopy(base))
    monkeypatch.setattr(rl._BitsInputLinear, "forward", counted("forward", forward))
    monkeypatch.setattr(rl._BitsInputLinear, "backward", counted("backward", backward))
    bits_model = copy.deepcopy(base)
    memory.optimize(bits_model, "recompute")
    bits = step(bits_model)
    assert calls == {"forward": 2, "backward": 2}, calls  # the MLP's second Linear and the projection, rerun once
    monkeypatch.setattr(rl, "_bits_rerun", lambda x, linear: False)
    dense_model = copy.deepcopy(base)
    memory.optimize(dense_model, "recompute")
    dense = step(dense_model)
    assert calls["backward"] == 2
    for k in none[0]:
        torch.testing.assert_close(bits[0][k], dense[0][k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bits[0][k], none[0][k], rtol=1e-4, atol=1e-6)
    for k in none[1]:
        assert torch.equal(bits[1][k], dense[1][k]), k
