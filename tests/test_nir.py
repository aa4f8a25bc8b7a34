"""NIR export/import: round trips give identical spikes and logits (but for spikes at threshold ties
where batch norm is folded or GEMMs are split otherwise, see TIE); graphs cross to and from
spikingjelly 2.0 and snntorch 1.0 with the same outputs; the dt convention; clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import efficient
from efficient import zoo
from efficient.errors import ArtifactError, ConfigError
from efficient.export import load_nir, to_nir, write_nir
from efficient.models.neurons import DLIF, LIF, PLIF, SpikingNeuron

nir = pytest.importorskip("nir")


def _spike_recorder(model: nn.Module) -> list[torch.Tensor]:
    """Spikes of every neuron of `model`, in call order, appended at each forward."""
    out: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, SpikingNeuron):
            m.register_forward_hook(lambda _m, _i, o: out.append(o.detach()))
    return out


# Spikes of two implementations whose pre-activations may differ in the last bits (BN folded into
# the conv in float64 against conv-then-BN in fp32, or one GEMM per step against one over T*B rows)
# agree except where a membrane lies within an ulp of threshold. `_compared_steps` allows a flip only
# where the reference membrane is within TIE of threshold (ulp-level differences stay orders below
# it); a wrong tau, threshold, weight or reset flips spikes far from threshold and still fails.
TIE = 1e-4


def _reference_recorder(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(spikes, pre-reset membrane, threshold) of every neuron of our `model`, in call order."""
    out: list = []
    for m in model.modules():
        if isinstance(m, SpikingNeuron):
            m.store_membrane = True
            m.register_forward_hook(
                lambda m_, _i, o: out.append((o.detach(), m_.membrane.detach(), float(m_.v_threshold))))
    return out


def _compared_steps(ref: list, got: list[torch.Tensor]) -> torch.Tensor:
    """[T, B] mask of the steps before any spike flipped at a threshold tie (in this sample, at any
    layer so far); fails on a spike that differs away from threshold before such a flip. After a
    flip the sample's later spikes and outputs legitimately differ, so they leave the comparison."""
    assert len(ref) == len(got) > 0
    T, B = ref[0][0].shape[:2]
    t_idx = torch.arange(T)[:, None]
    first = torch.full((B,), T)  # per sample: the first step with a flip at a tie
    for i, ((s, h, thr), g) in enumerate(zip(ref, got)):
        assert g.shape == s.shape, f"layer {i}: {tuple(g.shape)} vs {tuple(s.shape)}"
        diff = (s != g.to(s.dtype)).reshape(T, B, -1) & (t_idx < first)[..., None]
        t_diff = torch.where(diff.any(-1), t_idx, T).min(0).values  # [B]: this layer's first difference
        away = ((h - thr).abs() > TIE).reshape(T, B, -1)
        assert not (diff & (t_idx == t_diff)[..., None] & away).any(), f"layer {i}: spikes differ away from threshold"
        first = torch.minimum(first, t_diff)
    steps = t_idx < first
    assert steps.any(), "every sample had a spike flipped at a threshold tie at step 0: nothing left to compare"
    return steps


def _lif_mlp(decay_input: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), LIF(tau=2.0, decay_input=decay_input), nn.Linear(16, 4),
                        LIF(tau=3.0, decay_input=decay_input, v_threshold=0.5))
    with torch.no_grad():  # weights large enough that both layers fire
        for p in mlp.parameters():
            p.mul_(3.0)
    return mlp.eval()


def _fire(model: nn.Module) -> nn.Module:
    """Batch-norm statistics and scales that make every spiking layer fire (fresh models are silent)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.fill_(2.0)
                m.bias.copy_(torch.rand(m.num_features, generator=g))
            elif isinstance(m, nn.Linear):
                m.weight.mul_(4.0)
                m.bias.fill_(0.3)
    return model.eval()


def test_lif_mlp_round_trip_is_exact(tmp_path: Path) -> None:
    mlp = _lif_mlp()
    x = torch.rand(6, 3, 8) * 2
    write_nir(to_nir(mlp, x), tmp_path / "mlp.nir")
    net = efficient.load(tmp_path / "mlp.nir")
    ours, theirs = _spike_recorder(mlp), _spike_recorder(net)
    y_ref, y = mlp(x), net(x)
    assert torch.equal(y_ref, y)
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert 0.05 < a.mean() < 0.95  # both layers really fire


@pytest.mark.parametrize("neuron", ["lif", "dlif"])
def test_stable_snn_vgg5_round_trip_spikes_and_logits(tmp_path: Path, neuron: str) -> None:
    torch.manual_seed(0)
    model = _fire(zoo.create("stable-snn-vgg5", neuron=neuron, img_size=8, fc_dim=32, timesteps=4))
    img = torch.rand(2, 3, 8, 8)
    write_nir(to_nir(model, img), tmp_path / "vgg5.nir")
    net = efficient.load(tmp_path / "vgg5.nir")
    ours, theirs = _reference_recorder(model), _spike_recorder(net)
    with torch.no_grad():
        logits_t = model.forward_time(img)
        out = net(img.unsqueeze(0).expand(4, *img.shape))  # direct encoding: the image at every step
    assert len(ours) == len(theirs) == 5
    assert all(0.01 < s.float().mean() < 0.99 for s, _, _ in ours)
    # the graph folds batch norm into the convs in float64 (see TIE): spikes agree but for ties, and
    # the logits of the steps before any such flip come from the same spikes through the same head
    steps = _compared_steps(ours, theirs)
    torch.testing.assert_close(out[steps], logits_t[steps], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(logits_t.mean(0), model(img))  # the same model, the same computation


def test_wrn_exports_residual_sums(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _fire(zoo.create("stable-snn-wrn16", neuron="lif", img_size=8, timesteps=3, widen=1))
    with torch.no_grad():
        for blk in model.blocks:
            blk.convex.comb.copy_(torch.tensor([0.3, 0.7]))
    img = torch.rand(2, 3, 8, 8)
    graph = to_nir(model, img)
    assert any(isinstance(n, nir.Scale) for n in graph.nodes.values())
    write_nir(graph, tmp_path / "wrn.nir")
    net = efficient.load(tmp_path / "wrn.nir")
    ours, theirs = _reference_recorder(model), _spike_recorder(net)
    with torch.no_grad():
        out = net(img.unsqueeze(0).expand(3, *img.shape))
        ref = model.forward_time(img)
    # batch norm folded into the convs in float64 rounds differently from conv-then-BN in fp32 (see TIE)
    steps = _compared_steps(ours, theirs)
    torch.testing.assert_close(out[steps], ref[steps], rtol=0, atol=1e-4)
    assert ref.abs().max() > 0.1


def test_spikingjelly_graph_loads_with_its_outputs(tmp_path: Path) -> None:
    """Written by spikingjelly 2.0's `export_to_nir` (its neurons are ours: same charge, >= threshold)."""
    pytest.importorskip("spikingjelly.activation_based.nir_exchange")
    from spikingjelly.activation_based import functional, layer, neuron
    from spikingjelly.activation_based.nir_exchange import export_to_nir

    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv2d(2, 4, 3, padding=1), neuron.LIFNode(tau=2.0), layer.AvgPool2d(2), layer.Flatten(),
                        layer.Linear(64, 5), neuron.LIFNode(tau=4.0, decay_input=False, v_threshold=0.5))
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0)
    functional.set_step_mode(net, "m")
    x = (torch.rand(6, 3, 2, 8, 8) > 0.5).float()
    export_to_nir(net, x, tmp_path / "sj.nir", dt=1e-3)
    functional.reset_net(net)
    ref = net(x)
    assert 0.05 < ref.mean() < 0.95
    ours = efficient.load(tmp_path / "sj.nir", dt=1e-3)  # spikingjelly writes no dt: pass the one it used
    assert torch.equal(ours(x), ref)
    # the same file read at the default dt=1e-4 has ten times the time constants: other spikes
    assert not torch.equal(efficient.load(tmp_path / "sj.nir")(x), ref)


def test_our_export_imports_into_spikingjelly(tmp_path: Path) -> None:
    import_from_nir = pytest.importorskip("spikingjelly.activation_based.nir_exchange").import_from_nir

    mlp = _lif_mlp()
    x = torch.rand(6, 3, 8) * 2
    write_nir(to_nir(mlp, x, dt=1e-3), tmp_path / "mlp.nir")
    sj = import_from_nir(tmp_path / "mlp.nir", dt=1e-3, step_mode="m")
    out, _ = sj(x)
    assert torch.equal(out, mlp(x))


def test_our_export_imports_into_snntorch(tmp_path: Path) -> None:
    """snntorch 1.0's `import_from_nir` (reset to zero, beta = 1 - dt/tau) matches LIF without input
    decay (r = tau, so snntorch does not rescale the threshold); its `export_to_nir` fails, see the report."""
    snn = pytest.importorskip("snntorch")
    import_from_nir = pytest.importorskip("snntorch.import_nir").import_from_nir

    mlp = _lif_mlp(decay_input=False)
    x = torch.rand(6, 3, 8) * 2
    write_nir(to_nir(mlp, x), tmp_path / "mlp.nir")
    sn = import_from_nir(nir.read(tmp_path / "mlp.nir"))  # snntorch assumes dt = 1e-4, our default
    layers: dict = {}  # snntorch's spikes per Leaky layer, one [B, F] per step, in call order
    for m in sn.modules():
        if isinstance(m, snn.Leaky):  # init_hidden Leaky layers return the spikes alone
            m.register_forward_hook(lambda m_, _i, o: layers.setdefault(m_, []).append(o))
    state = None
    with torch.no_grad():
        for t in range(x.shape[0]):  # snntorch runs one step per call, its Leaky layers keep their state
            _, state = sn(x[t], state)
        ours = _reference_recorder(mlp)
        ref = mlp(x)
    assert 0.05 < ref.mean() < 0.95 and len(layers) == 2
    # snntorch computes each step's Linear on B rows, we on T*B rows (see TIE): the output is the
    # last layer's spikes, so agreeing spikes at every layer are the same outputs
    _compared_steps(ours, [torch.stack(v).detach() for v in layers.values()])


def test_dt_is_stored_and_read_back(tmp_path: Path) -> None:
    mlp = _lif_mlp()
    x = torch.rand(5, 2, 8) * 2
    graph = to_nir(mlp, x, dt=1e-3)
    lif = next(n for n in graph.nodes.values() if isinstance(n, nir.LIF))
    assert np.allclose(lif.tau, 2.0 * 1e-3) and np.allclose(lif.r, 1.0)  # tau_nir = tau * dt; decay_input -> r = 1
    write_nir(graph, tmp_path / "m.nir")
    net = load_nir(tmp_path / "m.nir")
    assert net.dt == 1e-3
    assert torch.equal(net(x), mlp(x))
    # reading it as if each step were 10x shorter makes tau 10x longer in steps
    slow = load_nir(tmp_path / "m.nir", dt=1e-4)
    assert slow.nodes["1"].tau == pytest.approx(20.0)


def test_neuron_parameter_mapping() -> None:
    shape = (3,)
    from efficient.export.neurons import lif_node

    no_decay = lif_node(LIF(tau=4.0, decay_input=False, v_threshold=0.7), shape, 1e-4, "n")
    assert np.allclose(no_decay.tau, 4e-4) and np.allclose(no_decay.r, 4.0) and np.allclose(no_decay.v_threshold, 0.7)
    plif = PLIF(init_tau=3.0)
    assert np.allclose(lif_node(plif, shape, 1e-4, "p").tau, 3e-4)
    d = DLIF(timesteps=3, leak=0.75)
    with torch.no_grad():
        d.gain.fill_(2.0)
    node = lif_node(d, shape, 1e-4, "d")  # tau = 1 / (1 - leak) = 4 steps, r = tau * gain
    assert np.allclose(node.tau, 4e-4) and np.allclose(node.r, 8.0) and np.allclose(node.v_reset, 0.0)


def test_dlif_equal_gains_round_trip_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 10), DLIF(timesteps=5, leak=0.8)).eval()
    with torch.no_grad():
        mlp[1].gain.fill_(1.7)
        mlp[0].weight.mul_(2)
    x = torch.rand(5, 4, 6)
    write_nir(to_nir(mlp, x), tmp_path / "d.nir")
    ref = mlp(x)
    assert 0.05 < ref.mean() < 0.95
    assert torch.equal(efficient.load(tmp_path / "d.nir")(x), ref)


def test_unexportable_neurons_name_the_layer() -> None:
    x = torch.rand(3, 2, 4)
    d = DLIF(timesteps=3)
    with torch.no_grad():
        d.gain.copy_(torch.tensor([1.0, 0.9, 1.1]))
    with pytest.raises(ConfigError, match=r"1 \(DLIF\).*gains.*differ"):
        to_nir(nn.Sequential(nn.Linear(4, 4), d), x)
    with pytest.raises(ConfigError, match=r"1 \(LIF\): soft reset"):
        to_nir(nn.Sequential(nn.Linear(4, 4), LIF(v_reset=None)), x)
    with pytest.raises(ConfigError, match=r"1 \(GELU\): no NIR export"):
        to_nir(nn.Sequential(nn.Linear(4, 4), nn.GELU()), x)


def test_transformers_fail_with_the_reason() -> None:
    img = torch.rand(1, 1, 16, 16)
    plain = zoo.create("spikformer-tiny", embed_dim=16, depth=1, num_heads=2, timesteps=2)
    with pytest.raises(ConfigError, match=r"blocks\.0\.attn \(SSA\): spiking self-attention multiplies spike tensors"):
        to_nir(plain, img)
    stata = zoo.create("spikformer-tiny", embed_dim=16, depth=2, num_heads=2, timesteps=2, prune_blocks=[1], keep_ratio=0.5)
    with pytest.raises(ConfigError, match=r"stata \(TokenPruner, at blocks\.0\): STATA's token selection"):
        to_nir(stata, img)


def test_bad_nir_files_give_clear_errors(tmp_path: Path) -> None:
    foreign = tmp_path / "model.nir"
    foreign.write_bytes(b"PK\x03\x04 this is a zip archive")
    with pytest.raises(ArtifactError, match=r"model\.nir: not a NIR file"):
        efficient.load(foreign)
    mlp = _lif_mlp()
    good = tmp_path / "good.nir"
    write_nir(to_nir(mlp, torch.rand(2, 1, 8)), good)
    truncated = tmp_path / "trunc.nir"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ArtifactError, match=r"trunc\.nir: .*(cannot be read|not a NIR)"):
        efficient.load(truncated)
    import h5py

    other = tmp_path / "other.nir"
    with h5py.File(other, "w") as f:
        f.create_dataset("weights", data=np.zeros(3))
    with pytest.raises(ArtifactError, match=r"other\.nir: an HDF5 file but not a NIR graph"):
        efficient.load(other)
    with pytest.raises(ArtifactError, match=r"missing\.nir: no such NIR file"):
        efficient.load(tmp_path / "missing.nir")
    with pytest.raises(ValueError, match=r"time-major input \[T, B, 8\]"):
        efficient.load(good)(torch.rand(2, 1, 9))


def test_unsupported_nodes_are_named(tmp_path: Path) -> None:
    n = 3
    nodes = {
        "input": nir.Input(input_type={"input": np.array([n])}),
        "syn": nir.CubaLIF(tau_syn=np.ones(n), tau_mem=np.ones(n), r=np.ones(n), v_leak=np.zeros(n), v_threshold=np.ones(n)),
        "output": nir.Output(output_type={"output": np.array([n])}),
    }
    nir.write(tmp_path / "cuba.nir", nir.NIRGraph(nodes=nodes, edges=[("input", "syn"), ("syn", "output")], metadata={}))
    with pytest.raises(ArtifactError, match=r"cuba\.nir: the graph uses nodes efficient cannot run: 'syn' \(CubaLIF: .*synaptic current"):
        efficient.load(tmp_path / "cuba.nir")
    rec = {
        "input": nir.Input(input_type={"input": np.array([n])}),
        "lif": nir.LIF(tau=np.full(n, 2e-4), r=np.ones(n), v_leak=np.zeros(n), v_threshold=np.ones(n)),
        "w": nir.Linear(weight=np.eye(n)),
        "output": nir.Output(output_type={"output": np.array([n])}),
    }
    g = nir.NIRGraph(nodes=rec, edges=[("input", "lif"), ("lif", "w"), ("w", "lif"), ("lif", "output")], metadata={})
    nir.write(tmp_path / "rnn.nir", g)
    with pytest.raises(ArtifactError, match=r"rnn\.nir: the graph is recurrent"):
        efficient.load(tmp_path / "rnn.nir")
    per_neuron = dict(rec, lif=nir.LIF(tau=np.array([2e-4, 3e-4, 4e-4]), r=np.ones(n), v_leak=np.zeros(n), v_threshold=np.ones(n)))
    nir.write(tmp_path / "pn.nir", nir.NIRGraph(nodes={k: v for k, v in per_neuron.items() if k != "w"},
                                                edges=[("input", "lif"), ("lif", "output")], metadata={}))
    with pytest.raises(ArtifactError, match=r"pn\.nir: node 'lif' \(LIF\) has per-neuron 'tau' values"):
        efficient.load(tmp_path / "pn.nir")


def test_cli_export_of_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from efficient.cli import main

    torch.manual_seed(0)
    model = _fire(zoo.create("stable-snn-digits", neuron="lif", timesteps=3))
    zoo.save_model(model, tmp_path / "digits.safetensors")
    assert main(["export", str(tmp_path / "digits.safetensors"), "--to", "nir", str(tmp_path / "d.nir"), "--dt", "1e-3"]) == 0
    assert "d.nir: 15 nodes (4 spiking)" in capsys.readouterr().out
    net = efficient.load(tmp_path / "d.nir")
    assert net.dt == 1e-3
    img = torch.rand(2, 1, 8, 8)
    ours, theirs = _reference_recorder(model), _spike_recorder(net)
    with torch.no_grad():
        ref, out = model.forward_time(img), net(img.unsqueeze(0).expand(3, *img.shape))
    steps = _compared_steps(ours, theirs)  # batch norm folded in float64: see TIE
    torch.testing.assert_close(out[steps], ref[steps], rtol=1e-5, atol=1e-6)


def test_cli_export_errors_are_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from efficient.cli import main

    assert main(["export", "spikformer-tiny", "--to", "nir", str(tmp_path / "s.nir")]) == 2
    assert "blocks.0.attn (SSA)" in capsys.readouterr().err
    assert main(["export", "stable-snn-digits", "--to", "onnx", str(tmp_path / "s.onnx")]) == 2
    assert "unknown export format" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_time_major_flatten_maps_to_sample_dims(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(2), nn.Linear(12, 5), LIF(tau=2.0)).eval()
    with torch.no_grad():
        net[1].weight.abs_().mul_(2)
    x = torch.rand(4, 2, 3, 2, 2)
    graph = to_nir(net, x)
    flat = next(n for n in graph.nodes.values() if isinstance(n, nir.Flatten))
    assert (flat.start_dim, flat.end_dim) == (0, -1)
    write_nir(graph, tmp_path / "f.nir")
    ref = net(x)
    assert ref.mean() > 0.05
    assert torch.equal(efficient.load(tmp_path / "f.nir")(x), ref)
    with pytest.raises(ConfigError, match=r"0 \(Flatten\): start_dim=1 would flatten time or batch"):
        to_nir(nn.Sequential(nn.Flatten(1), nn.Linear(24, 5)), x)


def test_our_vgg5_export_runs_in_spikingjelly(tmp_path: Path) -> None:
    """The conv graph (normalisation as a diagonal 1x1 conv, BN folded, pools, flatten) in spikingjelly's importer."""
    import_from_nir = pytest.importorskip("spikingjelly.activation_based.nir_exchange").import_from_nir

    torch.manual_seed(0)
    model = _fire(zoo.create("stable-snn-vgg5", neuron="lif", img_size=8, fc_dim=32, timesteps=4))
    img = torch.rand(2, 3, 8, 8)
    write_nir(to_nir(model, img), tmp_path / "vgg5.nir")
    sj = import_from_nir(tmp_path / "vgg5.nir", step_mode="m")
    from spikingjelly.activation_based import neuron

    theirs: list = []
    for m in sj.modules():  # its graph calls each neuron through a wrapper that returns (spikes, state)
        if isinstance(getattr(m, "module", None), neuron.BaseNode):
            m.register_forward_hook(lambda _m, _i, o: theirs.append(o[0].detach()))
    ours = _reference_recorder(model)
    with torch.no_grad():
        out, _ = sj(img.unsqueeze(0).expand(4, *img.shape))
        ref = model.forward_time(img)
    assert ref.abs().max() > 0.1
    steps = _compared_steps(ours, theirs)  # batch norm folded in float64: see TIE
    torch.testing.assert_close(out[steps], ref[steps], rtol=1e-5, atol=1e-5)


def test_if_and_li_nodes(tmp_path: Path) -> None:
    """IF (no leak, v += dt * r * I) matches spikingjelly's IFNode import; LI outputs its membrane."""
    import_from_nir = pytest.importorskip("spikingjelly.activation_based.nir_exchange").import_from_nir

    n, dt = 4, 1e-3
    w = np.random.default_rng(0).uniform(0, 1, (n, n))
    nodes = {
        "input": nir.Input(input_type={"input": np.array([n])}),
        "w": nir.Linear(weight=w),
        "if": nir.IF(r=np.full(n, 1.0 / dt), v_threshold=np.full(n, 1.0), v_reset=np.zeros(n)),
        "output": nir.Output(output_type={"output": np.array([n])}),
    }
    nir.write(tmp_path / "if.nir", nir.NIRGraph(nodes=nodes, edges=[("input", "w"), ("w", "if"), ("if", "output")], metadata={}))
    x = torch.rand(6, 2, n)
    ours = efficient.load(tmp_path / "if.nir", dt=dt)(x)
    theirs, _ = import_from_nir(tmp_path / "if.nir", dt=dt, step_mode="m")(x)
    assert 0.05 < ours.mean() < 0.95
    assert torch.equal(ours, theirs)

    li = {**nodes, "if": nir.LI(tau=np.full(n, 4 * dt), r=np.full(n, 2.0), v_leak=np.zeros(n))}
    nir.write(tmp_path / "li.nir", nir.NIRGraph(nodes=li, edges=[("input", "w"), ("w", "if"), ("if", "output")], metadata={}))
    out = efficient.load(tmp_path / "li.nir", dt=dt)(x)
    v, expect = torch.zeros(2, n), []
    cur = x @ torch.tensor(w, dtype=torch.float32).T
    for t in range(6):  # v += dt/tau * (v_leak - v + r * I)
        v = v + 0.25 * (-v + 2.0 * cur[t])
        expect.append(v)
    assert torch.allclose(out, torch.stack(expect), atol=1e-6)


def test_shape_mismatch_in_a_graph_is_named(tmp_path: Path) -> None:
    nodes = {
        "input": nir.Input(input_type={"input": np.array([4])}),
        "fc1": nir.Affine(weight=np.ones((6, 4)), bias=np.zeros(6)),
        "fc2": nir.Affine(weight=np.ones((3, 5)), bias=np.zeros(3)),  # expects 5 inputs, gets 6
        "output": nir.Output(output_type={"output": np.array([3])}),
    }
    graph = nir.NIRGraph(nodes=nodes, edges=[("input", "fc1"), ("fc1", "fc2"), ("fc2", "output")], metadata={}, type_check=False)
    nir.write(tmp_path / "bad.nir", graph)
    with pytest.raises(ArtifactError, match=r"bad\.nir: the NIR graph cannot be read \(ValueError: .*fc1.*fc2"):
        efficient.load(tmp_path / "bad.nir")


# ---------------------------------------------------------------------------------------------
# spikingjelly and snntorch models exported by us (their importers: tests/test_nir_interop.py)
# ---------------------------------------------------------------------------------------------


def _snntorch_conv(reset: str = "zero") -> nn.Sequential:
    snn = pytest.importorskip("snntorch")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.AvgPool2d(2), snn.Leaky(beta=0.8, init_hidden=True, reset_mechanism=reset),
                        nn.Flatten(), nn.Linear(64, 5), snn.Leaky(beta=0.6, threshold=0.5, init_hidden=True, reset_mechanism=reset))
    with torch.no_grad():
        for m in (net[0], net[4]):
            for p in m.parameters():
                p.mul_(3.0)
    return net.eval()


def _typed(graph) -> None:
    """The graph passes NIR's own type inference and every node carries its shapes."""
    nir.NIRGraph(nodes=graph.nodes, edges=graph.edges, metadata=graph.metadata, type_check=True)
    for name, node in graph.nodes.items():
        assert node.input_type is not None and all(v is not None for v in node.input_type.values()), name


def test_snntorch_conv_net_exports_and_round_trips(tmp_path: Path) -> None:
    import snntorch.utils

    net = _snntorch_conv()
    x = (torch.rand(6, 3, 2, 8, 8) > 0.5).float()
    graph = efficient.export.to_nir(net, x[0])  # snntorch models are called one step at a time: [B, ...]
    _typed(graph)
    assert [type(graph.nodes[k]).__name__ for k in ("0", "1", "2", "3", "4", "5")] == \
        ["Conv2d", "AvgPool2d", "LIF", "Flatten", "Affine", "LIF"]
    write_nir(graph, tmp_path / "snn.nir")
    snntorch.utils.reset(net)
    with torch.no_grad():
        ref = torch.stack([net(x[t]) for t in range(6)])
    ours = efficient.load(tmp_path / "snn.nir")
    theirs, mems = [], []
    def keep(m_, _i, o) -> None:  # snntorch keeps the step's membrane (before its delayed reset) in .mem
        theirs.append(o.detach())
        mems.append(m_.mem.detach())

    for m in (net[2], net[5]):
        m.register_forward_hook(keep)
    snntorch.utils.reset(net)
    with torch.no_grad():
        for t in range(6):
            net(x[t])
    got = _spike_recorder(ours)
    with torch.no_grad():
        out = ours(x)
    assert 0.05 < ref.mean() < 0.95
    ref_layers = [(torch.stack(theirs[i::2]), torch.stack(mems[i::2]), thr) for i, thr in enumerate((1.0, 0.5))]
    steps = _compared_steps(ref_layers, got)  # snntorch: conv on B rows per step and `mem > thr`; see TIE
    assert torch.equal(out[steps], ref[steps])


def test_spikingjelly_conv_net_exports_and_round_trips(tmp_path: Path) -> None:
    pytest.importorskip("spikingjelly.activation_based")
    from spikingjelly.activation_based import functional, layer, neuron

    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv2d(2, 4, 3, padding=1), neuron.LIFNode(tau=2.0), layer.AvgPool2d(2), layer.Flatten(),
                        layer.Linear(64, 5), neuron.IFNode(v_threshold=0.5),
                        layer.Linear(5, 3), neuron.ParametricLIFNode(init_tau=3.0, decay_input=False))
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0)
    functional.set_step_mode(net, "m")
    x = (torch.rand(6, 3, 2, 8, 8) > 0.5).float()
    graph = efficient.export.to_nir(net, x, dt=1e-3)
    _typed(graph)
    assert {type(n).__name__ for n in graph.nodes.values()} >= {"Conv2d", "AvgPool2d", "Flatten", "LIF", "IF", "Affine"}
    write_nir(graph, tmp_path / "sj.nir")
    functional.reset_net(net)
    with torch.no_grad():
        ref = net(x)
    assert 0.02 < ref.mean() < 0.98
    assert torch.equal(efficient.load(tmp_path / "sj.nir")(x), ref)  # the same charge, the same [T*B] layers


def test_peer_neurons_without_nir_form_name_the_layer() -> None:
    pytest.importorskip("snntorch")
    x = torch.rand(2, 2, 8, 8)
    with pytest.raises(ConfigError, match=r"2 \(snntorch Leaky\): reset_mechanism='subtract' has no NIR form.*'zero'"):
        efficient.export.to_nir(_snntorch_conv(reset="subtract"), x)
    from spikingjelly.activation_based import functional, layer, neuron

    sj = nn.Sequential(layer.Linear(4, 3), neuron.LIFNode(v_reset=None))
    functional.set_step_mode(sj, "m")
    with pytest.raises(ConfigError, match=r"1 \(spikingjelly LIFNode\): soft reset"):
        efficient.export.to_nir(sj, torch.rand(3, 2, 4))
    with pytest.raises(ConfigError, match=r"\[T, B, \.\.\.\] \(multi-step spikingjelly\)"):
        efficient.export.to_nir(sj, torch.rand(4))


SJ_NET_PY = '''
import torch
from torch import nn
from spikingjelly.activation_based import functional, layer, neuron

def build():
    net = nn.Sequential(layer.Conv2d(2, 4, 3, padding=1), neuron.LIFNode(tau=2.0, decay_input=False), layer.AvgPool2d(2),
                        layer.Flatten(), layer.Linear(64, 5), neuron.LIFNode(tau=2.0, decay_input=False))
    functional.set_step_mode(net, "m")
    return net
'''


def test_cli_exports_a_model_in_a_python_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("spikingjelly.activation_based")
    from efficient.cli import main
    from efficient.io import atomic_path  # noqa: F401  (the CLI writes atomically; nothing to clean up)

    (tmp_path / "net.py").write_text(SJ_NET_PY)
    import importlib.util

    spec = importlib.util.spec_from_file_location("net_ref", tmp_path / "net.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    ref_net = mod.build()
    with torch.no_grad():
        for p in ref_net.parameters():
            p.mul_(3.0)
    torch.save(ref_net.state_dict(), tmp_path / "w.pt")
    out = tmp_path / "net.nir"
    assert main(["export", f"{tmp_path / 'net.py'}:build", "--input-shape", "4,1,2,8,8", "--weights", str(tmp_path / "w.pt"),
                 "--to", "nir", str(out)]) == 0
    assert "net.nir: 8 nodes (2 spiking)" in capsys.readouterr().out
    x = (torch.rand(5, 3, 2, 8, 8) > 0.5).float()
    with torch.no_grad():
        ref = ref_net(x)
    assert ref.mean() > 0.02 and torch.equal(efficient.load(out)(x), ref)
    assert main(["import", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "input [2, 8, 8] -> output [5]" in printed and "LIF(tau=2.0" in printed, printed
    assert main(["export", f"{tmp_path / 'net.py'}:nothing", "--input-shape", "1,2", "--to", "nir", str(out)]) == 2
    assert "defines no 'nothing'" in capsys.readouterr().err
    assert main(["export", f"{tmp_path / 'net.py'}:build", "--input-shape", "4,x", "--to", "nir", str(out)]) == 2
    assert "--input-shape as positive integers" in capsys.readouterr().err


def _write_graph(path: Path, nodes: dict, edges: list) -> Path:
    nir.write(path, nir.NIRGraph(nodes=nodes, edges=edges, metadata={}, type_check=False))
    return path


def test_cli_import_bad_graphs_are_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Unsupported nodes, recurrent edges, shape mismatches, damaged files: one line on stderr, exit 2, no traceback."""
    from efficient.cli import main

    n = 3
    inp, out = nir.Input(input_type={"input": np.array([n])}), nir.Output(output_type={"output": np.array([n])})
    lif = nir.LIF(tau=np.full(n, 2e-4), r=np.ones(n), v_leak=np.zeros(n), v_threshold=np.ones(n))
    cuba = nir.CubaLIF(tau_syn=np.ones(n), tau_mem=np.ones(n), r=np.ones(n), v_leak=np.zeros(n), v_threshold=np.ones(n))
    cases = {
        "cuba.nir": ({"input": inp, "syn": cuba, "output": out}, [("input", "syn"), ("syn", "output")],
                     r"cuba\.nir: the graph uses nodes efficient cannot run: 'syn' \(CubaLIF: .*synaptic current"),
        "rnn.nir": ({"input": inp, "lif": lif, "w": nir.Linear(weight=np.eye(n)), "output": out},
                    [("input", "lif"), ("lif", "w"), ("w", "lif"), ("lif", "output")], r"rnn\.nir: the graph is recurrent"),
        "shape.nir": ({"input": nir.Input(input_type={"input": np.array([4])}), "fc1": nir.Affine(weight=np.ones((6, 4)), bias=np.zeros(6)),
                       "fc2": nir.Affine(weight=np.ones((3, 5)), bias=np.zeros(3)), "output": out},
                      [("input", "fc1"), ("fc1", "fc2"), ("fc2", "output")], r"shape\.nir: the NIR graph cannot be read .*fc1.*fc2.*do not chain"),
        "conv.nir": ({"input": nir.Input(input_type={"input": np.array([1, 4, 4])}),
                      "conv": nir.Conv2d(input_shape=np.array([4, 4]), weight=np.ones((2, 3, 3, 3)), stride=1, padding=1, dilation=1, groups=1, bias=np.zeros(2)),
                      "output": out}, [("input", "conv"), ("conv", "output")],
                     r"conv\.nir: the NIR graph cannot be read .*\[\[1 4 4\]\] -> conv\.input: \[\[3 4 4\]\].*do not chain"),
    }
    for name, (nodes, edges, message) in cases.items():
        _write_graph(tmp_path / name, nodes, edges)
        assert main(["import", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith("error: "), err
        assert __import__("re").search(message, err, __import__("re").S), (name, err)
    (tmp_path / "zip.nir").write_bytes(b"PK\x03\x04 not hdf5")
    assert main(["import", str(tmp_path / "zip.nir")]) == 2
    assert "zip.nir: not a NIR file" in capsys.readouterr().err
    assert main(["export", "stable-snn-digits", "neuron=lif", "--to", "nir", str(tmp_path / "bad.txt")]) == 2
    assert "NIR graphs are written to a .nir file" in capsys.readouterr().err
