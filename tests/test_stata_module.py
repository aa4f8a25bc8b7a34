"""STATA as a component: the `TokenPruner` on its own, the progress protocol, model configs as
dataclasses (zoo and recipe validator), and checkpoint keys that stay where they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.models.progress import TracksProgress, inform_progress
from efficient.models.sdt import SDTConfig, SpikeDrivenTransformer
from efficient.models.spikformer import Spikformer, SpikformerConfig
from efficient.models.stata import StataConfig, TokenPruner, find_pruner, stata_outputs
from efficient.objectives.stata import Stata
from efficient.zoo import config_to_options, create, get_entry

SMALL = dict(embed_dim=16, num_heads=2, timesteps=2, backend="torch")


def pruner(**kw) -> TokenPruner:
    cfg = StataConfig(**{"anchor": "per_timestep", "prune_blocks": [1, 2], "keep_ratio": 0.5, **kw})
    p = TokenPruner(cfg, depth=2, timesteps=2, embed_dim=4, n_patches=8, kernel_backend="torch")
    p.reset_parameters()
    return p


def test_pruner_alone_owns_anchor_schedule_selection_and_record():
    p = pruner(keep_warmup_start=1.0, keep_warmup_epochs=2.0).train()
    assert p.token_schedule() == [(9, 5), (5, 3)]
    x = torch.randn(2, 3, 8, 4)
    assert torch.equal(p.insert_anchor(x)[:, :, 0], p.anchor[:, None, :].expand(2, 3, 4))
    assert {i: s.ratio for i, s in p.begin().items()} == {0: 0.5, 1: 0.5}  # never told the progress: the target
    p.set_progress(0.5)
    assert {i: s.ratio for i, s in p.begin().items()} == {0: 1.0, 1: 1.0}  # before the warm-up: keep all
    p.set_progress(5.0)
    steps = p.begin()
    x = p.insert_anchor(x)
    s = torch.randn(2, 3, 8)
    out = steps[0](x, s, s)
    assert out.shape == (2, 3, 5, 4) and torch.equal(out[:, :, 0], x[:, :, 0])  # anchor kept, 4 of 8 patches
    rec = p.outputs()
    assert len(rec.scores) == 1 and rec.stats["kept_idx"][0].shape == (3, 4) and rec.stats["keep_ratio"] == 0.5


def test_progress_reaches_every_pruner_once_through_wrappers():
    calls = []

    class Spy(nn.Module, TracksProgress):
        def set_progress(self, epoch: float) -> None:
            calls.append(epoch)

    m = create("spikformer-tiny-stata", **SMALL, keep_warmup_start=1.0, keep_warmup_epochs=2.0)
    wrapped = nn.ModuleDict({"module": m, "spy": Spy()})  # as DDP / compile wrap a model
    assert inform_progress(wrapped, 2.0) == 2 and calls == [2.0]
    assert m.train().keep_ratios()[0] == pytest.approx(0.75)
    assert inform_progress(nn.Linear(2, 2), 1.0) == 0  # a model without such components: nothing to tell
    m.set_progress(3.0)  # the model's own method tells its components, once
    assert m.stata._epoch == 3.0


def test_objective_reads_the_pruner_through_a_wrapper():
    m = create("spikformer-tiny-stata", **SMALL).train()
    wrapped = nn.ModuleDict({"module": m})
    m(torch.rand(3, 1, 16, 16) * 2)
    assert find_pruner(wrapped) is m.stata and stata_outputs(wrapped) is m.stata.outputs()
    intra, _ = Stata().alignment(wrapped)
    assert len(m.stata.outputs().scores) == 2 and intra > 0
    assert stata_outputs(nn.Linear(2, 2)).scores == []  # no STATA: no alignment terms


def test_checkpoints_keep_the_anchor_key_and_parameter_order():
    m = create("spikformer-tiny-stata", **SMALL)
    sd = m.state_dict()
    assert next(iter(sd)) == "anchor" and not any(k.startswith("stata.") for k in sd)
    assert next(iter(m.parameters())) is m.stata.anchor  # the optimizer's first parameter, as before
    other = create("spikformer-tiny-stata", **SMALL)
    other.load_state_dict(sd)
    assert torch.equal(other.stata.anchor, m.stata.anchor)
    nested = nn.ModuleDict({"net": other})  # the key follows its owner's prefix
    assert "net.anchor" in nested.state_dict()
    nested.load_state_dict({k: v.clone() for k, v in nested.state_dict().items()})


def test_configs_are_dataclasses_and_variants_are_data():
    cfg = SpikformerConfig(embed_dim=16, num_heads=2, timesteps=2, backend="torch", img_size=16, in_chans=1,
                           pool_stages=1, depth=2, stata=StataConfig(anchor="per_timestep", prune_blocks=[1], keep_ratio=0.5))
    torch.manual_seed(0)
    a = Spikformer(cfg)
    torch.manual_seed(0)
    b = Spikformer(**config_to_options(cfg))  # the same model from flat options
    x = torch.rand(2, 1, 16, 16)
    assert torch.equal(a.eval()(x), b.eval()(x)) and a.stata.prune_at == {0: 0.5}
    assert not issubclass(SpikeDrivenTransformer, Spikformer)
    assert get_entry("sdt-stata").config is SDTConfig and get_entry("spikformer-stata").config is SpikformerConfig
    opts = get_entry("spikformer-stata").accepted_kwargs()
    assert {"keep_ratio", "anchor", "lean_inference", "embed_dim"} <= set(opts) and "stata" not in opts
    assert "qkv_bias" not in get_entry("sdt-2-512").accepted_kwargs()
    with pytest.raises(TypeError, match="no option"):
        Spikformer(keep_ratios=0.5)


def test_recipe_validator_reads_the_nested_stata_options():
    from efficient.config import validate

    rec = validate({"model": {"name": "sdt-stata", "keep_ratio": 0.6, "fuse_pruned": True}, "data": {"name": "digits"}})
    assert rec.model["keep_ratio"] == 0.6 and rec.model["fuse_pruned"] is True
    with pytest.raises(ConfigError, match="model.prune_point: expected one of"):
        validate({"model": {"name": "sdt-stata", "prune_point": "before"}, "data": {"name": "digits"}})
    with pytest.raises(ConfigError, match="Did you mean 'keep_ratio'"):
        validate({"model": {"name": "spikformer-stata", "keep_ration": 0.5}, "data": {"name": "digits"}})
