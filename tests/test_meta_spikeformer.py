"""Meta-SpikeFormer (Spike-driven Transformer V2): published sizes, the token grid its convs read
(dense, pruned, with an anchor), samples independent of their batch, the official checkpoint
layout, STATA on and off, recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
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
from efficient.models.meta_spikeformer import VARIANTS, MetaBlock, RepConvBN, TokenGrid
from efficient.models.stata import stata_outputs

SMALL = dict(embed_dim=32, last_dim=40, num_heads=4, depth=3, last_depth=1, timesteps=2, img_size=32, pool_stages=2,
             num_classes=10, backend="torch")

# Parameter counts (M) in the paper's ImageNet table (Yao et al., ICLR 2024, Table 3: Meta-SpikeFormer
# 15.1M / 31.3M / 55.4M) and what the reference code builds (BICLab/Spike-Driven-Transformer-V2
# `Spiking_vit_MetaFormer` with embed_dim [64,128,256,360], `metaspikformer_8_384`, `metaspikformer_8_512`)
PAPER_M = {"sdt-v2-8-256": 15.1, "sdt-v2-8-384": 31.3, "sdt-v2-8-512": 55.4}
REFERENCE_CODE = {"sdt-v2-8-256": 15_112_208, "sdt-v2-8-384": 31_333_864,
                  "sdt-v2-8-512": 55_350_248}


@pytest.mark.parametrize("name", PAPER_M)
def test_parameter_counts_match_the_paper(name: str) -> None:
    n = zoo.meta_param_count(name)
    assert abs(n / 1e6 - PAPER_M[name]) / PAPER_M[name] < 0.01, f"{name}: {n / 1e6:.2f}M vs the paper's {PAPER_M[name]}M"
    assert n == REFERENCE_CODE[name]


def test_variants_table_is_what_the_zoo_holds() -> None:
    assert sorted(VARIANTS) == sorted(n for n, e in zoo.registry().items() if e.family == "sdt-v2")
    for name, v in VARIANTS.items():
        entry = zoo.get_entry(name)
        assert isinstance(v.config, entry.config) and not entry.open_options()
        assert zoo.config_to_options(v.config) == entry.resolved_cfg()
        assert entry.builder.__module__ == "efficient.models.meta_spikeformer"
        assert len(name) <= 26  # `efficient zoo` lists a model per line in 80 columns
    with torch.device("meta"):
        m = zoo.create("sdt-v2-8-512")
    assert m.patch_embed.grid == 14 and len(m.blocks) == 8 and hasattr(m.blocks[6], "down")
    assert [b.attn.q.conv1.in_features for b in m.blocks] == [512] * 6 + [640] * 2
    assert [d.conv.stride[0] for d in m.patch_embed.down] == [2, 2, 2, 2]
    assert zoo.get_entry("sdt-v2-dvs").input_spec.timesteps == 16


# ---------------------------------------------------------------------------------- the token grid


def _grid_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 16, 5, generator=g, dtype=torch.float64), torch.randn(5, 1, 3, 3, generator=g, dtype=torch.float64), \
        torch.randn(5, generator=g, dtype=torch.float64)


def _dense_depthwise(u: torch.Tensor, w: torch.Tensor, fill: torch.Tensor, h: int) -> torch.Tensor:
    """The reference's BNAndPad + depthwise conv, channels-first: pad with `fill`, convolve, no padding."""
    T, B, n, C = u.shape
    m = u.reshape(T * B, h, h, C).permute(0, 3, 1, 2)
    m = F.pad(m - fill[:, None, None], (1, 1, 1, 1)) + fill[:, None, None]
    return F.conv2d(m, w, groups=C).flatten(2).transpose(1, 2).reshape(T, B, n, C)


def test_grid_depthwise_dense_and_with_every_position_listed_is_the_reference() -> None:
    u, w, fill = _grid_case()
    ref = _dense_depthwise(u, w, fill, 4)
    torch.testing.assert_close(TokenGrid(4, 4).depthwise(u, w, fill), ref, rtol=1e-12, atol=1e-12)
    listed = TokenGrid(4, 4, pos=torch.arange(16).expand(3, 16))
    torch.testing.assert_close(listed.depthwise(u, w, fill), ref, rtol=1e-12, atol=1e-12)


def test_grid_pruned_tokens_and_the_anchor_read_as_outside_the_image() -> None:
    u, w, fill = _grid_case()
    keep = torch.tensor([[0, 5, 6, 15], [3, 2, 9, 10], [12, 1, 4, 7]])  # per sample, in any order
    # the reference view: a pruned cell holds the padding value, then every kept token reads its own cell
    holes = fill.expand(2, 3, 16, 5).clone()
    idx = keep[None, :, :, None].expand(2, 3, 4, 5)
    holes.scatter_(2, idx, u.gather(2, idx))
    ref = _dense_depthwise(holes, w, fill, 4).gather(2, idx)
    got = TokenGrid(4, 4, pos=keep).depthwise(u.gather(2, idx), w, fill)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    # an anchor in front: alone on an empty grid, it sees only its own centre tap
    anchor = torch.randn(2, 3, 1, 5, dtype=torch.float64)
    with_anchor = TokenGrid(4, 4, prefix=1, pos=keep).depthwise(torch.cat([anchor, u.gather(2, idx)], 2), w, fill)
    alone = fill * w.sum((1, 2, 3)) + (anchor - fill) * w[:, 0, 1, 1]
    torch.testing.assert_close(with_anchor[:, :, :1], alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(with_anchor[:, :, 1:], ref, rtol=1e-12, atol=1e-12)


def test_grid_conv3x3_after_pruning_computes_the_kept_cells_only() -> None:
    g = torch.Generator().manual_seed(1)
    s = (torch.rand(2, 3, 16, 4, generator=g) > 0.5).double()
    conv = nn.Conv2d(4, 6, 3, 1, 1).double()
    dense = TokenGrid(4, 4).conv3x3(s, conv)
    ref = conv(s.reshape(6, 4, 4, 4).permute(0, 3, 1, 2)).flatten(2).transpose(1, 2).reshape(2, 3, 16, 6)
    torch.testing.assert_close(dense, ref, rtol=1e-12, atol=1e-12)
    keep = torch.tensor([[0, 5, 6], [3, 2, 9], [12, 1, 4]])
    idx = keep[None, :, :, None]
    zeroed = torch.zeros_like(s).scatter(2, idx.expand(2, 3, 3, 4), s.gather(2, idx.expand(2, 3, 3, 4)))
    want = TokenGrid(4, 4).conv3x3(zeroed, conv).gather(2, idx.expand(2, 3, 3, 6))
    got = TokenGrid(4, 4, pos=keep).conv3x3(s.gather(2, idx.expand(2, 3, 3, 4)), conv)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    fused = TokenGrid(4, 4, pos=keep).keep(torch.tensor([[0, 2], [1, 2], [2, 0]]), fused=True)
    assert fused.holes and fused.pos.tolist() == [[0, 6, -1], [2, 9, -1], [4, 12, -1]]


def test_repconv_unit_is_the_reference_rep_conv_with_bn_padding() -> None:
    """RepConvBN on grid tokens == conv1x1 -> BNAndPad(1) -> 3x3 depthwise (valid) -> conv1x1 -> BN -> BN,
    computed channels-first as the reference does (eval mode, trained-looking statistics)."""
    with float64():
        torch.manual_seed(0)
        unit = RepConvBN(6)
        for bn in (unit.bn1, unit.bn2, unit.bn):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.normal_()
        unit.eval()
        x = (torch.rand(2, 3, 9, 6) > 0.6).double()
        m = x.reshape(6, 3, 3, 6).permute(0, 3, 1, 2)
        def bn2d(bn: nn.BatchNorm1d, y: torch.Tensor) -> torch.Tensor:  # BatchNorm2d with that unit's parameters
            return F.batch_norm(y, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)

        y = F.pad(bn2d(unit.bn1, F.conv2d(m, unit.conv1.weight[:, :, None, None])), (1, 1, 1, 1))
        bn = unit.bn1  # BNAndPadLayer: the border holds what BN maps 0 to
        pad = (bn.bias - bn.running_mean * bn.weight / torch.sqrt(bn.running_var + bn.eps)).view(1, -1, 1, 1)
        y[:, :, 0:1, :] = pad
        y[:, :, -1:, :] = pad
        y[:, :, :, 0:1] = pad
        y[:, :, :, -1:] = pad
        y = F.conv2d(y, unit.dw.weight, groups=6)
        y = bn2d(unit.bn, bn2d(unit.bn2, F.conv2d(y, unit.conv2.weight[:, :, None, None])))
        ref = y.flatten(2).transpose(1, 2).reshape(2, 3, 9, 6)
        torch.testing.assert_close(unit(x, TokenGrid(3, 3)), ref, rtol=1e-12, atol=1e-12)


def test_block_without_grid_says_what_it_needs() -> None:
    blk = MetaBlock(8, 2, 4.0, dict(backend="torch"))
    with pytest.raises(ValueError, match="needs the token grid"):
        blk(torch.zeros(1, 1, 4, 8))


# -------------------------------------------------------------------------------------- the model


def test_spikes_feed_every_conv_but_the_reference_real_valued_ones() -> None:
    """The reference's spike-driven layout: binary input to every conv / Linear except the pixel conv,
    the depthwise convs of RepConv and SepConv's second 1x1 conv (they follow a BN / a depthwise)."""
    torch.manual_seed(0)
    x = torch.rand(2, 3, 32, 32)
    m = make_fire(zoo.create("sdt-v2-cifar", **SMALL), x)
    seen: dict[str, torch.Tensor] = {}
    hooks = [mod.register_forward_pre_hook(lambda mod, a, name=name: seen.__setitem__(name, a[0]))
             for name, mod in m.named_modules() if isinstance(mod, (nn.Linear, nn.Conv2d))]
    with torch.no_grad():
        m(x)
    for h in hooks:
        h.remove()
    real = {n for n, a in seen.items() if not bool(((a == 0) | (a == 1)).all())}
    expected = {"patch_embed.down.0.conv"} | {f"patch_embed.blocks.{i}.sep.pwconv2" for i in range(4)}
    expected |= {f"blocks.{b}.attn.{p}.conv2" for b in range(3) for p in ("q", "k", "v", "proj")}
    assert real == expected
    rates = firing_rates(m, x)
    assert len(rates) == 3 + 4 * 4 + 3 * 7 + 1 + 1 and all(0.01 < r < 0.99 for r in rates.values())


@pytest.mark.parametrize("name,extra", [("sdt-v2-cifar", {}),
                                        ("sdt-v2-stata", {"prune_blocks": [1, 2, 3]})])
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
        m = make_fire(zoo.create("sdt-v2-cifar", **SMALL), torch.rand(8, 3, 32, 32))
        handle = flatten_time_into(m.patch_embed.blocks[1].sep.lif2)
        with pytest.raises(AssertionError, match="depends on the rest of its batch"):
            assert_batch_independent(m, x, other)
        handle.remove()
        assert_batch_independent(m, x, other)


def test_stata_off_is_the_dense_model_and_on_prunes_with_gradients() -> None:
    torch.manual_seed(0)
    dense = zoo.create("sdt-v2-cifar", **SMALL)
    off = zoo.create("sdt-v2-stata", **SMALL, anchor="off", prune_blocks=[])
    off.load_state_dict(dense.state_dict())
    x = torch.rand(2, 3, 32, 32)
    assert torch.equal(off.eval()(x), dense.eval()(x))

    m = zoo.create("sdt-v2-stata", **SMALL, prune_blocks=[1, 2, 3]).train()
    out = m(torch.rand(3, 3, 32, 32))
    stats = stata_outputs(m).stats
    assert stats["tokens_in"] == [65, 46, 33] and stats["tokens_out"] == 24
    (out.sum() + sum(s.float().mean() for s, _ in stata_outputs(m).scores)).backward()
    assert m.anchor.grad is not None and torch.isfinite(m.anchor.grad).all() and m.anchor.grad.abs().sum() > 0
    assert all(p.grad is not None for p in m.parameters())


def test_stata_scores_are_the_anchor_row_of_qk() -> None:
    torch.manual_seed(0)
    m = zoo.create("sdt-v2-tiny-stata", backend="torch").eval()
    att = m.blocks[0].attn
    grid = TokenGrid(8, 8, prefix=1)
    x = torch.randn(4, 2, 65, 64) * 2
    with torch.no_grad():
        for bn in att.modules():
            if isinstance(bn, nn.BatchNorm1d):
                bn.running_var.fill_(1e-3)  # the fresh projections' small outputs, amplified until they fire
        _, s, c = att(x, grid, anchor=True, scores=True)
        sp = att.pre_lif(x)
        q, k = att.split_heads(att.q_lif(att.q(sp, grid))), att.split_heads(att.k_lif(att.k(sp, grid)))
        a = (q @ k.transpose(-2, -1)).sum(2)
    assert float(a.abs().sum()) > 0
    assert torch.equal(s, a[:, :, 0, 1:])
    torch.testing.assert_close(c, a[:, :, 1:, 1:].mean(2), rtol=1e-6, atol=0)


def test_official_layout_round_trip_with_and_without_the_distillation_head(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.rand(2, 3, 32, 32)
    model = make_fire(zoo.create("sdt-v2-cifar", **SMALL, distill_head=True), x)
    official = to_layout(model.state_dict(), "sdt-v2-kd")  # BICLab classification/models.py names
    assert official["block3.0.attn.q_conv.0.body.0.weight"].shape == (32, 32, 1, 1)
    assert official["block3.1.attn.proj_conv.0.body.2.0.weight"].shape == (32, 1, 3, 3)
    assert official["block4.0.mlp.fc1_conv.weight"].shape == (160, 40, 1)
    assert official["downsample4.encode_conv.weight"].shape == (40, 32, 3, 3)
    assert {"downsample1_1.encode_conv.bias", "ConvBlock2_2.0.Conv.dwconv.weight", "ConvBlock1_1.0.conv2.weight",
            "block3.0.attn.v_conv.1.running_var", "block3.1.attn.k_conv.0.body.1.bn.running_mean", "head_kd.bias"} <= set(official)
    assert not any(k.startswith("block3.3.") for k in official)
    assert detect_layout(official).name == "sdt-v2-kd"
    torch.save({"model": official, "epoch": 199}, tmp_path / "kd.pth")  # as main_finetune.py saves it
    plain = {k: v for k, v in SMALL.items()}
    loaded = efficient.load("sdt-v2-cifar", pretrained=tmp_path / "kd.pth", **plain)
    assert loaded.pretrained_cfg["layout"] == "sdt-v2-kd" and loaded.pretrained_cfg["distill_head"] is True
    with torch.no_grad():  # the same weights in the same model: equal bits
        assert torch.equal(loaded(x), model(x))

    without = {k: v for k, v in official.items() if not k.startswith("head_kd.")}
    assert detect_layout(without).name == "sdt-v2"
    torch.save(without, tmp_path / "plain.pth")
    single = efficient.load("sdt-v2-cifar", pretrained=tmp_path / "plain.pth", **plain, distill_head=True)
    assert not hasattr(single, "head_kd")
    with pytest.raises(ArtifactError, match=r"a MetaSpikeFormer checkpoint .* load it into a MetaSpikeFormer entry"):
        efficient.load("sdt-2-512", pretrained=tmp_path / "plain.pth")
    with pytest.raises(ArtifactError, match=r"shape mismatch"):
        efficient.load("sdt-v2-cifar", pretrained=tmp_path / "plain.pth", **{**plain, "last_dim": 48})


def test_config_errors_name_the_option() -> None:
    with pytest.raises(ConfigError, match="does not fit the Meta-SpikeFormer conv stages"):
        zoo.create("sdt-v2-tiny", img_size=15)
    with pytest.raises(ConfigError, match="last_depth must be in 0..depth=2"):
        zoo.create("sdt-v2-tiny", last_depth=3)
    with pytest.raises(ConfigError, match="not divisible by num_heads"):
        zoo.create("sdt-v2-tiny", last_dim=70)
    m = zoo.create("sdt-v2-tiny", last_depth=0, backend="torch")  # transformer blocks at one width
    assert not any(hasattr(b, "down") for b in m.blocks) and m.head.in_features == 64
    assert m(torch.rand(1, 1, 16, 16)).shape == (1, 10)


def test_activation_memory_levels_keep_the_step() -> None:
    """`bits` gives a training step bitwise, `recompute` (conv blocks and transformer blocks rerun
    with their token grid) within the zoo reference's tolerance, pruning and fusing included."""
    import zoo_reference as zr
    from efficient import memory

    for case in (c for c in zr.CASES if c.id in ("sdt-v2-tiny-stata", "sdt-v2/fuse-after-block")):
        none = zr.compute_case(case)
        assert zr.compute_case(case, perturb=lambda m: memory.optimize(m, "bits")) == none
        recompute = zr.compute_case(case, perturb=lambda m: memory.optimize(m, "recompute"))
        assert zr.compare(none, recompute) == [], case.id


@pytest.mark.slow
@pytest.mark.parametrize("recipe,overrides", [
    ("sdt_v2_digits", []),
    ("sdt_v2_cluttered", ["data.train_per_digit=1", "data.val_per_digit=1", "profile.samples=4"]),
    ("sdt_v2_stata_cluttered", ["data.train_per_digit=1", "data.val_per_digit=1", "profile.samples=4"]),
])
def test_recipe_trains_two_steps_with_cost_report(recipe: str, overrides: list[str], tmp_path: Path) -> None:
    from conftest import ROOT

    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml", ["train.max_steps=2", "train.progress=false", *overrides])
    summary = Trainer(r, tmp_path / "run").fit()
    assert summary["steps"] == 2 and 0 <= summary["val"]["acc"] <= 1
    assert summary["cost"]["flops"] > 0 and (tmp_path / "run" / "report.md").exists()
