"""Spikformer / SDT checkpoints in spikingjelly 2.0's and the official repositories' layouts load
into our zoo entries with the same spikes (but for threshold ties) and logits; bad checkpoints give
errors that name the keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import efficient
from efficient.errors import ArtifactError
from efficient.export.checkpoints import detect_layout, to_layout
from efficient.models.neurons import SpikingNeuron


def _make_fire(model: nn.Module, x: torch.Tensor, reset=None) -> nn.Module:
    """Batch-norm statistics of `x` (one training pass) and scales that make every neuron layer fire
    (fresh transformers barely spike: their projections start at std 0.02); returns it in eval mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.momentum = None
        m.reset_running_stats()
    model.train()
    with torch.no_grad():
        model(x)
        if reset is not None:
            reset(model)
        for m in bns:
            m.weight.fill_(1.5)
            m.bias.fill_(0.5)
    return model.eval()


def _spikes(model: nn.Module, kind: type) -> list[tuple[str, torch.Tensor]]:
    """(name, spikes) of every `kind` neuron layer, in the order the forward pass calls them."""
    trace: list[tuple[str, torch.Tensor]] = []
    for name, m in model.named_modules():
        if isinstance(m, kind):
            m.register_forward_hook(lambda _m, _i, o, name=name: trace.append((name, o.detach().clone())))
    return trace


def _sj_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from spikingjelly.activation_based import functional

    functional.reset_net(model)
    with torch.no_grad():
        return model(x)


def _assert_spikes_agree(theirs: list, ours: list) -> int:
    """Layer by layer, our spikes equal spikingjelly's but for a few flipped at threshold ties; returns
    how many flipped. spikingjelly computes pre-activations with Conv1d/Conv2d (oneDNN) where we use
    Linear, and the two may round the same sum differently in the last bit, so a membrane within an
    ulp of threshold can fire in one and not the other. Allowed per layer: 0.1 % of its spikes, at
    least 2 (the smallest layers hold a few hundred). A wrong weight mapping (a swapped, transposed or
    misplaced tensor) changes tens of percent of the spikes of the first layer it feeds."""
    ref: list[tuple[str, torch.Tensor]] = []
    for name, s in theirs:  # spikingjelly's Spikformer fires q, k and v from one [T, B, 3C, N] neuron
        split = name.endswith("qkv_lif")
        ref += [(f"{name}[{i}]", c) for i, c in enumerate(s.chunk(3, dim=2))] if split else [(name, s)]
    assert len(ref) == len(ours) > 0
    flipped = 0
    for (rn, r), (on, o) in zip(ref, ours):
        # ours are [T, B, N, C] where spikingjelly's are channels-first ([T, B, C, N] or [T, B, C, H, W])
        o = (o if o.shape == r.shape else o.transpose(-1, -2).reshape(r.shape)).to(r.dtype)
        n = int((o != r).sum())
        assert n <= max(2, 1e-3 * r.numel()), f"{on} vs spikingjelly's {rn}: {n} of {r.numel()} spikes differ"
        flipped += n
    return flipped


def _logit_tol(flipped: int) -> dict:
    """Logits are a linear head over pooled spikes: with every spike equal they differ only by the
    rounding of the head's sums (~1e-7); a few spikes flipped at ties move them by a head weight over
    the pooled positions each (~1e-4), far below the O(1) change of a wrong mapping."""
    return dict(atol=1e-5 if flipped == 0 else 5e-2, rtol=0)


def test_spikingjelly_spikformer_cifar10_gives_its_logits(tmp_path: Path) -> None:
    pytest.importorskip("spikingjelly.activation_based")
    from spikingjelly.activation_based import functional, neuron
    from spikingjelly.activation_based.model.spikformer import spikformer_cifar10

    torch.manual_seed(0)
    x = torch.rand(1, 3, 32, 32)
    sj = _make_fire(spikformer_cifar10(), x, functional.reset_net)
    theirs = _spikes(sj, neuron.BaseNode)
    ref = _sj_forward(sj, x).mean(0)  # spikingjelly's head runs per time step: [T, B, classes]
    torch.save(sj.state_dict(), tmp_path / "sj_spikformer.pth")

    ours = efficient.load("spikformer-4-384", pretrained=tmp_path / "sj_spikformer.pth")
    assert ours.pretrained_cfg["layout"] == "spikingjelly"
    assert ours.pretrained_cfg["stem_pool"] == "before_neuron"  # spikingjelly pools before the stem neurons
    spikes = _spikes(ours, SpikingNeuron)
    with torch.no_grad():
        out = ours(x)
    rates = [float(s.float().mean()) for _, s in spikes]
    assert len(rates) == 33 and all(0.01 < r < 0.99 for r in rates)  # every neuron layer fires
    torch.testing.assert_close(out, ref, **_logit_tol(_assert_spikes_agree(theirs, spikes)))

    # the same weights in the official repository's layout (cifar10/model.py), as its train script saves them
    official = to_layout(ours.state_dict(), "spikformer-cifar")
    assert "block.0.attn.q_linear.weight" in official and "patch_embed.proj_conv3.weight" in official
    torch.save({"state_dict": official, "epoch": 299}, tmp_path / "official.pth.tar")
    same = efficient.load("spikformer-4-384", pretrained=tmp_path / "official.pth.tar", stem_pool="before_neuron")
    assert same.pretrained_cfg["layout"] == "spikformer-cifar"
    with torch.no_grad():  # the same weights in the same model: the same computation, equal bits
        assert torch.equal(same(x), out)
    paper = efficient.load("spikformer-4-384", pretrained=tmp_path / "official.pth.tar")  # the paper's stem
    assert all(torch.equal(a, b) for a, b in zip(paper.state_dict().values(), ours.state_dict().values()))


def _tiny_spikformer(**kw) -> nn.Module:
    return efficient.zoo.create("spikformer-4-384", embed_dim=32, depth=1, num_heads=4, timesteps=2, img_size=16, **kw)


def test_official_imagenet_layout_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.rand(2, 3, 16, 16)
    model = _make_fire(_tiny_spikformer(qkv_bias=False, pool_stages=4), x)
    official = to_layout(model.state_dict(), "spikformer-imagenet")
    assert official["block.0.attn.q_conv.weight"].shape == (32, 32, 1)  # Conv1d
    assert official["block.0.mlp.fc1_conv.weight"].shape == (128, 32, 1, 1)  # 1x1 Conv2d
    assert detect_layout(official).name == "spikformer-imagenet"
    torch.save(official, tmp_path / "imagenet.pth")
    loaded = efficient.load("spikformer-4-384", pretrained=tmp_path / "imagenet.pth", embed_dim=32, depth=1, num_heads=4,
                            timesteps=2, img_size=16, qkv_bias=False, pool_stages=4)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_spikingjelly_sdt_and_official_sdt_layouts(tmp_path: Path) -> None:
    pytest.importorskip("spikingjelly.activation_based")
    from spikingjelly.activation_based import functional, neuron
    from spikingjelly.activation_based.model.spike_driven_transformer import SpikeDrivenTransformer

    torch.manual_seed(0)
    x = torch.rand(2, 3, 16, 16)
    sj = SpikeDrivenTransformer(T=2, in_channels=3, num_classes=10, embed_dims=64, num_heads=8, depths=2, pooling_stat="0011")
    with torch.no_grad():  # its stem convs have biases (ours none): make them matter
        for m in sj.patch_embed.modules():
            if isinstance(m, nn.Conv2d) and m.bias is not None:
                m.bias.normal_()
    sj = _make_fire(sj, x, functional.reset_net)
    theirs = _spikes(sj, neuron.BaseNode)
    ref = _sj_forward(sj, x)
    torch.save(sj.state_dict(), tmp_path / "sj_sdt.pth")
    opts = dict(embed_dim=64, num_heads=8, depth=2, timesteps=2, img_size=16)  # pooling_stat "0011" = pool_stages 2
    ours = efficient.load("sdt-2-512", pretrained=tmp_path / "sj_sdt.pth", **opts)
    assert ours.pretrained_cfg["layout"] == "sdt-spikingjelly"
    spikes = _spikes(ours, SpikingNeuron)
    with torch.no_grad():
        out = ours(x)
    assert all(0.01 < float(s.float().mean()) < 0.99 for _, s in spikes)
    torch.testing.assert_close(out, ref, **_logit_tol(_assert_spikes_agree(theirs, spikes)))

    official = to_layout(ours.state_dict(), "sdt")  # BICLab/Spike-Driven-Transformer names
    assert official["block.1.attn.q_conv.weight"].shape == (64, 64, 1, 1)
    assert "block.0.attn.talking_heads.weight" in official and "patch_embed.proj_bn3.running_var" in official
    torch.save({"model": {f"module.{k}": v for k, v in official.items()}}, tmp_path / "sdt.pth")  # a DDP checkpoint
    again = efficient.load("sdt-2-512", pretrained=tmp_path / "sdt.pth", **opts)
    assert again.pretrained_cfg["layout"] == "sdt"
    with torch.no_grad():  # the same weights in the same model: the same computation, equal bits
        assert torch.equal(again(x), out)


def test_checkpoint_of_another_architecture_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sdt = efficient.zoo.create("sdt-2-512", embed_dim=32, num_heads=4, depth=1, timesteps=2, img_size=16)
    torch.save(to_layout(sdt.state_dict(), "sdt"), tmp_path / "sdt.pth")
    with pytest.raises(ArtifactError, match=r"sdt\.pth: a SpikeDrivenTransformer checkpoint .* but 'spikformer-4-384' is a Spikformer"):
        efficient.load("spikformer-4-384", pretrained=tmp_path / "sdt.pth")
    torch.save({"conv1.weight": torch.zeros(8, 3, 7, 7), "fc.weight": torch.zeros(10, 8)}, tmp_path / "resnet.pth")
    with pytest.raises(ArtifactError, match=r"resnet\.pth: weights do not fit Spikformer .*unexpected \['conv1\.weight'"):
        efficient.load("spikformer-4-384", pretrained=tmp_path / "resnet.pth")


def test_mismatched_keys_and_shapes_are_named(tmp_path: Path) -> None:
    from efficient.errors import ConfigError

    with pytest.raises(ConfigError, match=r"stem_pool must be 'after_neuron' or 'before_neuron'"):
        _tiny_spikformer(stem_pool="before")
    torch.manual_seed(0)
    official = to_layout(_tiny_spikformer().state_dict(), "spikformer-cifar")
    opts = dict(embed_dim=32, depth=1, num_heads=4, timesteps=2, img_size=16)
    torch.save(official, tmp_path / "ok.pth")
    with pytest.raises(ArtifactError, match=r"ok\.pth: .*shape mismatch \(file -> model\) block\.0\.attn\.k_bn\.bias \(32,\) "
                                            r"-> blocks\.0\.attn\.k\.bn\.bias \(64,\)"):
        efficient.load("spikformer-4-384", pretrained=tmp_path / "ok.pth", **{**opts, "embed_dim": 64})
    with pytest.raises(ArtifactError, match=r"ok\.pth: .*missing \d+ keys: block\.1\.attn\.k_bn\.bias \(ours: blocks\.1\.attn\.k\.bn\.bias\)"):
        efficient.load("spikformer-4-384", pretrained=tmp_path / "ok.pth", **{**opts, "depth": 2})
    extra = dict(official, **{"block.0.attn.gate.weight": torch.zeros(3)})
    del extra["head.bias"]
    torch.save(extra, tmp_path / "odd.pth")
    with pytest.raises(ArtifactError, match=r"missing 1 keys: head\.bias \(ours: head\.bias\); unexpected 1 keys: \['block\.0\.attn\.gate\.weight'\]"):
        efficient.load("spikformer-4-384", pretrained=tmp_path / "odd.pth", **opts)


def test_unreadable_and_pickled_checkpoints(tmp_path: Path) -> None:
    import argparse

    official = to_layout(_tiny_spikformer().state_dict(), "spikformer-cifar")
    torch.save({"state_dict": official, "args": argparse.Namespace(lr=1e-3)}, tmp_path / "train.pth.tar")
    with pytest.raises(ArtifactError, match=r"train\.pth\.tar: this checkpoint holds pickled Python objects"):
        efficient.load("spikformer-4-384", pretrained=tmp_path / "train.pth.tar")
    opts = dict(embed_dim=32, depth=1, num_heads=4, timesteps=2, img_size=16)
    trusted = efficient.load("spikformer-4-384", pretrained=tmp_path / "train.pth.tar", allow_pickle=True, **opts)
    assert trusted.pretrained_cfg["layout"] == "spikformer-cifar"
    torch.save(official, tmp_path / "full.pth")
    (tmp_path / "cut.pth").write_bytes((tmp_path / "full.pth").read_bytes()[:2000])
    with pytest.raises(ArtifactError, match=r"cut\.pth: not a readable torch checkpoint"):
        efficient.load("spikformer-4-384", pretrained=tmp_path / "cut.pth", **opts)
