"""Spike-driven Transformer with STATA switches: identities, token counts, explicit scores."""

from __future__ import annotations

import pytest
import torch

from efficient.errors import ConfigError
from efficient.zoo import count_params, create, meta_param_count

SMALL = dict(embed_dim=16, num_heads=2, timesteps=2, backend="torch")


def test_sdt_dense_identities():
    dense = create("sdt-2-512", **SMALL)
    off = create("sdt-stata", **SMALL, anchor="off", prune_blocks=[])
    off.load_state_dict(dense.state_dict())
    assert count_params(off) == count_params(dense)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(off.eval()(x), dense.eval()(x))
    keep_all = create("sdt-stata", **SMALL, keep_ratio=1.0).eval()
    no_prune = create("sdt-stata", **SMALL, prune_blocks=[]).eval()
    no_prune.load_state_dict(keep_all.state_dict())
    assert torch.equal(keep_all(x), no_prune(x))


def test_sdt_stata_prunes_65_46_33_and_keeps_scores():
    m = create("sdt-stata", **SMALL).train()
    out = m(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 10)
    assert m.stata_stats["tokens_in"] == [65, 46] and m.stata_stats["tokens_out"] == 33
    assert len(m.stata_scores) == 2 and m.stata_scores[0][0].shape == (2, 3, 64)


def test_sdt_scores_are_the_anchor_row_and_column_mean_of_qk():
    m = create("sdt-stata", **SMALL).eval()
    att = m.blocks[0].attn
    x = torch.randn(2, 2, 65, 16) * 2
    _, s, c = att(x, anchor=True, scores=True)
    xs = att.shortcut_lif(x)
    q, k = att.q(xs), att.k(xs)
    a = q @ k.transpose(-2, -1)  # the N x N map SDSA itself never forms
    assert torch.equal(s, a[:, :, 0, 1:])
    torch.testing.assert_close(c, a[:, :, 1:, 1:].mean(2), rtol=1e-6, atol=0)


def test_sdt_parameter_count_and_bad_input():
    assert round(meta_param_count("sdt-2-512") / 1e6, 2) == 10.23
    with pytest.raises(ConfigError, match="does not fit the SPS stem"):
        create("sdt-stata", **SMALL, img_size=30)
    with pytest.raises(ConfigError, match="at most depth=2"):
        create("sdt-stata", **SMALL, prune_blocks=[3])


def _mlp_step(mlp, x):
    x = x.clone().requires_grad_(True)
    y = mlp(x)
    y.backward(torch.randn_like(y, generator=torch.Generator().manual_seed(1)))
    return y, x.grad, [p.grad.clone() for p in mlp.parameters()], [b.clone() for b in mlp.buffers()]


def test_sdt_mlp_hidden_unit_runs_as_one_op_with_the_separate_calls_values():
    """fc1's Linear -> BatchNorm and lif2 (split across the membrane shortcut's module order) run as
    one fused Linear-BN-LIF op, with the separate calls' spikes, gradients and running statistics."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from efficient.models.neurons import separate_units

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    mlp = create("sdt-2-512", embed_dim=16, num_heads=2, timesteps=2).blocks[0].mlp.train()  # our neuron kernels
    state = {k: v.clone() for k, v in mlp.state_dict().items()}
    x = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(0)) * 2
    with Ops() as ops:
        fused = _mlp_step(mlp, x)
    assert ops.names.count("efficient.linear_bn_lif_forward") == 1 and ops.names.count("efficient.lif_forward") == 1
    mlp.load_state_dict(state)
    mlp.zero_grad(set_to_none=True)
    with separate_units():
        apart = _mlp_step(mlp, x)
    assert torch.equal(fused[0], apart[0])
    torch.testing.assert_close(fused[1], apart[1])
    for a, b in zip(fused[2], apart[2]):
        torch.testing.assert_close(a, b)
    for a, b in zip(fused[3], apart[3]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_sdt_mlp_hook_on_fc1_sees_fc1_called():
    mlp = create("sdt-2-512", embed_dim=16, num_heads=2, timesteps=2).blocks[0].mlp.train()
    seen: list[tuple[int, ...]] = []
    mlp.fc1.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    mlp(torch.randn(2, 3, 5, 16))
    assert seen == [(2, 3, 5, 64)]  # the fused op would have bypassed fc1's forward
