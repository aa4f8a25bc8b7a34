"""Evaluate a trained run on its validation split: `efficient eval RUN_DIR [--checkpoint best|last]`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory written by `efficient train`")
    p.add_argument("--checkpoint", choices=["best", "last"], default="best")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides (e.g. data.root=/data)")


def evaluate_run(run_dir: Path, which: str = "best", overrides: list[str] | None = None) -> dict[str, float]:
    """Validation metrics of a run dir's `which` checkpoint, by the evaluation loop training uses."""
    from efficient import zoo
    from efficient.config import load_recipe
    from efficient.data import build_data
    from efficient.errors import ConfigError
    from efficient.objectives import build_objective
    from efficient.train.engine import evaluate, resolve_device, val_loader

    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir}: not a run dir (no config.yaml); give a directory written by `efficient train`")
    recipe = load_recipe(run_dir / "config.yaml", overrides or [])
    weights = run_dir / "checkpoint" / which / "model.safetensors"
    if not weights.exists():
        raise ConfigError(f"{run_dir}: no {which} checkpoint ({weights} missing)")
    model = zoo.load(run_dir)
    zoo.load_weights(model, weights)
    device = resolve_device(recipe.train.device)
    model.to(device).eval()
    data = build_data(recipe.data)
    objective = build_objective(recipe.objective)
    objective.setup(model, data, recipe)
    # the whole split in full precision, whatever eval.max_batches and train.amp say for training
    return evaluate(model, objective, val_loader(recipe, data), device)


def run(args: argparse.Namespace) -> int:
    from efficient.commands import print_values

    run_dir = Path(args.run_dir)
    metrics = evaluate_run(run_dir, args.checkpoint, args.overrides)
    if args.format == "json":
        print(json.dumps(metrics, indent=2))
        return 0
    print_values(f"{run_dir} ({args.checkpoint})", metrics, "metric", "value")
    return 0
