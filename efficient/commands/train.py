"""Train a recipe: `efficient train RECIPE.yaml [key.path=value ...] [--out DIR] [--resume RUN_DIR]`."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="recipe YAML (omit with --resume)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, typed like YAML scalars (e.g. optim.lr=1e-3)")
    p.add_argument("--out", help="run directory (default: <train.out_dir>/<recipe name>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run exactly where its last checkpoint stopped")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="train with N processes on this machine (DistributedDataParallel, or the layout of train.parallel: "
                        "pipeline stages x data-parallel replicas, or FSDP2; data.batch_size is the global batch)")


def default_run_dir(out_dir: str, recipe_path: str) -> Path:
    return Path(out_dir) / f"{Path(recipe_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def run(args: argparse.Namespace) -> int:
    from efficient.config import load_recipe
    from efficient.errors import ConfigError
    from efficient.train.engine import Trainer

    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").exists():
            raise ConfigError(f"--resume {run_dir}: not a run dir (no config.yaml)")
        overrides = ([args.recipe] if args.recipe and "=" in args.recipe else []) + list(args.overrides)
        recipe = load_recipe(run_dir / "config.yaml", overrides)
    else:
        if not args.recipe:
            raise ConfigError("give a recipe YAML (e.g. efficient train recipes/stata_digits.yaml) or --resume RUN_DIR")
        recipe = load_recipe(args.recipe, args.overrides)
        run_dir = Path(args.out) if args.out else default_run_dir(recipe.train.out_dir, args.recipe)
        if (run_dir / "checkpoint").exists():
            raise ConfigError(f"--out {run_dir} already holds a run; pick another directory or continue it with --resume {run_dir}")
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    if recipe.train.optimizer_in_backward:  # one process only: refused before any process starts
        from efficient.config import check_optimizer_in_backward

        check_optimizer_in_backward(recipe, int(os.environ.get("WORLD_SIZE", args.nproc)), recipe.train.parallel.enabled)
    if recipe.train.parallel.enabled:
        from efficient.config import check_parallel

        # the process layout fails here, before any process starts
        world = int(os.environ.get("WORLD_SIZE", args.nproc))
        check_parallel(recipe, world)
        if args.resume:
            from efficient.train.checkpoint import find_resumable
            from efficient.train.parallel import check_resume_layout

            check_resume_layout(find_resumable(run_dir), recipe, world)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from efficient.train.distributed import launch

        if not recipe.train.parallel.enabled:  # plain DDP: every process takes an equal share
            from efficient.config import check_global_batch

            check_global_batch(recipe, args.nproc)  # before any process starts

        argv = ["train", "--resume", str(run_dir), *args.overrides] if args.resume else ["train", args.recipe, *args.overrides, "--out", str(run_dir)]
        return launch(args.nproc, argv)
    if recipe.train.parallel.enabled:
        from efficient.train.parallel import ParallelTrainer

        trainer: Trainer = ParallelTrainer(recipe, run_dir, resume=bool(args.resume))
    else:
        trainer = Trainer(recipe, run_dir, resume=bool(args.resume))
    from efficient.train.distributed import cleanup

    try:
        summary = trainer.fit()
        if trainer.dist.is_main:
            print_summary(trainer.console, summary, trainer.run_dir)
    finally:
        cleanup(trainer.dist)
    return 0


def print_summary(console, summary: dict, run_dir: Path) -> None:
    from efficient.profiler.console import Column, FitTable, echo, number

    rows = [(f"val {k}", f"{v:.4f}") for k, v in summary["val"].items()]
    rows += [("train time", f"{summary['train_time_s']:.1f} s"), ("params", f"{summary['params']:,}")]
    cost = summary.get("cost") or {}
    n = cost.get("batch_size") or 1  # the profiler counts the whole profiled batch
    for key, label, scale, unit in (
        ("dense_macs", "dense MACs / sample", 1e6, "M"),
        ("macs", "MACs / sample", 1e6, "M"),
        ("sops", "SOPs / sample", 1e6, "M"),
        ("energy_pj", "energy / sample", 1e6, "uJ"),
    ):
        if key in cost:
            rows.append((label, f"{cost[key] / n / scale:.3f} {unit}"))
    if "mean_firing_rate" in cost:
        rows.append(("mean firing rate", f"{cost['mean_firing_rate']:.4f}"))
    console.print(FitTable([Column("metric", [k for k, _ in rows], name=True), number("value", [v for _, v in rows])],
                           title=f"{summary['model']} -> {run_dir}"))
    if (run_dir / "report.html").exists():
        echo(f"report: {run_dir / 'report.html'} (plots, costs, recipe; `efficient report {run_dir} --open`)", console)
