"""Recipe parsing and every error path a user can hit before training starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from efficient.config import load_recipe, load_yaml, parse_override, parse_yaml, validate
from efficient.errors import ConfigError

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))


def test_tiny_recipe_loads_with_defaults(tiny_recipe: Path) -> None:
    r = load_recipe(tiny_recipe)
    assert r.model["name"] == "spikformer-tiny" and r.model["embed_dim"] == 16
    assert r.data["batch_size"] == 8 and r.data["num_workers"] == 0
    assert r.optim.lr == 0.01 and r.optim.name == "adamw"
    assert r.schedule.warmup_epochs == 0.5
    assert r.train.epochs == 2 and r.eval.batch_size is None


@pytest.mark.parametrize("item,expected", [
    ("optim.lr=1e-3", (["optim", "lr"], 1e-3)),
    ("train.amp=false", (["train", "amp"], False)),
    ("model.name=spikformer-4-384", (["model", "name"], "spikformer-4-384")),
    ("data.shape=[1, 8, 8]", (["data", "shape"], [1, 8, 8])),
    ("train.max_steps=null", (["train", "max_steps"], None)),
])
def test_overrides_are_typed_like_yaml(item: str, expected: tuple) -> None:
    assert parse_override(item) == expected


def test_overrides_apply(tiny_recipe: Path) -> None:
    r = load_recipe(tiny_recipe, ["optim.lr=0.5", "model.depth=2", "train.max_steps=3"])
    assert r.optim.lr == 0.5 and r.model["depth"] == 2 and r.train.max_steps == 3


@pytest.mark.parametrize("override,needle", [
    ("optim.lr=abc", "optim.lr: expected a number, got 'abc'"),
    ("optim.lrr=1", "optim.lrr: unknown key. Did you mean 'lr'?"),
    ("train.epochs=0", "train.epochs: must be > 0"),
    ("optim.lr=-1", "optim.lr: must be > 0"),
    ("optim.name=adamx", "optim.name: expected one of 'adamw', 'sgd', 'adam', got 'adamx'. Did you mean 'adam'?"),
    ("model.embed_dims=8", "model.embed_dims: unknown key. Did you mean 'embed_dim'?"),
    ("model.embed_dim=3.5", "model.embed_dim: expected an integer, got 3.5"),
    ("model.name=spikformer-tiy", "model.name: unknown model 'spikformer-tiy'. Did you mean: spikformer-tiny"),
    ("data.name=cifar", "data.name: unknown dataset 'cifar'. Did you mean 'cifar10'?"),
    ("objective.name=clasification", "Did you mean 'classification'?"),
    ("trian.epochs=1", "trian: unknown section. Did you mean 'train'?"),
    ("data.batch_size=0", "data.batch_size: must be >= 1"),
    ("train.amp=maybe", "train.amp: expected true/false, got 'maybe'"),
    ("optim.betas=[0.9]", "optim.betas: expected a list of 2 values, got 1"),
])
def test_bad_values_fail_before_work_naming_file_and_key(tiny_recipe: Path, override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_recipe(tiny_recipe, [override])
    msg = str(e.value)
    assert needle in msg
    assert str(tiny_recipe) in msg


def test_malformed_yaml_reports_line_and_column(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  name: spikformer-tiny\n  depth: [1, 2\ndata:\n  name: digits\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: malformed YAML at line \d+, column \d+"):
        load_recipe(p)


def test_missing_file_and_missing_sections(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="model: missing section"):
        validate(parse_yaml("data: {name: digits}"), "r.yaml")
    with pytest.raises(ConfigError, match="a recipe is a mapping"):
        validate(parse_yaml("- 1\n- 2"), "r.yaml")


def test_bad_override_grammar() -> None:
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_override("optim.lr")
    with pytest.raises(ConfigError, match="is not a key path"):
        parse_override("optim..lr=1")


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_validate(recipe: Path, tmp_path: Path) -> None:
    from efficient.commands.validate import check_recipe

    overrides = []
    if "path" in (load_yaml(recipe).get("model") or {}):
        # the checkpoint directory is the user's: validate against a tiny one written here
        transformers = pytest.importorskip("transformers")
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=8,
                                       num_attention_heads=2, num_key_value_heads=1)
        transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
        overrides = [f"model.path={tmp_path / 'ckpt'}"]
    check_recipe(str(recipe), overrides)


def test_resolved_config_round_trips(tiny_recipe: Path, tmp_path: Path) -> None:
    r = load_recipe(tiny_recipe)
    out = tmp_path / "resolved.yaml"
    out.write_text(r.to_yaml())
    assert load_recipe(out).to_dict() == r.to_dict()
