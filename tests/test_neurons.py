"""efficient.models.neurons: LIF / PLIF / DLIF modules, DLIF against the stable-SNN equations."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import needs_cxx
from torch import nn

from efficient.kernels import lif as K
from efficient.models import neurons as neurons_mod
from efficient.models.neurons import DLIF, LIF, PLIF, SpikingNeuron

BACKENDS = ["torch", "loop"]  # "loop" = the custom op's fused loop, eagerly (same math as the compiled path)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _x(shape, seed=0, scale=1.5, shift=0.6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale + shift


# ---- stable-SNN DLIF, written independently from the paper's equations (spec section 2) -------


class _Triangle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, v_th, w):
        ctx.save_for_backward(v)
        ctx.v_th, ctx.w = v_th, w
        return (v >= v_th).float()

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        return g * (ctx.w - (v - ctx.v_th).abs()).clamp_min(0) / ctx.w**2, None, None


def dlif_from_equations(x, a, lam, v_th, w):
    """V[t] = lam * V[t-1] * (1 - S[t-1]) + a[t] * I[t];  S[t] = H(V[t] - v_th); reset not detached."""
    v_prev = torch.zeros_like(x[0])
    s_prev = torch.zeros_like(x[0])
    out, vs = [], []
    for t in range(x.shape[0]):
        v = lam * v_prev * (1 - s_prev) + a[t] * x[t]
        s = _Triangle.apply(v, v_th, w)
        out.append(s)
        vs.append(v)
        v_prev, s_prev = v, s
    return torch.stack(out), torch.stack(vs)


@pytest.mark.parametrize("lam,width", [(0.99, 1.0), (0.5, 0.5), (0.9, 0.3)])
def test_dlif_matches_stable_snn_equations(backend, lam, width):
    T = 6
    x, g = _x((T, 3, 10), 1), _x((T, 3, 10), 2)
    neuron = DLIF(T, leak=lam, v_threshold=1.0, width=width, backend=backend)
    with torch.no_grad():
        neuron.gain.copy_(torch.linspace(0.6, 1.4, T))
    xa = x.clone().requires_grad_()
    s = neuron(xa)
    (s * g).sum().backward()
    a = neuron.gain.detach().clone().requires_grad_()
    xb = x.clone().requires_grad_()
    s_ref, _ = dlif_from_equations(xb, a, lam, 1.0, width)
    (s_ref * g).sum().backward()
    assert 0 < s_ref.mean() < 1
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(neuron.gain.grad, a.grad, rtol=1e-6, atol=1e-6)


def test_dlif_unit_gain_equals_stable_snn_lif_bitwise(backend):
    """Property 1: with a = 1, DLIF is the stable-SNN LIF (leak charge, hard reset, not detached)."""
    x, g = _x((5, 4, 6), 3), _x((5, 4, 6), 4)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    s_d = DLIF(5, leak=0.99, backend=backend)(xa)
    (s_d * g).sum().backward()
    # the same implementation the module used (reference, or the op's loop), in leak-charge mode
    s_l = neurons_mod.lif(xb, v_reset=0.0, detach_reset=False, surrogate="triangle", alpha=1.0, leak=0.99,
                          backend=backend)
    (s_l * g).sum().backward()
    assert torch.equal(s_d, s_l) and torch.equal(xa.grad, xb.grad)


def test_dlif_fires_at_threshold_and_surrogate_support(backend):
    """Property 2 (V = V_th spikes) and 3 (dS/dV = 1/w at V_th, 0 for |V - V_th| >= w)."""
    w = 0.5
    x = torch.tensor([[1.0, 1.5, 0.5, 1.2, 0.75]])  # one step: V = x
    xs = x.clone().requires_grad_()
    s = DLIF(1, leak=0.5, width=w, backend=backend)(xs)
    assert s.tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0]]
    s.sum().backward()
    expected = torch.tensor([[1 / w, 0.0, 0.0, (w - 0.2) / w**2, (w - 0.25) / w**2]])
    torch.testing.assert_close(xs.grad, expected)


def test_dlif_reset_gradient_not_detached(backend):
    """Property 4: gradients flow through (1 - S); a detached reset gives different gradients."""
    x, g = _x((5, 2, 8), 5), _x((5, 2, 8), 6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    s = DLIF(5, leak=0.9, backend=backend)(xa)
    (s * g).sum().backward()
    s_det, _ = K.lif_reference(xb, v_reset=0.0, detach_reset=True, surrogate="triangle", alpha=1.0, leak=0.9)
    (s_det * g).sum().backward()
    assert s.sum() > 0 and not torch.allclose(xa.grad, xb.grad)


def test_dlif_wrong_timesteps_and_hook_sees_input_current():
    neuron = DLIF(4, backend="torch")
    with pytest.raises(ValueError, match="timesteps=4"):
        neuron(torch.randn(3, 2, 5))
    with pytest.raises(ValueError, match="floating point"):
        neuron(torch.ones(4, 2, dtype=torch.int32))
    seen = []
    neuron.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    x = torch.randn(4, 2, 5)
    neuron(x)
    assert seen[0] is x  # the stable-SNN objective records I before the gain


# ---- LIF / PLIF modules -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 2, 3, 5, 5), (4, 2, 7, 6)])
def test_lif_shapes_dtype_and_statelessness(backend, shape):
    neuron = LIF(backend=backend)
    x = _x(shape).to(torch.bfloat16)
    s1, s2 = neuron(x), neuron(x)
    assert s1.shape == x.shape and s1.dtype == torch.bfloat16
    assert torch.equal(s1, s2), "each call starts from the resting membrane"
    ref, _ = K.lif_reference(x)
    assert torch.equal(s1, ref)


def test_lif_membrane_options(backend):
    x = _x((3, 2, 4))
    neuron = LIF(v_reset=None, detach_reset=False, backend=backend, store_membrane=True)
    s, h = neuron(x, return_membrane=True)
    s_ref, h_ref = K.lif_reference(x, v_reset=None, detach_reset=False)
    assert torch.equal(s, s_ref) and torch.equal(h, h_ref) and h.dtype == torch.float32
    out = neuron(x)
    assert isinstance(out, torch.Tensor) and torch.equal(neuron.membrane, h_ref)


def test_plif_parameter_and_gradient(backend):
    neuron = PLIF(init_tau=3.0, v_reset=None, surrogate="atan", alpha=2.0, backend=backend)
    assert neuron.w.item() == pytest.approx(-math.log(2.0))
    assert neuron.tau == pytest.approx(3.0)
    x = _x((4, 3, 5))
    neuron(x).sum().backward()
    w = torch.tensor(-math.log(2.0), requires_grad=True)
    K.lif_reference(x, v_reset=None, surrogate="atan", alpha=2.0, rate=w.sigmoid())[0].sum().backward()
    torch.testing.assert_close(neuron.w.grad, w.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("surrogate,alpha", [("sigmoid", 4.0), ("atan", 2.0), ("triangle", 1.0)])
def test_neuron_alpha_defaults_per_surrogate(surrogate, alpha):
    """LIF/PLIF and the model configs leave alpha to the surrogate (spikingjelly's defaults)."""
    from efficient.models.spikformer import SpikformerConfig

    assert LIF(surrogate=surrogate).alpha == alpha and PLIF(surrogate=surrogate).alpha == alpha
    assert LIF(surrogate=surrogate, alpha=0.5).alpha == 0.5
    assert LIF(**{**SpikformerConfig(surrogate=surrogate).neuron(), "backend": "torch"}).alpha == alpha


def test_common_base_and_repr():
    neurons = [LIF(tau=3.0, v_reset=None, surrogate="atan", alpha=2.0), PLIF(init_tau=2.5), DLIF(8, leak=0.99, width=0.5)]
    assert all(isinstance(n, SpikingNeuron) for n in neurons)
    r = [repr(n) for n in neurons]
    assert "tau=3.0" in r[0] and "v_reset=None" in r[0] and "surrogate=atan(alpha=2.0)" in r[0]
    assert "tau=2.5 (learnable)" in r[1]
    assert "timesteps=8" in r[2] and "leak=0.99" in r[2] and "width=0.5" in r[2]
    assert list(dict(neurons[2].named_parameters())) == ["gain"] and torch.equal(neurons[2].gain, torch.ones(8))


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: LIF(tau=1.0), "tau must be > 1"),
        (lambda: LIF(surrogate="gauss"), "surrogate"),
        (lambda: LIF(backend="cuda"), "backend"),
        (lambda: PLIF(init_tau=0.5), "init_tau"),
        (lambda: DLIF(0), "timesteps"),
        (lambda: DLIF(4, width=0.0), "width"),
    ],
)
def test_bad_options(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_input_through_module():
    with pytest.raises(ValueError, match="at least 2 dims"):
        LIF(backend="torch")(torch.randn(7))
    with pytest.raises(ValueError, match="T=0"):
        LIF()(torch.randn(0, 2, 3))


@pytest.mark.slow
@needs_cxx
def test_model_compiles_without_graph_breaks():
    """fullgraph=True fails on any graph break: the custom op's fake impl makes LIF traceable."""
    net = nn.Sequential(nn.Linear(6, 6), LIF(), PLIF(), DLIF(3, leak=0.9))
    x = torch.randn(3, 2, 6, requires_grad=True)
    eager = net(x)
    compiled = torch.compile(net, fullgraph=True)(x)
    compiled.sum().backward()
    # inductor may fuse the neurons' arithmetic into FMAs: a membrane within an ulp of threshold can
    # fire in one and not the other, so at most 2 of the 36 output spikes may differ (a broken
    # trace, e.g. a neuron dropped or run per step with a fresh state, changes far more)
    assert eager.shape == compiled.shape and int((eager != compiled).sum()) <= 2 and x.grad is not None
