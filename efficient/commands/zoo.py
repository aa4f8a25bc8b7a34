"""List the model zoo (`efficient zoo [PATTERN]`) or show one entry (`efficient zoo show NAME`)."""

from __future__ import annotations

import argparse
import json
import re


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="PATTERN | show NAME", help="glob pattern, or `show NAME`")
    p.add_argument("--format", choices=["table", "json"], default="table")


def run(args: argparse.Namespace) -> int:
    from rich import box
    from rich.console import Console

    from efficient import zoo
    from efficient.errors import ConfigError
    from efficient.profiler.console import Column, FitTable, echo, number

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
        rows = [("description", entry.description), ("paper", entry.paper), ("params", f"{info['params']:,}"),
                ("input", entry.input_spec.describe())]
        rows += [(f"config.{k}", str(v)) for k, v in info["config"].items()]
        console.print(FitTable([Column("key", [k for k, _ in rows], name=True),
                                Column("value", [v for _, v in rows], wrap=True, min_width=24)],
                               title=entry.name, table=dict(show_header=False, box=box.SQUARE)))
        for tag, w in entry.weights().items():  # commands and paths wrap at spaces only, so they copy whole
            echo(f"{w.summary()} ({w.dtype}, sha256 {w.sha256[:12]}...)", console, head=f"weights {tag}: ", head_style="bold",
                 indent="  ")
            echo(w.command, console, head="  trained by: ", indent="    ")
            echo(", ".join(f"{k}={v}" for k, v in w.config.items()), console, head="  options: ", indent="    ")
        return 0
    pattern = args.args[0] if args.args else None
    names = zoo.list_models(pattern)
    rows = [(n, zoo.meta_param_count(n), zoo.get_entry(n)) for n in names]
    if args.format == "json":
        print(json.dumps([{"name": n, "params": p, "input": e.input_spec.describe(), "paper": e.paper,
                           "weights": {t: {"dataset": w.dataset, "metrics": w.metrics} for t, w in e.weights().items()}}
                          for n, p, e in rows], indent=2))
        return 0
    weights = [list(e.weights().values()) for _, _, e in rows]
    full = ["; ".join(w.summary() if w.tag == w.dataset else f"{w.tag} ({w.summary()})" for w in ws) or "-" for ws in weights]
    tags = [", ".join(w.tag for w in ws) or "-" for ws in weights]
    count = [str(len(ws)) if ws else "-" for ws in weights]
    console.print(FitTable([
        Column("name", [n for n, _, _ in rows], name=True),
        number("params", [f"{p / 1e6:.2f}M" for _, p, _ in rows]),
        Column("input", [e.input_spec.describe() for _, _, e in rows]),
        Column("weights", full, drop=2, shorter=Column("weights", tags, drop=1, shorter=Column(
            "weights", count, justify="right", note="weights: number of shipped weight sets"))),
        Column("paper", [short_citation(e.paper) for _, _, e in rows], wrap=True, min_width=16),
    ], title="efficient model zoo", caption="full citation, weights and options: `efficient zoo show NAME`"))
    return 0


_CITATION = re.compile(r"\((?P<authors>[^()]+?),\s*(?:(?P<venue>[^(),]*?)\s+)?(?P<year>(?:19|20)\d\d)\)\s*$")


def short_citation(paper: str) -> str:
    """'Title (Zhou et al., ICLR 2023)' -> "Zhou+ ICLR'23"; a single author keeps no '+'. A paper
    string of another form is returned as it is ('-' when empty)."""
    m = _CITATION.search(paper or "")
    if not m:
        return (paper or "").strip() or "-"
    authors = m["authors"].strip()
    first = re.split(r"\s*(?:,|&|\band\b|\bet al\b)", authors, maxsplit=1)[0].split()
    many = len(first) < len(authors.split()) or "&" in authors
    name = (first[-1] if first else authors) + ("+" if many else "")
    venue = (m["venue"] or "").strip()
    return f"{name} {venue}'{m['year'][2:]}" if venue else f"{name} '{m['year'][2:]}"
