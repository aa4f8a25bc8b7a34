"""The MS-MPPD stability objective: the eps recurrence and its gain, the loss terms and where their
gradients go, the FGSM training perturbation, the SNN-RAT regulariser, recipes and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.models.neurons import DLIF
from efficient.objectives import build_objective
from efficient.objectives.stability import (
    fgsm_perturbation,
    mppd,
    mppd_gain,
    mppd_matrix,
    parseval_step,
    project_simplex,
    stability_terms,
)
from efficient.zoo import create

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _model(**kw):
    """Digits-sized DLIF VGG with louder FC layers so every spiking layer fires at init."""
    torch.manual_seed(0)
    m = create("stable-snn-digits", timesteps=4, fc_dim=16, backend="torch", **kw)
    with torch.no_grad():
        m.fc1.weight.mul_(8)
        m.fc2.weight.mul_(8)
        for bn in m.modules():  # running stats = one batch's stats, so eval mode fires too
            if isinstance(bn, nn.BatchNorm2d):
                bn.momentum = None
        m.train()(_batch(32)[0])
    return m


def _batch(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


# ------------------------------------------------------------------------ recurrence and bound


def test_mppd_recurrence_equals_toeplitz_matrix_form():
    delta = torch.randn(8, 3, 5, dtype=torch.float64)
    eps = mppd(delta, 0.9)
    via_matrix = torch.einsum("ts,s...->t...", mppd_matrix(8, 0.9), delta)
    torch.testing.assert_close(eps, via_matrix)
    assert mppd_matrix(3, 0.5).tolist() == [[1, 0, 0], [0.5, 1, 0], [0.25, 0.5, 1]]


@pytest.mark.parametrize("leak, T, gain", [(0.99, 8, 5.26), (0.99, 16, 9.89), (0.99, 64, 32.3), (0.9, 8, 4.11)])
def test_sharp_gain_matches_the_spec_table(leak, T, gain):
    assert mppd_gain(T, leak) == pytest.approx(gain, abs=0.01 if gain < 10 else 0.1)


def test_bound_holds_and_is_tight_at_top_singular_vectors():
    torch.manual_seed(0)
    T, leak, n_in, n_out = 8, 0.99, 12, 7
    W = torch.randn(n_out, n_in, dtype=torch.float64)
    L = mppd_matrix(T, leak)
    bound_const = mppd_gain(T, leak) * torch.linalg.matrix_norm(W, ord=2).item()

    def eps_norm(ds):  # ds: [T, n_in] spike perturbation -> eps = L (W ds[t])
        return mppd(ds @ W.T, leak).norm().item()

    for _ in range(20):
        ds = torch.randn(T, n_in, dtype=torch.float64)
        assert eps_norm(ds) <= bound_const * ds.norm().item() * (1 + 1e-12)
    u_l = torch.linalg.svd(L).Vh[0]  # top right singular vector of L_T (over time)
    v_w = torch.linalg.svd(W).Vh[0]  # top right singular vector of W (over neurons)
    ds = torch.outer(u_l, v_w)
    assert eps_norm(ds) == pytest.approx(bound_const * ds.norm().item(), rel=1e-6)
    # with DLIF gains a[t]: sigma_max(L diag(a))
    a = torch.linspace(0.5, 1.5, T, dtype=torch.float64)
    assert mppd_gain(T, leak, a) == pytest.approx(torch.linalg.matrix_norm(L * a[None, :], ord=2).item())


# ------------------------------------------------------------------------------ loss terms


def test_mppd_is_exactly_zero_when_the_perturbation_is_zero():
    model = _model().train()
    x, y = _batch()
    terms = stability_terms(model, x, x.clone(), y)
    assert terms["mppd"].item() == 0.0
    assert terms["ce_clean"].item() == terms["ce_pert"].item()


def test_mppd_is_a_mean_so_duplicating_the_batch_changes_nothing():
    delta = torch.randn(4, 3, 6)
    assert mppd(torch.cat([delta, delta], 1), 0.99).pow(2).mean().item() == pytest.approx(mppd(delta, 0.99).pow(2).mean().item(), rel=1e-6)
    model = _model().eval()
    x, y = _batch(4)
    xp = (x + 0.05 * torch.randn_like(x)).clamp(0, 1)
    one = stability_terms(model, x, xp, y)
    two = stability_terms(model, torch.cat([x, x]), torch.cat([xp, xp]), torch.cat([y, y]))
    for k in ("mppd", "ce_clean", "ce_pert"):
        assert two[k].item() == pytest.approx(one[k].item(), rel=1e-5)


def _mppd_grads(model, mppd_after_gain=False):
    x, y = _batch()
    x = x.requires_grad_(True)
    xp = (x.detach() + 0.1 * torch.randn_like(x)).requires_grad_(True)
    terms = stability_terms(model, x, xp, y, mppd_after_gain=mppd_after_gain)
    assert terms["mppd"].item() > 0
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(terms["mppd"], [x, xp, *params.values()], allow_unused=True)
    g = {k: (torch.zeros_like(p) if gr is None else gr) for (k, p), gr in zip(params.items(), grads[2:])}
    return grads[0], grads[1], g


def test_mppd_gradient_routing():
    model = _model().train()
    gx, gxp, g = _mppd_grads(model)
    assert gx is None or gx.abs().sum() == 0  # nothing flows into the clean branch
    assert gxp.abs().sum() > 0
    assert g["head.weight"].abs().sum() == 0 and g["head.bias"].abs().sum() == 0  # output Linear
    assert g["neuron2.gain"].abs().sum() == 0  # the last layer's a[t] (current recorded before the gain)
    for k in ("fc2.weight", "fc1.weight", "neuron1.gain", "features.0.conv.weight"):
        assert g[k].abs().sum() > 0, k  # earlier layers do get the MPPD gradient
    _, _, g_after = _mppd_grads(model, mppd_after_gain=True)
    assert g_after["neuron2.gain"].abs().sum() > 0


def test_kappa_and_rho_reduce_to_cross_entropy():
    x, y = _batch()
    model = _model().train()
    plain = F.cross_entropy(model(x), y)
    loss, logs = build_objective({"name": "stability", "perturbation": "none", "rho": 0.0}).loss(model, (x, y))
    assert loss.item() == plain.item()
    torch.manual_seed(5)
    loss_k1, _ = build_objective({"name": "stability", "perturbation": "gaussian", "kappa": 1.0, "rho": 0.0}).loss(model, (x, y))
    assert loss_k1.item() == pytest.approx(plain.item(), rel=1e-6)
    torch.manual_seed(5)
    xp = x + (8 / 255) * torch.randn_like(x)  # the objective's own draw, replayed
    mix = 0.5 * F.cross_entropy(model(x), y) + 0.5 * F.cross_entropy(model(xp), y)
    torch.manual_seed(5)
    obj = build_objective({"name": "stability", "perturbation": "gaussian", "rho": 0.0})
    loss_mix, logs = obj.loss(model, (x, y))
    assert loss_mix.item() == pytest.approx(mix.item(), rel=1e-6)
    torch.manual_seed(5)
    loss_rho, logs = build_objective({"name": "stability", "perturbation": "gaussian", "rho": 2.0}).loss(model, (x, y))
    assert logs["mppd"] > 0 and loss_rho.item() == pytest.approx(mix.item() + 2.0 * float(logs["mppd"]), rel=1e-5)


def test_fgsm_training_perturbation():
    model = _model().train()
    x, y = _batch()
    modes = []
    handle = model.register_forward_pre_hook(lambda m, i: modes.append(m.training))
    z = torch.randn_like(x)
    xt = fgsm_perturbation(model, x, y, step=4 / 255, start_sigma=0.001, noise=z)
    handle.remove()
    assert modes == [False] and model.training  # computed in eval mode, train mode restored
    assert xt.min() >= 0 and xt.max() <= 1
    assert (xt - x).abs().max() <= 4 / 255 + (0.001 * z).abs().max() + 1e-6
    assert (xt - x).abs().max() > 3 / 255  # it did take the step
    assert not xt.requires_grad and all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------- SNN-RAT regulariser


def test_parseval_step_keeps_orthogonal_weights_and_simplex_projection():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(300, 250), nn.Linear(8, 5))
    with torch.no_grad():
        for m in net:
            w = m.weight.reshape(m.weight.shape[0], -1)
            q, _ = torch.linalg.qr(torch.randn(w.shape[1], w.shape[0]))
            m.weight.copy_(q.T.reshape(m.weight.shape))  # orthonormal rows
    before = [m.weight.detach().clone() for m in net]
    parseval_step(net, beta=0.004)
    for b, m in zip(before, net):
        torch.testing.assert_close(m.weight, b, atol=1e-5, rtol=0)
    with torch.no_grad():
        net[2].weight.mul_(2)
    parseval_step(net, beta=0.004)  # a non-orthogonal W moves toward orthogonality
    assert torch.linalg.matrix_norm(net[2].weight, ord=2) < 2.0
    for v in (torch.tensor([0.8, 0.6]), torch.tensor([3.0, -1.0, 0.2]), torch.tensor([0.5, 0.5])):
        p = project_simplex(v)
        assert (p >= 0).all() and p.sum().item() == pytest.approx(1.0)
    torch.testing.assert_close(project_simplex(torch.tensor([0.8, 0.6])), torch.tensor([0.6, 0.4]))
    torch.testing.assert_close(project_simplex(torch.tensor([0.3, 0.7])), torch.tensor([0.3, 0.7]))


def test_simplex_projection_matches_its_definition_and_reads_nothing_back():
    """Against the sort-based rule with rho read back on the host (Duchi et al. 2008), on random vectors;
    the projection itself keeps rho on the device (no Python bool or number taken from a tensor)."""
    from torch.overrides import TorchFunctionMode

    class ReadBacks(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("__bool__", "item", "__int__", "__float__", "tolist", "__index__"):
                self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 7, 32):
        for scale in (0.1, 1.0, 10.0):
            v = torch.randn(n, generator=g) * scale
            u, _ = torch.sort(v, descending=True)
            css = torch.cumsum(u, 0) - 1
            rho = int(torch.nonzero(u - css / torch.arange(1, n + 1) > 0).max()) + 1
            want = torch.clamp(v - css[rho - 1] / rho, min=0)
            with ReadBacks() as mode:
                got = project_simplex(v)
            assert torch.equal(got, want) and mode.names == []
            assert got.min() >= 0 and abs(float(got.sum()) - 1) < 1e-5


def test_at_reg_mode_applies_the_retraction_between_steps():
    model = _model()
    x, y = _batch()
    obj = build_objective({"name": "stability", "perturbation": "gaussian", "parseval_beta": 0.01})
    w0 = model.fc2.weight.detach().clone()
    obj.loss(model, (x, y))
    assert torch.equal(model.fc2.weight, w0)  # first step: nothing to retract yet
    obj.loss(model, (x, y))
    assert not torch.equal(model.fc2.weight, w0)


# --------------------------------------------------------------------- recipes, bad input


@pytest.mark.parametrize("name", ["stable_snn_cifar", "stable_snn_cifar_at", "stable_snn_digits", "stable_snn_digits_at", "stable_snn_digits_eps32", "stable_snn_digits_at_eps32"])
def test_recipes_validate(name):
    from efficient.config import load_recipe

    r = load_recipe(RECIPES / f"{name}.yaml")
    assert r.model["name"].startswith("stable-snn") and r.objective["name"] == "stability"
    assert r.data["normalize"] is False
    assert r.objective["perturbation"] == ("fgsm" if "_at" in name else "gaussian")


def test_bad_input_errors():
    obj = build_objective({"name": "stability"})
    with pytest.raises(ConfigError, match="needs a model with spiking neurons"):
        obj.setup(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), None, None)
    with pytest.raises(ConfigError, match="kappa"):
        build_objective({"name": "stability", "kappa": 1.5})
    with pytest.raises(ConfigError, match=r"objective.step=2.0 is outside \[0, 1\]"):
        build_objective({"name": "stability", "step": 2.0})
    from efficient.config import validate

    with pytest.raises(ConfigError, match="objective.perturbation: expected one of"):
        validate({"model": {"name": "stable-snn-digits"}, "data": {"name": "digits"}, "objective": {"name": "stability", "perturbation": "pgd"}})
    assert isinstance(_model().neuron2, DLIF)


def test_leak_is_read_from_the_last_layer():
    from efficient.models.neurons import LIF
    from efficient.objectives.stability import layer_dynamics, last_spiking_layer

    lif_model = create("stable-snn-digits", neuron="lif", leak=0.9, timesteps=2, backend="torch")
    assert layer_dynamics(last_spiking_layer(lif_model)) == pytest.approx((0.9, 1.0))
    assert layer_dynamics(last_spiking_layer(create("stable-snn-digits", leak=0.8, timesteps=2))) == (0.8, 1.0)
    assert layer_dynamics(LIF(tau=4.0, decay_input=True)) == (0.75, 0.25)  # H = V + (X - V)/tau
    with pytest.raises(ConfigError, match="set objective.leak"):
        layer_dynamics(nn.ReLU())
