"""Adversarial evaluation: `efficient attack RUN_OR_MODEL --attack fgsm,pgd --eps 8/255 [--steps N] [--data NAME]`.

Runs white-box L-inf attacks (BPTT through the model's own surrogate) on the validation split in
[0, 1] pixel space and prints clean and robust accuracy (a table, or JSON with --format json).
A run trained on normalised data is wrapped with its normalisation so the attack still sees pixels.
Results on a run dir are also appended to RUN_DIR/attacks.jsonl, which `efficient report` shows.
`--attack suite` reports the per-example worst case over the adaptive suite of
`efficient.attacks.suite` (with `--source RUN` for its transfer attack) and `--checks` adds the
gradient-masking checks of `efficient.attacks.masking`.
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
    p.add_argument("--attack", action="append",
                   help="fgsm, pgd, apgd-ce or apgd-dlr; repeat or comma-separate (default: fgsm,pgd); or suite alone, "
                        "the worst case over APGD-CE/DLR, PGD restarts, other-surrogate BPTT, transfer and Square")
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
    g = p.add_argument_group("suite (--attack suite)")
    g.add_argument("--source", metavar="RUN", help="an independently trained run dir (same data) for the transfer attack")
    g.add_argument("--checks", action="store_true", help="also run the gradient-masking checks (pass/fail with numbers)")
    g.add_argument("--apgd-steps", type=int, default=100, help="APGD-CE/DLR and other-surrogate steps (default 100)")
    g.add_argument("--apgd-restarts", type=int, default=2, help="APGD restarts (default 2)")
    g.add_argument("--pgd-steps", type=int, default=100, help="PGD steps per random start (default 100)")
    g.add_argument("--pgd-restarts", type=int, default=3, help="PGD random starts (default 3)")
    g.add_argument("--pgd-step", type=float, default=0.25, help="PGD step as a fraction of eps (default 0.25)")
    g.add_argument("--transfer-steps", type=int, default=100, help="PGD steps on the --source model (default 100)")
    g.add_argument("--square-queries", type=int, default=1000, help="Square attack queries (default 1000)")
    g.add_argument("--surrogate", action="append", metavar="NAME[:ALPHA]",
                   help="other surrogates to attack through (repeatable; default sigmoid:1 and ste:1)")
    g.add_argument("--suite-attacks", help="comma-separated subset of the suite to run (default: all)")
    g.add_argument("--check-tol", type=float, default=0.02, help="allowed violation in a check, as a fraction (default 0.02)")
    g.add_argument("--check-steps", type=int, default=10, help="k of the checks' PGD-k and FGSM comparison (default 10)")


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


def load_model(target_arg: str, pretrained: Any, checkpoint: str, flag: str = "RUN_OR_MODEL") -> tuple[Any, dict[str, Any] | None]:
    """The model of a run dir (with its `checkpoint`), a file or a zoo name, and the run's data section."""
    from efficient import zoo

    target = Path(target_arg)
    if target.is_dir():
        if pretrained is not None:
            raise ConfigError(f"--pretrained applies to zoo names; {target} brings its own weights (pick them with --checkpoint)")
        from efficient.config import load_yaml

        run_data = (load_yaml(target / "config.yaml") if (target / "config.yaml").exists() else {}).get("data")
        model = zoo.load(target)
        weights = target / "checkpoint" / checkpoint / "model.safetensors"
        if weights.exists():
            zoo.load_weights(model, weights)
        elif checkpoint != "best":
            raise ConfigError(f"{flag} {target}: no {checkpoint} checkpoint ({weights} missing)")
        return model, run_data
    model = zoo.load(target_arg, pretrained=pretrained)
    return model, getattr(model, "pretrained_cfg", {}).get("data")  # shipped weights know their dataset


def pixel_model(model: Any, stats: tuple[list[float], list[float]] | None, num_classes: int) -> Any:
    """`model` behind its input normalisation (if its data were normalised), so attacks see [0, 1] pixels."""
    from torch import nn

    if stats is None:
        return model
    from efficient.models.stable_snn import Normalize

    wrapped = nn.Sequential(Normalize(*stats), model)
    wrapped.num_classes = num_classes  # type: ignore[assignment]
    return wrapped


def _load_source(args: argparse.Namespace, num_classes: int) -> Any:
    """The --source run (same data section as the target) for the transfer attack."""
    if not Path(args.source).is_dir():
        raise ConfigError(f"--source {args.source}: not a run dir; give the run dir of an independently trained model")
    source, source_data = load_model(args.source, None, args.checkpoint, "--source")
    stats = None
    if source_data is not None:
        _, stats = load_pixel_data(dict(source_data))
    if getattr(source, "num_classes", num_classes) != num_classes:
        raise ConfigError(f"--source {args.source} has {source.num_classes} classes, the target {num_classes}: train it on the same data")
    return pixel_model(source, stats, num_classes)


def suite_config(args: argparse.Namespace) -> Any:
    from efficient.attacks import SuiteConfig

    surrogates = []
    for item in args.surrogate or ["sigmoid:1", "ste:1"]:
        name, _, alpha = item.partition(":")
        try:
            surrogates.append((name.strip(), float(alpha) if alpha else 1.0))
        except ValueError:
            raise ConfigError(f"--surrogate {item!r}: expected NAME or NAME:ALPHA such as sigmoid:1") from None
    only = tuple(a.strip() for a in args.suite_attacks.split(",") if a.strip()) if args.suite_attacks else None
    return SuiteConfig(
        apgd_steps=args.apgd_steps, apgd_restarts=args.apgd_restarts, pgd_steps=args.pgd_steps,
        pgd_restarts=args.pgd_restarts, pgd_step=args.pgd_step, surrogates=tuple(surrogates), transfer_steps=args.transfer_steps,
        square_queries=args.square_queries, only=only,
    )


def _suite_requested(names: list[str] | None) -> bool:
    flat = [n.strip() for item in (names or []) for n in item.split(",") if n.strip()]
    if "suite" in flat and len(flat) > 1:
        raise ConfigError("--attack suite runs alone (it already includes PGD and APGD); drop the other attack names")
    return flat == ["suite"]


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from efficient.attacks import parse_eps, robust_accuracy

    eps = parse_eps(args.eps)
    suite = _suite_requested(args.attack)
    if not suite:
        for flag, value in (("--source", args.source), ("--checks", args.checks or None)):
            if value is not None:
                raise ConfigError(f"{flag} belongs to --attack suite; add --attack suite or drop {flag}")
    elif args.steps is not None or args.alpha is not None:
        raise ConfigError("--steps/--alpha set single attacks; the suite takes --pgd-steps, --apgd-steps, --square-queries, ...")
    cfg = suite_config(args) if suite else None
    if suite and args.checks:
        from efficient.attacks import CheckConfig

        check_cfg = CheckConfig(tol=args.check_tol, steps=args.check_steps)
    alpha = parse_eps(args.alpha, "--alpha") if args.alpha is not None else None
    specs = None if suite else attack_specs(args.attack, eps, args.steps, alpha, not args.no_random_start)
    model, run_data = load_model(args.target, args.pretrained, args.checkpoint)
    name = getattr(model, "zoo_name", type(model).__name__)
    bundle, stats = load_pixel_data(_data_section(args, run_data))
    num_classes = getattr(model, "num_classes", bundle.num_classes)
    model = pixel_model(model, stats, num_classes)
    from efficient.train.engine import resolve_device

    device = resolve_device(args.device, "--device")
    model.to(device).eval()
    loader = DataLoader(bundle.val, batch_size=args.batch_size, shuffle=False, collate_fn=bundle.collate_fn)
    torch.manual_seed(args.seed)
    head = {"model": name, "target": str(args.target), "data": bundle_name(args, run_data)}
    if not suite:
        result = robust_accuracy(model, loader, specs, device=device, max_batches=args.max_batches, seed=args.seed)
        return {**head, **result}
    from efficient.attacks import worst_case

    source = _load_source(args, num_classes).to(device).eval() if args.source else None
    import itertools

    batches = list(itertools.islice(loader, args.max_batches)) if args.max_batches else list(loader)
    result = worst_case(model, batches, eps, cfg, source=source, device=device, max_batches=args.max_batches, seed=args.seed)
    out = {**head, "source": args.source, "suite": result}
    if args.checks:
        from efficient.attacks import masking_checks

        out["checks"] = masking_checks(model, batches, result, check_cfg, device=device, max_batches=args.max_batches, seed=args.seed)
    return out


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
    if "suite" in res:  # the report reads n / clean / attacks[]: the suite's attacks plus its worst case as rows
        s = res["suite"]
        rows = [{"attack": a["attack"], "eps": s["eps"], "steps": a.get("steps"), "acc": a["acc"]}
                for a in s["attacks"] if not a.get("skipped")]
        entry.update(n=s["n"], clean=s["clean"], attacks=rows + [{"attack": "worst case (suite)", "eps": s["eps"], "steps": None, "acc": s["worst_case"]}])
    append_jsonl(target / ATTACKS_FILE, entry)
    return target / ATTACKS_FILE
def _print_suite(res: dict[str, Any]) -> None:
    from rich.console import Console

    from efficient.profiler.console import Column, FitTable, echo, number

    s = res["suite"]
    rows = [("clean", "-", f"{100 * s['clean']:.2f}", "-", "-")]
    for r in s["attacks"]:
        setting = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("attack", "acc", "seconds", "unique_breaks", "skipped", "acc_first_restart"))
        if r.get("skipped"):
            rows.append((r["attack"], setting, "skipped", "-", r["skipped"]))
        else:
            rows.append((r["attack"], setting, f"{100 * r['acc']:.2f}", str(r["unique_breaks"]), f"{r['seconds']:.1f}"))
    rows.append(("worst case", "every attack", f"{100 * s['worst_case']:.2f}", "-", f"{s['seconds']:.1f} ({s['seconds_per_image']:.3f}/image)"))
    attack, setting, acc, only, seconds = zip(*rows)
    console = Console()
    console.print(FitTable([Column("attack", attack, name=True), Column("setting", setting, wrap=True), number("accuracy %", acc),
                            number("only it broke", only, drop=1), number("seconds", seconds, drop=2)],
                           title=f"{res['model']} on {res['data']} (val, n={s['n']}), suite at eps {255 * s['eps']:.3g}/255"))
    if "checks" in res:
        for line in res["checks"]["lines"]:
            echo(line, console, indent="  ")
        echo("masking checks: " + ("all passed" if res["checks"]["passed"] else "FAILED (robust accuracy not to be trusted)"), console)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from efficient.profiler.console import Column, FitTable, echo, number

    res = evaluate(args)
    saved = record_in_run(args, res)
    if args.format == "json":
        print(json.dumps(res, indent=2))
        return 0
    console = Console()
    if "suite" in res:
        _print_suite(res)
    else:
        rows = [("clean", "-", "-", "-", f"{100 * res['clean']:.2f}")]
        for r in res["attacks"]:
            step = "adaptive" if r["alpha"] is None else f"{255 * r['alpha']:.3g}/255"
            rows.append((r["attack"], f"{255 * r['eps']:.3g}/255", str(r["steps"]), step, f"{100 * r['acc']:.2f}"))
        attack, eps, steps, step, acc = zip(*rows)
        console.print(FitTable([Column("attack", attack, name=True), number("eps", eps), number("steps", steps, drop=1),
                                number("step size", step, drop=1), number("accuracy %", acc)],
                               title=f"{res['model']} on {res['data']} (val, n={res['n']})"))
    if saved is not None:
        echo(f"recorded in {saved} (shown by `efficient report {args.target}`)", console)
    return 0
