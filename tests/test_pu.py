"""PU learning: asymmetric-risk boundaries, the fence, stochastic labels and the pu_digits data."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from efficient.data.pu import pu_digits
from efficient.errors import ConfigError
from efficient.objectives.pu import PULearning, asymmetric_pu_risk, fence_posterior


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: thread hand-offs cost more than the math


def _npdf(x: float, mu: float) -> float:
    return math.exp(-0.5 * (x - mu) ** 2)


def test_asymmetric_risk_puts_each_boundary_at_gamma_times_prior():
    """1-D Gaussians: P = N(+1, 1), N = N(-1, 1), U = 0.4 P + 0.6 N. The weak classifier for
    gamma must switch sign once, where eta(x) = gamma * 0.4 (finite samples: within 0.02, a tenth
    of the 0.2 between neighbouring levels; the fit lands within 0.01)."""
    prior, gammas = 0.4, torch.tensor([0.5, 1.0, 1.5, 2.0])
    g = torch.Generator().manual_seed(0)
    xp = torch.randn(3000, 1, generator=g) + 1
    yu = torch.rand(6000, generator=g) < prior
    xu = torch.randn(6000, 1, generator=g) + torch.where(yu, 1.0, -1.0)[:, None]
    x = torch.cat([xp, xu])
    s = torch.cat([torch.ones(3000), torch.zeros(6000)])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    for _ in range(300):
        loss = asymmetric_pu_risk(net(x), s, gammas)
        opt.zero_grad()
        loss.backward()
        opt.step()
    grid = torch.linspace(-3, 3, 1201)[:, None]
    with torch.no_grad():
        f = net(grid)
    for k, gam in enumerate(gammas.tolist()):
        cross = (torch.sign(f[:-1, k]) != torch.sign(f[1:, k])).nonzero()
        xb = grid[cross[0, 0], 0].item()
        eta = prior * _npdf(xb, 1) / (prior * _npdf(xb, 1) + (1 - prior) * _npdf(xb, -1))
        assert len(cross) == 1, (gam, cross)
        assert eta == pytest.approx(gam * prior, abs=0.02), (gam, xb, eta)


def test_fence_posterior_is_the_interval_midpoint():
    t = torch.tensor([0.7, 0.1, 0.3, 0.5, 0.9])  # unsorted on purpose
    votes = torch.tensor([0, 1, 2, 3, 4, 5])
    torch.testing.assert_close(fence_posterior(votes, t), torch.tensor([0.05, 0.2, 0.4, 0.6, 0.8, 0.95]))


def test_risk_needs_both_sets():
    with pytest.raises(ValueError, match="labeled positives and unlabeled"):
        asymmetric_pu_risk(torch.zeros(3, 2), torch.ones(3), torch.ones(2))


def test_pu_digits_hides_labels_and_states_the_prior():
    d = pu_digits(labeled_frac=0.3, image_size=8)
    s = torch.tensor([d.train[i][1] for i in range(len(d.train))])
    y = d.train.base.y
    assert (y[s == 1] == 1).all()  # only positives are ever labeled
    assert (s.sum() / (y == 1).sum()).item() == pytest.approx(0.3, abs=0.06)
    assert d.meta["prior_u"] == pytest.approx((y[s == 0] == 1).float().mean().item())
    assert d.val[0][1] in (0, 1)


def test_objective_fence_and_targets_on_digits():
    d = pu_digits(labeled_frac=0.3, image_size=8)
    obj = PULearning(fence_steps=150)
    obj.setup(nn.Linear(1, 1), d, None)
    assert obj.prior == d.meta["prior_u"]
    xs = torch.stack([d.train[i][0] for i in range(len(d.train))])
    s = torch.tensor([d.train[i][1] for i in range(len(d.train))])
    y = d.train.base.y
    eta = obj.soft_labels(xs)
    unl = s == 0
    # the fence ranks the hidden positives above the negatives among the unlabeled
    assert eta[unl & (y == 1)].mean() > eta[unl & (y == 0)].mean() + 0.3
    torch.manual_seed(0)
    tgt = obj.targets(torch.zeros(len(s), 2), xs, s)
    assert (tgt[s == 1] == 1).all()
    assert (tgt[unl] == y[unl]).float().mean() > 0.7
    naive = PULearning(naive=True)
    naive.setup(None, d, None)
    assert torch.equal(naive.targets(torch.zeros(len(s), 2), xs, s), s.long())


def test_bad_options_are_rejected():
    with pytest.raises(ConfigError, match="prior"):
        PULearning(prior=1.5)
    with pytest.raises(ConfigError, match="thresholds"):
        PULearning(thresholds=[0.5, 0.5])
