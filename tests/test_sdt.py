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
