"""Profile a trained run as it was trained: the model its `config.yaml` built, the weights of one of
its checkpoints, and by default the validation samples its `report.md` / `summary.json` cost used."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from efficient.errors import ConfigError
from efficient.profiler.energy import EnergySpec
from efficient.profiler.report import Report
from efficient.train.checkpoint import MODEL_FILE

if TYPE_CHECKING:
    from efficient.config import Recipe

Checkpoint = Literal["last", "best"]
CHECKPOINTS: tuple[str, ...] = ("last", "best")


@dataclass
class Run:
    """A trained artifact: the run dir it came from (None for a lone .safetensors), its validated
    recipe (None without a run dir), the weights file, and a short label for reports."""

    run_dir: Path | None
    recipe: Recipe | None
    weights: Path
    label: str


def find_run(path: str | Path, checkpoint: Checkpoint = "last") -> Run | None:
    """The run behind `path` (a run dir, or a .safetensors inside one's checkpoint/), or None for a
    zoo name. `checkpoint` picks the weights of a run dir: "last" (the final weights, which the
    run's cost report profiled) or "best" (the best validation checkpoint, what `efficient.load` takes)."""
    if checkpoint not in CHECKPOINTS:
        raise ConfigError(f"checkpoint must be one of {', '.join(CHECKPOINTS)}, got {checkpoint!r}")
    p = Path(path)
    if not p.exists():
        return None
    if p.is_dir():
        if not (p / "config.yaml").exists():
            raise ConfigError(f"{p}: not a run dir (no config.yaml). Train one with `efficient train RECIPE.yaml`.")
        weights = p / "checkpoint" / checkpoint / MODEL_FILE
        if not weights.exists():
            have = [c for c in CHECKPOINTS if (p / "checkpoint" / c / MODEL_FILE).exists()]
            hint = f"; it has: {', '.join(have)} (choose with --checkpoint)" if have else "; did the run save one?"
            raise ConfigError(f"{p}: no {checkpoint} checkpoint ({weights} is missing){hint}")
        return Run(p, _recipe(p), weights, p.resolve().name)
    if p.suffix == ".safetensors":
        run_dir = p.parent.parent.parent  # run/checkpoint/<which>/model.safetensors
        if p.parent.parent.name == "checkpoint" and (run_dir / "config.yaml").exists():
            return Run(run_dir, _recipe(run_dir), p, f"{run_dir.resolve().name}/{p.parent.name}")
        return Run(None, None, p, p.name)
    raise ConfigError(f"{p}: expected a zoo name, a run dir or a .safetensors file")


def _recipe(run_dir: Path) -> Recipe:
    from efficient.config import load_recipe

    return load_recipe(run_dir / "config.yaml")


def load_run_model(run: Run) -> nn.Module:
    """Rebuild the model from the run's config (or the file's metadata) and load `run.weights`."""
    from efficient import zoo

    model = zoo.load(run.run_dir if run.run_dir is not None else run.weights)
    if run.run_dir is not None:
        zoo.load_weights(model, run.weights)
    return model.eval()


def validation_inputs(bundle: Any, samples: int) -> Any:
    """The first `samples` validation inputs in order: what a run's cost report profiles."""
    from torch.utils.data import DataLoader

    if samples < 1:
        raise ConfigError(f"samples must be a positive integer, got {samples}")
    batch = next(iter(DataLoader(bundle.val, batch_size=samples, shuffle=False, collate_fn=bundle.collate_fn)), None)
    if batch is None:
        raise ConfigError("the validation split is empty; there is nothing to profile on")
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def random_kind(recipe: Recipe) -> Literal["normal", "unit"]:
    """"unit" when the run fed unnormalised [0, 1] pixels (`data.normalize: false`), else "normal"."""
    from efficient.data import get_dataset_builder

    data = recipe.data
    if "normalize" in data:
        return "normal" if data["normalize"] else "unit"
    param = inspect.signature(get_dataset_builder(data["name"])).parameters.get("normalize")
    if param is not None and param.default is False:
        return "unit"
    return "normal"


def profile_run(
    path: str | Path,
    *,
    checkpoint: Checkpoint = "last",
    data: Literal["val", "random"] = "val",
    samples: int | None = None,
    input_shape: Any = None,
    timesteps: int | None = None,
    energy: EnergySpec | None = None,
    flops_per_mac: float | None = None,
    name: str | None = None,
    **counting: Any,
) -> Report:
    """Profile a run dir (or a run's .safetensors) the way its own cost report did.

    data="val" (default): the first `samples` validation inputs of the run's data config (default: the
    recipe's `profile.samples`, as the run's report), so the totals equal `summary.json`'s "cost".
    data="random": a seeded random input of `input_shape` (default: the shape the model was built for),
    normalised as the run's data was. `energy` and `flops_per_mac` default to the recipe's `profile`.
    `counting`: profile()'s convention, neurobench and memory_access.
    """
    run = find_run(path, checkpoint)
    if run is None:
        raise ConfigError(f"{path}: no such run dir or .safetensors file")
    if data not in ("val", "random"):
        raise ConfigError(f"data must be 'val' or 'random', got {data!r}")
    if data == "val" and input_shape is not None:
        raise ConfigError("input_shape applies to random inputs; the validation data brings its own shape. Pass data='random'.")
    return profile_run_model(load_run_model(run), run, data=data, samples=samples, input_shape=input_shape,
                             timesteps=timesteps, energy=energy, flops_per_mac=flops_per_mac, name=name, **counting)


def profile_run_model(model: nn.Module, run: Run, *, data: Literal["val", "random"] = "val", samples: int | None = None,
                      input_shape: Any = None, timesteps: int | None = None, energy: EnergySpec | None = None,
                      flops_per_mac: float | None = None, name: str | None = None, **counting: Any) -> Report:
    """`profile_run` on an already loaded model: inputs, energy and FLOP convention from the run's recipe.
    `counting`: profile()'s convention, neurobench and memory_access."""
    from efficient.profiler.api import profile

    recipe = run.recipe
    if recipe is not None:
        energy = energy if energy is not None else recipe.profile.energy
        flops_per_mac = flops_per_mac if flops_per_mac is not None else recipe.profile.flops_per_mac
    energy = energy if energy is not None else "45nm-fp32"
    flops_per_mac = flops_per_mac if flops_per_mac is not None else 2
    label = name or run.label
    if data == "val":
        if recipe is None:
            raise ConfigError(f"{run.weights}: a .safetensors file outside a run dir has no validation data; "
                              "profile it on random inputs (--data random) or a dataset (--data NAME)")
        from efficient.data import build_data

        n = samples if samples is not None else recipe.profile.samples
        x = validation_inputs(build_data(recipe.data), n)
        exits = [x] if hasattr(model, "exit_layers") else None  # an early-exit model's exit distribution, as the run's
        report = profile(model, inputs=x, data=exits, timesteps=timesteps, energy=energy, flops_per_mac=flops_per_mac, name=label,
                         **counting)
        shape = list(x.shape) if hasattr(x, "shape") else sorted(x) if isinstance(x, dict) else type(x).__name__
        report.meta["input"] = f"validation data of the run, first {int(report.totals['batch_size'])} samples {shape}"
    else:
        kind = random_kind(recipe) if recipe is not None else "normal"
        report = profile(model, input_shape=input_shape, batch=samples or 1, timesteps=timesteps, energy=energy,
                         flops_per_mac=flops_per_mac, name=label, random=kind, **counting)
    report.meta["weights"] = str(run.weights)
    report.meta["zoo_model"] = getattr(model, "zoo_name", None)
    return report
