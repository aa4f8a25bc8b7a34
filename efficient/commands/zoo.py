"""List the model zoo (`efficient zoo [PATTERN]`) or show one entry (`efficient zoo show NAME`)."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="PATTERN | show NAME", help="glob pattern, or `show NAME`")
    p.add_argument("--format", choices=["table", "json"], default="table")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from efficient import zoo
    from efficient.errors import ConfigError

    console = Console()
    if args.args and args.args[0] == "show":
        if len(args.args) != 2:
            raise ConfigError("usage: efficient zoo show NAME")
        entry = zoo.get_entry(args.args[1])
        info = zoo.entry_summary(entry)
        info["params"] = zoo.meta_param_count(entry.name)
        if args.format == "json":
            print(json.dumps(info, indent=2, default=str))
            return 0
        table = Table(title=entry.name, show_header=False)
        table.add_row("description", entry.description)
        table.add_row("paper", entry.paper)
        table.add_row("params", f"{info['params']:,}")
        table.add_row("input", entry.input_spec.describe())
        for k, v in info["config"].items():
            table.add_row(f"config.{k}", str(v))
        for tag, w in entry.weights().items():
            table.add_row(f"weights.{tag}", f"{w.summary()} ({w.dtype}, sha256 {w.sha256[:12]}...): {w.command}")
            table.add_row(f"weights.{tag}.options", ", ".join(f"{k}={v}" for k, v in w.config.items()))
        console.print(table)
        return 0
    pattern = args.args[0] if args.args else None
    names = zoo.list_models(pattern)
    rows = [(n, zoo.meta_param_count(n), zoo.get_entry(n)) for n in names]
    if args.format == "json":
        print(json.dumps([{"name": n, "params": p, "input": e.input_spec.describe(), "paper": e.paper,
                           "weights": {t: {"dataset": w.dataset, "metrics": w.metrics} for t, w in e.weights().items()}}
                          for n, p, e in rows], indent=2))
        return 0
    table = Table(title="efficient model zoo")
    for col in ("name", "params", "input", "weights", "paper"):
        table.add_column(col, justify="right" if col == "params" else "left")
    for n, p, e in rows:
        weights = "; ".join(w.summary() if w.tag == w.dataset else f"{w.tag} ({w.summary()})" for w in e.weights().values())
        table.add_row(n, f"{p / 1e6:.2f}M", e.input_spec.describe(), weights or "-", e.paper)
    console.print(table)
    return 0
