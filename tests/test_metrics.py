"""Training-time measures: local complexity, AGOP alignment, tangent-kernel eigenvalue, catapults."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.metrics import MEASURES, get_measure, measure
from efficient.metrics.catapult import agop, agop_alignment, frobenius_cosine, ntk_top_eigenvalue, tangent_kernel
from efficient.metrics.local_complexity import frame_directions, local_complexity
from efficient.models.mlp import NTKTwoLayer


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: thread hand-offs cost more than the math


def _relu_1d(seed: int = 0, width: int = 40) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, 1)).double()


def test_local_complexity_counts_breakpoints_in_1d():
    net = _relu_1d()
    w, b = net[0].weight[:, 0].detach(), net[0].bias.detach()
    bp = -b / w
    x = torch.tensor([[0.1], [-0.4], [0.7]], dtype=torch.float64)
    last = None
    for r in (0.05, 0.2, 0.5, 1.0):
        lc = local_complexity(net, (x, None), radius=r, n_frame=2)
        expect = [((bp > xi - r) & (bp < xi + r)).sum().item() for xi in x[:, 0].tolist()]
        assert lc["lc"] == pytest.approx(sum(expect) / 3)
        assert lc["lc/0"] == lc["lc"]  # one probed layer: the head is excluded
        assert last is None or lc["lc"] >= last  # non-decreasing in r with fixed directions
        last = lc["lc"]
    assert last > 0


def test_frame_directions_are_orthonormal_and_checked():
    d = frame_directions(10, 8, seed=3, dtype=torch.float64)
    torch.testing.assert_close(d @ d.T, torch.eye(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="n_frame"):
        frame_directions(3, 8)
    with pytest.raises(ValueError, match="even"):
        frame_directions(10, 5)


def test_local_complexity_on_images_counts_every_layer():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.rand(5, 1, 8, 8)
    lc = local_complexity(net, (x, torch.zeros(5)), radius=0.5, n_frame=8)
    assert set(lc) == {"lc", "lc/0", "lc/1"}
    assert lc["lc"] == pytest.approx(lc["lc/0"] + lc["lc/1"])
    assert local_complexity(net, x, radius=1e-9, n_frame=8)["lc"] <= lc["lc"]


def test_agop_of_a_linear_map_is_w_wT_and_alignment_is_a_cosine():
    w = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)
    lin = nn.Linear(3, 1, bias=True).double()
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(7, 3, dtype=torch.float64)
    G = agop(lin, x)
    torch.testing.assert_close(G, w.T @ w)
    assert agop_alignment(lin, (x,), target=w.T @ w)["agop_align"] == pytest.approx(1.0)
    v = torch.tensor([[2.0, -1.0, 0.0]], dtype=torch.float64)  # orthogonal to w
    assert agop_alignment(lin, (x,), target=v.T @ v)["agop_align"] == pytest.approx(0.0, abs=1e-12)
    assert agop_alignment(lin, (x,))["agop_top_frac"] == pytest.approx(1.0)
    assert frobenius_cosine(G, 3 * G) == pytest.approx(1.0)


def test_tangent_kernel_of_a_linear_model():
    lin = nn.Linear(4, 1).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    K = tangent_kernel(lin, x)
    # d f / d(w, b) = (x, 1): K = (X X^T + 1) / n
    torch.testing.assert_close(K, (x @ x.T + 1) / 6)
    lam = ntk_top_eigenvalue(lin, (x, None))
    assert lam["ntk_top_eig"] == pytest.approx(torch.linalg.eigvalsh((x @ x.T + 1) / 6)[-1].item())
    assert lam["ntk_critical_lr"] == pytest.approx(2 / lam["ntk_top_eig"])


def _gd(lr_factor: float, steps: int = 200) -> tuple[list[float], float, float]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64)
    net = NTKTwoLayer(5, 1024, seed=0)
    lam0 = ntk_top_eigenvalue(net, (x, y))["ntk_top_eig"]
    lr = lr_factor * 2 / lam0
    losses = []
    for _ in range(steps):
        loss = 0.5 * ((net(x) - y) ** 2).mean()
        losses.append(loss.item())
        net.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= lr * p.grad
    return losses, ntk_top_eigenvalue(net, (x, y))["ntk_top_eig"], lr


def test_catapult_above_the_critical_step_and_none_below():
    calm, _, _ = _gd(0.5)
    assert max(calm) <= calm[0] + 1e-12 and calm[-1] < 0.5 * calm[0]
    spiky, lam_end, lr = _gd(1.5)
    assert max(spiky) > 5 * spiky[0]  # the loss spikes ...
    assert spiky[-1] < spiky[0]  # ... then converges
    assert lam_end < 2 / lr  # with the kernel's top eigenvalue pushed below 2 / eta


def test_measure_registry():
    assert set(MEASURES) == {"local_complexity", "agop_alignment", "ntk_top_eigenvalue"}
    lin = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    out = measure(["local_complexity", "ntk_top_eigenvalue"], lin, (torch.randn(4, 6), None))
    assert {"lc", "ntk_top_eig", "ntk_critical_lr"} <= set(out)
    with pytest.raises(ConfigError, match="Did you mean"):
        get_measure("local_complexit")
