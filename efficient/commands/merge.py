"""Merge two trained runs of the same architecture into one model (`cca`, `permute` or `average`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from efficient.commands import print_values
from efficient.errors import ConfigError
import efficient.merge as _merge
from efficient.merge import METHODS, accuracy, merge_models

__doc__ = _merge.__doc__  # `efficient merge --help` describes the method, whose home is efficient.merge

if TYPE_CHECKING:
    from efficient.config import Recipe


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="first run dir (or .safetensors with metadata)")
    p.add_argument("b", help="second run dir of the same architecture")
    p.add_argument("--method", choices=METHODS, default="cca", help="alignment before averaging (default: cca)")
    p.add_argument("--gamma", type=float, default=0.1, help="CCA covariance ridge (default 0.1)")
    p.add_argument("--recipe", help="recipe whose data section gives calibration and validation data (default: A's config.yaml)")
    p.add_argument("--calib-batches", type=int, default=8, help="training batches for the calibration pass (default 8)")
    p.add_argument("--out", help="write the merged model here (.safetensors; loadable with efficient.load)")
    p.add_argument("--json", action="store_true", help="print the accuracy table as JSON")


def _recipe_for(args: argparse.Namespace) -> Recipe:
    """The recipe whose data section feeds calibration and validation: --recipe, else A's config.yaml."""
    from efficient.config import load_recipe

    src = Path(args.recipe) if args.recipe else Path(args.a) / "config.yaml"
    if not src.exists():
        raise ConfigError(f"merge: no recipe to build data from ({src} missing); pass --recipe RECIPE.yaml")
    return load_recipe(src)


def run(args: argparse.Namespace) -> int:
    """Entry point of `efficient merge`: merge, then report accuracy of parents, average and merge."""
    import json

    from torch.utils.data import DataLoader

    from efficient.data import build_data
    from efficient.zoo import load, save_model

    if args.calib_batches < 1:
        raise ConfigError("merge: --calib-batches must be >= 1")
    a, b = load(args.a), load(args.b)
    if getattr(a, "zoo_name", None) != getattr(b, "zoo_name", None):
        raise ConfigError(f"merge: {args.a} is {getattr(a, 'zoo_name', '?')} but {args.b} is {getattr(b, 'zoo_name', '?')}; merge runs of the same architecture")
    recipe = _recipe_for(args)
    data = build_data(recipe.data)
    g = torch.Generator().manual_seed(0)
    train = DataLoader(data.train, batch_size=recipe.data["batch_size"], shuffle=True, generator=g, collate_fn=data.collate_fn)
    batches = [x for (x, _), _ in zip(train, range(args.calib_batches))]
    val = list(DataLoader(data.val, batch_size=256, shuffle=False, collate_fn=data.collate_fn))
    rows = {"A": accuracy(a, val), "B": accuracy(b, val), "average": accuracy(merge_models(a, b, batches, "average"), val)}
    merged = merge_models(a, b, batches, args.method, args.gamma)
    rows[args.method] = accuracy(merged, val)
    if args.out:
        save_model(merged, Path(args.out), getattr(a, "zoo_name", None), getattr(a, "zoo_cfg", {}))
    if args.json:
        print(json.dumps({"val_acc": rows, "method": args.method, "out": args.out}))
    else:
        print_values(f"merge {args.a} + {args.b} ({args.method})", rows, "model", "val acc")
    return 0
