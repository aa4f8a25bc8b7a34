"""Check a model for the bugs that corrupt accuracy and firing statistics (`efficient check MODEL`).

MODEL is a zoo name, a run dir or a .safetensors checkpoint. Each check prints PASS, FAIL or SKIP
with its number; the exit code is 1 when any check fails. The checks: batch independence (a
sample's output does not depend on the rest of its batch), state reset between calls, time
causality, silent / saturated spiking layers (on real data only), dead surrogate gradients, and
binary spikes (what the op after a spiking layer reads is 0 or 1). Examples:

    efficient check spikformer-tiny                      # fresh weights, random inputs
    efficient check spikformer-tiny --pretrained         # shipped weights, on their validation data
    efficient check runs/stata --format json             # a run, on its own validation data
    efficient check spikformer-tiny --data digits --only rates,binary

`efficient.check(model, example)` runs the same checks on any module from Python (spikingjelly and
snntorch models included; pass `reset=` for what runs between their forwards).
"""

from __future__ import annotations

import argparse
import json
import sys

from efficient.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="zoo name, run dir or .safetensors checkpoint")
    p.add_argument("--pretrained", metavar="SOURCE", nargs="?", const=True,
                   help="zoo names: the shipped weights (no value), a tag of them, a run dir, .safetensors file or URL")
    p.add_argument("--checkpoint", choices=("last", "best"), default="last", help="weights of a run dir (default last)")
    p.add_argument("--data", metavar="SOURCE",
                   help="inputs: 'val' (a run's validation data, or that of shipped weights; the default for them), "
                        "'random' (the default otherwise; the rates check is skipped), or a dataset name / recipe YAML")
    p.add_argument("--batch", type=int, default=8, metavar="N", help="samples of data used (default 8)")
    p.add_argument("--only", metavar="IDS", help="comma-separated checks to run: batch, state, causality, rates, surrogate, binary")
    p.add_argument("--rtol", type=float, metavar="R", help="relative change counted as a dependence (default 1e-4)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("-o", "--output", metavar="FILE", help="write the json output to FILE instead of stdout")


def run(args: argparse.Namespace) -> int:
    from efficient.checks import CHECKS, RTOL, check

    if args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    if args.rtol is not None and not args.rtol > 0:
        raise ConfigError(f"--rtol must be a positive number, got {args.rtol}")
    if args.output and args.format != "json":
        raise ConfigError("-o/--output writes the json output; add --format json")
    only = None
    if args.only is not None:
        only = [c.strip() for c in args.only.split(",") if c.strip()]
        if not only:
            raise ConfigError(f"--only {args.only!r}: name one or more of {', '.join(CHECKS)}, comma-separated")
    report = check(args.model, only=only, pretrained=args.pretrained, checkpoint=args.checkpoint, data=args.data,
                   batch=args.batch, rtol=args.rtol if args.rtol is not None else RTOL)
    code = 0 if report.passed else 1
    if args.format == "json":
        text = json.dumps(report.to_dict(), indent=2) + "\n"
        if args.output:
            from efficient.io import write_text

            write_text(args.output, text)
        else:
            sys.stdout.write(text)
        return code
    from rich.console import Console

    from efficient.profiler.console import echo

    console = Console()
    for table in report.tables():
        console.print(table)
    failed = [r.name for r in report.failed]
    echo(f"{len(failed)} of {len(report.results)} checks failed: {', '.join(failed)}" if failed else
         f"no check failed ({sum(r.status == 'PASS' for r in report.results)} passed, "
         f"{sum(r.status == 'SKIP' for r in report.results)} skipped)", console)
    return code
