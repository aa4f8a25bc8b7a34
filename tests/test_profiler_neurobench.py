"""NeuroBench 2.3 as the oracle: the profiler's NeuroBench block equals what `neurobench`'s Benchmark
reports (footprint, connection sparsity, activation sparsity, synaptic operations, membrane updates)
on an snntorch conv net, a plain torch CNN and one of our spiking transformers through its hooks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import efficient
from efficient.profiler import profile

nb_bench = pytest.importorskip("neurobench.benchmarks")
snn = pytest.importorskip("snntorch")
from neurobench.metrics.static import ConnectionSparsity, Footprint  # noqa: E402
from neurobench.metrics.workload import ActivationSparsity, MembraneUpdates, SynapticOperations  # noqa: E402
from neurobench.models import SNNTorchModel, TorchModel  # noqa: E402


def _excite(model: nn.Module, gain: float, zero_every: int = 5) -> None:
    """Weights large enough that neurons fire, with every `zero_every`-th weight zero (connection sparsity)."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear)):
            with torch.no_grad():
                w = torch.randn(m.weight.shape, generator=g) * gain / math.sqrt(m.weight[0].numel())
                w.view(-1)[::zero_every] = 0.0
                m.weight.copy_(w)


def _neurobench(model, x: torch.Tensor) -> dict:
    loader = DataLoader(TensorDataset(x, torch.zeros(x.shape[0], dtype=torch.long)), batch_size=x.shape[0])
    bench = nb_bench.Benchmark(model, loader, [], [], [[Footprint, ConnectionSparsity],
                                                        [ActivationSparsity, SynapticOperations, MembraneUpdates]])
    return bench.run(quiet=True)


def _check(ours: dict, theirs: dict, membrane: bool) -> None:
    assert ours["footprint"] == theirs["Footprint"]
    assert ours["connection_sparsity"] == theirs["ConnectionSparsity"] and ours["connection_sparsity"] > 0
    assert ours["activation_sparsity"] == pytest.approx(theirs["ActivationSparsity"], abs=1e-12)
    assert 0 < ours["activation_sparsity"] < 1
    so, their_so = ours["synaptic_operations"], theirs["SynapticOperations"]
    for key in ("Effective_MACs", "Effective_ACs", "Dense"):
        assert so[key] == pytest.approx(their_so[key], abs=1e-9), key
    if membrane:
        assert ours["membrane_updates"] == pytest.approx(theirs["MembraneUpdates"], abs=1e-9) and ours["membrane_updates"] > 0
    else:  # no neuron exposes a membrane NeuroBench can read: it counts 0, we say "not measured"
        assert ours["membrane_updates"] is None and theirs["MembraneUpdates"] == 0


class StepLoop(nn.Module):
    """Runs an snntorch net over the steps of [B, T, ...] as NeuroBench's SNNTorchModel does."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        snn.utils.reset(self.net)
        return torch.stack([self.net(data[:, t])[0] for t in range(data.shape[1])], 1)


def _snntorch_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), snn.Leaky(beta=0.9, init_hidden=True), nn.Flatten(),
                        nn.Linear(4 * 8 * 8, 10), snn.Leaky(beta=0.9, init_hidden=True, output=True))
    _excite(net, 3.0)
    return net


def test_snntorch_conv_net_equals_neurobench():
    net = _snntorch_net()
    x = torch.rand(3, 4, 1, 8, 8, generator=torch.Generator().manual_seed(1))  # [B, T, C, H, W], real pixels
    theirs = _neurobench(SNNTorchModel(_snntorch_net()), x)  # a fresh twin: snntorch keeps state in buffers
    report = profile(StepLoop(net), inputs=x, neurobench=True)
    _check(report.neurobench, theirs, membrane=True)
    so = report.neurobench["synaptic_operations"]
    assert so["Effective_MACs"] > 0 and so["Effective_ACs"] > 0  # the first conv on pixels, the linear on spikes
    # the NeuroBench convention charges the same Effective MACs / ACs, for the whole batch
    nbc = profile(StepLoop(net), inputs=x, convention="neurobench")
    assert nbc.totals["macs"] == 3 * so["Effective_MACs"] and nbc.totals["sops"] == 3 * so["Effective_ACs"]


def test_plain_torch_cnn_equals_neurobench():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 3 * 3, 10), nn.Sigmoid())
    _excite(net, 1.0)
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    theirs = _neurobench(TorchModel(net), x)
    report = profile(net, inputs=x, neurobench=True)
    _check(report.neurobench, theirs, membrane=False)
    # Dense skips the padded border of the first conv; our dense_macs counts it (fvcore's convention)
    assert report.neurobench["synaptic_operations"]["Dense"] * 4 < report.totals["dense_macs"]


def test_zoo_spiking_transformer_equals_neurobench_through_its_hooks():
    from efficient.models.neurons import SpikingNeuron

    model = efficient.zoo.create("spikformer-tiny", timesteps=2).eval()
    _excite(model, 5.0)
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    wrapped = TorchModel(model)
    wrapped.add_activation_module(SpikingNeuron)  # NeuroBench's hook for neurons of other libraries
    theirs = _neurobench(wrapped, x)
    report = profile(model, inputs=x, neurobench=True)
    _check(report.neurobench, theirs, membrane=False)
    assert report.neurobench["synaptic_operations"]["Effective_ACs"] > 0


def test_neurobench_block_in_outputs(capsys):
    net = _snntorch_net()
    x = torch.rand(2, 3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    r = profile(StepLoop(net), inputs=x, neurobench=True)
    assert "### NeuroBench metrics" in r.to_markdown() and 'id="neurobench"' in r.to_html()
    assert r.to_dict()["neurobench"]["definitions"]["synaptic_operations"].startswith("per Linear/Conv call")
    # the collector's own convolutions are not counted as the model's
    plain = profile(StepLoop(net), inputs=x)
    assert (plain.totals["macs"], plain.totals["sops"]) == (r.totals["macs"], r.totals["sops"])
