"""Stable-SNN zoo models: sizes of the paper's networks, the neuron switch (DLIF with a = 1 is the
LIF of the same leak), normalisation inside the model, time averaging, the last spiking layer."""

from __future__ import annotations

import pytest
import torch

from efficient.errors import ConfigError
from efficient.models.neurons import DLIF, LIF, SpikingNeuron
from efficient.models.stable_snn import CIFAR_MEAN, CIFAR_STD, ConvexCombination
from efficient.objectives.stability import last_spiking_layer, record_current
from efficient.zoo import count_params, create, list_models


def test_zoo_entries_and_paper_parameter_counts():
    assert {"stable-snn-vgg11", "stable-snn-vgg5", "stable-snn-wrn16", "stable-snn-digits"} <= set(list_models("stable-snn*"))
    with torch.device("meta"):
        vgg11 = create("stable-snn-vgg11")
        wrn16 = create("stable-snn-wrn16")
    assert round(count_params(vgg11) / 1e6, 2) == 61.38  # the paper's VGG-11 on CIFAR-10
    assert round(count_params(wrn16) / 1e6, 2) == 2.75  # WRN-16-4


def _tiny(neuron: str, **kw):
    torch.manual_seed(0)
    return create("stable-snn-digits", neuron=neuron, timesteps=4, fc_dim=16, backend="torch", **kw)


def test_neuron_switch_builds_lif_or_dlif():
    for kind, cls in (("lif", LIF), ("dlif", DLIF)):
        layers = [m for m in _tiny(kind).modules() if isinstance(m, SpikingNeuron)]
        assert len(layers) == 4 and all(isinstance(m, cls) for m in layers)
    gains = [m.gain for m in _tiny("dlif").modules() if isinstance(m, DLIF)]
    assert all(g.shape == (4,) and torch.equal(g, torch.ones(4)) for g in gains)
    lif = next(m for m in _tiny("lif").modules() if isinstance(m, LIF))
    assert lif.tau == pytest.approx(100.0) and not lif.decay_input and not lif.detach_reset and lif.surrogate == "triangle"


def test_dlif_with_unit_gain_equals_lif_of_the_same_leak():
    x = torch.rand(6, 1, 8, 8)
    y = torch.randint(0, 10, (6,))
    dlif, lif = _tiny("dlif"), _tiny("lif")
    with torch.no_grad():  # louder FC layers so the last spiking layer fires and the test bites
        dlif.fc1.weight.mul_(8)
        dlif.fc2.weight.mul_(8)
    missing, unexpected = lif.load_state_dict(dlif.state_dict(), strict=False)
    assert not missing and all(k.endswith("gain") for k in unexpected)
    outs, grads = [], []
    for m in (dlif, lif):
        m.train()
        out = m(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        outs.append(out)
        grads.append(m.features[0].conv.weight.grad)
    assert outs[0].abs().sum() > 0 and grads[0].abs().sum() > 0
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_normalisation_inside_and_logits_averaged_over_time():
    x = torch.rand(3, 1, 8, 8)
    a = _tiny("dlif").eval()
    b = _tiny("dlif", mean=[0.0], std=[1.0]).eval()
    mean, std = a.normalize.mean, a.normalize.std
    torch.testing.assert_close(a(x), b((x - mean) / std))
    assert a.forward_time(x).shape == (4, 3, 10)
    torch.testing.assert_close(a(x), a.forward_time(x).mean(0))
    cifar = create("stable-snn-wrn16", timesteps=1, depth=10, widen=1, backend="torch")
    assert torch.allclose(cifar.normalize.mean.flatten(), torch.tensor(CIFAR_MEAN))
    assert torch.allclose(cifar.normalize.std.flatten(), torch.tensor(CIFAR_STD))
    assert not any("normalize" in k for k in cifar.state_dict())  # buffers, not weights


@pytest.mark.parametrize(
    "name, kw, shape",
    [
        ("stable-snn-vgg11", {}, (2, 1, 4096)),
        ("stable-snn-wrn16", {}, (2, 1, 256, 8, 8)),
    ],
)
def test_hook_picks_the_last_spiking_layer(name, kw, shape):
    torch.manual_seed(0)
    model = create(name, timesteps=2, backend="torch", **kw).eval()
    layer = last_spiking_layer(model)
    assert layer is [m for m in model.modules() if isinstance(m, SpikingNeuron)][-1]
    with record_current(layer) as seen, torch.no_grad():
        model(torch.rand(1, 3, 32, 32))
    assert len(seen) == 1 and tuple(seen[0].shape) == shape


def test_wrn_convex_combination_starts_at_half_half():
    model = create("stable-snn-wrn16", timesteps=1, depth=10, widen=1, backend="torch")
    combs = [m.comb for m in model.modules() if isinstance(m, ConvexCombination)]
    assert len(combs) == 3 and all(torch.equal(c.data, torch.tensor([0.5, 0.5])) for c in combs)
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)


def test_bad_inputs_name_what_is_wrong():
    model = _tiny("dlif")
    with pytest.raises(ValueError, match=r"expects images \[B, 1, 8, 8\]"):
        model(torch.rand(2, 3, 8, 8))
    with pytest.raises(ValueError, match="leak must be in"):
        create("stable-snn-digits", leak=1.0)
    with pytest.raises(ValueError, match="neuron must be 'lif' or 'dlif'"):
        create("stable-snn-digits", neuron="plif")
    with pytest.raises(ValueError, match="mean/std need 1 entries"):
        create("stable-snn-digits", mean=[0.1, 0.2], std=[1.0, 1.0])
    from efficient.config import validate

    with pytest.raises(ConfigError, match=r"model.neuron: expected one of 'lif', 'dlif'"):
        validate({"model": {"name": "stable-snn-digits", "neuron": "izh"}, "data": {"name": "digits"}})
