"""Zoo variants are data: each family's `VARIANTS` table is what the registry holds, options come
from the family's config dataclass, and the stable-SNN, MLP and BiLipNet entries keep their
options, types and defaults."""

from __future__ import annotations

import dataclasses
import importlib
import typing

import pytest
import torch

from efficient import zoo
from efficient.errors import ConfigError

FAMILIES = {
    "spikformer": "efficient.models.spikformer",
    "sdt": "efficient.models.sdt",
    "qkformer": "efficient.models.qkformer",
    "ee-gpt": "efficient.models.ee_gpt",
    "stable-snn": "efficient.models.stable_snn",
    "mlp": "efficient.models.mlp",
    "bilipnet": "efficient.models.bilipnet",
}

STABLE = {"neuron": "dlif", "timesteps": 8, "num_classes": 10, "in_chans": 3, "img_size": 32, "leak": 0.99,
          "v_threshold": 1.0, "width": 1.0, "mean": None, "std": None, "backend": "auto"}
MLP = {"img_size": 16, "in_chans": 1, "num_classes": 10, "activation": "relu", "dropout": 0.0}

# name -> the options it resolves to (defaults and the variant's own values)
RESOLVED = {
    "stable-snn-vgg11": {**STABLE, "fc_dim": 4096},
    "stable-snn-vgg5": {**STABLE, "fc_dim": 4096},
    "stable-snn-digits": {**STABLE, "in_chans": 1, "img_size": 8, "fc_dim": 128},
    "stable-snn-wrn16": {**STABLE, "depth": 16, "widen": 4, "drop": 0.0},
    "mlp-tiny": {"hidden": [16], **MLP},
    "mlp-small": {"hidden": [64, 64], **MLP},
    "mlp-base": {"hidden": [256, 256], **MLP},
    "bilipnet-digits": {"img_size": 8, "in_chans": 1, "num_classes": 10, "hidden": 128, "depth": 2, "mu": 0.1, "nu": 2.0,
                        "scale": 10.0},
}

TYPES = {"neuron": typing.Literal["lif", "dlif"], "timesteps": int, "num_classes": int, "in_chans": int, "img_size": int,
         "leak": float, "v_threshold": float, "width": float, "mean": typing.Optional[list[float]],
         "std": typing.Optional[list[float]], "backend": str, "fc_dim": int, "depth": int, "widen": int, "drop": float,
         "activation": typing.Literal["relu", "gelu", "tanh", "identity"], "dropout": float, "mu": float, "nu": float,
         "scale": float}


@pytest.mark.parametrize("family, module", FAMILIES.items())
def test_each_family_registers_its_variants_table(family: str, module: str) -> None:
    variants = importlib.import_module(module).VARIANTS
    assert sorted(variants) == sorted(n for n, e in zoo.registry().items() if e.family == family)
    for name, v in variants.items():
        entry = zoo.get_entry(name)
        assert dataclasses.is_dataclass(entry.config) and isinstance(v.config, entry.config)
        assert not entry.open_options()
        assert (entry.input_spec, entry.paper, entry.description) == (v.input_spec, v.paper, v.description)
        assert zoo.config_to_options(v.config) == entry.resolved_cfg()
        assert entry.builder.__module__ == module


@pytest.mark.parametrize("name", RESOLVED)
def test_options_types_and_defaults(name: str) -> None:
    entry = zoo.get_entry(name)
    assert entry.resolved_cfg() == RESOLVED[name]
    options = entry.accepted_kwargs()
    assert set(options) == set(RESOLVED[name])
    hidden = list[int] if name.startswith("mlp") else int
    assert {k: p.annotation for k, p in options.items()} == {k: TYPES.get(k, hidden) for k in RESOLVED[name]}
    with pytest.raises(ConfigError, match=f"not an option of model '{name}'.*Valid options: {', '.join(sorted(RESOLVED[name]))}"):
        zoo.create(name, no_such_option=1)


def test_a_variant_may_name_what_builds_it() -> None:
    from efficient.models.stable_snn import VGG_CFGS, SpikingVGG, SpikingWRN

    with torch.device("meta"):
        for name, plan in (("stable-snn-vgg11", "vgg11"), ("stable-snn-vgg5", "vgg5"), ("stable-snn-digits", "tiny")):
            m = zoo.create(name, backend="torch")
            assert type(m) is SpikingVGG
            assert len(m.features) == len(VGG_CFGS[plan])
        assert type(zoo.create("stable-snn-wrn16", backend="torch")) is SpikingWRN
