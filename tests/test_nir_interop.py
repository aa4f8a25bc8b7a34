"""NIR across libraries: graphs we export run in norse 1.1, sinabs 3.1, rockpool 3.1, spikingjelly 2.0
and snntorch 1.0's importers, and their exporters' graphs run in ours, spikes compared step by step.

Each test records (library, direction, graph) with `record_property`; `bench/nir_table.py` turns a
junit-xml run of this file into the README's table. Where a library cannot take a graph, or takes
it and computes something else, the test is a strict xfail whose reason is that library's error
(or the first differing step), so it turns into a failure the day the library is fixed.

Reference: the graph run by `efficient.load`, whose spikes equal the exported model's (tested in
tests/test_nir.py). Two float paths may differ in the last bits (one GEMM per step against one over
T*B rows; `>` against `>=` at threshold), so a spike may flip only where our membrane is within TIE
of threshold, and a sample's later steps leave the comparison after such a flip.

What maps to what (forward Euler, `v += dt/tau * (v_leak - v + r*I)`, unless said):
- norse LIFBoxCell: the same Euler step at its `dt`, spike at `v > v_th`, reset to `v_reset`; it
  ignores `r` (assumes 1). IAFCell: `v += I` each step whatever `dt` and `r`. LIBoxCell: Euler.
- sinabs: `tau` in time steps, `v = exp(-1/tau) v + I`, reset by subtraction, whatever the node says.
- rockpool: imports Linear/Affine and CubaLIF only; LIFNeuronTorch resets by subtraction.
- spikingjelly: its LIFNode/IFNode are our kernel's charge (see efficient.export.neurons).
- snntorch import: LIF as `Leaky(beta = 1 - dt/tau, reset to zero)` at dt = 1e-4, needs `r*dt/tau = 1`.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn

import efficient
from efficient.errors import ArtifactError
from efficient.export import from_nir, to_nir, write_nir
from efficient.models.neurons import LIF, SpikingNeuron

nir = pytest.importorskip("nir")
pytest.importorskip("nirtorch")

TIE = 1e-4
T, B = 6, 3


@pytest.fixture
def interop(record_property) -> Callable[[str, str, str], None]:
    """Tags the test with its table cell: library, direction, graph (node types)."""

    def tag(library: str, direction: str, graph: str) -> None:
        record_property("nir_interop", json.dumps({"library": library, "direction": direction, "graph": graph}))

    return tag


@pytest.fixture(autouse=True)
def _quiet():
    """The peers log a warning per diverging parameter and print progress; the tests assert instead."""
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def _record(model: nn.Module) -> list:
    """(spikes, pre-reset membrane, threshold) of each of our neurons in `model`, in call order."""
    out: list = []
    for m in model.modules():
        if isinstance(m, SpikingNeuron):
            m.store_membrane = True
            m.register_forward_hook(lambda m_, _i, o: out.append((o.detach(), m_.membrane.detach(), float(m_.v_threshold))))
    return out


def assert_same_spikes(ref: list, got: list[torch.Tensor]) -> None:
    """Spikes of every layer agree with our reference but for flips at a threshold tie (see module doc)."""
    assert len(ref) == len(got) > 0, f"{len(got)} spiking layers against our {len(ref)}"
    t_idx = torch.arange(ref[0][0].shape[0])[:, None]
    first = torch.full((ref[0][0].shape[1],), ref[0][0].shape[0])
    for i, ((s, h, thr), g) in enumerate(zip(ref, got)):
        g = g.detach().reshape(s.shape).to(s.dtype)
        diff = (s != g).reshape(*s.shape[:2], -1) & (t_idx < first)[..., None]
        t_diff = torch.where(diff.any(-1), t_idx, s.shape[0]).min(0).values
        away = ((h - thr).abs() > TIE).reshape(*s.shape[:2], -1)
        bad = diff & (t_idx == t_diff)[..., None] & away
        assert not bad.any(), f"layer {i}: spikes differ away from threshold from step {int(t_diff.min())} on"
        first = torch.minimum(first, t_diff)
    assert (t_idx < first).any(), "every sample flipped at a tie at step 0: nothing compared"


def _ours(path, x: torch.Tensor, dt: float | None = None) -> tuple[torch.Tensor, list]:
    """Our run of a `.nir` file (or an in-memory graph) on `x`; each neuron layer's (spikes, membrane, threshold)."""
    if isinstance(path, Path):
        net = efficient.load(path, dt=dt) if dt is not None else efficient.load(path)
    else:
        net = from_nir(path, dt=dt)
    rec = _record(net)
    with torch.no_grad():
        out = net(x)
    assert rec and all(0.02 < s.float().mean() < 0.98 for s, _, _ in rec), "a layer is silent or saturated"
    return out, rec


def _hooked(net: nn.Module, is_neuron: Callable[[nn.Module], bool], pick=lambda o: o[0] if isinstance(o, tuple) else o) -> dict:
    """Per-step outputs of each neuron module of a peer network, keyed by module, in first-call order."""
    seen: dict = {}
    for m in net.modules():
        if is_neuron(m):
            m.register_forward_hook(lambda m_, _i, o: seen.setdefault(m_, []).append(pick(o).detach()))
    return seen


def _stepped(net: nn.Module, x: torch.Tensor, seen: dict) -> list[torch.Tensor]:
    """Runs a stateful peer graph (`net(x_t, state) -> (out, state)`) over T; each layer's spikes [T, B, ...]."""
    state = None
    with torch.no_grad():
        for t in range(x.shape[0]):
            _, state = net(x[t], state)
    return [torch.stack(v) for v in seen.values()]


# ---------------------------------------------------------------------------------------------
# the models we export
# ---------------------------------------------------------------------------------------------


def _scaled(net: nn.Module, k: float = 3.0) -> nn.Module:
    """Weights `k` times their initialisation, so that every layer fires (neuron parameters untouched)."""
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                for p in m.parameters(recurse=False):
                    p.mul_(k)
    return net.eval()


def lif_mlp(decay_input: bool) -> tuple[nn.Module, torch.Tensor]:
    """Ours: Linear, LIF, Linear, LIF (decay_input -> r = 1, else r = tau)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), LIF(tau=2.0, decay_input=decay_input), nn.Linear(16, 4),
                        LIF(tau=3.0, decay_input=decay_input, v_threshold=0.5))
    return _scaled(net), torch.rand(T, B, 8) * 2


def sj_if_mlp() -> tuple[nn.Module, torch.Tensor]:
    """spikingjelly multi-step Linear, IFNode, Linear, IFNode."""
    from spikingjelly.activation_based import functional, layer, neuron

    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(8, 16), neuron.IFNode(), layer.Linear(16, 4), neuron.IFNode(v_threshold=0.5))
    functional.set_step_mode(net, "m")
    return _scaled(net, 2.0), torch.rand(T, B, 8)


def snntorch_conv() -> tuple[nn.Module, torch.Tensor]:
    """snntorch, stepped: Conv2d, AvgPool2d, Leaky, Conv2d, AvgPool2d (global), Leaky; reset to zero."""
    snn = pytest.importorskip("snntorch")

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.AvgPool2d(2), snn.Leaky(beta=0.8, init_hidden=True, reset_mechanism="zero"),
                        nn.Conv2d(4, 6, 3, padding=1), nn.AvgPool2d(4),
                        snn.Leaky(beta=0.6, threshold=0.5, init_hidden=True, reset_mechanism="zero"))
    return _scaled(net), (torch.rand(T, B, 2, 8, 8) > 0.5).float()


def sj_conv(flatten: bool = False, pool: bool = True) -> tuple[nn.Module, torch.Tensor]:
    """spikingjelly multi-step: Conv2d, LIFNode, AvgPool2d (if `pool`), then Conv2d + global AvgPool2d (or
    Flatten + Linear), LIFNode."""
    from spikingjelly.activation_based import functional, layer, neuron

    torch.manual_seed(0)
    side = 4 if pool else 8
    head = ([layer.Flatten(), layer.Linear(4 * side * side, 6)] if flatten
            else [layer.Conv2d(4, 6, 3, padding=1), layer.AvgPool2d(side)])
    net = nn.Sequential(layer.Conv2d(2, 4, 3, padding=1), neuron.LIFNode(tau=2.0, decay_input=False),
                        *([layer.AvgPool2d(2)] if pool else []), *head,
                        neuron.LIFNode(tau=3.0, decay_input=False, v_threshold=0.5))
    functional.set_step_mode(net, "m")
    return _scaled(net), (torch.rand(T, B, 2, 8, 8) > 0.5).float()


def _export(model: nn.Module, x: torch.Tensor, path: Path, dt: float, stepped: bool = False) -> Path:
    write_nir(to_nir(model, x[0] if stepped else x, dt=dt), path)
    return path


# ---------------------------------------------------------------------------------------------
# efficient -> norse
# ---------------------------------------------------------------------------------------------


def _norse(path: Path, x: torch.Tensor, dt: float) -> list[torch.Tensor]:
    norse = pytest.importorskip("norse.torch")
    net = norse.from_nir(nir.read(path), dt=dt)
    kinds = (norse.LIFBoxCell, norse.IAFCell)
    return _stepped(net, x, _hooked(net, lambda m: isinstance(m, kinds)))


def test_to_norse_affine_lif(tmp_path: Path, interop) -> None:
    interop("norse", "efficient → norse", "Affine + LIF (r = 1)")
    model, x = lif_mlp(decay_input=True)
    path = _export(model, x, tmp_path / "m.nir", dt=1e-3)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _norse(path, x, dt=1e-3))


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="norse logs 'The parameter r is expected to be set to 1' and drops r: other spikes")
def test_to_norse_affine_lif_r_tau(tmp_path: Path, interop) -> None:
    interop("norse", "efficient → norse", "Affine + LIF (r ≠ 1)")
    model, x = lif_mlp(decay_input=False)
    path = _export(model, x, tmp_path / "m.nir", dt=1e-3)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _norse(path, x, dt=1e-3))


def test_to_norse_affine_if(tmp_path: Path, interop) -> None:
    interop("norse", "efficient → norse", "Affine + IF")
    model, x = sj_if_mlp()
    path = _export(model, x, tmp_path / "m.nir", dt=1e-3)  # IF written with r = 1/dt: dt * r * I = I, norse's v += I
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _norse(path, x, dt=1e-3))


@pytest.mark.xfail(strict=True, raises=KeyError,
                   reason="norse.from_nir has no module for AvgPool2d; nirtorch's graph then fails: KeyError: '1'")
def test_to_norse_conv_avgpool(tmp_path: Path, interop) -> None:
    interop("norse", "efficient → norse", "Conv2d + AvgPool2d + LIF")
    model, x = snntorch_conv()
    path = _export(model, x, tmp_path / "m.nir", dt=1e-4, stepped=True)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _norse(path, x, dt=1e-4))


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="norse.from_nir applies NIR's per-sample Flatten(0, -1) to the batch: "
                          "'mat1 and mat2 shapes cannot be multiplied (1x768 and 256x6)'")
def test_to_norse_flatten(tmp_path: Path, interop) -> None:
    interop("norse", "efficient → norse", "Conv2d + LIF + Flatten + Affine")
    model, x = sj_conv(flatten=True, pool=False)
    path = _export(model, x, tmp_path / "m.nir", dt=1e-3)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _norse(path, x, dt=1e-3))


# ---------------------------------------------------------------------------------------------
# efficient -> sinabs
# ---------------------------------------------------------------------------------------------


def _sinabs(path: Path, x: torch.Tensor) -> list[torch.Tensor]:
    sinabs = pytest.importorskip("sinabs")
    import sinabs.layers as sl

    net = sinabs.from_nir(nir.read(path), batch_size=x.shape[1])
    seen = _hooked(net, lambda m: isinstance(m, (sl.LIFSqueeze, sl.IAFSqueeze)), pick=lambda o: o)
    with torch.no_grad():  # Squeeze layers take [B*T, ...], batch-major
        net(x.transpose(0, 1).flatten(0, 1))
    return [v[0].unflatten(0, (x.shape[1], x.shape[0])).transpose(0, 1) for v in seen.values()]


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="sinabs.from_nir builds LIFSqueeze with reset by subtraction and tau read in time steps "
                          "(exp(-1/tau) decay), whatever v_reset and dt say: other spikes")
def test_to_sinabs_affine_lif(tmp_path: Path, interop) -> None:
    interop("sinabs", "efficient → sinabs", "Affine + LIF")
    model, x = lif_mlp(decay_input=False)
    path = _export(model, x, tmp_path / "m.nir", dt=1.0)  # tau in steps, sinabs' unit; r = tau is its v += I
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _sinabs(path, x))


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="sinabs.from_nir builds IAFSqueeze with reset by subtraction (and v >= -v_th), "
                          "whatever v_reset says: other spikes")
def test_to_sinabs_affine_if(tmp_path: Path, interop) -> None:
    interop("sinabs", "efficient → sinabs", "Affine + IF")
    model, x = sj_if_mlp()
    path = _export(model, x, tmp_path / "m.nir", dt=1.0)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _sinabs(path, x))


@pytest.mark.xfail(strict=True, raises=ValueError,
                   reason="sinabs.from_nir tests any(v_leak) on a [C, H, W] array: 'The truth value of an array "
                          "with more than one element is ambiguous'; it has no AvgPool2d either")
def test_to_sinabs_conv(tmp_path: Path, interop) -> None:
    interop("sinabs", "efficient → sinabs", "Conv2d + AvgPool2d + LIF")
    model, x = snntorch_conv()
    path = _export(model, x, tmp_path / "m.nir", dt=1.0, stepped=True)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _sinabs(path, x))


# ---------------------------------------------------------------------------------------------
# efficient -> rockpool
# ---------------------------------------------------------------------------------------------


def _rockpool(path: Path, x: torch.Tensor) -> list[torch.Tensor]:
    rnir = pytest.importorskip("rockpool.nn.modules.torch.nir")
    net = rnir.from_nir(nir.read(path))
    out, _state = net(x.transpose(0, 1))  # rockpool is batch-major [B, T, ...]
    return [out.transpose(0, 1)]


@pytest.mark.xfail(strict=True, raises=AttributeError,
                   reason="rockpool.from_nir reads LIF nodes as CubaLIF: \"'LIF' object has no attribute 'tau_mem'\"")
def test_to_rockpool_affine_lif(tmp_path: Path, interop) -> None:
    interop("rockpool", "efficient → rockpool", "Affine + LIF")
    model, x = lif_mlp(decay_input=False)
    path = _export(model, x, tmp_path / "m.nir", dt=1e-3)
    _, ref = _ours(path, x)
    assert_same_spikes(ref[-1:], _rockpool(path, x))


@pytest.mark.xfail(strict=True, raises=NotImplementedError,
                   reason="rockpool.from_nir: \"Cannot convert <class 'nir.ir.conv.Conv2d'> to rockpool module\"")
def test_to_rockpool_conv(tmp_path: Path, interop) -> None:
    interop("rockpool", "efficient → rockpool", "Conv2d + AvgPool2d + LIF")
    model, x = snntorch_conv()
    path = _export(model, x, tmp_path / "m.nir", dt=1e-3, stepped=True)
    _, ref = _ours(path, x)
    assert_same_spikes(ref[-1:], _rockpool(path, x))


# ---------------------------------------------------------------------------------------------
# efficient -> spikingjelly, snntorch (the two conv nets of their own users, exported by us)
# ---------------------------------------------------------------------------------------------


def _spikingjelly(path: Path, x: torch.Tensor, dt: float) -> list[torch.Tensor]:
    import_from_nir = pytest.importorskip("spikingjelly.activation_based.nir_exchange").import_from_nir
    from spikingjelly.activation_based import neuron

    net = import_from_nir(path, dt=dt, step_mode="m")
    seen = _hooked(net, lambda m: isinstance(getattr(m, "module", None), neuron.BaseNode))
    with torch.no_grad():
        net(x)
    return [v[0] for v in seen.values()]


def _snntorch(path: Path, x: torch.Tensor) -> list[torch.Tensor]:
    snn = pytest.importorskip("snntorch")
    import_from_nir = pytest.importorskip("snntorch.import_nir").import_from_nir

    net = import_from_nir(nir.read(path))
    return _stepped(net, x, _hooked(net, lambda m: isinstance(m, snn.Leaky)))


@pytest.mark.parametrize("make", [snntorch_conv, sj_conv], ids=["snntorch-conv", "spikingjelly-conv"])
def test_to_spikingjelly_conv(tmp_path: Path, interop, make) -> None:
    interop("spikingjelly", "efficient → spikingjelly", "Conv2d + AvgPool2d + LIF")
    model, x = make()
    path = _export(model, x, tmp_path / "m.nir", dt=1e-4, stepped=make is snntorch_conv)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _spikingjelly(path, x, dt=1e-4))


@pytest.mark.parametrize("make", [snntorch_conv, sj_conv], ids=["snntorch-conv", "spikingjelly-conv"])
def test_to_snntorch_conv(tmp_path: Path, interop, make) -> None:
    interop("snntorch", "efficient → snntorch", "Conv2d + AvgPool2d + LIF")
    model, x = make()
    path = _export(model, x, tmp_path / "m.nir", dt=1e-4, stepped=make is snntorch_conv)  # snntorch's importer assumes 1e-4
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _snntorch(path, x))


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="snntorch's import_from_nir applies NIR's per-sample Flatten(0, -1) to the batch: "
                          "'mat1 and mat2 shapes cannot be multiplied (1x192 and 64x6)'")
def test_to_snntorch_flatten(tmp_path: Path, interop) -> None:
    interop("snntorch", "efficient → snntorch", "Flatten + Affine")
    model, x = sj_conv(flatten=True)
    path = _export(model, x, tmp_path / "m.nir", dt=1e-4)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _snntorch(path, x))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="snntorch's import_from_nir: 'r != 1 not supported' for IF "
                                                             "(and with r = 1 it builds a Leaky with beta=0.9)")
def test_to_snntorch_if(tmp_path: Path, interop) -> None:
    interop("snntorch", "efficient → snntorch", "Affine + IF")
    model, x = sj_if_mlp()
    path = _export(model, x, tmp_path / "m.nir", dt=1e-4)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _snntorch(path, x))


def test_to_snntorch_lif_r1(tmp_path: Path, interop) -> None:
    """r*dt/tau != 1: snntorch divides the threshold by it instead (the same spikes, its membrane tau times ours)."""
    interop("snntorch", "efficient → snntorch", "Affine + LIF (r = 1)")
    model, x = lif_mlp(decay_input=True)
    path = _export(model, x, tmp_path / "m.nir", dt=1e-4)
    _, ref = _ours(path, x)
    assert_same_spikes(ref, _snntorch(path, x))


# ---------------------------------------------------------------------------------------------
# their exporters -> efficient
# ---------------------------------------------------------------------------------------------


@pytest.mark.xfail(strict=True, raises=ArtifactError,
                   reason="norse.to_nir writes tau = dt / tau_mem_inv (1e-5 s for its 10 ms default at dt = 1 ms): read "
                          "at norse's dt the graph's LIF is unstable and efficient says so: 'tau=1e-05 s < dt=0.001 s'")
def test_from_norse_lif_li(interop) -> None:
    interop("norse", "norse → efficient", "Affine + LIF + LI")
    norse = pytest.importorskip("norse.torch")
    torch.manual_seed(0)
    net = norse.SequentialState(nn.Linear(8, 16), norse.LIFBoxCell(), nn.Linear(16, 4), norse.LIBoxCell())
    with torch.no_grad():
        net[0].weight.mul_(60.0)  # norse's default tau_mem = 10 ms at dt = 1 ms: large currents make it fire
    x = torch.rand(T, B, 8)
    graph = norse.to_nir(net, x[0, :1])  # norse writes no dt: we pass its 1 ms
    seen = _hooked(net, lambda m: isinstance(m, norse.LIFBoxCell))
    outs, state = [], None
    with torch.no_grad():
        for t in range(T):
            o, state = net(x[t], state)
            outs.append(o)
    out, ref = _ours(graph, x, dt=1e-3)
    assert_same_spikes(ref[:1], [torch.stack(seen[net[1]])])
    torch.testing.assert_close(out, torch.stack(outs), rtol=1e-5, atol=1e-5)  # the LI membrane


def test_from_norse_if(interop) -> None:
    interop("norse", "norse → efficient", "Affine + IF")
    norse = pytest.importorskip("norse.torch")
    torch.manual_seed(0)
    net = norse.SequentialState(nn.Linear(8, 16), norse.IAFCell())
    x = torch.rand(T, B, 8)
    graph = norse.to_nir(net, x[0, :1])  # IF(r=1); norse adds the input each step: dt * r * I = I at dt = 1
    spikes = _stepped(net, x, _hooked(net, lambda m: isinstance(m, norse.IAFCell)))
    _, ref = _ours(graph, x, dt=1.0)
    assert_same_spikes(ref, spikes)


@pytest.mark.xfail(strict=True, raises=ArtifactError,
                   reason="norse.to_nir writes no node for nn.Flatten (None in the graph): "
                          "'the graph uses nodes efficient cannot run: '2' (NoneType ...)'")
def test_from_norse_conv_flatten(interop) -> None:
    interop("norse", "norse → efficient", "Conv2d + LIF + Flatten")
    norse = pytest.importorskip("norse.torch")
    net = norse.SequentialState(nn.Conv2d(2, 3, 3), norse.LIFBoxCell(), nn.Flatten(), nn.Linear(12, 2))
    from_nir(norse.to_nir(net, torch.rand(1, 2, 4, 4)), dt=1e-3)


def _sinabs_net(reset, conv: bool = False) -> tuple[nn.Module, torch.Tensor]:
    """sinabs IAF layers firing one spike per step at most (SingleSpike; its default MultiSpike emits floor(v/v_th))."""
    import sinabs.layers as sl
    from sinabs.activation import SingleSpike

    torch.manual_seed(0)
    iaf = lambda **kw: sl.IAFSqueeze(batch_size=B, reset_fn=reset, spike_fn=SingleSpike, **kw)  # noqa: E731
    if conv:
        net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), iaf(), sl.SumPool2d(2), nn.Flatten(), nn.Linear(64, 6), iaf())
        return _scaled(net, 3.0), (torch.rand(T, B, 2, 8, 8) > 0.5).float()
    net = nn.Sequential(nn.Linear(8, 16), iaf(), nn.Linear(16, 4), iaf(spike_threshold=0.5))
    return _scaled(net, 2.0), torch.rand(T, B, 8)


def _sinabs_run(net: nn.Module, x: torch.Tensor) -> tuple[object, list[torch.Tensor]]:
    """sinabs' NIR graph of `net` and its spikes per IAF layer, [T, B, ...] (Squeeze layers take [B*T, ...])."""
    sinabs = pytest.importorskip("sinabs")
    import sinabs.layers as sl

    flat = x.transpose(0, 1).flatten(0, 1)
    graph = sinabs.to_nir(net, flat)
    sinabs.reset_states(net)
    seen = _hooked(net, lambda m: isinstance(m, sl.IAFSqueeze), pick=lambda o: o)
    with torch.no_grad():
        net(flat)
    return graph, [v[0].unflatten(0, (x.shape[1], x.shape[0])).transpose(0, 1) for v in seen.values()]


@pytest.mark.parametrize("conv", [False, True], ids=["affine", "conv"])
def test_from_sinabs_if_reset_to_zero(interop, conv: bool) -> None:
    pytest.importorskip("sinabs")
    from sinabs.activation import MembraneReset

    interop("sinabs", "sinabs → efficient",
            "Conv2d + SumPool2d + Flatten + IF" if conv else "Affine + IF")
    net, x = _sinabs_net(MembraneReset(), conv)
    graph, spikes = _sinabs_run(net, x)  # sinabs: v += I per step (dt = 1), v >= v_th fires, reset to 0
    _, ref = _ours(graph, x, dt=1.0)
    assert_same_spikes(ref, spikes)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="sinabs.to_nir writes IAF with reset by subtraction (its default) as an IF that resets "
                          "to v_reset = 0: the graph computes other spikes")
def test_from_sinabs_if_subtract(interop) -> None:
    pytest.importorskip("sinabs")
    from sinabs.activation import MembraneSubtract

    interop("sinabs", "sinabs → efficient", "Affine + IF (reset by subtraction)")
    net, x = _sinabs_net(MembraneSubtract())
    graph, spikes = _sinabs_run(net, x)
    _, ref = _ours(graph, x, dt=1.0)
    assert_same_spikes(ref, spikes)


@pytest.mark.xfail(strict=True, raises=TypeError,
                   reason="nir.write of sinabs.to_nir's conv graph: 'One of data, shape or dtype must be specified' "
                          "(it leaves Conv2d input_shape unset)")
def test_from_sinabs_conv_file(tmp_path: Path, interop) -> None:
    pytest.importorskip("sinabs")
    from sinabs.activation import MembraneReset

    interop("sinabs", "sinabs → efficient", "Conv2d + SumPool2d + Flatten + IF, via a .nir file")
    net, x = _sinabs_net(MembraneReset(), conv=True)
    graph, spikes = _sinabs_run(net, x)
    nir.write(tmp_path / "s.nir", graph)
    _, ref = _ours(tmp_path / "s.nir", x, dt=1.0)
    assert_same_spikes(ref, spikes)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="rockpool.to_nir writes LIFNeuronTorch (reset by subtraction, several spikes per step, "
                          "exp(-dt/tau) decay) as a NIR LIF that resets to 0, r = tau*exp(-dt/tau)/dt: other spikes")
def test_from_rockpool_lif(interop) -> None:
    interop("rockpool", "rockpool → efficient", "Linear + LIF")
    pytest.importorskip("rockpool.nn.modules.torch.nir")
    from rockpool.nn.combinators import Sequential
    from rockpool.nn.modules import LIFNeuronTorch, LinearTorch
    from rockpool.nn.modules.torch.nir import to_nir as rockpool_to_nir

    torch.manual_seed(0)
    net = Sequential(LinearTorch((8, 16)), LIFNeuronTorch(16, tau_mem=0.004, dt=1e-3))
    with torch.no_grad():
        net[0].weight.mul_(4.0)
    x = torch.rand(T, B, 8)
    spikes, _, _ = net(x.transpose(0, 1))
    _, ref = _ours(rockpool_to_nir(net), x, dt=1e-3)
    assert_same_spikes(ref, [spikes.transpose(0, 1)])


@pytest.mark.xfail(strict=True, raises=ArtifactError,
                   reason="rockpool.to_nir writes LIFTorch as CubaLIF (synaptic current as a second state), "
                          "which efficient does not run: \"'1_LIFTorch' (CubaLIF: ...)\"")
def test_from_rockpool_cubalif(interop) -> None:
    interop("rockpool", "rockpool → efficient", "Linear + CubaLIF")
    pytest.importorskip("rockpool.nn.modules.torch.nir")
    from rockpool.nn.combinators import Sequential
    from rockpool.nn.modules import LIFTorch, LinearTorch
    from rockpool.nn.modules.torch.nir import to_nir as rockpool_to_nir

    from_nir(rockpool_to_nir(Sequential(LinearTorch((8, 16)), LIFTorch(16))), dt=1e-3)


def test_from_spikingjelly_conv(tmp_path: Path, interop) -> None:
    interop("spikingjelly", "spikingjelly → efficient", "Conv2d + AvgPool2d + Flatten + LIF")
    export_to_nir = pytest.importorskip("spikingjelly.activation_based.nir_exchange").export_to_nir
    from spikingjelly.activation_based import functional

    model, x = sj_conv(flatten=True)
    export_to_nir(model, x, tmp_path / "sj.nir", dt=1e-3)
    functional.reset_net(model)
    seen = _hooked(model, lambda m: type(m).__name__ == "LIFNode", pick=lambda o: o)
    with torch.no_grad():
        model(x)
    _, ref = _ours(tmp_path / "sj.nir", x, dt=1e-3)  # spikingjelly writes no dt: pass the one it used
    assert_same_spikes(ref, [v[0] for v in seen.values()])


@pytest.mark.xfail(strict=True, raises=ValueError,
                   reason="snntorch's export_to_nir: 'Type inference error: type mismatch: input.output: [[3 4]] -> "
                          "0.input: [[4]]' (it writes the batch into the input type)")
def test_from_snntorch_leaky(interop) -> None:
    interop("snntorch", "snntorch → efficient", "Affine + LIF")
    snn = pytest.importorskip("snntorch")
    from snntorch.export_nir import export_to_nir

    export_to_nir(nn.Sequential(nn.Linear(4, 5), snn.Leaky(beta=0.9, init_hidden=True)), torch.rand(3, 4))


@pytest.mark.xfail(strict=True, raises=IndexError, reason="snntorch's export_to_nir on Conv2d + AvgPool2d: "
                                                          "'IndexError: tuple index out of range'")
def test_from_snntorch_conv(interop) -> None:
    interop("snntorch", "snntorch → efficient", "Conv2d + AvgPool2d + LIF")
    snn = pytest.importorskip("snntorch")
    from snntorch.export_nir import export_to_nir

    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.AvgPool2d(2), snn.Leaky(beta=0.9, init_hidden=True))
    export_to_nir(net, torch.rand(3, 2, 6, 6))
