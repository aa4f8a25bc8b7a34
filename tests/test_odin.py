"""ODIN two-head reward model: head normalisation, the disentangling terms, and the length shift."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from efficient.data.preferences import synthetic_prefs
from efficient.errors import ConfigError
from efficient.objectives.odin import ODIN, last_hidden, normalised_heads, odin_terms, pearson


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: thread hand-offs cost more than the math


class BagLM(nn.Module):
    """Causal running mean of byte embeddings: the hidden state at t summarises tokens <= t."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(256, d)
        self.head = nn.Linear(d, 256)

    def forward_features(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        return e.cumsum(1) / torch.arange(1, ids.shape[1] + 1, device=ids.device)[None, :, None]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(ids))


def test_pearson_matches_numpy():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, generator=g), torch.randn(50, generator=g)
    y = y + 0.5 * x
    assert pearson(x, y).item() == pytest.approx(np.corrcoef(x.numpy(), y.numpy())[0, 1], abs=1e-5)


def test_heads_are_centred_unit_vectors_and_orthogonal_heads_cost_nothing():
    w = normalised_heads(torch.randn(2, 8) + 3)
    torch.testing.assert_close(w.mean(-1), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(2))
    ortho = normalised_heads(torch.tensor([[1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 2.0, -2.0]]))
    lengths = torch.arange(10.0)
    t = odin_terms(torch.randn(10), 3 * lengths + 1, lengths, ortho)
    assert t["ortho"].item() == 0.0


def test_length_term_vanishes_for_an_affine_length_head_and_uncorrelated_quality():
    lengths = torch.tensor([3.0, 5, 8, 2, 9, 4, 7, 6])
    r_l = 0.7 * lengths - 2.0  # r_L = a len + b with a > 0: 1 - rho = 0
    r_q = torch.tensor([1.0, -1, 1, -1, -1, 1, -1, 1])
    # remove the length component so rho(r_Q, len) = 0 exactly
    lc = lengths - lengths.mean()
    r_q = r_q - (r_q * lc).sum() / (lc * lc).sum() * lc
    t = odin_terms(r_q, r_l, lengths, normalised_heads(torch.randn(2, 4)))
    assert t["length"].item() == pytest.approx(0.0, abs=1e-5)
    t_bad = odin_terms(r_l, r_q, lengths, normalised_heads(torch.randn(2, 4)))  # heads swapped
    assert t_bad["length"].item() == pytest.approx(2.0, abs=1e-5)


def test_last_hidden_reads_the_last_completion_token():
    m = BagLM()
    data = synthetic_prefs(num_train=4, num_val=4, max_extra_len=4)
    ids, mask = data.collate_fn([data.train[i] for i in range(4)])
    h = last_hidden(m, ids, mask)
    full = m.forward_features(ids)
    for i in range(ids.shape[0]):
        t = int(mask[i].nonzero().max())
        torch.testing.assert_close(h[i], full[i, t])


def _train_rm(heads: int, steps: int = 150) -> tuple[ODIN, nn.Module, dict[str, float]]:
    data = synthetic_prefs(num_train=512, num_val=256, max_extra_len=8, length_bias=1.0, seed=3)
    model = BagLM()
    obj = ODIN(heads=heads)
    obj.setup(model, data, None)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for step in range(steps):
        idx = [(step * 32 + i) % len(data.train) for i in range(32)]
        loss, _ = obj.loss(model, data.collate_fn([data.train[i] for i in idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    ev = obj.evaluate(model, data.collate_fn(list(data.val.records)))
    return obj, model, {k: v / ev["n"] for k, v in ev.items() if k != "n"}


def test_odin_moves_the_length_correlation_to_the_length_head():
    _, _, vanilla = _train_rm(heads=1)
    _, model, odin = _train_rm(heads=2)
    assert vanilla["rho_q"] > 0.3  # a one-head reward model absorbs the annotators' length bias
    assert abs(odin["rho_q"]) < 0.1
    assert odin["rho_l"] > 0.9
    assert odin["acc"] > 0.85  # the quality head still ranks by the true reward
    assert "reward_heads.weight" in model.state_dict()


def test_bad_heads_option():
    with pytest.raises(ConfigError, match="heads"):
        ODIN(heads=3)
