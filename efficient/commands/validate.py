"""Check a recipe without running it: schema, types, ranges, and a build of the model on the meta device."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")


def check_recipe(path: str, overrides: list[str]) -> "object":
    """Validate a recipe and build its model on the meta device (no weights, no data read)."""
    import torch

    from efficient import zoo
    from efficient.config import load_recipe
    from efficient.errors import ConfigError
    from efficient.objectives import build_objective

    recipe = load_recipe(path, overrides)
    kwargs = {k: v for k, v in recipe.model.items() if k not in ("name", "pretrained")}
    try:
        with torch.device("meta"):
            zoo.create(recipe.model["name"], **kwargs)
        build_objective(recipe.objective)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{path}: {e}") from None
    return recipe


def run(args: argparse.Namespace) -> int:
    recipe = check_recipe(args.recipe, args.overrides)
    from efficient.profiler.console import echo

    echo(f"{args.recipe}: ok (model {recipe.model['name']}, data {recipe.data['name']}, objective {recipe.objective['name']}, "
         f"{recipe.train.epochs} epochs)")
    return 0
