"""Property-based tests: every recipe text and override is accepted or rejected with ConfigError,
never a traceback of another type."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from efficient.config import SECTIONS, Recipe, apply_overrides, parse_override, parse_yaml, validate
from efficient.errors import ConfigError

KEYS = ["name", "lr", "epochs", "batch_size", "image_size", "depth", "embed_dim", "seed", "warmup_epochs",
        "amp", "betas", "max_steps", "label_smoothing", "augment", "root", "files", "seq_len", "hidden"]
NAMES = ["spikformer-tiny", "mlp-small", "digits", "synthetic", "text", "classification", "lm", "adamw", "cosine", "nope"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(NAMES), st.text(max_size=8))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5), c, max_size=3), max_leaves=8)
sections = st.dictionaries(st.sampled_from(KEYS) | st.integers(0, 3), values, max_size=4)
recipes = st.dictionaries(st.sampled_from(list(SECTIONS) + ["trian", "x"]), sections | values, max_size=8)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(recipes)
def test_any_recipe_dict_is_accepted_or_rejected_cleanly(data: dict) -> None:
    try:
        r = validate(data, "fuzz.yaml")
    except ConfigError as e:
        assert str(e).startswith("fuzz.yaml")
    else:
        assert isinstance(r, Recipe)


@FUZZ
@given(st.text(max_size=200))
def test_any_yaml_text_parses_or_fails_with_config_error(text: str) -> None:
    try:
        out = parse_yaml(text, "fuzz.yaml")
    except ConfigError:
        return
    assert isinstance(out, dict)


@FUZZ
@given(st.text(max_size=40))
def test_override_grammar(item: str) -> None:
    try:
        parts, _ = parse_override(item)
    except ConfigError:
        return
    assert parts and all(parts)


@FUZZ
@given(st.lists(st.sampled_from(["optim.lr=", "train.epochs=", "model.depth=", "data.batch_size=", "model=", "a.b.c="]), min_size=1, max_size=3),
       st.lists(st.sampled_from(["1", "0", "-3", "1e-3", "abc", "[1, 2]", "{a: 1}", "null", "true", ""]), min_size=3, max_size=3))
def test_overrides_on_a_real_recipe(keys: list[str], vals: list[str]) -> None:
    base = yaml.safe_load("model: {name: mlp-small}\ndata: {name: digits}\n")
    items = [k + v for k, v in zip(keys, vals)]
    try:
        validate(apply_overrides(base, items), "r.yaml")
    except ConfigError:
        pass
