"""Profile a model's cost: MACs, synaptic operations, FLOPs, energy, firing rates (`efficient profile MODEL`).

MODEL is a zoo name, a run dir or a .safetensors checkpoint. Examples:

    efficient profile spikformer-4-384
    efficient profile spikformer-stata --compare spikformer-4-384
    efficient profile runs/stata --data cifar10 --format md --plot energy.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from efficient.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="zoo name, run dir or .safetensors checkpoint")
    p.add_argument("--input", metavar="SHAPE", help="input shape per sample, e.g. 3x32x32 (default: the zoo entry's)")
    p.add_argument("--batch", type=int, default=1, metavar="N", help="batch size of the profiled pass (default 1)")
    p.add_argument("--timesteps", type=int, metavar="T", help="override the model's time steps")
    p.add_argument("--pretrained", metavar="RUN", help="load weights from a run dir or .safetensors file")
    p.add_argument("--data", metavar="RECIPE_OR_NAME",
                   help="profile on real validation inputs: a recipe YAML or a dataset name (also measures exits)")
    p.add_argument("--data-batches", type=int, default=4, metavar="K", help="validation batches used with --data (default 4)")
    p.add_argument("--format", choices=("table", "json", "md", "csv"), default="table")
    p.add_argument("--plot", metavar="PNG", help="write energy / firing rate per layer to this PNG")
    p.add_argument("--compare", metavar="OTHER_MODEL", help="profile a second model and show both side by side")
    p.add_argument("--energy", default="45nm-fp32", metavar="PRESET", help="45nm-fp32 (default), 45nm-fp16, 45nm-int8")
    p.add_argument("--flops-per-mac", type=float, default=2.0, help="FLOPs per MAC (default 2)")
    p.add_argument("--exit-threshold", type=float, help="confidence threshold for early-exit models with --data")
    p.add_argument("--layers", type=int, default=40, metavar="N", help="layers shown in table/md output (default 40)")
    p.add_argument("--depth", type=int, default=1, metavar="D", help="module depth of the top-modules summary (default 1)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the json/md/csv output to FILE instead of stdout")


def _load(name: str, pretrained: str | None) -> Any:
    from efficient.zoo import load

    return load(name, pretrained=pretrained)


def _data_batches(spec: str, batch: int, k: int) -> list[Any]:
    """Validation batches from a recipe YAML or a registered dataset name."""
    from torch.utils.data import DataLoader

    from efficient.data import build_data, get_dataset_builder

    if spec.endswith((".yaml", ".yml")):
        from efficient.config import load_recipe

        if not Path(spec).exists():
            raise ConfigError(f"--data {spec}: no such recipe file")
        bundle = build_data(load_recipe(spec).data)
    else:
        bundle = get_dataset_builder(spec)()
    loader = DataLoader(bundle.val, batch_size=batch, shuffle=False, collate_fn=bundle.collate_fn)
    batches = list(itertools.islice(iter(loader), k))
    if not batches:
        raise ConfigError(f"--data {spec}: the validation split is empty")
    return batches


def _profile(name: str, args: argparse.Namespace, data: list[Any] | None) -> Any:
    from efficient.profiler import profile

    model = _load(name, args.pretrained if name == args.model else None)
    inputs = None
    if data:
        import torch

        from efficient.profiler.api import _first_input

        inputs = torch.cat([_first_input(b) for b in data])  # all K batches in one pass
    return profile(model, inputs=inputs, input_shape=args.input, batch=args.batch, timesteps=args.timesteps,
                   energy=args.energy, data=data, flops_per_mac=args.flops_per_mac,
                   exit_threshold=args.exit_threshold, name=Path(name).name if Path(name).exists() else name)


def run(args: argparse.Namespace) -> int:
    from efficient.profiler.energy import resolve_energy

    resolve_energy(args.energy)  # fail on a bad preset before loading anything
    if args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    if args.input:
        from efficient.profiler.api import parse_shape

        parse_shape(args.input)
    data = _data_batches(args.data, args.batch, args.data_batches) if args.data else None
    report = _profile(args.model, args, data)
    other = _profile(args.compare, args, data) if args.compare else None
    cmp = report.compare(other) if other is not None else None

    if args.plot:
        report.plot(args.plot)
    if args.format == "table":
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else 160)  # pipes: don't squeeze layer names
        for r in report.to_table(max_layers=args.layers, depth=args.depth):
            console.print(r)
        if cmp is not None:
            console.print(cmp.to_table())
        for w in report.warnings + (other.warnings if other is not None else []):
            console.print(f"[yellow]warning:[/yellow] {w}")
        if args.plot:
            console.print(f"plot written to {args.plot}")
        return 0
    if args.format == "json":
        d = report.to_dict()
        if other is not None:
            d = {"report": d, "compare": other.to_dict(), "comparison": cmp.to_dict()}
        text = json.dumps(d, indent=2, default=str)
    elif args.format == "md":
        text = report.to_markdown(max_layers=args.layers, depth=args.depth)
        if other is not None:
            text += "\n" + other.to_markdown(max_layers=args.layers, depth=args.depth) + "\n### Comparison\n\n" + cmp.to_markdown()
    else:
        text = report.to_csv()
        if other is not None:
            text += other.to_csv().split("\n", 1)[1]
    if args.output:
        from efficient.io import write_text

        write_text(args.output, text)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0
