"""QKFormer: published sizes, neurons that keep samples apart, the official checkpoint layouts,
STATA in the SSA stage, activation-memory levels and the recipes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from conftest import ROOT
from torch import nn

import efficient
import zoo_reference as zr
from efficient import memory, zoo
from efficient.errors import ArtifactError, ConfigError
from efficient.export.checkpoints import detect_layout, to_layout
from efficient.models.neurons import SpikingNeuron
from efficient.models.qkformer import QKFormer

# Parameter counts as the paper states them (QKFormer, NeurIPS 2024, arXiv 2403.16552): its
# ImageNet-1K results table (HST-10-384 / 512 / 768, also the official README's table), its CIFAR
# table (HST-4-384, one count for CIFAR-10 and -100: it is the 100-class model's) and its
# neuromorphic table (HST-2-256, CIFAR10-DVS). Within 1 %.
PAPER_M = {
    ("qkformer-10-384", ()): 16.47,
    ("qkformer-10-512", ()): 29.08,
    ("qkformer-10-768", ()): 64.96,
    ("qkformer-4-384", (("num_classes", 100),)): 6.74,
    ("qkformer-2-256-dvs", ()): 1.50,
}
# The exact counts the reference code prints in its published training logs (imagenet/logs/QKFormer_64M.txt,
# cifar10/cifar10_origin_log.txt, cifar10-dvs/cifar10-dvs_origin_log.txt): equal, not just close.
LOGGED = {"qkformer-10-768": 64_962_760, "qkformer-4-384": 6_706_234, "qkformer-2-256-dvs": 1_504_138}


@pytest.mark.parametrize("name, options", list(PAPER_M), ids=[n + "".join(f"-{k}{v}" for k, v in o) for n, o in PAPER_M])
def test_parameter_counts_match_the_paper(name: str, options: tuple) -> None:
    n = zoo.meta_param_count(name, **dict(options))
    assert abs(n / 1e6 / PAPER_M[name, options] - 1) < 0.01, n
    if not options and name in LOGGED:
        assert n == LOGGED[name]


# small builds of the three layouts (CIFAR, ImageNet and DVS stems), float64-friendly
SMALL: dict[str, tuple[str, dict[str, Any], tuple[int, ...]]] = {
    "cifar": ("qkformer-4-384", dict(embed_dim=32, num_heads=2, img_size=16, timesteps=2), (3, 16, 16)),
    "imagenet": ("qkformer-10-384", dict(embed_dim=32, num_heads=2, depth=4, img_size=32, num_classes=10, timesteps=2),
                 (3, 32, 32)),
    "dvs": ("qkformer-2-256-dvs", dict(embed_dim=32, num_heads=2, img_size=32, timesteps=2), (2, 32, 32)),
    "tiny-stata": ("qkformer-tiny-stata", dict(timesteps=2, keep_warmup_start=0.0, keep_warmup_epochs=0.0), (1, 16, 16)),
}


def _bns(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _make_fire(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """BatchNorm statistics of `x` and affine scales that make every neuron layer fire (fresh
    weights barely do); returned in eval mode."""
    for m in _bns(model):
        m.momentum = None
        m.reset_running_stats()
    model.train()
    with torch.no_grad():
        model(x)
        for m in _bns(model):
            m.weight.fill_(1.5)
            m.bias.fill_(0.5)
    return model.eval()


def _rates(model: nn.Module, x: torch.Tensor) -> list[float]:
    """Firing rate of every neuron layer on `x`."""
    rates: list[float] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: rates.append(float(o.float().mean())))
             for m in model.modules() if isinstance(m, SpikingNeuron)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return rates


def _build(kind: str, **extra: Any) -> tuple[nn.Module, torch.Tensor]:
    """A small model of `kind` (torch neurons) that fires everywhere, in eval mode, and 7 inputs for it."""
    name, options, shape = SMALL[kind]
    torch.manual_seed(0)
    model = zoo.create(name, **options, **extra, backend="torch")
    x = torch.rand(7, *shape) * 2
    return _make_fire(model, x), x


@pytest.fixture
def float64() -> Any:
    """Float64 throughout: a summation order that changes with the batch size then moves a
    membrane by ~1e-16, far from flipping a spike (in fp32 an ulp at a threshold could)."""
    with zr.default_dtype(torch.float64):
        yield


def _leaky_batch(model: nn.Module) -> int:
    """Reproduce QKFormer issue #14 in `model`: each SSA projection neuron gets `[T*B, 1, ...]`, so
    its membrane runs on from one sample to the next. Returns how many neurons were changed."""

    class Flattened(nn.Module):
        def __init__(self, lif: nn.Module) -> None:
            super().__init__()
            self.lif = lif

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lif(x.reshape(x.shape[0] * x.shape[1], 1, *x.shape[2:])).reshape(x.shape)

    n = 0
    for blk in model.blocks:
        blk.attn.proj.lif = Flattened(blk.attn.proj.lif)
        n += 1
    return n


def _alone_vs_batched(model: nn.Module, x: torch.Tensor) -> float:
    """Largest difference between each sample's logits computed alone and in the batch `x`
    (and in a batch whose other samples are replaced)."""
    with torch.no_grad():
        batched = model(x)
        other = model(torch.cat([x[:1], torch.rand_like(x[1:]) * 2]))[0]
        alone = torch.cat([model(x[i:i + 1]) for i in range(len(x))])
    return max(float((batched - alone).abs().max()), float((other - alone[0]).abs().max()))


@pytest.mark.parametrize("kind", SMALL)
def test_a_sample_does_not_depend_on_its_batch(kind: str, float64: Any) -> None:
    model, x = _build(kind)
    rates = _rates(model, x)
    # every neuron layer fires, and none always does but for a QKTA token mask (with several firing
    # query channels per head it saturates)
    assert len(rates) > 10 and all(r > 0.01 for r in rates) and sum(r > 0.99 for r in rates) <= 1, rates
    # eval: each sample's logits are the same alone, beside others, and for every batch size
    assert _alone_vs_batched(model, x) < 1e-9
    with torch.no_grad():
        full = model(x)
        for b in (2, 3, 5):
            torch.testing.assert_close(torch.cat([model(x[i:i + b]) for i in range(0, len(x), b)]), full, rtol=0, atol=1e-9)
    # training, BatchNorm on its running statistics (the one layer meant to mix a batch): the same
    model.train()
    for m in _bns(model):
        m.eval()
    assert _alone_vs_batched(model, x) < 1e-9
    # training with batch statistics: they do not depend on the order, so neither may anything else
    model.train()
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    with torch.no_grad():
        torch.testing.assert_close(model(x[perm]), model(x)[perm], rtol=0, atol=1e-9)


def test_these_checks_catch_issue_14(float64: Any) -> None:
    """The official code's bug (a neuron on `[T*B, ...]`) fails the checks above."""
    model, x = _build("cifar")
    assert _leaky_batch(model) == 2
    assert _alone_vs_batched(model, x) > 1e-3
    model.train()
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    with torch.no_grad():
        assert not torch.allclose(model(x[perm]), model(x)[perm], rtol=0, atol=1e-6)


def _official_keys(kind: str) -> dict[str, tuple[int, ...]]:
    """Some keys of the reference code's models (read off its model files) and their shapes at D=32."""
    if kind == "cifar":  # cifar10/model.py: D/4 = 8, D/2 = 16, D = 32
        return {"patch_embed1.proj_conv.weight": (4, 3, 3, 3), "patch_embed1.proj_res_conv.weight": (8, 4, 1, 1),
                "stage1.0.tssa.q_conv.weight": (8, 8, 1), "stage1.0.tssa.proj_conv.bias": (8,),
                "stage1.0.mlp.mlp1_conv.weight": (32, 8, 1, 1), "patch_embed2.proj4_bn.running_var": (16,),
                "patch_embed3.proj3_conv.weight": (32, 16, 3, 3), "stage3.1.ssa.v_conv.weight": (32, 32, 1),
                "stage3.0.mlp.mlp2_bn.num_batches_tracked": (), "head.weight": (10, 32)}
    if kind == "imagenet":  # imagenet/qkformer.py
        return {"patch_embed1.proj2_conv.weight": (8, 8, 3, 3), "stage2.1.tssa.k_bn.weight": (16,),
                "stage3.0.attn.q_conv.weight": (32, 32, 1), "stage3.0.mlp.fc2_conv.weight": (32, 128, 1, 1)}
    return {"patch_embed1.proj3_conv.weight": (16, 8, 3, 3), "patch_embed1.proj_res_conv.weight": (16, 4, 1, 1),
            "patch_embed2.proj_conv.weight": (32, 16, 3, 3), "stage2.0.ssa.proj_conv.bias": (32,),
            "stage2.0.mlp.mlp1_conv.weight": (32, 32, 1, 1)}  # cifar10-dvs/model.py (MLP ratio 1)


@pytest.mark.parametrize("kind", ["cifar", "imagenet", "dvs"])
def test_official_checkpoint_layouts_load_with_equal_logits(kind: str, tmp_path: Path) -> None:
    model, x = _build(kind)
    name, options, _ = SMALL[kind]
    official = to_layout(model.state_dict(), f"qkformer-{kind}")
    assert len(official) == len(model.state_dict())
    for key, shape in _official_keys(kind).items():
        assert tuple(official[key].shape) == shape, key
    assert not any(k.endswith(("q_conv.bias", "k_conv.bias", "v_conv.bias")) for k in official)  # bias-free q/k/v
    assert detect_layout(official).name == f"qkformer-{kind}"
    # as the reference ImageNet script saves it: under "model", with DistributedDataParallel's prefix
    torch.save({"model": {f"module.{k}": v for k, v in official.items()}, "epoch": 199}, tmp_path / "ckpt.pth")
    loaded = efficient.load(name, pretrained=tmp_path / "ckpt.pth", **options, backend="torch")
    assert loaded.pretrained_cfg["layout"] == f"qkformer-{kind}"
    with torch.no_grad():  # the same weights in the same model: the same computation, equal bits
        assert torch.equal(loaded(x), model(x))


def test_layouts_bring_their_stems_and_mismatches_are_named(tmp_path: Path) -> None:
    model, x = _build("dvs", depth=3)
    torch.save(to_layout(model.state_dict(), "qkformer-dvs"), tmp_path / "dvs.pth")
    # a DVS checkpoint into the CIFAR entry: rebuilt with the reference DVS model's stem and stages
    opts = dict(embed_dim=32, num_heads=2, img_size=32, in_chans=2, num_classes=10, depth=3, mlp_ratio=1.0, timesteps=2)
    other = efficient.load("qkformer-4-384", pretrained=tmp_path / "dvs.pth", **opts, backend="torch")
    assert (other.cfg.stem, other.cfg.qkta_depths) == ("dvs", [1])
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    with pytest.raises(ArtifactError, match=r"a QKFormer checkpoint .* but 'spikformer-4-384' is a Spikformer; .*'qkformer-4-384'"):
        efficient.load("spikformer-4-384", pretrained=tmp_path / "dvs.pth")
    with pytest.raises(ArtifactError, match=r"missing \d+ keys: stage2\.2\.ssa\.k_bn\.bias \(ours: blocks\.2\.attn\.k\.bn\.bias\)"):
        efficient.load("qkformer-2-256-dvs", pretrained=tmp_path / "dvs.pth", **{**SMALL["dvs"][1], "depth": 4})


def test_config_errors_speak_to_the_user() -> None:
    with pytest.raises(ConfigError, match="depth=2 leaves no SSA block"):
        zoo.create("qkformer-4-384", depth=2)
    with pytest.raises(ConfigError, match="img_size 30 does not fit: the 'cifar' stem and 2 downsampling stage"):
        zoo.create("qkformer-4-384", img_size=30)
    with pytest.raises(ConfigError, match="stem must be one of"):
        zoo.create("qkformer-4-384", stem="vit")
    with pytest.raises(ConfigError, match=r"prune_blocks \[3\].*depth=2"):  # prune_blocks count the SSA blocks
        zoo.create("qkformer-4-384-stata", prune_blocks=[3])
    with pytest.raises(ConfigError, match="not divisible by num_heads"):
        zoo.create("qkformer-4-384", num_heads=7)


def test_stata_off_is_the_dense_model_and_on_prunes_the_ssa_stage() -> None:
    torch.manual_seed(0)
    x = torch.rand(3, 1, 16, 16) * 2
    dense = zoo.create("qkformer-tiny", timesteps=2).eval()
    off = zoo.create("qkformer-tiny-stata", timesteps=2, anchor="off", prune_blocks=[]).eval()
    off.load_state_dict(dense.state_dict())
    assert list(off.state_dict()) == list(dense.state_dict()) and "anchor" not in dense.state_dict()
    with torch.no_grad():
        assert torch.equal(off(x), dense(x))

    on = zoo.create("qkformer-tiny-stata", timesteps=2)
    assert next(iter(on.state_dict())) == "anchor"  # the anchor leads, as in Spikformer's checkpoints
    on.set_progress(100.0)  # after the keep-ratio warm-up
    from efficient.objectives.stata import Stata

    loss, logs = Stata().loss(on, (x, torch.tensor([1, 2, 3])))
    loss.backward()
    assert on.stata_stats["tokens_in"] == [65, 33] and on.stata_stats["tokens_out"] == 17
    assert [s.shape for s, _ in on.stata_scores] == [(2, 3, 64), (2, 3, 32)]
    assert on.anchor.grad is not None and on.anchor.grad.abs().sum() > 0
    assert all(p.grad is not None for n, p in on.named_parameters() if "stata" not in n)
    assert float(logs["stata/intra"]) >= 0 and float(logs["stata/inter"]) >= 0
    # inference: the lean path (rows nobody reads are skipped) gives the logits of the full path
    on.eval()
    full = zoo.create("qkformer-tiny-stata", timesteps=2, lean_inference=False).eval()
    full.load_state_dict(on.state_dict())
    with torch.no_grad():
        assert on.uses_lean_path(on.embed(x)) and torch.equal(on(x), full(x))


def test_token_attention_score() -> None:
    """`stata_score="token"`: block i's scores are its queries' channel sums (QKTA's token vector)."""
    torch.manual_seed(0)
    x = torch.rand(3, 1, 16, 16) * 2
    m = zoo.create("qkformer-tiny-stata", timesteps=2, stata_score="token", keep_warmup_start=0.0)
    queries: list[torch.Tensor] = []
    m.blocks[0].attn.q.register_forward_hook(lambda _m, _i, out: queries.append(out))
    out = m(x)
    out.sum().backward()
    s, c = m.stata_scores[0]
    assert torch.equal(s, queries[0][:, :, 1:].sum(-1))  # patch tokens: the anchor (index 0) is not scored
    assert c.shape == s.shape and not torch.equal(s, c)
    assert m.stata_stats["tokens_in"] == [65, 33]
    m.eval()
    assert not m.uses_lean_path(m.embed(x))  # the token score reads every query
    with torch.no_grad():
        assert m(x).shape == (3, 10)


def test_flat_stata_options_and_forward_split() -> None:
    m = efficient.load("qkformer-tiny", anchor="per_timestep", prune_blocks=[2], keep_ratio=0.5, timesteps=2)
    x = torch.rand(2, 1, 16, 16)
    with torch.no_grad():
        feats = m.forward_features(x)
        assert feats.shape == (2, 2, 1 + 32, 64)  # T, B, anchor + kept patches, D
        assert torch.equal(m.forward_head(feats), m(x))
    assert m.stata.prune_at == {1: 0.5} and m.grid == 8


def test_no_host_synchronisation_in_a_training_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward + backward never read a tensor on the host (`.item()`, `.tolist()`, `bool()`, ...)."""
    m = zoo.create("qkformer-tiny", timesteps=2, backend="torch").train()
    x = torch.rand(2, 1, 16, 16)

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("host synchronisation inside the model")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    m(x).sum().backward()


def _qk_case(case_id: str) -> zr.Case:
    return next(c for c in zr.CASES if c.id == case_id)


@pytest.mark.parametrize("case_id", ["qkformer-tiny", "qkformer-tiny-stata"])
def test_activation_memory_levels(case_id: str) -> None:
    """`bits` changes nothing; `recompute` (PEDS and QKTA blocks rerun whole, SSA blocks by halves) agrees with `none`."""
    case = _qk_case(case_id)
    none = zr.compute_case(case)
    assert zr.compute_case(case, perturb=lambda m: memory.optimize(m, "bits")) == none
    recompute = zr.compute_case(case, perturb=lambda m: memory.optimize(m, "recompute"))
    # a block rerun in backward records its STATA scores a second time (the pruner's record is no
    # buffer; Spikformer's blocks do the same), and the reference reads that record after backward:
    # outputs, losses, gradients and BatchNorm statistics are what must agree
    for rec in (none, recompute):
        for mode, r in rec["modes"].items():
            if mode.startswith("train"):
                r.pop("stata", None)
    assert zr.compare(none, recompute, rtol=case.rtol) == []


def test_units_are_blocks_and_embeddings() -> None:
    from efficient.memory.recompute import units

    names = [n for n, _ in units(zoo.create("qkformer-4-384", embed_dim=32, num_heads=2, img_size=16))]
    assert names[:3] == ["patch_embed", "stages.0.blocks.0", "stages.0.downsample"]
    # the SSA blocks by halves, as Spikformer's
    assert names[-4:] == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"] and len(names) == 9


RECIPES = [("qkformer_digits", []), ("qkformer_cluttered", ["data.train_per_digit=1", "data.val_per_digit=1", "profile.samples=4"]),
           ("qkformer_stata_cluttered", ["data.train_per_digit=1", "data.val_per_digit=1", "profile.samples=4"])]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, overrides", RECIPES, ids=[r for r, _ in RECIPES])
def test_recipes_train_two_steps(recipe: str, overrides: list[str], tmp_path: Path) -> None:
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml", ["train.max_steps=2", "train.progress=false", *overrides])
    summary = Trainer(r, tmp_path / "run").fit()
    assert summary["steps"] == 2 and 0 <= summary["val"]["acc"] <= 1
    assert summary["cost"]["sops"] > 0 and (tmp_path / "run" / "report.md").exists()


def test_cifar_recipe_is_the_reference_one() -> None:
    from efficient.config import load_recipe

    r = load_recipe(ROOT / "recipes" / "qkformer_cifar.yaml", [])
    assert r.model == {"name": "qkformer-4-384"} and r.train.epochs == 400 and r.data["batch_size"] == 64
    assert (r.optim.lr, r.optim.weight_decay, r.schedule.warmup_epochs, r.schedule.cooldown_epochs) == (1.0e-3, 6.0e-2, 20, 10)
    stata = load_recipe(ROOT / "recipes" / "qkformer_cifar.yaml", ["model.name=qkformer-4-384-stata", "objective.name=stata",
                                                                   "model.keep_ratio=0.5"])
    assert stata.model["keep_ratio"] == 0.5


def test_is_a_zoo_family() -> None:
    names = efficient.list_models("qkformer*")
    assert {"qkformer-4-384", "qkformer-10-768", "qkformer-tiny-stata"} <= set(names)
    assert type(zoo.create("qkformer-tiny")) is QKFormer


def test_units_vouch_only_for_counts_their_inputs_hold() -> None:
    """efficient.memory keeps a unit's input as uint8 where the model says it is a count of spikes: the
    QKTA blocks, a stage's closing PEDS and (without STATA) the SSA blocks get inputs that are whole
    numbers within the stated bound; the stem PEDS reads images and says nothing, and a STATA model's
    SSA blocks (anchor, fused tokens) say nothing."""
    from efficient.models.qkformer import PEDS

    torch.manual_seed(0)
    model = zoo.create("qkformer-4-384", embed_dim=64, num_heads=4, depth=4, qkta_depths=[1, 2]).train()
    units = [m for m in model.modules() if hasattr(m, "recompute_count_bound")]
    bounds = {id(m): m.recompute_count_bound for m in units}
    assert model.patch_embed.recompute_count_bound is None
    # QKTA 2 | 2, 4; closing PEDS 4, 6; one SSA block 2, its MLP half 3
    assert sorted(b for b in bounds.values() if b is not None) == [2, 2, 2, 3, 4, 4, 6]
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.append((m.recompute_count_bound, a[0].detach())))
             for m in units]
    model(torch.rand(2, 3, 32, 32) * 4)
    for h in hooks:
        h.remove()
    vouched = [(b, x) for b, x in seen if b is not None]
    assert len(vouched) == 7
    for b, x in vouched:
        assert torch.equal(x, x.round()) and x.min() >= 0 and x.max() <= b
    assert any(float(x.max()) >= 2 for _, x in vouched)  # counts, not just spikes
    stata = zoo.create("qkformer-4-384-stata", embed_dim=64, num_heads=4, depth=3, qkta_depths=[1])
    assert [b.recompute_count_bound for b in stata.blocks] == [None, None]
    assert [isinstance(m, PEDS) for m in units].count(True) == 3
