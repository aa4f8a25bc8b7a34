"""Adversarial evaluation: `efficient attack RUN_OR_MODEL --attack fgsm,pgd --eps 8/255 [--steps N] [--data NAME]`.

Runs white-box L-inf attacks (BPTT through the model's own surrogate) on the validation split in
[0, 1] pixel space and prints clean and robust accuracy (a table, or JSON with --format json).
A run trained on normalised data is wrapped with its normalisation so the attack still sees pixels.
Results on a run dir are also appended to RUN_DIR/attacks.jsonl, which `efficient report` shows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from efficient.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="RUN_OR_MODEL", help="a run dir, a .safetensors file, or a zoo name (fresh weights unless --pretrained)")
    p.add_argument("--pretrained", metavar="SOURCE", nargs="?", const=True,
                   help="zoo names: the shipped weights (no value; attacked on their validation data), a tag of them, a file or URL")
    p.add_argument("--attack", action="append", help="fgsm, pgd, apgd-ce or apgd-dlr; repeat or comma-separate (default: fgsm,pgd)")
    p.add_argument("--eps", default="8/255", help="L-inf radius in [0, 1] pixel units, e.g. 8/255 (default)")
    p.add_argument("--steps", type=int, help="PGD/APGD iterations (default 10; FGSM is one step)")
    p.add_argument("--alpha", help="PGD step size, e.g. 2/255 (default: 2.55/255 for 7 steps at 8/255, else 2.5*eps/steps)")
    p.add_argument("--no-random-start", action="store_true", help="PGD starts at the clean input")
    p.add_argument("--data", help="dataset name or recipe YAML (default: the run's own data section)")
    p.add_argument("--data-opt", action="append", default=[], metavar="KEY=VALUE", help="dataset option, e.g. image_size=8 (repeatable)")
    p.add_argument("--checkpoint", choices=["best", "last"], default="best", help="which checkpoint of a run dir")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-batches", type=int, help="evaluate only the first N validation batches")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=0, help="seed of the random starts")
    p.add_argument("--format", choices=["table", "json"], default="table")


def attack_specs(names: list[str] | None, eps: float, steps: int | None, alpha: float | None, random_start: bool) -> list[Any]:
    from efficient.attacks import AttackSpec

    flat = [n.strip() for item in (names or ["fgsm,pgd"]) for n in item.split(",") if n.strip()]
    if not flat:
        raise ConfigError("--attack: give at least one of fgsm, pgd, apgd-ce, apgd-dlr")
    return [AttackSpec(n, eps, None if n == "fgsm" else steps, alpha if n == "pgd" else None, random_start) for n in flat]


def _data_section(args: argparse.Namespace, run_data: dict[str, Any] | None) -> dict[str, Any]:
    from efficient.config import load_yaml, parse_override

    if args.data:
        if args.data.endswith((".yaml", ".yml")):
            section = dict(load_yaml(args.data).get("data") or {})
            if "name" not in section:
                raise ConfigError(f"--data {args.data}: the recipe has no data.name")
        else:
            section = {"name": args.data}
    elif run_data is not None:
        section = dict(run_data)
    else:
        raise ConfigError(f"{args.target}: a zoo name carries no dataset; pass --data NAME (e.g. --data digits) or a run dir")
    for item in args.data_opt:
        parts, value = parse_override(item)
        if len(parts) != 1:
            raise ConfigError(f"--data-opt {item!r}: expected KEY=VALUE with a plain key such as image_size=8")
        section[parts[0]] = value
    return section


def load_pixel_data(section: dict[str, Any]) -> tuple[Any, tuple[list[float], list[float]] | None]:
    """Build the dataset with `normalize: false`; return it and the (mean, std) the model was
    trained with if its data were normalised (None otherwise)."""
    import inspect

    from efficient.config import check_kwargs_against
    from efficient.data import DATA_LOADER_KEYS, build_data, get_dataset_builder

    builder = get_dataset_builder(section["name"])
    params = inspect.signature(builder).parameters
    opts = check_kwargs_against(builder, {k: v for k, v in section.items() if k != "name"}, "--data", "data", skip=DATA_LOADER_KEYS)
    normalized = False
    if "normalize" in params:
        normalized = bool(opts.get("normalize", params["normalize"].default))
        opts["normalize"] = False
    bundle = build_data({"name": section["name"], **opts})
    if bundle.task != "classification":
        raise ConfigError(f"--data {section['name']}: attacks need a classification dataset, got task {bundle.task!r}")
    stats = None
    if normalized:
        mean, std = bundle.meta.get("mean"), bundle.meta.get("std")
        if mean is None or std is None:
            raise ConfigError(f"--data {section['name']}: the run used normalised inputs but the dataset reports no mean/std")
        stats = (list(mean), list(std))
    return bundle, stats


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from efficient import zoo
    from efficient.attacks import parse_eps, robust_accuracy

    eps = parse_eps(args.eps)
    alpha = parse_eps(args.alpha, "--alpha") if args.alpha is not None else None
    specs = attack_specs(args.attack, eps, args.steps, alpha, not args.no_random_start)
    target = Path(args.target)
    run_data = None
    if target.is_dir():
        if args.pretrained is not None:
            raise ConfigError(f"--pretrained applies to zoo names; {target} brings its own weights (pick them with --checkpoint)")
        from efficient.config import load_yaml

        run_data = (load_yaml(target / "config.yaml") if (target / "config.yaml").exists() else {}).get("data")
        model = zoo.load(target)
        weights = target / "checkpoint" / args.checkpoint / "model.safetensors"
        if weights.exists():
            zoo.load_weights(model, weights)
        elif args.checkpoint != "best":
            raise ConfigError(f"{target}: no {args.checkpoint} checkpoint ({weights} missing)")
    else:
        model = zoo.load(args.target, pretrained=args.pretrained)
        run_data = getattr(model, "pretrained_cfg", {}).get("data")  # shipped weights know their dataset
    name = getattr(model, "zoo_name", type(model).__name__)
    bundle, stats = load_pixel_data(_data_section(args, run_data))
    num_classes = getattr(model, "num_classes", bundle.num_classes)
    if stats is not None:
        from efficient.models.stable_snn import Normalize

        model = nn.Sequential(Normalize(*stats), model)
        model.num_classes = num_classes  # type: ignore[assignment]
    from efficient.train.engine import resolve_device

    device = resolve_device(args.device, "--device")
    model.to(device).eval()
    loader = DataLoader(bundle.val, batch_size=args.batch_size, shuffle=False, collate_fn=bundle.collate_fn)
    torch.manual_seed(args.seed)
    result = robust_accuracy(model, loader, specs, device=device, max_batches=args.max_batches, seed=args.seed)
    return {"model": name, "target": str(args.target), "data": bundle_name(args, run_data), **result}


def bundle_name(args: argparse.Namespace, run_data: dict[str, Any] | None) -> str:
    return str(args.data or (run_data or {}).get("name", "?"))


def record_in_run(args: argparse.Namespace, res: dict[str, Any]) -> Path | None:
    """Append the result to RUN_DIR/attacks.jsonl when the target is a run dir (its report.html shows
    robust accuracy from it); None for other targets."""
    target = Path(args.target)
    if not (target.is_dir() and (target / "config.yaml").exists()):
        return None
    import time

    from efficient.io import append_jsonl
    from efficient.report.rundata import ATTACKS_FILE

    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checkpoint": args.checkpoint, "seed": args.seed,
             "max_batches": args.max_batches, **res}
    append_jsonl(target / ATTACKS_FILE, entry)
    return target / ATTACKS_FILE


def run(args: argparse.Namespace) -> int:
    res = evaluate(args)
    saved = record_in_run(args, res)
    if args.format == "json":
        print(json.dumps(res, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{res['model']} on {res['data']} (val, n={res['n']})")
    for col, just in (("attack", "left"), ("eps", "right"), ("steps", "right"), ("step size", "right"), ("accuracy %", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    table.add_row("clean", "-", "-", "-", f"{100 * res['clean']:.2f}")
    for r in res["attacks"]:
        step = "adaptive" if r["alpha"] is None else f"{255 * r['alpha']:.3g}/255"
        table.add_row(r["attack"], f"{255 * r['eps']:.3g}/255", str(r["steps"]), step, f"{100 * r['acc']:.2f}")
    console = Console()
    console.print(table)
    if saved is not None:
        console.print(f"recorded in {saved} (shown by `efficient report {args.target}`)")
    return 0
