"""InterLUDE: interleaving, embedding fusion, delta consistency and the FixMatch special case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from efficient.data.ssl import ssl_digits
from efficient.errors import ConfigError
from efficient.models.mlp import MLP
from efficient.objectives.interlude import InterLUDE, deinterleave, delta_consistency, fixmatch_unlabeled, fuse, interleave


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: thread hand-offs cost more than the math


def _batch(B: int = 3, mu: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
    return r(B, 1, 4, 4), r(B, 1, 4, 4), torch.randint(0, 5, (B,), generator=g), r(B, mu, 1, 4, 4), r(B, mu, 1, 4, 4)


def test_interleave_roundtrip_and_neighbours():
    xl_w, xl_s, _, u_w, u_s = _batch()
    x = interleave(xl_w, xl_s, u_w, u_s)
    assert x.shape[0] == 3 * 2 * 3
    assert torch.equal(x[0], xl_w[0]) and torch.equal(x[1], u_w[0, 0]) and torch.equal(x[3], xl_s[0])
    back = deinterleave(x, mu=2)
    for a, b in zip(back, (xl_w, xl_s, u_w, u_s)):
        assert torch.equal(a, b)


def test_fusion_is_the_roll_formula_and_delta_zero_is_identity():
    h = torch.randn(6, 5)
    out = fuse(h, 0.1)
    for i in range(6):
        torch.testing.assert_close(out[i], 0.9 * h[i] + 0.1 * h[(i + 1) % 6])
    torch.testing.assert_close(fuse(h, 0.0), h)
    torch.manual_seed(0)
    model = MLP(16, [8, 8], 5)
    batch = _batch()
    plain = model(interleave(batch[0], batch[1], batch[3], batch[4]))
    fused = torch.cat(InterLUDE(delta=0.0).logits(model, batch)[:2])
    torch.testing.assert_close(fused, torch.cat(deinterleave(plain, 2)[:2]))
    moved = torch.cat(InterLUDE(delta=0.3).logits(model, batch)[:2])
    assert (moved - fused).abs().max() > 1e-4


def test_delta_consistency_zero_when_gaps_match_and_no_labeled_gradient():
    l_w, l_s = torch.randn(4, 5), torch.randn(4, 5)
    u_w, u_s = l_w.unsqueeze(1).repeat(1, 3, 1), l_s.unsqueeze(1).repeat(1, 3, 1)
    assert delta_consistency(l_w, l_s, u_w, u_s).item() == pytest.approx(0.0, abs=1e-12)
    l_w.requires_grad_(True)
    l_s.requires_grad_(True)
    u_w = torch.randn(4, 3, 5, requires_grad=True)
    rel = delta_consistency(l_w, l_s, u_w, u_s)
    assert rel > 0
    rel.backward()
    assert l_w.grad is None and l_s.grad is None
    assert u_w.grad.abs().sum() > 0
    # the value: MSE of the mean unlabeled gap against the labeled gap
    d_l = torch.softmax(l_w.detach(), -1) - torch.softmax(l_s.detach(), -1)
    d_u = (torch.softmax(u_w.detach(), -1) - torch.softmax(u_s, -1)).mean(1)
    torch.testing.assert_close(rel.detach(), ((d_u - d_l) ** 2).mean())


def test_delta_zero_without_rel_is_fixmatch():
    torch.manual_seed(1)
    model = MLP(16, [8, 8], 5)
    batch = _batch(B=4, mu=3, seed=2)
    xl_w, xl_s, y, u_w, u_s = batch
    # FixMatch computed independently, with separate forwards for each view
    pw = torch.softmax(model(u_w.flatten(0, 1)), -1).detach()
    conf, pseudo = pw.max(-1)
    tau = ((conf.min() + conf.max()) / 2).item()  # some pseudo-labels pass, some do not
    mask = (conf >= tau).float()
    assert 0 < mask.mean() < 1
    sup = F.cross_entropy(model(xl_w), y)
    unsup = (F.cross_entropy(model(u_s.flatten(0, 1)), pseudo, reduction="none") * mask).mean()
    ours, logs = InterLUDE(delta=0.0, lambda_rel=0.0, tau=tau).loss(model, batch)
    torch.testing.assert_close(ours, sup + unsup)
    assert logs["rel"] == 0.0


def test_fixmatch_mask_and_options():
    u_w = torch.tensor([[[10.0, 0.0], [0.1, 0.0]]])
    u_s = torch.zeros(1, 2, 2)
    loss, rate = fixmatch_unlabeled(u_w, u_s, tau=0.95)
    assert rate.item() == 0.5
    torch.testing.assert_close(loss, torch.tensor(0.5 * torch.log(torch.tensor(2.0)).item()))
    with pytest.raises(ConfigError, match="delta"):
        InterLUDE(delta=1.0)
    with pytest.raises(ConfigError, match="fusion_module"):
        InterLUDE(fusion_module="nope").setup(MLP(4, [3], 2), None, None)


def test_ssl_digits_items():
    d = ssl_digits(labels_per_class=2, mu=3, image_size=8)
    xl_w, xl_s, y, u_w, u_s = d.train[0]
    assert xl_w.shape == (1, 8, 8) and u_w.shape == (3, 1, 8, 8) and u_s.shape == (3, 1, 8, 8)
    assert d.meta["n_labeled"] == 20 and len(d.train) == d.meta["n_unlabeled"] // 3
    assert sorted({int(d.train.yl[i]) for i in range(20)}) == list(range(10))
