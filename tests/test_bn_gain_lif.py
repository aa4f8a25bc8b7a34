"""BatchNorm -> per-step gain -> LIF by chunks of channels (`efficient.kernels.bn_lif.bn_gain_lif`), with
which memory level `recompute` reruns the stable-SNN's conv units: the DLIF's spikes, running statistics
and gradients, and the units of a recomputed region take this path, and only they."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from efficient import memory
from efficient.kernels import bn_lif
from efficient.models import neurons
from efficient.models.neurons import DLIF
from efficient.zoo import create


def _unit(C: int, T: int, leak: float, thr: float) -> tuple[torch.nn.BatchNorm2d, DLIF]:
    bn = torch.nn.BatchNorm2d(C)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.4)
        bn.running_mean.uniform_(-0.1, 0.1)
    neuron = DLIF(T, leak=leak, v_threshold=thr)
    with torch.no_grad():
        neuron.gain.copy_(torch.linspace(0.7, 1.4, T))
    return bn, neuron


@pytest.mark.parametrize("chunk", [1 << 30, 4 * 3 * 3 * 2, 1], ids=["whole", "two-channels", "one-channel"])
@pytest.mark.parametrize("leak,thr", [(0.99, 1.0), (0.5, 0.3)])
def test_it_equals_batchnorm_then_dlif(chunk: int, leak: float, thr: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spikes and running statistics are the separate calls' bit for bit; the gradients of z, BatchNorm's
    parameters and the gain are theirs within rounding (the gain's sums chunks' partial sums)."""
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", chunk)
    torch.manual_seed(0)
    T, B, C = 3, 4, 5
    bn, neuron = _unit(C, T, leak, thr)
    bn2, neuron2 = copy.deepcopy(bn), copy.deepcopy(neuron)
    z = torch.randn(T * B, C, 3, 3, requires_grad=True)
    ref = neuron(bn(z).unflatten(0, (T, B))).flatten(0, 1)
    assert 0 < float(ref.detach().mean()) < 1
    g = torch.randn_like(ref)
    wanted = [z, neuron.gain, bn.weight, bn.bias]
    ref_grads = torch.autograd.grad(ref, wanted, g)
    z2 = z.detach().clone().requires_grad_(True)
    out = bn_lif.bn_gain_lif(z2, T, neuron2.gain, bn2.weight, bn2.bias, bn2.running_mean, bn2.running_var, bn2.momentum,
                             bn2.eps, leak=leak, v_threshold=thr, surrogate=neuron2.surrogate, alpha=neuron2.alpha)
    assert torch.equal(out, ref)
    assert torch.equal(bn2.running_mean, bn.running_mean) and torch.equal(bn2.running_var, bn.running_var)
    grads = torch.autograd.grad(out, [z2, neuron2.gain, bn2.weight, bn2.bias], g)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _gain_call(z: torch.Tensor, bn: torch.nn.BatchNorm2d, neuron: DLIF, T: int, **kwargs) -> torch.Tensor:
    return bn_lif.bn_gain_lif(z, T, neuron.gain, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.momentum, bn.eps,
                              leak=neuron.leak, v_threshold=neuron.v_threshold, **kwargs)


def test_a_donated_z_receives_its_own_gradient_and_a_second_backward_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`donate=True`: backward writes z's gradient into z's storage (the values of the call that
    allocates it, bit for bit); z's version moves on, so a second backward through the same graph
    fails autograd's check rather than reading gradients as z."""
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 4 * 3 * 3 * 2)
    torch.manual_seed(0)
    T, B, C = 3, 4, 5
    bn, neuron = _unit(C, T, 0.9, 0.5)
    base = torch.randn(T * B, C, 3, 3)
    g = torch.randn_like(base)
    w = torch.randn(C, C, 1, 1, requires_grad=True)
    grads = {}
    for donate in (False, True):
        z = torch.nn.functional.conv2d(base, w)  # a fresh output, as a conv unit's
        b2, n2 = copy.deepcopy(bn), copy.deepcopy(neuron)
        out = _gain_call(z, b2, n2, T, donate=donate)
        (gz,) = torch.autograd.grad(out, [z], g, retain_graph=True)
        assert (gz.data_ptr() == z.data_ptr()) is donate
        grads[donate] = gz.clone()
        if donate:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(out, [z], g)
    assert torch.equal(grads[True], grads[False])


def test_without_spikes_the_call_keeps_what_backward_needs_and_its_backward_is_the_same() -> None:
    """`spikes=False` (a rerun nobody reads the spikes of): the result owns no memory and is zeros, the
    running statistics move as with spikes, and the gradients are the spiking call's bit for bit."""
    torch.manual_seed(1)
    T, B, C = 2, 3, 4
    bn, neuron = _unit(C, T, 0.8, 0.4)
    z0 = torch.randn(T * B, C, 2, 2)
    g = torch.randn_like(z0)
    got = {}
    for spikes in (True, False):
        z = z0.clone().requires_grad_(True)
        b2, n2 = copy.deepcopy(bn), copy.deepcopy(neuron)
        out = _gain_call(z, b2, n2, T, spikes=spikes)
        got[spikes] = (out, b2.running_mean, b2.running_var, torch.autograd.grad(out, [z, n2.gain, b2.weight, b2.bias], g))
    out, mean, var, grads = got[False]
    assert out.shape == z0.shape and out.stride() == (0, 0, 0, 0) and not out.any()
    assert 0 < float(got[True][0].detach().mean()) < 1
    assert torch.equal(mean, got[True][1]) and torch.equal(var, got[True][2])
    for a, b in zip(grads, got[True][3]):
        assert torch.equal(a, b)


def test_a_gain_of_the_wrong_length_is_named() -> None:
    bn, neuron = _unit(2, 3, 0.9, 1.0)
    with pytest.raises(ValueError, match="gain must have one value per step"):
        bn_lif.bn_gain_lif(torch.randn(6, 2, 2, 2), 3, torch.ones(4), bn.weight, bn.bias, bn.running_mean,
                           bn.running_var, 0.1, 1e-5, leak=0.9)


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _vgg_none_then_recompute(untouched: list) -> tuple:
    """One step of a tiny stable-SNN VGG at level `none` (which must leave the record `untouched` empty), then
    of a copy at level `recompute`: (recomputed model, none model, its gradients, none's, the batch)."""
    torch.manual_seed(0)
    base = create("stable-snn-vgg11", width=0.125, fc_dim=64, timesteps=2).train()
    x, y = torch.rand(2, 3, 32, 32), torch.tensor([1, 7])
    none = copy.deepcopy(base)
    ref = _step(none, x, y)
    assert not untouched
    rec = copy.deepcopy(base)
    memory.optimize(rec, "recompute")
    return rec, none, _step(rec, x, y), ref, (x, y)


def test_a_recomputed_vgg_reruns_its_units_by_chunks_and_trains_as_level_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """At level `recompute` each conv unit of the stable-SNN VGG runs BatchNorm, gain and DLIF by chunks
    (forward and rerun), at level `none` never; the step's gradients and the running statistics are
    level none's. A DLIF watched by a hook (the MPD objective's records its input current) is called
    as a module."""
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 1 << 12)
    calls: list[int] = []
    how: list[tuple[bool, bool]] = []
    real = neurons.bn_gain_lif

    def counted(z, *args, **kwargs):
        calls.append(z.shape[1])
        how.append((kwargs["spikes"], kwargs["donate"]))
        return real(z, *args, **kwargs)

    monkeypatch.setattr(neurons, "bn_gain_lif", counted)
    rec, none, got, ref, (x, y) = _vgg_none_then_recompute(calls)
    convs = [m for m in rec.modules() if type(m).__name__ == "ConvUnit"]
    assert len(calls) == 2 * len(convs)  # each unit's forward and its rerun
    # the forward's spikes are computed; the reruns (in backward, last unit first) only serve their
    # backward, which writes z's gradient into z, a convolution's fresh output
    assert how == [(True, True)] * len(convs) + [(False, True)] * len(convs)
    # a unit right after another keeps that unit's spikes as bits; after a pool (or first) it does not
    layers = list(rec.features)
    assert [u.recompute_spike_input() for u in convs] == [
        i > 0 and type(layers[i - 1]).__name__ == "ConvUnit" for i in (layers.index(u) for u in convs)]
    assert sum(u.recompute_spike_input() for u in convs) == 4  # VGG-11: 8 convs, 4 right after another
    # a layer swapped since counts as what it is now: a unit after a non-spiking layer keeps its input dense
    after = next(u for u in convs if u.recompute_spike_input())
    i = layers.index(after)
    swapped = rec.features[i - 1]
    rec.features[i - 1] = torch.nn.Identity()
    assert not after.recompute_spike_input()
    rec.features[i - 1] = swapped
    swapped.neuron, kept = torch.nn.ReLU(), swapped.neuron
    assert not after.recompute_spike_input()
    swapped.neuron = kept
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for (k, a), b in zip(rec.state_dict().items(), none.state_dict().values()):
        assert torch.equal(a, b), k
    calls.clear()
    convs[0].neuron.register_forward_hook(lambda m, i, o: None)
    _step(rec, x, y)
    assert len(calls) == 2 * (len(convs) - 1)


def test_conv_units_inside_a_larger_recomputed_unit_compute_their_spikes_in_its_rerun() -> None:
    """A rerun leaves spikes uncomputed only for the unit being rerun itself: conv units inside a larger
    unit feed each other in that unit's rerun, so its step trains as level none."""
    from efficient.models.stable_snn import ConvUnit

    class Pair(torch.nn.Module):
        recompute_unit = True

        def __init__(self) -> None:
            super().__init__()
            self.units = torch.nn.ModuleList([ConvUnit(3, 4, DLIF(2, leak=0.9, v_threshold=0.3)),
                                              ConvUnit(4, 6, DLIF(2, leak=0.9, v_threshold=0.3))])
            for i, u in enumerate(self.units):
                u.placed(self.units, i)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.units[1](self.units[0](x))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair, self.head = Pair(), torch.nn.Linear(6 * 4 * 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.pair(x.unsqueeze(0).expand(2, -1, -1, -1, -1)).mean(0).flatten(1))

    torch.manual_seed(0)
    base = Net().train()
    x, y = torch.rand(3, 3, 4, 4), torch.tensor([0, 2, 1])
    ref = _step(copy.deepcopy(base), x, y)
    rec = copy.deepcopy(base)
    plan = memory.optimize(rec, "recompute")
    assert "pair" in plan.units and "pair.units.0" not in plan.units
    assert [u.recompute_spike_input() for u in rec.pair.units] == [False, True]
    got = _step(rec, x, y)
    assert any(float(t.abs().sum()) > 0 for t in got[:-2])  # the convolutions learn: their spikes were real
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_compiled_recompute_vgg_runs_the_op_pair_and_equals_eager_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile a recomputed VGG unit runs as `efficient::bn_gain_lif_forward` / `_backward_into`
    (its z is a plain convolution's output, whose gradient backward writes into it; at level `none` the
    compiler sees BatchNorm and DLIF apart), and the compiled `recompute` step gives eager `none`'s loss
    and gradients within rounding (inductor, which writes in place)."""
    from test_memory_compiled import _ops_of_compiled_step

    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 1 << 12)
    torch.manual_seed(0)
    base = create("stable-snn-vgg11", width=0.125, fc_dim=64, timesteps=2).train()
    x, y = torch.rand(2, 3, 32, 32), torch.tensor([1, 7])
    fw, _ = _ops_of_compiled_step(copy.deepcopy(base), x, y)
    assert not [t for t, _ in fw if "gain" in str(t)], fw
    model = copy.deepcopy(base)
    memory.optimize(model, "recompute")
    fw, bw = _ops_of_compiled_step(model, x, y)
    assert any(t is torch.ops.efficient.bn_gain_lif_forward.default for t, _ in fw), fw
    assert any(t is torch.ops.efficient.bn_gain_lif_backward_into.default for t, _ in bw), bw
    assert not [t for t, _ in bw if t is torch.ops.efficient.bn_gain_lif_backward.default], bw
    none = copy.deepcopy(base)
    loss = F.cross_entropy(none(x), y)
    loss.backward()
    model = copy.deepcopy(base)
    memory.optimize(model, "recompute")
    torch._dynamo.reset()
    got = F.cross_entropy(torch.compile(model)(x), y)
    got.backward()
    torch._dynamo.reset()
    assert float(got.detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
    for (k, a), b in zip(model.named_parameters(), none.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-5, msg=k)
    for (k, a), b in zip(model.state_dict().items(), none.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)


def test_a_recomputed_wrn_reruns_its_blocks_with_their_units_by_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stable-SNN WRN's wide blocks are units of level `recompute` (each keeps its input), whose two
    BatchNorm -> DLIF pairs run by chunks; the step trains as level `none` and keeps far less."""
    from efficient.memory.measure import activation_memory

    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 1 << 12)
    calls: list[int] = []
    real = neurons.bn_gain_lif
    monkeypatch.setattr(neurons, "bn_gain_lif", lambda z, *a, **k: calls.append(1) or real(z, *a, **k))
    torch.manual_seed(0)
    base = create("stable-snn-wrn16", widen=1, timesteps=2).train()
    x, y = torch.rand(2, 3, 32, 32), torch.tensor([1, 7])
    none = copy.deepcopy(base)
    ref = _step(none, x, y)
    rec = copy.deepcopy(base)
    plan = memory.optimize(rec, "recompute")
    blocks = [n for n in plan.units if n.startswith("blocks.")]
    assert blocks == [f"blocks.{i}" for i in range(len(rec.blocks))]
    calls.clear()
    got = _step(rec, x, y)
    assert len(calls) == 2 * 2 * len(blocks)  # two pairs per block, forward and rerun
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for (k, a), b in zip(rec.state_dict().items(), none.state_dict().values()):
        assert torch.equal(a, b), k
    loss = lambda out: F.cross_entropy(out, y)  # noqa: E731
    kept = activation_memory(rec, x, loss, level="recompute").total_bytes
    assert kept < 0.2 * activation_memory(rec, x, loss, level="none").total_bytes


def test_the_triton_path_equals_the_loop_in_the_interpreter() -> None:
    """On a GPU the chunks run the LIF's Triton kernels: spikes, running statistics and gradients are
    the CPU loop's (in the Triton interpreter, two channels per chunk)."""
    pytest.importorskip("triton")
    from _interpreter import run_interpreted

    script = r"""
import json, torch
from efficient.kernels import bn_lif as K
torch.manual_seed(0)
T, B, C = 2, 3, 4
z, g = torch.randn(T * B, C, 2, 2), torch.randn(T * B, C, 2, 2)
gain, w, b = torch.tensor([0.8, 1.2]), torch.rand(C) + 0.5, torch.randn(C) * 0.1
K.RECOMPUTE_CHUNK = 2 * T * B * 4
out = {}
for backend in ("loop", "triton"):
    leaves = [t.clone().requires_grad_(True) for t in (z, gain, w, b)]
    rm, rv = torch.zeros(C), torch.ones(C)
    s = K.bn_gain_lif(leaves[0], T, leaves[1], leaves[2], leaves[3], rm, rv, 0.1, 1e-5, leak=0.9, v_threshold=0.5,
                      backend=backend)
    out[backend] = (s.detach(), rm, rv, torch.autograd.grad(s, leaves, g))
a, c = out["loop"], out["triton"]
print(json.dumps([0 < float(a[0].mean()) < 1, torch.equal(a[0], c[0]), torch.allclose(a[1], c[1]),
                  torch.allclose(a[2], c[2]), all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a[3], c[3]))]))
"""
    assert run_interpreted(script, []) == [True] * 5


def test_a_checkpointed_unit_with_spike_input_reruns_on_its_bits_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A VGG conv unit whose input is the unit before's spikes, rerun under torch's checkpoint (its output is
    larger than a chunk): the checkpoint keeps the input's bits only, the rerun hands the convolution a
    placeholder of no memory (stride 0) and the convolution reads the bits; the step's gradients and state
    are level none's."""
    from efficient.memory import conv_backward as cb

    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 1 << 8)  # every unit's output is larger: all checkpointed
    seen: list[tuple[bool, bool]] = []  # per call: (placeholder, input requires grad)
    real = cb._BitsInputConv2d.apply

    def recorded(x, *args):
        seen.append((all(s == 0 for s in x.stride()), x.requires_grad))
        return real(x, *args)

    monkeypatch.setattr(cb._BitsInputConv2d, "apply", recorded)
    rec, none, got, ref, _ = _vgg_none_then_recompute(seen)
    n = sum(u.recompute_input_from_bits() for u in rec.modules() if type(u).__name__ == "ConvUnit")
    assert n == 4  # VGG-11's units right after another
    assert seen == [(False, True)] * n + [(True, False)] * n  # forward on the input, rerun on a placeholder
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for (k, a), b in zip(rec.state_dict().items(), none.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_unit_that_says_it_reads_bits_but_does_not_is_named() -> None:
    """A unit that claims `recompute_input_from_bits()` but reads its input itself would rerun on a
    placeholder: its forward already fails, naming it."""
    from efficient.memory import recompute as rc

    class Claims(torch.nn.Module):
        recompute_unit = True

        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)

        def recompute_spike_input(self) -> bool:
            return True

        def recompute_input_from_bits(self) -> bool:
            return True

        def forward(self, x: torch.Tensor, spike_bits: torch.Tensor | None = None) -> torch.Tensor:
            return self.conv(x)  # ignores the bits

    unit = Claims().train()
    rc.wrap(unit)
    x = torch.rand(2, 2, 4, 4).lt(0.5).float().requires_grad_()
    with pytest.raises(RuntimeError, match="Claims says recompute_input_from_bits"):
        unit(x)
