"""BiLipNet / MonLip / PLNet: certified bounds hold for random parameters."""

from __future__ import annotations

import pytest
import torch

from efficient.models.bilipnet import BiLipClassifier, BiLipNet, MonLipLayer, PLNet, cayley, certified_radius


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: thread hand-offs cost more than the math


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 2)


def _pairs(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * 2
    dx = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    return x, x + dx


@pytest.mark.parametrize("shape", [(6, 6), (9, 4)])
def test_cayley_columns_are_orthonormal(shape):
    W = torch.randn(*shape, dtype=torch.float64) * 3
    R = cayley(W)
    torch.testing.assert_close(R.T @ R, torch.eye(shape[1], dtype=torch.float64), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="tall"):
        cayley(torch.randn(3, 5))


def test_monlip_layer_is_monotone_and_lipschitz_for_random_parameters():
    mu, nu = 0.1, 10.0
    for seed in range(3):
        layer = MonLipLayer(5, 12, mu, nu).double()
        _randomise(layer, seed)
        x, y = _pairs(20_000, 5, seed)
        dx, df = y - x, layer(y) - layer(x)
        mono = ((df * dx).sum(1) / (dx * dx).sum(1)).min().item()
        lip = (df.norm(dim=1) / dx.norm(dim=1)).max().item()
        assert mono >= mu - 1e-9 and lip <= nu + 1e-9
        assert lip > 0.5 * nu  # the bounds are not vacuous: the layer uses its range


def test_bilipnet_is_bi_lipschitz_for_random_parameters():
    mu, nu = 0.1, 10.0
    for seed in range(3):
        net = BiLipNet(4, 10, depth=2, mu=mu, nu=nu).double()
        _randomise(net, seed + 10)
        x, y = _pairs(20_000, 4, seed)
        ratio = (net(y) - net(x)).norm(dim=1) / (y - x).norm(dim=1)
        assert ratio.min().item() >= mu - 1e-9 and ratio.max().item() <= nu + 1e-9
    assert net.lipschitz_bounds() == (mu, nu)


def test_plnet_satisfies_the_pl_inequality():
    mu = 0.1
    net = PLNet(4, 10, depth=2, mu=mu, nu=10.0).double()
    _randomise(net, 3)
    x = (torch.randn(500, 4, dtype=torch.float64) * 3).requires_grad_(True)
    F = net(x)
    (grad,) = torch.autograd.grad(F.sum(), x)
    lhs = 0.5 * grad.pow(2).sum(1)
    rhs = mu**2 * (F - net.c).detach()
    assert (lhs >= rhs - 1e-9).all()


def test_eval_cache_matches_training_output_and_is_refreshed():
    net = BiLipNet(3, 6).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    train_out = net(x)
    net.eval()
    torch.testing.assert_close(net(x), train_out)
    net.train()
    with torch.no_grad():
        net.layers[0].Q.W.add_(1.0)
    net.eval()
    assert (net(x) - train_out).abs().max() > 1e-6  # new weights, not the stale cache


def test_classifier_logits_respect_the_certified_bound_and_radius():
    torch.manual_seed(0)
    clf = BiLipClassifier(16, 4, hidden=24, nu=2.0, scale=5.0).double()
    _randomise(clf, 7)
    x, y = _pairs(5000, 16, 1)
    lip = ((clf(y) - clf(x)).norm(dim=1) / (y - x).norm(dim=1)).max().item()
    assert lip <= clf.lipschitz_bound() + 1e-9
    logits = clf(x[:200])
    r = certified_radius(logits, clf.lipschitz_bound())
    g = torch.Generator().manual_seed(2)
    d = torch.randn(200, 16, generator=g, dtype=torch.float64)
    d = d / d.norm(dim=1, keepdim=True) * r[:, None] * 0.999
    assert torch.equal(clf(x[:200] + d).argmax(1), logits.argmax(1))


def test_zoo_entry_builds():
    import efficient

    m = efficient.load("bilipnet-digits")
    assert m(torch.rand(2, 1, 8, 8)).shape == (2, 10)
    assert m.lipschitz_bound() == pytest.approx(20.0)
