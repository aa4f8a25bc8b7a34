"""Spikingformer: published sizes, spike-driven residuals (every conv / matmul reads spikes),
samples independent of their batch, the official checkpoint layouts, STATA on and off, recipes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import efficient
from _spiking_transformer_checks import (
    assert_batch_independent,
    assert_batch_size_invariant,
    firing_rates,
    flatten_time_into,
    float64,
    make_fire,
)
from efficient import zoo
from efficient.errors import ArtifactError, ConfigError
from efficient.export.checkpoints import detect_layout, to_layout
from efficient.models.spikingformer import VARIANTS, Spikingformer
from efficient.models.stata import stata_outputs
from efficient.models.neurons import SpikingNeuron

SMALL = dict(embed_dim=32, num_heads=4, depth=2, timesteps=2, backend="torch")

# Parameter counts (M) in the paper's tables (arXiv 2304.11954 Tables 1-3, also the reference
# repository's README): ImageNet 8-384 / 8-512 / 8-768, CIFAR 4-384, DVS 2-256.
PAPER_M = {"spikingformer-8-384": 16.81, "spikingformer-8-512": 29.68, "spikingformer-8-768": 66.34,
           "spikingformer-4-384": 9.32, "spikingformer-2-256-dvs": 2.57}
# what the reference code builds (models counted with its own `vit_snn`): ours is the same network
REFERENCE_CODE = {"spikingformer-4-384": 9_326_266, "spikingformer-8-768": 66_363_208}


@pytest.mark.parametrize("name", PAPER_M)
def test_parameter_counts_match_the_paper(name: str) -> None:
    n = zoo.meta_param_count(name)
    assert abs(n / 1e6 - PAPER_M[name]) / PAPER_M[name] < 0.01, f"{name}: {n / 1e6:.2f}M vs the paper's {PAPER_M[name]}M"
    if name in REFERENCE_CODE:
        assert n == REFERENCE_CODE[name]


def test_variants_table_is_what_the_zoo_holds() -> None:
    assert sorted(VARIANTS) == sorted(n for n, e in zoo.registry().items() if e.family == "spikingformer")
    for name, v in VARIANTS.items():
        entry = zoo.get_entry(name)
        assert isinstance(v.config, entry.config) and not entry.open_options()
        assert zoo.config_to_options(v.config) == entry.resolved_cfg()
        assert entry.builder.__module__ == "efficient.models.spikingformer"
        assert len(name) <= 26  # `efficient zoo` lists a model per line in 80 columns
    assert zoo.get_entry("spikingformer-8-512").input_spec.shape == (3, 224, 224)
    assert zoo.get_entry("spikingformer-2-256-dvs").input_spec.timesteps == 16


def test_every_conv_and_matmul_reads_spikes_and_the_stream_is_real() -> None:
    """Pre-activation residuals: a LIF opens every branch, so each Linear / Conv (but the first,
    on pixels, and the head, on the pooled stream) sees spikes, and blocks add real-valued BN outputs."""
    torch.manual_seed(0)
    x = torch.rand(2, 3, 32, 32)
    m = make_fire(zoo.create("spikingformer-4-384", **SMALL), x)
    seen: dict[str, torch.Tensor] = {}
    hooks = [mod.register_forward_pre_hook(lambda mod, a, name=name: seen.__setitem__(name, a[0]))
             for name, mod in m.named_modules() if isinstance(mod, (nn.Linear, nn.Conv2d, m.blocks[0].__class__))]
    with torch.no_grad():
        m(x)
    for h in hooks:
        h.remove()
    assert len(seen) == 5 + 2 * (1 + 6) + 1
    for name, a in seen.items():
        binary = bool(((a == 0) | (a == 1)).all())
        if name in ("patch_embed.convs.0", "head") or name.startswith("blocks.") and name.count(".") == 1:
            assert not binary, f"{name} should read real values"
        else:
            assert binary, f"{name} reads non-spikes"
    assert all(0.01 < r < 0.99 for r in firing_rates(m, x).values())


@pytest.mark.parametrize("name,extra", [("spikingformer-4-384", {}), ("spikingformer-stata", {"prune_blocks": [1, 2]})])
def test_a_sample_does_not_depend_on_its_batch(name: str, extra: dict) -> None:
    with float64():
        torch.manual_seed(0)
        x, other = torch.rand(3, 3, 32, 32), torch.rand(3, 3, 32, 32)
        m = make_fire(zoo.create(name, **SMALL, **extra), torch.rand(8, 3, 32, 32))
        for train in (False, True):
            assert_batch_independent(m, x, other, train=train)
        assert_batch_size_invariant(m, x)


def test_the_checks_catch_a_neuron_fed_time_and_batch_flattened() -> None:
    with float64():
        torch.manual_seed(0)
        x, other = torch.rand(3, 3, 32, 32), torch.rand(3, 3, 32, 32)
        m = make_fire(zoo.create("spikingformer-4-384", **SMALL), torch.rand(8, 3, 32, 32))
        handle = flatten_time_into(m.blocks[1].attn.attn_lif)  # QKFormer #14's bug, planted
        with pytest.raises(AssertionError, match="depends on the rest of its batch"):
            assert_batch_independent(m, x, other)
        with pytest.raises(AssertionError, match="depends on the batch size"):
            assert_batch_size_invariant(m, x)
        handle.remove()
        assert_batch_independent(m, x, other)


def test_stata_off_is_the_dense_model_and_on_prunes_with_gradients() -> None:
    torch.manual_seed(0)
    dense = zoo.create("spikingformer-4-384", **SMALL)
    off = zoo.create("spikingformer-stata", **SMALL, anchor="off", prune_blocks=[])
    off.load_state_dict(dense.state_dict())
    x = torch.rand(2, 3, 32, 32)
    assert torch.equal(off.eval()(x), dense.eval()(x))

    m = zoo.create("spikingformer-tiny-stata", backend="torch").train()
    out = m(torch.rand(3, 1, 16, 16))
    stats = stata_outputs(m).stats
    assert stats["tokens_in"] == [65, 33] and stats["tokens_out"] == 17
    s, c = stata_outputs(m).scores[0]
    assert s.shape == c.shape == (4, 3, 64)
    (out.sum() + s.float().mean()).backward()
    assert m.anchor.grad is not None and torch.isfinite(m.anchor.grad).all()
    assert all(p.grad is not None for n, p in m.named_parameters() if p.requires_grad and "norm" not in n)


def test_stata_scores_are_the_anchor_row_of_qk() -> None:
    torch.manual_seed(0)
    m = zoo.create("spikingformer-tiny-stata", backend="torch").eval()
    att = m.blocks[0].attn
    x = torch.randn(4, 2, 65, 64) * 2
    with torch.no_grad():
        for bn in att.modules():
            if isinstance(bn, nn.BatchNorm1d):
                bn.running_var.fill_(1e-3)  # the fresh projections' small outputs, amplified until they fire
        _, s, c = att(x, anchor=True, scores=True)
        q, k, _ = att.qkv(att.pre_lif(x))
        a = (q @ k.transpose(-2, -1)).sum(2)  # [T, B, N, N], summed over heads
    assert float(a.abs().sum()) > 0
    assert torch.equal(s, a[:, :, 0, 1:])
    torch.testing.assert_close(c, a[:, :, 1:, 1:].mean(2), rtol=1e-6, atol=0)


def test_official_cifar_layout_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.rand(2, 3, 32, 32)
    model = make_fire(zoo.create("spikingformer-4-384", **SMALL), x)
    official = to_layout(model.state_dict(), "spikingformer-cifar")  # zhouchenlin2096/Spikingformer cifar10/model.py
    assert official["block.0.attn.q_conv.weight"].shape == (32, 32, 1)  # Conv1d, no bias
    assert "block.0.attn.q_conv.bias" not in official and official["block.0.attn.proj_conv.bias"].shape == (32,)
    assert official["block.1.mlp.mlp2_conv.weight"].shape == (32, 128, 1, 1)  # 1x1 Conv2d
    assert {"patch_embed.block0_conv.weight", "patch_embed.block4_bn.running_var", "block.1.norm2.bias"} <= set(official)
    assert detect_layout(official).name == "spikingformer-cifar"
    torch.save({"state_dict": {f"module.{k}": v for k, v in official.items()}, "epoch": 399}, tmp_path / "cifar.pth.tar")
    loaded = efficient.load("spikingformer-4-384", pretrained=tmp_path / "cifar.pth.tar", **SMALL)
    assert loaded.pretrained_cfg["layout"] == "spikingformer-cifar"
    with torch.no_grad():  # the same weights in the same model: equal bits
        assert torch.equal(loaded(x), model(x))


def test_official_imagenet_dvs_layout_round_trip_fills_the_unused_norms(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.rand(2, 3, 64, 64)
    opts = dict(SMALL, img_size=64, num_classes=10)
    model = make_fire(zoo.create("spikingformer-8-512", **opts, reference_norms=False), x)
    official = to_layout(model.state_dict(), "spikingformer")  # imagenet/model.py, cifar10-dvs/model.py
    assert {"patch_embed.proj_conv.weight", "patch_embed.proj4_conv.weight", "block.0.mlp.mlp1_bn.running_mean"} <= set(official)
    assert not any("norm" in k for k in official)
    torch.save(official, tmp_path / "imagenet.pth")
    loaded = efficient.load("spikingformer-8-512", pretrained=tmp_path / "imagenet.pth", **opts, reference_norms=False)
    assert loaded.pretrained_cfg["layout"] == "spikingformer" and loaded.pretrained_cfg["reference_norms"] is True
    assert len(loaded.pretrained_cfg["filled"]) == 4 * SMALL["depth"]  # norm1/norm2 weight and bias: identity
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    with pytest.raises(ArtifactError, match=r"a Spikingformer checkpoint .* but 'spikformer-8-512' is a Spikformer; load it "
                                            r"into a Spikingformer entry \(e\.g\. efficient\.load\('spikingformer-4-384'"):
        efficient.load("spikformer-8-512", pretrained=tmp_path / "imagenet.pth")


def test_config_errors_name_the_option() -> None:
    with pytest.raises(ConfigError, match="does not fit the Spikingformer stem"):
        zoo.create("spikingformer-tiny", img_size=15)
    with pytest.raises(ConfigError, match="at most depth=2"):
        zoo.create("spikingformer-tiny-stata", prune_blocks=[3])
    cfg = dataclasses.replace(VARIANTS["spikingformer-tiny"].config, depth=1)
    assert len(Spikingformer(cfg).blocks) == 1 and len(Spikingformer(depth=3).blocks) == 3


def test_activation_memory_levels_keep_the_step() -> None:
    """`bits` gives a training step bitwise, `recompute` (the stem and each block's attention and
    MLP rerun) within the zoo reference's tolerance."""
    import zoo_reference as zr
    from efficient import memory

    case = next(c for c in zr.CASES if c.id == "spikingformer-tiny-stata")
    none = zr.compute_case(case)
    assert zr.compute_case(case, perturb=lambda m: memory.optimize(m, "bits")) == none
    recompute = zr.compute_case(case, perturb=lambda m: memory.optimize(m, "recompute"))
    assert zr.compare(none, recompute) == []
    units = [n for n, _ in memory.recompute.units(zoo.create("spikingformer-tiny"))]
    assert units == ["patch_embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,overrides", [
    ("spikingformer_digits", []),
    ("spikingformer_cluttered", ["data.train_per_digit=1", "data.val_per_digit=1", "profile.samples=4"]),
    ("spikingformer_stata_cluttered", ["data.train_per_digit=1", "data.val_per_digit=1", "profile.samples=4"]),
])
def test_recipe_trains_two_steps_with_cost_report(recipe: str, overrides: list[str], tmp_path: Path) -> None:
    from conftest import ROOT

    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml", ["train.max_steps=2", "train.progress=false", *overrides])
    summary = Trainer(r, tmp_path / "run").fit()
    assert summary["steps"] == 2 and 0 <= summary["val"]["acc"] <= 1
    assert summary["cost"]["flops"] > 0 and (tmp_path / "run" / "report.md").exists()


def test_neurons_are_ours() -> None:
    m = zoo.create("spikingformer-tiny")
    lifs = [n for n, mod in m.named_modules() if isinstance(mod, SpikingNeuron)]
    assert len(lifs) == 4 + 2 * 7  # stem stages, and per block: pre, q, k, v, attention, two MLP neurons
