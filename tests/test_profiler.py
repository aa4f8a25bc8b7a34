"""Profiler: hand-computed counts, conventions, early exits, warnings, errors and renderers."""

from __future__ import annotations

import contextlib
import itertools
import json
import math

import pytest
import torch
from conftest import needs_cxx
from torch import nn

import efficient
from efficient.errors import ConfigError
from efficient.models.neurons import LIF
from efficient.profiler import PRESETS, profile, resolve_energy


def _spikes(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


class TwoLayerSNN(nn.Module):
    """Linear(4->3) -> LIF -> Linear(3->2) on [T, B, 4]; weights make LIF spikes copy inputs 0 and 1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3, bias=False)
        self.lif = LIF(tau=2.0, v_threshold=1.0)
        self.fc2 = nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.tensor([[10.0, 0, 0, 0], [0, 10.0, 0, 0], [0, 0, 0, 0]]))
            self.fc2.weight.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.lif(self.fc1(x)))


def test_two_layer_snn_hand_counted():
    # T=3, B=1: input spikes t0 [1,1,0,1], t1 [0,1,0,0], t2 [1,0,1,1] -> 7 nonzeros
    x = _spikes([[[1, 1, 0, 1]], [[0, 1, 0, 0]], [[1, 0, 1, 1]]])
    r = profile(TwoLayerSNN(), inputs=x)
    fc1, lif, fc2 = r.layer("fc1"), r.layer("lif"), r.layer("fc2")
    # fc1: each input spike reaches 3 outputs; LIF copies inputs 0,1: t0 [1,1,0], t1 [0,1,0], t2 [1,0,0]
    assert (fc1.sops, fc1.macs, fc1.dense_macs) == (7 * 3, 0, 3 * 4 * 3)
    assert fc1.input_firing_rate == pytest.approx(7 / 12)
    assert lif.output_firing_rate == pytest.approx(4 / 9)
    assert lif.firing_rate_per_step == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert (fc2.sops, fc2.macs, fc2.dense_macs) == (4 * 2, 0, 3 * 3 * 2)
    t = r.totals
    assert (t["sops"], t["macs"], t["dense_macs"]) == (29, 0, 54)
    assert t["energy_pj"] == pytest.approx(0.9 * 29)
    assert t["mean_firing_rate"] == pytest.approx(4 / 9)
    assert t["flops"] == 2 * 54 and t["flops_per_mac"] == 2
    assert r.meta["timesteps"] == 3


def test_real_input_counts_macs_and_energy_constants():
    x = torch.randn(3, 1, 4)  # real-valued: fc1 is a MAC layer
    r = profile(TwoLayerSNN(), inputs=x, energy="45nm-int8")
    assert r.layer("fc1").macs == 36 and r.layer("fc1").sops == 0
    assert r.totals["e_mac_pj"] == 0.23 and r.totals["e_ac_pj"] == 0.03
    assert r.totals["energy_pj"] == pytest.approx(0.23 * r.totals["macs"] + 0.03 * r.totals["sops"])


def _brute_conv_sops(mask: torch.Tensor, k: int, stride: int, pad: int, cout: int, groups: int) -> int:
    """Sum over nonzero inputs of (output positions the kernel maps it to) x Cout/groups."""
    _, cin, h, w = mask.shape
    ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    total = 0
    for b, c, i, j in mask.nonzero().tolist():
        touched = sum(
            1
            for oi, oj in itertools.product(range(ho), range(wo))
            if 0 <= i + pad - oi * stride < k and 0 <= j + pad - oj * stride < k
        )
        total += touched * (cout // groups)
    return total


@pytest.mark.parametrize("cin,cout,k,stride,pad,groups", [(2, 3, 3, 1, 1, 1), (4, 4, 3, 2, 1, 4), (2, 6, 5, 1, 2, 2)])
def test_conv_padding_fan_out_exact(cin, cout, k, stride, pad, groups):
    conv = nn.Conv2d(cin, cout, k, stride, pad, groups=groups, bias=False)
    g = torch.Generator().manual_seed(cin * 10 + k)
    mask = (torch.rand(2, cin, 6, 6, generator=g) < 0.3).float()
    layer = profile(conv, inputs=mask).layer("Conv2d")
    assert layer.sops == _brute_conv_sops(mask, k, stride, pad, cout, groups)
    assert layer.macs == 0
    out_hw = ((6 + 2 * pad - k) // stride + 1) ** 2
    assert layer.dense_macs == 2 * out_hw * cout * (cin // groups) * k * k


def test_conv_corner_and_center_spikes():
    conv = nn.Conv2d(1, 5, 3, 1, 1, bias=False)
    corner = torch.zeros(1, 1, 4, 4)
    corner[0, 0, 0, 0] = 1
    center = torch.zeros(1, 1, 4, 4)
    center[0, 0, 1, 1] = 1
    # a corner spike reaches 2x2 outputs, an interior one 3x3 (not nnz x k*k x Cout = 45)
    assert profile(conv, inputs=corner).totals["sops"] == 4 * 5
    assert profile(conv, inputs=center).totals["sops"] == 9 * 5


def test_binary_input_rate_quarter_gives_quarter_of_macs():
    # stata.md 8.10: fr = 0.25 binary input gives SOP = 0.25 * MAC * T
    T, B, D, H = 4, 2, 16, 8
    x = torch.zeros(T, B, D)
    x[..., ::4] = 1.0  # exactly a quarter of the inputs fire
    lin = nn.Linear(D, H)
    r = profile(lin, inputs=x)
    mac_per_step = B * D * H
    assert r.totals["sops"] == 0.25 * mac_per_step * T
    assert r.totals["dense_macs"] == mac_per_step * T


def test_flops_per_mac_doubles_flops():
    x = torch.randn(2, 8)
    lin = nn.Linear(8, 4)
    one, two = profile(lin, inputs=x, flops_per_mac=1), profile(lin, inputs=x)
    assert two.totals["flops"] == 2 * one.totals["flops"] == 2 * 2 * 8 * 4
    assert "2 x dense_macs" in two.meta["conventions"]["flops"]


def test_integer_residual_is_not_spikes():
    x = torch.tensor([[0.0, 1.0, 2.0, 1.0]])  # {0,1,2}: sum of two spike maps
    r = profile(nn.Linear(4, 3), inputs=x)
    assert r.totals["sops"] == 0 and r.totals["macs"] == 12


def test_spike_times_spike_matmul_conventions():
    class QK(nn.Module):
        def forward(self, q, k):
            return q @ k.transpose(-2, -1)

    q = _spikes([[[1, 0, 1], [0, 0, 1]]])  # [1, 2, 3], nnz 3
    k = _spikes([[[1, 1, 0], [0, 0, 0], [1, 0, 1]]])  # [1, 3, 3]
    op = profile(QK(), inputs=(q, k))
    co = profile(QK(), inputs=(q, k), spike_matmul="coincidence")
    assert op.totals["sops"] == 3 * 3  # nnz(Q) x fan-out (3 keys)
    assert co.totals["sops"] == int((q @ k.transpose(-2, -1)).sum())  # coinciding (1,1) pairs
    assert op.meta["spike_spike_matmul"] == {"operand_sops": 9, "coincidence_sops": co.totals["sops"]}


def test_functional_ops_attributed_to_issuing_module():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 5))

        def forward(self, x):
            return torch.einsum("bi,io->bo", x, self.w)  # functional: no nn.Linear

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return x @ x.T + self.inner(x).sum()

    r = profile(Outer(), inputs=torch.randn(3, 6))
    assert r.layer("inner").dense_macs == 3 * 6 * 5
    assert r.layer("Outer").dense_macs == 3 * 6 * 3  # the root's own matmul
    top = r.top_modules(1)
    assert [t["name"] for t in top] == ["inner", "(Outer own ops)"]
    assert top[1]["dense_macs"] == 3 * 6 * 3


def test_snntorch_and_spikingjelly_neurons_detected():
    snntorch = pytest.importorskip("snntorch")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3, bias=False)
            self.lif = snntorch.Leaky(beta=0.5, threshold=1.0)
            with torch.no_grad():
                self.fc.weight.copy_(torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 0, 0]]))

        def forward(self, x):  # [T, B, 4], one neuron call per step
            mem = self.lif.init_leaky()
            out = []
            for t in range(x.shape[0]):
                spk, mem = self.lif(self.fc(x[t]), mem)
                out.append(spk)
            return torch.stack(out)

    x = _spikes([[[1, 0, 0, 0]], [[0, 1, 0, 0]], [[0, 0, 0, 0]]])
    net = Net()
    r = profile(net, inputs=x)
    lif = r.layer("lif")
    assert lif.neuron == "snntorch single-step"
    with torch.no_grad():
        spikes = net(x)  # [T, 1, 3]
    assert lif.firing_rate_per_step == pytest.approx(spikes.mean((1, 2)).tolist())
    assert lif.output_firing_rate == pytest.approx(float(spikes.mean()))
    assert 0 < lif.output_firing_rate < 1
    assert r.totals["sops"] == 2 * 3

    sjn = pytest.importorskip("spikingjelly.activation_based.neuron")

    sj = nn.Sequential(nn.Linear(4, 3), sjn.LIFNode(step_mode="m"))
    r2 = profile(sj, inputs=torch.randn(2, 1, 4) * 5)
    assert r2.layer("1").neuron == "spikingjelly multi-step"
    assert len(r2.layer("1").firing_rate_per_step) == 2


@needs_cxx
def test_lif_custom_op_counts_like_reference():
    # backend="compile" runs efficient::lif_forward (a torch.library custom op) inside the mode
    x = torch.randn(3, 2, 4) * 3
    ref, op = TwoLayerSNN(), TwoLayerSNN()
    op.lif.backend = "compile"
    r_ref, r_op = profile(ref, inputs=x), profile(op, inputs=x)
    assert r_op.layer("lif").firing_rate_per_step == r_ref.layer("lif").firing_rate_per_step
    assert r_op.totals["sops"] == r_ref.totals["sops"] > 0
    assert not r_op.warnings


# ------------------------------------------------------------------------- STATA and early exit


def _block_linear_macs(report) -> int:
    return sum(x.dense_macs for x in report.layers if x.name.startswith("blocks.") and x.type == "Linear")


def test_stata_block_macs_drop_by_expected_ratio():
    base_kw = dict(img_size=32, embed_dim=32, num_heads=2, depth=4, timesteps=1, pool_stages=2, in_chans=3)
    stata = efficient.zoo.create("spikformer-4-384", **base_kw, anchor="per_timestep", prune_blocks=[2, 3], keep_ratio=0.7)
    dense = efficient.zoo.create("spikformer-4-384", **base_kw)
    x = torch.randn(2, 3, 32, 32)
    r_dense, r_stata = profile(dense, inputs=x), profile(stata, inputs=x)
    assert [b["tokens_in"] for b in r_dense.blocks] == [64, 64, 64, 64]
    assert [b["tokens_in"] for b in r_stata.blocks] == [65, 65, 46, 33]
    # per token: attn linears 4 D^2 on block input tokens, MLP 8 D^2 on kept tokens (after_attn pruning)
    attn_tokens, mlp_tokens = [65, 65, 46, 33], [65, 46, 33, 33]
    expected = (4 * sum(attn_tokens) + 8 * sum(mlp_tokens)) / (12 * 64 * 4)  # 2252 / 3072 = 0.733
    assert _block_linear_macs(r_stata) / _block_linear_macs(r_dense) == pytest.approx(expected, rel=1e-12)


class ToyEarlyExit(nn.Module):
    """L linear blocks with exit heads; the three attributes early-exit models expose."""

    def __init__(self, num_layers: int = 4, exits=(1, 2), dim: int = 8, vocab: int = 5) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.exit_layers = [*exits, num_layers]
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_layers))
        self.heads = nn.ModuleDict({str(k): nn.Linear(dim, vocab) for k in self.exit_layers})
        self._forced = None
        self.dist = {1: 0.5, 2: 0.25, num_layers: 0.25}
        self.seen_threshold = None

    @contextlib.contextmanager
    def forced_exit(self, layer):
        prev, self._forced = self._forced, layer
        try:
            yield
        finally:
            self._forced = prev

    def exit_distribution(self, batches, threshold):
        self.seen_threshold = threshold
        assert len(list(batches)) >= 1
        return dict(self.dist)

    def forward(self, idx):
        k = self.num_layers if self._forced is None else self._forced
        h = self.emb(idx)
        for blk in self.blocks[:k]:
            h = torch.relu(blk(h))
        return self.heads[str(k)](h)


def test_early_exit_forced_layers_and_expected_cost():
    model = ToyEarlyExit()
    idx = torch.randint(0, 5, (2, 3))
    r = profile(model, inputs=idx, data=[idx, idx], exit_threshold=0.7)
    ex = r.exits
    L = model.num_layers
    full = ex["per_exit"][L]["backbone_macs"]
    for k in model.exit_layers:
        assert ex["per_exit"][k]["backbone_macs"] * L == full * k  # exactly k / L of the backbone
    tokens = 6
    per_tok = {k: (k * 8 * 8 + 8 * 5) for k in model.exit_layers}  # k blocks + one head, per token
    for k in model.exit_layers:
        assert ex["per_exit"][k]["macs_per_token"] == per_tok[k]
    expected = 0.5 * per_tok[1] + 0.25 * per_tok[2] + 0.25 * per_tok[L]
    assert ex["tokens"] == tokens and model.seen_threshold == 0.7
    assert ex["expected_macs_per_token"] == pytest.approx(expected)
    assert ex["speedup_bound"] == pytest.approx(per_tok[L] / expected)
    assert ex["expected_energy_pj_per_token"] == pytest.approx(4.6 * expected)
    assert "Early exits" in r.to_markdown()


def test_early_exit_distribution_must_sum_to_one():
    model = ToyEarlyExit()
    model.dist = {1: 0.5, 2: 0.1, 4: 0.1}
    idx = torch.randint(0, 5, (1, 4))
    with pytest.raises(ConfigError, match="sum to 0.7"):
        profile(model, inputs=idx, data=[idx])


def test_ee_gpt_forced_exit_is_k_over_L_of_backbone():
    model = efficient.zoo.create("ee-gpt-tiny", n_layer=4, n_embd=32, n_head=2, seq_len=16, exit_layers=[1, 2])
    r = profile(model, input_shape=(16,), batch=1)
    per = r.exits["per_exit"]
    assert r.exits["backbone"] == "layers"
    for k in model.exit_layers:
        assert per[k]["backbone_macs"] * 4 == per[4]["backbone_macs"] * k


# --------------------------------------------------------------------------------- warnings


def test_warns_when_all_neurons_silent():
    model = efficient.zoo.create("spikformer-tiny")
    r = profile(model, inputs=torch.zeros(1, 1, 16, 16))
    assert r.totals["mean_firing_rate"] == 0.0
    silence = [w for w in r.warnings if "none of its 19 spiking layers fired" in w]
    assert len(silence) == 1 and "freshly initialised" in silence[0] and "patch_embed.lifs.0" in silence[0]


def test_warns_about_unattributed_modules_and_unknown_custom_ops():
    helper = nn.Linear(4, 4)

    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.stash = [helper]  # a plain list: not a registered submodule

        def forward(self, x):
            return self.stash[0](x)

    r = profile(Hidden(), inputs=torch.randn(2, 4))
    assert r.layer("<unattributed>").dense_macs == 2 * 4 * 4
    assert any("<unattributed>" in w and "Linear" in w for w in r.warnings)

    @torch.library.custom_op("proftest::hidden_mm", mutates_args=())
    def hidden_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    class UsesCustom(nn.Module):
        def forward(self, x):
            return hidden_mm(x, x.T)

    r2 = profile(UsesCustom(), inputs=torch.randn(3, 3))
    assert any("proftest::hidden_mm" in w for w in r2.warnings)


def test_efficient_custom_ops_pass_through_as_elementwise():
    @torch.library.custom_op("efficient::proftest_spike", mutates_args=())
    def spike(x: torch.Tensor) -> torch.Tensor:
        return (x >= 0).to(x.dtype)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.fc2(spike(self.fc1(x)))

    torch.manual_seed(0)
    net, x = Net(), torch.randn(5, 4)
    r = profile(net, inputs=x)
    s = spike(net.fc1(x))
    assert r.layer("fc2").sops == int(s.count_nonzero()) * 2  # the custom op's output counted as spikes
    assert r.layer("fc1").macs == 5 * 4 * 8
    assert not any("custom ops" in w for w in r.warnings)


# ------------------------------------------------------------------------------- bad input


def test_input_shape_that_does_not_fit():
    model = efficient.zoo.create("spikformer-tiny")
    with pytest.raises(ConfigError, match=r"does not fit the model.*1x16x16"):
        profile(model, input_shape=(3, 32, 32))
    with pytest.raises(ConfigError, match="positive integer"):
        profile(model, input_shape="1x0x16")


def test_unknown_energy_preset_and_overrides():
    with pytest.raises(ConfigError, match=r"unknown energy preset '45nm-fp31'.*Did you mean '45nm-fp32'"):
        profile(nn.Linear(2, 2), inputs=torch.randn(1, 2), energy="45nm-fp31")
    e = resolve_energy({"preset": "45nm-fp16", "e_ac_pj": 0.1})
    assert (e.e_mac_pj, e.e_ac_pj) == (1.5, 0.1) and "custom" in e.name
    assert (PRESETS["45nm-fp32"].e_mac_pj, PRESETS["45nm-fp32"].e_ac_pj) == (4.6, 0.9)
    with pytest.raises(ConfigError, match="e_mac"):
        resolve_energy({"e_mac": 1.0})


def test_model_without_inputs_needs_a_shape():
    with pytest.raises(ConfigError, match="input_shape="):
        profile(nn.Linear(2, 2))


# ------------------------------------------------------------------------------- renderers


def test_report_renderers_and_compare(tmp_path):
    small = efficient.zoo.create("spikformer-tiny")
    big = efficient.zoo.create("spikformer-tiny", embed_dim=128)
    x = torch.randn(2, 1, 16, 16)
    a, b = profile(small, inputs=x), profile(big, inputs=x, timesteps=2)
    assert a.totals["batch_size"] == 2 and b.meta["timesteps"] == 2 and small.timesteps == 4
    d = json.loads(a.to_json())
    assert d["totals"]["dense_macs"] == a.totals["dense_macs"] and len(d["layers"]) == len(a.layers)
    csv_lines = a.to_csv().strip().split("\n")
    assert csv_lines[0].startswith("name,type,dense_macs") and len(csv_lines) == len(a.layers) + 1
    md = a.to_markdown()
    assert "4.6 pJ x MACs + 0.9 pJ x SOPs" in md and "FLOPs = 2 x dense MACs" in md and "Top modules" in md
    png = a.plot(tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cmp = a.compare(b)
    row = {r["metric"]: r for r in cmp.rows}["dense_macs"]
    assert row["change_pct"] == pytest.approx(100 * (b.totals["dense_macs"] - a.totals["dense_macs"]) / a.totals["dense_macs"])
    assert "%" in cmp.to_markdown()
    for key in ("params", "dense_macs", "macs", "sops", "flops", "flops_per_mac", "energy_pj", "e_mac_pj", "e_ac_pj", "mean_firing_rate"):
        assert isinstance(a.totals[key], (int, float)), key
    assert math.isclose(a.totals["energy_pj"], 4.6 * a.totals["macs"] + 0.9 * a.totals["sops"])
