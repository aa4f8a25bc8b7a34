"""Profile a model's cost: MACs, synaptic operations, FLOPs, energy, firing rates (`efficient profile MODEL`).

MODEL is a zoo name, a run dir or a .safetensors checkpoint. A run dir is profiled as it was trained:
the model of its config.yaml, its last checkpoint, and its own validation samples (the ones its
report.md used), so the totals equal summary.json's "cost". Examples:

    efficient profile spikformer-4-384
    efficient profile spikformer-stata --compare spikformer-4-384
    efficient profile runs/stata --compare runs/dense --plot compare.png
    efficient profile runs/stata --data random --input 1x8x8 --format md
    efficient profile spikformer-4-384 --memory --batch 8      # activation memory of a training step
    efficient profile runs/stata --convention spikformer --memory-access --neurobench

--convention picks how operands are charged (efficient, accumulate, spikingjelly, spikformer, stata,
neurobench; each report states its convention, formula and source). --memory-access adds the
memory-traffic energy (Lemaire et al. 2022) beside the compute-only number; --neurobench adds
NeuroBench's metrics with NeuroBench's definitions.

With --memory it measures instead what one training step (forward, loss, backward) keeps for
backward at each memory level (efficient.memory: none, bits, recompute), on a random input of the
model's shape: the total, its ratio to level none, and the bytes per top-level block.
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
    p.add_argument("--input", metavar="SHAPE",
                   help="profile a random input of this shape per sample, e.g. 3x32x32 (default: the shape the model was built for)")
    p.add_argument("--batch", type=int, metavar="N",
                   help="samples in the profiled pass (default: a run's profile.samples on its validation data, else 1)")
    p.add_argument("--timesteps", type=int, metavar="T", help="override the model's time steps")
    p.add_argument("--checkpoint", choices=("last", "best"), default="last",
                   help="weights of a run dir: last (default; what the run's report profiled) or best")
    p.add_argument("--pretrained", metavar="SOURCE", nargs="?", const=True,
                   help="zoo names: the shipped weights (no value), a tag of them, a run dir, .safetensors file or URL; "
                        "shipped weights are profiled on their validation data unless --data/--input say otherwise")
    p.add_argument("--data", metavar="SOURCE",
                   help="inputs: 'val' (a run's own validation data; default for run dirs), 'random' (default for "
                        "zoo names), or a recipe YAML / dataset name for its validation inputs (also measures exits)")
    p.add_argument("--data-batches", type=int, default=4, metavar="K", help="validation batches used with --data DATASET (default 4)")
    p.add_argument("--format", choices=("table", "json", "md", "csv", "html"), default="table")
    p.add_argument("--convention", metavar="NAME",
                   help="how operands are charged: efficient (default: operand-exact, integers as MACs), accumulate, "
                        "spikingjelly, spikformer, stata, neurobench")
    p.add_argument("--neurobench", action="store_true",
                   help="also report NeuroBench's metrics (footprint, connection and activation sparsity, synaptic "
                        "operations, membrane updates) with NeuroBench's definitions")
    p.add_argument("--memory-access", action="store_true",
                   help="add memory-access energy (weights, membrane potentials, spikes; Lemaire et al. 2022) beside "
                        "the compute-only energy")
    p.add_argument("--plot", metavar="PNG", help="write energy / firing rate per layer to this PNG (both models with --compare)")
    p.add_argument("--compare", metavar="OTHER_MODEL",
                   help="profile a second model (zoo name or run dir) on its own inputs and show both, with ratios")
    p.add_argument("--energy", metavar="PRESET",
                   help="45nm-fp32, 45nm-fp16, 45nm-int8 (default: a run's profile.energy, else 45nm-fp32)")
    p.add_argument("--flops-per-mac", type=float, metavar="F", help="FLOPs per MAC (default: a run's profile.flops_per_mac, else 2)")
    p.add_argument("--exit-threshold", type=float, help="confidence threshold for early-exit models with --data DATASET")
    p.add_argument("--layers", type=int, default=40, metavar="N", help="layers shown in table/md output (default 40)")
    p.add_argument("--depth", type=int, default=1, metavar="D", help="module depth of the top-modules summary (default 1)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the json/md/csv output to FILE instead of stdout")
    p.add_argument("--memory", action="store_true",
                   help="measure activation memory instead: the bytes one training step keeps for backward, per block, "
                        "at each memory level, on a random input of the model's shape (--input, --batch, --timesteps apply)")
    p.add_argument("--memory-budget", metavar="F", type=float,
                   help="with --memory: measure level recompute with this budget (a fraction of none's bytes: units "
                        "keep the matmul/convolution outputs that save the most rerun FLOPs per byte, as many as fit)")
    p.add_argument("--memory-peaks", action="store_true",
                   help="with --memory: also the step's peak of live tensors at each level and where it sits: the "
                        "forward, or the unit whose backward holds it (at level recompute, its rerun and backward)")
    p.add_argument("--memory-level", metavar="LEVELS",
                   help="levels measured with --memory, comma-separated from none, bits, recompute (default: all three)")


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


def _mode(name: str, args: argparse.Namespace, run: Any) -> str:
    """'val', 'random' or 'dataset': where the inputs of model `name` come from."""
    if args.data in (None, "val", "random"):
        mode = args.data or ("random" if args.input or run is None or run.run_dir is None else "val")
    else:
        mode = "dataset"
    if args.input and mode != "random":
        raise ConfigError(f"--input sets the shape of a random input, but --data {args.data} brings its own inputs; "
                          "give one of them (or --data random --input SHAPE)")
    if mode == "val" and (run is None or run.run_dir is None):
        what = "a zoo name" if run is None else "a .safetensors file outside a run dir"
        raise ConfigError(f"--data val profiles a run dir on its own validation data, and {name} is {what}; "
                          "use --data random or --data DATASET")
    return mode


def _profile(name: str, args: argparse.Namespace, data: list[Any] | None, pretrained: str | None) -> Any:
    from efficient.profiler import profile
    from efficient.profiler.run import find_run, load_run_model, profile_run_model
    from efficient.zoo import load

    run = find_run(name, args.checkpoint)
    mode = _mode(name, args, run)
    if run is not None:
        if pretrained:
            raise ConfigError(f"--pretrained applies to zoo names; {name} brings its own weights (pick them with --checkpoint)")
        model, label = load_run_model(run), run.label
        if mode in ("val", "random"):
            return profile_run_model(model, run, data=mode, samples=args.batch, input_shape=args.input,
                                     timesteps=args.timesteps, energy=args.energy, flops_per_mac=args.flops_per_mac,
                                     **_counting(args))
    else:
        model, label = load(name, pretrained=pretrained), name
        trained_on = getattr(model, "pretrained_cfg", {}).get("data")
        if trained_on and args.data is None and not args.input:  # shipped weights: their own validation inputs
            from efficient.hub import validation_batches

            mode, data = "dataset", validation_batches(trained_on, args.batch or 8, args.data_batches)
    energy = args.energy or "45nm-fp32"
    flops_per_mac = args.flops_per_mac if args.flops_per_mac is not None else 2
    if mode == "random":
        return profile(model, input_shape=args.input, batch=args.batch or 1, timesteps=args.timesteps, energy=energy,
                       flops_per_mac=flops_per_mac, name=label, **_counting(args))
    import torch

    from efficient.data import first_input

    inputs = torch.cat([first_input(b) for b in data])  # all K batches in one pass
    return profile(model, inputs=inputs, timesteps=args.timesteps, energy=energy, data=data, flops_per_mac=flops_per_mac,
                   exit_threshold=args.exit_threshold, name=label, **_counting(args))


def _counting(args: argparse.Namespace) -> dict[str, Any]:
    """The counting options of `profile()` the command line chose."""
    return {"convention": args.convention or "efficient", "neurobench": args.neurobench, "memory_access": args.memory_access}


def _memory_levels(spec: str | None) -> list[str]:
    from efficient.memory import LEVELS, check_level

    if spec is None:
        return list(LEVELS)
    levels = [lv.strip() for lv in spec.split(",") if lv.strip()]
    if not levels:
        raise ConfigError(f"--memory-level {spec!r}: name one or more of {', '.join(LEVELS)}, comma-separated")
    return list(dict.fromkeys(check_level(lv, "--memory-level") for lv in levels))


def _memory(args: argparse.Namespace) -> int:
    """`--memory`: activation memory of one training step at each level asked."""
    from efficient.memory import optimize
    from efficient.memory.measure import activation_memory, measure_levels
    from efficient.profiler.api import _check_input_shape, _repeat_time, _resolve_inputs, _timesteps_override
    from efficient.profiler.run import find_run, load_run_model
    from efficient.zoo import load

    levels = _memory_levels(args.memory_level)
    if args.memory_budget is not None:
        from efficient.memory.plan import check_budget
        from efficient.memory.recompute import require_budget_support

        check_budget(args.memory_budget)
        if "recompute" not in levels:
            raise ConfigError("--memory-budget applies to level recompute; add it to --memory-level")
        require_budget_support()
    for flag, given in (("--compare", args.compare), ("--plot", args.plot), ("--exit-threshold", args.exit_threshold is not None),
                        ("--convention", args.convention), ("--neurobench", args.neurobench), ("--memory-access", args.memory_access)):
        if given:
            raise ConfigError(f"{flag} does not apply with --memory, which measures one model's training step")
    if args.data not in (None, "random"):
        raise ConfigError(f"--memory measures a step on a random input of the model's shape, not on --data {args.data}; "
                          "give --input SHAPE to change the shape")
    if args.format not in ("table", "json"):
        raise ConfigError(f"--memory prints a table or --format json, not --format {args.format}")
    run = find_run(args.model, args.checkpoint)
    if run is not None:
        if args.pretrained:
            raise ConfigError(f"--pretrained applies to zoo names; {args.model} brings its own weights (pick them with --checkpoint)")
        model, label = load_run_model(run), run.label
    else:
        model, label = load(args.model, pretrained=args.pretrained), args.model
    optimize(model, "none")  # measured from level none up, whatever the model was loaded with
    batch = args.batch or 1
    inputs, kwargs, source = _resolve_inputs(model, None, args.input, batch, None)
    _check_input_shape(model, inputs, kwargs, source, label)
    with _timesteps_override(model, args.timesteps) as (t_used, repeat_input):
        if repeat_input:
            inputs = tuple(_repeat_time(a, args.timesteps) for a in inputs)
        measured = measure_levels(model, kwargs or inputs, dict.fromkeys(["none", *levels]))
        plan = None
        if args.memory_budget is not None:
            plan = optimize(model, "recompute", budget=args.memory_budget, example=kwargs or inputs)
            measured["recompute"] = activation_memory(model, kwargs or inputs)
            optimize(model, "none")
        peaks = _memory_peaks(model, kwargs or inputs, ["none", *levels], args.memory_budget) if args.memory_peaks else None
    results = {lv: measured[lv] for lv in levels}
    base = measured["none"]
    where = source + (f", T={t_used}" if t_used else "")
    if args.format == "json":
        d = {"model": label, "input": where, "batch": batch, "none_total_bytes": base.total_bytes,
             "ratio_to_none": {lv: m.ratio(base) for lv, m in results.items()},
             "levels": {lv: m.to_dict() for lv, m in results.items()}}
        if plan is not None:
            d["recompute_plan"] = {"budget": plan.budget, "kept_fraction": plan.kept_fraction,
                                   "rerun_share": plan.rerun_share, "keep": plan.keep, "summary": plan.summary()}
        if peaks is not None:
            d["step_peak_bytes"] = {lv: max(ph.values()) for lv, ph in peaks.items()}
            d["step_peak_phases"] = peaks
        text = json.dumps(d, indent=2)
        if args.output:
            from efficient.io import write_text

            write_text(args.output, text + "\n")
        else:
            sys.stdout.write(text + "\n")
        return 0
    from rich.console import Console

    from efficient.profiler.render import memory_tables

    console = Console()
    for t in memory_tables(results, base, f"activation memory: {label}, {where}"):
        console.print(t)
    if plan is not None:
        console.print(f"recompute with a budget: {plan.summary()}")
    if peaks is not None:
        from rich.table import Table

        from efficient.memory.measure import fmt_bytes

        top = max(peaks["none"].values())
        t = Table(title=f"step peak of live tensors: {label}, {where}")
        for col in ("level", "peak", "vs none", "where it sits"):
            t.add_column(col, justify="right" if col in ("peak", "vs none") else "left")
        for lv, ph in peaks.items():
            phase, most = next(iter(ph.items()))
            t.add_row(lv, fmt_bytes(most), f"{most / top:.3f}x", phase)
        console.print(t)
        if "recompute" in peaks:
            t = Table(title="level recompute: the most live bytes per phase")
            t.add_column("phase")
            t.add_column("most live", justify="right")
            for phase, most in list(peaks["recompute"].items())[:args.layers]:
                t.add_row(phase, fmt_bytes(most))
            console.print(t)
    return 0


def _memory_peaks(model: Any, example: Any, levels: list[str], budget: float | None) -> dict[str, dict[str, int]]:
    """{level: its step's most live bytes per phase (`efficient.memory.peak_phases`), largest first}; level
    recompute with `budget` (of none's bytes) where one is given. Leaves the model at level none."""
    from efficient.memory import optimize, peak_phases

    found = {}
    try:
        for lv in dict.fromkeys(levels):
            if lv == "recompute" and budget is not None:
                optimize(model, lv, budget=budget, example=example)
            else:
                optimize(model, lv)
            found[lv] = peak_phases(model, example)
    finally:
        optimize(model, "none")
    return found


def run(args: argparse.Namespace) -> int:
    from efficient.profiler.energy import resolve_energy

    if args.energy is not None:
        resolve_energy(args.energy)  # fail on a bad preset before loading anything
    if args.convention is not None:
        from efficient.profiler.conventions import resolve_convention

        resolve_convention(args.convention)
    if args.batch is not None and args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    if args.memory_level is not None and not args.memory:
        raise ConfigError("--memory-level chooses the levels --memory measures; add --memory")
    if args.memory_budget is not None and not args.memory:
        raise ConfigError("--memory-budget applies to the recompute level --memory measures; add --memory")
    if args.memory_peaks and not args.memory:
        raise ConfigError("--memory-peaks adds the step's peaks to what --memory measures; add --memory")
    if args.flops_per_mac is not None and not args.flops_per_mac > 0:
        raise ConfigError(f"--flops-per-mac must be a positive number, got {args.flops_per_mac}")
    if args.input:
        from efficient.profiler.api import parse_shape

        parse_shape(args.input)
    if args.memory:
        return _memory(args)
    dataset = args.data not in (None, "val", "random")
    data = _data_batches(args.data, args.batch or 1, args.data_batches) if dataset else None
    report = _profile(args.model, args, data, args.pretrained)
    other = _profile(args.compare, args, data, None) if args.compare else None
    cmp = report.compare(other) if other is not None else None

    if args.plot:
        (cmp if cmp is not None else report).plot(args.plot)
    if args.format == "table":
        from rich.console import Console
        from rich.rule import Rule

        from efficient.profiler.console import echo

        console = Console()  # a terminal's width, else COLUMNS, else 80; tables keep layer names whole
        for rep in (report, other) if other is not None else (report,):
            if other is not None:
                console.print(Rule(str(rep.meta.get("model"))))
            for r in rep.to_table(max_layers=args.layers, depth=args.depth):
                console.print(r)
        if cmp is not None:
            console.print(Rule("comparison"))
            console.print(cmp.to_table())
        for rep in (report, other) if other is not None else (report,):
            for w in rep.warnings:
                echo(w, console, head=f"warning ({rep.meta.get('model')}): ", head_style="yellow")
        if args.plot:
            echo(f"plot written to {args.plot}", console)
        return 0
    if args.format == "json":
        d = report.to_dict()
        if other is not None:
            d = {"report": d, "compare": other.to_dict(), "comparison": cmp.to_dict()}
        text = json.dumps(d, indent=2, default=str)
    elif args.format == "html":
        if other is not None:
            raise ConfigError("--format html writes one report; drop --compare (or use --format md)")
        text = report.to_html(max_layers=args.layers)
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
