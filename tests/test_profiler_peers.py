"""Profiler against peers: fvcore and torch's FlopCounterMode on ANNs, spikingjelly 2.0's op
counters on spiking transformers (its Spikformer and ours)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import efficient
from efficient.profiler import profile

fvcore_nn = pytest.importorskip("fvcore.nn")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

# fvcore operator names that are multiply-accumulates in our sense; it also counts norms and
# pooling (batch_norm, layer_norm, adaptive_avg_pool2d), which are not MACs in our convention.
FVCORE_MAC_OPS = {"conv", "linear", "addmm", "matmul", "bmm", "einsum"}


def _fvcore_macs(model: nn.Module, x: torch.Tensor) -> tuple[int, dict[str, int], set[str]]:
    fa = fvcore_nn.FlopCountAnalysis(model, x)
    fa.unsupported_ops_warnings(False)
    fa.uncalled_modules_warnings(False)
    by_op = dict(fa.by_operator())
    return sum(v for k, v in by_op.items() if k in FVCORE_MAC_OPS), by_op, set(fa.unsupported_ops())


def _torch_flops(model: nn.Module, x: torch.Tensor) -> int:
    fc = FlopCounterMode(display=False)
    with fc, torch.no_grad():
        model(x)
    return fc.get_total_flops()


def _sdpa_macs(report) -> int:
    return sum(x.dense_macs for x in report.layers if "scaled_dot_product" in x.ops)


def _check_ann(model: nn.Module, x: torch.Tensor) -> tuple:
    model.eval()
    r = profile(model, inputs=x)
    fv, by_op, unsupported = _fvcore_macs(model, x)
    t = r.totals
    assert t["macs"] == t["dense_macs"] and t["sops"] == 0  # an ANN: every op is a real MAC
    return r, fv, by_op, unsupported, _torch_flops(model, x)


def _resnet(size: int):
    import torchvision as tv  # a dependency of efficient
    torch.manual_seed(0)
    return tv.models.resnet18(), torch.randn(1, 3, size, size)


def _vit(size: int, fused: bool):
    import timm  # a dependency of efficient
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", img_size=size)
    for blk in m.blocks:
        blk.attn.fused_attn = fused
    return m, torch.randn(1, 3, size, size)


@pytest.mark.parametrize("size", [32, pytest.param(224, marks=pytest.mark.slow)])
def test_resnet18_matches_fvcore_and_flopcounter(size):
    model, x = _resnet(size)
    r, fv, by_op, unsupported, tflops = _check_ann(model, x)
    assert r.totals["dense_macs"] == fv  # conv + linear; fvcore's batch_norm/pool counts are not MACs
    assert "batch_norm" in by_op  # (fvcore counts BN; we state it and leave it out)
    assert r.totals["flops"] == tflops  # FlopCounterMode: 2 per MAC
    if size == 224:
        assert r.totals["dense_macs"] == 1_814_073_344


@pytest.mark.parametrize("size", [32, pytest.param(224, marks=pytest.mark.slow)])
def test_vit_tiny_explicit_attention_matches_peers(size):
    model, x = _vit(size, fused=False)
    r, fv, by_op, unsupported, tflops = _check_ann(model, x)
    assert r.totals["dense_macs"] == fv and "matmul" in by_op
    assert r.totals["flops"] == tflops


@pytest.mark.parametrize("size", [32, pytest.param(224, marks=pytest.mark.slow)])
def test_vit_tiny_fused_attention_is_counted_where_peers_skip_it(size):
    # With F.scaled_dot_product_attention, fvcore skips the op (listed unsupported) and
    # FlopCounterMode has no formula for the CPU flash kernel; we count Q K^T and P V.
    model, x = _vit(size, fused=True)
    r, fv, by_op, unsupported, tflops = _check_ann(model, x)
    n = (size // 16) ** 2 + 1
    heads, d, depth = 3, 64, 12
    sdpa = _sdpa_macs(r)
    assert sdpa == depth * heads * n * n * 2 * d
    assert "aten::scaled_dot_product_attention" in unsupported
    assert r.totals["dense_macs"] - sdpa == fv
    if x.device.type == "cpu":
        assert r.totals["flops"] - 2 * sdpa == tflops


# ----------------------------------------------------------------------------- spikingjelly


def _excite(model: nn.Module, gain: float) -> None:
    """Random weights large enough that neurons fire (a fresh init is nearly silent)."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear)):
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * gain / math.sqrt(m.weight[0].numel()))


def _sj_counts(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    pytest.importorskip("spikingjelly.activation_based.op_counter")  # the oracle is an optional peer
    from spikingjelly.activation_based import functional
    from spikingjelly.activation_based.op_counter import DispatchCounterMode, MACCounter, SynOpCounter

    syn = SynOpCounter()
    # spikingjelly's MACCounter also charges BatchNorm's affine (one MAC per element); our macs
    # cover matmul/conv/linear only, so BatchNorm is excluded there to compare like with like.
    mac = MACCounter(extra_ignore_modules=[nn.BatchNorm1d, nn.BatchNorm2d])
    functional.reset_net(model)
    with torch.no_grad(), DispatchCounterMode([syn, mac]):
        model(x)
    functional.reset_net(model)
    return syn.get_total(), mac.get_total()


def _check_sj_parity(model: nn.Module, x: torch.Tensor) -> None:
    sj_sops, sj_macs = _sj_counts(model, x)
    # spikingjelly classifies each operand tensor as a whole: the "spikingjelly" preset does too
    co = profile(model, inputs=x, convention="spikingjelly")
    ours = profile(model, inputs=x, convention={"preset": "spikingjelly", "spike_matmul": "operand"})
    assert ours.totals["mean_firing_rate"] > 0.05 and sj_sops > 0 and sj_macs > 0
    # same convention: exact
    assert co.totals["sops"] == sj_sops
    assert co.totals["macs"] == ours.totals["macs"] == sj_macs
    sj_energy = 4.6 * sj_macs + 0.9 * sj_sops
    assert co.totals["energy_pj"] == pytest.approx(sj_energy, rel=1e-12)
    # the operand convention differs only on spike x spike matmuls; converting gives the same number
    ss = ours.meta["spike_spike_matmul"]
    assert ours.totals["sops"] - ss["operand_sops"] + ss["coincidence_sops"] == sj_sops
    assert ss["operand_sops"] > ss["coincidence_sops"] > 0  # the models do have spike x spike matmuls
    converted = ours.totals["energy_pj"] - 0.9 * (ss["operand_sops"] - ss["coincidence_sops"])
    assert converted == pytest.approx(sj_energy, rel=1e-12)
    # the default splits mixed operand tensors per row: never more MACs than the whole-tensor count
    default = profile(model, inputs=x)
    assert default.totals["dense_macs"] == co.totals["dense_macs"]
    assert default.totals["macs"] <= co.totals["macs"]


def test_spikingjelly_spikformer_matches_its_op_counter():
    pytest.importorskip("spikingjelly.activation_based")
    from spikingjelly.activation_based.model.spikformer import Spikformer

    torch.manual_seed(0)
    model = Spikformer(T=2, img_size_h=16, img_size_w=16, patch_size=4, num_classes=10,
                       embed_dims=64, num_heads=4, depths=1).eval()
    _excite(model, 3.0)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    _check_sj_parity(model, x)
    r = profile(model, inputs=x)
    assert r.layer("blocks.0.attn.qkv_lif").neuron == "spikingjelly multi-step"
    assert [b["tokens_in"] for b in r.blocks] == [16]


def test_zoo_spikformer_matches_spikingjelly_op_counter():
    model = efficient.zoo.create("spikformer-tiny", timesteps=2).eval()
    _excite(model, 5.0)
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    _check_sj_parity(model, x)
