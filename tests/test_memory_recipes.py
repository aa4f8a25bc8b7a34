"""Every shipped recipe at every activation-memory level (short runs), and the levels under DDP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT
from safetensors.torch import load_file
from test_events import make_cifar10_dvs, make_gesture

from efficient import memory
from efficient.config import load_recipe
from efficient.train.engine import Trainer

# --------------------------------------------------------------------------- every shipped recipe

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
# profile.memory=false: the end-of-run measure of every level (tests/test_memory.py checks it) is
# three more steps per run
SHORT = ["train.max_steps=1", "train.progress=false", "profile.enabled=false", "profile.memory=false", "eval.max_batches=1",
         "eval.batch_size=2"]


def _recipe_model(name: str) -> tuple[str, str]:
    cfg = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    return cfg["model"]["name"], cfg["data"]["name"]


def _spiking(model: str) -> bool:
    """Whether the zoo model has spiking neurons (built on the meta device: no weights allocated)."""
    from efficient.memory.spikes import is_neuron
    from efficient.zoo import create

    with torch.device("meta"):
        net = create(model, **({"n_embd": 32, "n_head": 2, "mlp_hidden": 64} if model.startswith("ee-gpt") else {}))
    return any(is_neuron(m) for m in net.modules())


SPIKING_RECIPES = [r for r in RECIPES if _spiking(_recipe_model(r)[0])]


def _data_overrides(data: str, tmp: Path, fake_cifar) -> list[str]:
    """Data the recipe can load here: tiny datasets written by the tests, batches of 2."""
    if data in ("cifar10", "cifar100"):
        return [f"data.root={fake_cifar(data)}", "data.batch_size=2", "data.num_workers=0"]
    if data == "dvs_gesture":
        return [f"data.root={make_gesture(tmp / 'events')}", "data.batch_size=2", "data.num_workers=0"]
    if data == "cifar10_dvs":
        return [f"data.root={make_cifar10_dvs(tmp / 'events')}", "data.batch_size=2", "data.num_workers=0"]
    if data == "cluttered_digits":
        return ["data.batch_size=2", "data.train_per_digit=1", "data.val_per_digit=1"]
    return ["data.batch_size=2"]


# one recipe whose neurons take the compiled CPU loop keeps it; the others run the same loop eagerly
# (EFFICIENT_BACKEND=loop), so no run waits seconds for inductor to compile neuron loops of its shapes
COMPILED_RECIPE = "spikformer_dvs_gesture"


@pytest.mark.slow
@pytest.mark.parametrize("level", ["bits", "recompute"])
@pytest.mark.parametrize("recipe", SPIKING_RECIPES)
def test_every_spiking_recipe_trains_at_each_level(recipe: str, level: str, tmp_path: Path, fake_cifar,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if recipe != COMPILED_RECIPE:
        monkeypatch.setenv("EFFICIENT_BACKEND", "loop")
    model, data = _recipe_model(recipe)
    # the spiking VGGs with 256-wide FC layers (61M -> 10M parameters): the same units, a fraction
    # of the checkpoint and optimizer time
    narrow = ["model.fc_dim=256"] if model.startswith("stable-snn-vgg") else []
    r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml",
                    [*SHORT, *_data_overrides(data, tmp_path, fake_cifar), *narrow, f"train.memory={level}"])
    trainer = Trainer(r, tmp_path / "run")
    assert trainer.memory_plan.level == level and trainer.memory_plan.neurons
    summary = trainer.fit()
    assert summary["steps"] == 1 and summary["memory"]["level"] == level
    assert not (tmp_path / "run" / "memory.json").exists()  # profile.memory=false is honoured
    assert all(torch.isfinite(torch.tensor(float(v))) for v in summary["val"].values())


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r not in SPIKING_RECIPES])
def test_recipes_without_spikes_accept_every_level(recipe: str) -> None:
    """Models without spiking neurons (the GPTs, MLPs, BiLipNet) have nothing to keep as bits: each
    level validates, and the plan says it leaves the model alone."""
    from efficient.zoo import create

    model, _ = _recipe_model(recipe)
    for level in memory.LEVELS:
        r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml", [f"train.memory={level}"])
        assert r.train.memory == level
    net = create(model, **({"n_embd": 32, "n_head": 2, "mlp_hidden": 64} if model.startswith("ee-gpt") else {}))
    plan = memory.optimize(net, "recompute")
    assert plan.units == [] and "nothing to do" in plan.summary()


@pytest.mark.slow
def test_levels_under_ddp(tiny_recipe: Path, tmp_path: Path) -> None:
    """Two processes (DDP over gloo), none and recompute: recompute ends within rounding of none
    (the gradient all-reduce sees the same gradients, saved-tensor hooks included: the units'
    spike inputs are kept as bits). bits alone is bit for bit none in one process
    (tests/test_memory.py); DDP adds nothing to what it changes."""
    from test_distributed import efficient as run_cli

    weights = {}
    for level in ("none", "recompute"):
        out = tmp_path / level
        r = run_cli("train", str(tiny_recipe), "--out", str(out), "--nproc", "2", "train.max_steps=2", "optim.name=sgd",
                    "optim.lr=0.5", f"train.memory={level}")
        assert r.returncode == 0, r.stderr[-3000:]
        weights[level] = load_file(str(out / "checkpoint" / "last" / "model.safetensors"))
    for k, v in weights["none"].items():
        torch.testing.assert_close(weights["recompute"][k], v, rtol=1e-4, atol=1e-5)
