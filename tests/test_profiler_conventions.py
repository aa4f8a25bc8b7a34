"""Operand-exact counting under each convention, hand-computed: an anchor-row tensor (one real row among
spike rows), an integer residual, a conv batch mixing real and spike samples, attention operands; the
presets, the conventions block in every output, and the memory-access energy model."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.profiler import CONVENTIONS, MemoryModel, profile, resolve_convention
from efficient.profiler.counting import split_operand
from test_profiler import TwoLayerSNN  # Linear -> LIF -> Linear whose spikes are known by hand

ANCHOR = torch.tensor([[[0.5, -1.2, 0.3, 2.0],   # real-valued anchor row: 4 elements, all nonzero
                        [1.0, 0.0, 1.0, 1.0],    # spikes: 3
                        [0.0, 0.0, 1.0, 0.0]]])  # spikes: 1
RESIDUAL = torch.tensor([[[0.0, 1.0, 2.0, 1.0],  # integer row: sum 4, nonzeros 3
                          [1.0, 0.0, 0.0, 1.0]]])  # spike row: 2


class FirstThen(nn.Module):
    """A first layer on real pixels, then one linear layer on `x` (the op the conventions disagree on)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2, bias=False)
        self.fc = nn.Linear(cin, cout, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.arange(1.0, cin * cout + 1).reshape(cout, cin))

    def forward(self, pixels: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.first(pixels).sum() + self.fc(x)


def _fc(convention, x: torch.Tensor, cout: int):
    pixels = torch.tensor([[0.25, -0.5]])  # first layer: 2 x 2 = 4 real MACs
    r = profile(FirstThen(x.shape[-1], cout), inputs=(pixels, x), convention=convention)
    return r, r.layer("fc"), r.layer("first")


# anchor row, Linear(4 -> 5): fan-out 5, dense 3 x 4 x 5 = 60
@pytest.mark.parametrize("convention,macs,sops", [
    ("efficient", 4 * 5, (3 + 1) * 5),       # the real row as MACs, spike rows as SOPs
    ("accumulate", 4 * 5, (3 + 1) * 5),      # no integers here: as efficient
    ("spikingjelly", 60, 0),                 # one real value makes the tensor MACs
    ("spikformer", 0, (4 + 3 + 1) * 5),      # after the first layer: nonzeros x fan-out, whatever the values
    ("stata", 60, 0),                        # STATA's model: only an all-binary tensor is spikes
    ("neurobench", 8 * 5, 0),                # a value outside {-1, 0, 1}: Effective MACs = nonzero pairs
])
def test_anchor_row_under_each_convention(convention, macs, sops):
    r, fc, first = _fc(convention, ANCHOR, 5)
    assert (fc.dense_macs, fc.macs, fc.sops) == (60, macs, sops)
    assert first.macs == 4 and first.sops == 0
    assert r.totals["energy_pj"] == pytest.approx(4.6 * (macs + 4) + 0.9 * sops)
    if convention in ("efficient", "accumulate"):
        assert fc.real_operand_macs == 20


def test_neurobench_convention_skips_zero_weights():
    model = FirstThen(4, 5)
    with torch.no_grad():
        model.fc.weight[0, 2] = 0.0  # feature 2 -> output 0: rows 0, 1, 2 all have feature 2 nonzero
    r = profile(model, inputs=(torch.tensor([[0.25, -0.5]]), ANCHOR), convention="neurobench")
    assert r.layer("fc").macs == 8 * 5 - 3


# integer residual, Linear(4 -> 3): fan-out 3, dense 2 x 4 x 3 = 24
@pytest.mark.parametrize("convention,macs,sops,int_macs,int_acs", [
    ("efficient", 4 * 3, 2 * 3, 12, 0),               # integer row as MACs (the conservative default)
    ("accumulate", 0, 4 * 3 + 2 * 3, 0, 12),          # value-weighted: sum 4 x fan-out 3
    ({"integer": "nonzero"}, 0, 3 * 3 + 2 * 3, 0, 9),  # as if binary: nonzeros 3 x 3
    ("spikingjelly", 24, 0, 24, 0),                   # whole tensor not binary: every row MACs
    ("stata", 24, 0, 24, 0),                          # STATA's model: as spikingjelly's, integers dense
    ("spikformer", 0, (3 + 2) * 3, 0, 0),
    ("neurobench", 5 * 3, 0, 0, 0),                   # a 2 in the input: MACs over nonzero pairs
])
def test_integer_residual_under_each_convention(convention, macs, sops, int_macs, int_acs):
    r, fc, _ = _fc(convention, RESIDUAL, 3)
    assert (fc.dense_macs, fc.macs, fc.sops) == (24, macs, sops)
    assert (fc.int_operand_macs, fc.int_operand_acs) == (int_macs, int_acs)
    assert r.totals["int_operand_macs"] == int_macs and r.totals["int_operand_acs"] == int_acs


def test_conv_batch_splits_real_and_spike_samples():
    x = torch.zeros(2, 1, 3, 3)
    x[0] = torch.randn(1, 3, 3, generator=torch.Generator().manual_seed(0))  # a real sample
    x[1, 0, 1, 1] = 1.0  # centre spike: reaches all 9 outputs
    x[1, 0, 0, 0] = 1.0  # corner spike: reaches 4 (padding 1)
    conv = nn.Conv2d(1, 2, 3, padding=1, bias=False)
    r = profile(conv, inputs=x)
    per_sample = 9 * 2 * 9
    assert (r.totals["dense_macs"], r.totals["macs"], r.totals["sops"]) == (2 * per_sample, per_sample, (9 + 4) * 2)
    whole = profile(conv, inputs=x, convention="spikingjelly")
    assert (whole.totals["macs"], whole.totals["sops"]) == (2 * per_sample, 0)


def test_attention_operands_classified_each():
    class QK(nn.Module):
        def forward(self, q, k):
            return q @ k.transpose(-2, -1)

    q = torch.tensor([[[0.3, -0.2, 0.5, 1.5], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])  # anchor row + 3 spikes
    k = torch.tensor([[[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]]])  # 5 spikes
    op = profile(QK(), inputs=(q, k))
    # Q's spike rows: nnz 3 x 3 keys; K's 5 spikes drive the anchor row: 5 accumulates
    assert (op.totals["macs"], op.totals["sops"]) == (0, 3 * 3 + 5)
    co = profile(QK(), inputs=(q, k), spike_matmul="coincidence")
    assert co.totals["sops"] == 4 + 5  # coinciding (1, 1) products of the spike rows: 3 + 1
    whole = profile(QK(), inputs=(q, k), convention="spikingjelly").totals  # Q is "real" as a whole: K's spikes drive 3 rows
    assert (whole["macs"], whole["sops"]) == (0, 5 * 3)


def test_padding_rows_are_free_among_spikes_and_dense_among_reals():
    lin = nn.Linear(4, 2, bias=False)
    spikes = torch.tensor([[1.0, 0, 0, 1], [0, 0, 0, 0]])  # a zero (padding) row in a spike tensor
    reals = torch.tensor([[0.5, -0.1, 0.2, 0.3], [0, 0, 0, 0]])  # a zero row in a real tensor
    assert (profile(lin, inputs=spikes).totals["sops"], profile(lin, inputs=spikes).totals["macs"]) == (2 * 2, 0)
    assert profile(lin, inputs=reals).totals["macs"] == 2 * 4 * 2  # an ANN's padding is computed: macs == dense


def test_split_operand_units_follow_the_feature_axis_through_a_transpose():
    k = ANCHOR[0]  # tokens x features, anchor row 0
    s_rows = split_operand(k)
    s_cols = split_operand(k.t())  # K^T: the stride-1 axis is still the feature axis: units are tokens
    for s in (s_rows, s_cols):
        assert (s.real_numel, s.bin_nnz, s.int_numel) == (4, 4, 0)


def test_ann_totals_unchanged_by_convention_choice():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(2, 3, 8, 8)
    for c in ("efficient", "accumulate", "spikingjelly"):
        t = profile(net, inputs=x, convention=c).totals
        assert t["macs"] == t["dense_macs"] and t["sops"] == 0, c


def test_presets_are_documented_and_resolvable():
    assert {"efficient", "accumulate", "spikingjelly", "spikformer", "stata", "neurobench"} <= set(CONVENTIONS)
    for name, conv in CONVENTIONS.items():
        assert conv.source and conv.formula, name
    assert "FL_l x fr_l" in CONVENTIONS["spikformer"].formula
    custom = resolve_convention({"preset": "spikformer", "integer": "accumulate"})
    assert custom.after_first == "nonzero" and custom.integer == "accumulate" and custom.name == "custom(spikformer)"
    with pytest.raises(ConfigError, match="Did you mean 'spikformer'"):
        resolve_convention("spikeformer")
    with pytest.raises(ConfigError, match="convention.integer must be one of"):
        resolve_convention({"integer": "free"})


def test_conventions_block_in_every_output():
    r, _, _ = _fc("spikformer", ANCHOR, 5)
    conv = r.meta["conventions"]
    for key in ("preset", "formula", "source", "firing_rate", "real_input_layers", "integer_operands", "timesteps",
                "energy", "flops", "first_layer"):
        assert key in conv, key
    assert conv["first_layer"].startswith("first:")
    assert conv["real_input_layers"] == ["first"]
    assert "4.6 pJ" in conv["energy"] and "Horowitz" in conv["energy"]
    assert json.loads(r.to_json())["meta"]["conventions"]["preset"] == "spikformer"
    md = r.to_markdown()
    assert "### Conventions" in md and "Zhou et al., ICLR 2023" in md and "spikes per neuron per time step" in md
    html = r.to_html()
    assert 'id="conventions"' in html and "Zhou et al., ICLR 2023" in html
    from rich.console import Console

    console = Console(width=120, record=True)
    for t in r.to_table():
        console.print(t)
    text = console.export_text()
    assert "conventions" in text and "Zhou et al" in text


def test_memory_access_energy_hand_counted():
    x = torch.tensor([[[1.0, 1, 0, 1]], [[0, 1, 0, 0]], [[1, 0, 1, 1]]])  # T=3, 7 spikes; LIF emits 4 spikes
    r = profile(TwoLayerSNN(), inputs=x, memory_access=True)
    e = MemoryModel().word_pj
    assert e(8 * 1024) == 10 and e(32 * 1024) == 20 and e(1024 * 1024) == 100 and e(4 * 1024) == 5 and e(2 ** 30) == 100
    # (words, buffer bytes): fc1 (21 SOPs): weights, input spikes, target potentials read + written
    fc1 = [(21, 48), (7, 48), (2 * 21, 36)]
    lif = [(2 * 9, 12), (4, 12)]  # every neuron's membrane read + written per step (3 neurons x 3 steps); spikes
    fc2 = [(8, 24), (4, 36), (2 * 8, 24)]  # 8 SOPs
    want = sum(w * e(b) for w, b in fc1 + lif + fc2)
    t = r.totals
    assert t["energy_memory_pj"] == pytest.approx(want, rel=1e-12)
    assert t["energy_total_pj"] == pytest.approx(t["energy_pj"] + want, rel=1e-12)
    assert t["energy_pj"] == pytest.approx(0.9 * 29)  # the compute-only number is unchanged beside it
    assert t["memory_weights_words"] == 29 and t["memory_spikes_words"] == 4 and t["memory_potentials_words"] == 42 + 18 + 16
    assert r.layer("lif").memory_pj == pytest.approx(sum(w * e(b) for w, b in lif))
    assert "Lemaire" in r.meta["conventions"]["memory_access"]
    assert "memory-access energy" in r.to_markdown()


def test_memory_access_of_an_ann_writes_outputs():
    lin = nn.Linear(4, 3, bias=False)
    x = torch.randn(2, 4)
    r = profile(lin, inputs=x, memory_access=True)
    e = MemoryModel().word_pj
    # 24 MACs: 24 weight reads, 8 input reads (each real input once), 6 output writes
    assert r.totals["energy_memory_pj"] == pytest.approx(24 * e(48) + 8 * e(32) + 6 * e(24), rel=1e-12)
    with pytest.raises(ConfigError, match="memory_access must be"):
        profile(lin, inputs=x, memory_access="lemaire")
