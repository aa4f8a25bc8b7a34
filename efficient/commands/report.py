"""Write a run's HTML report: `efficient report RUN_DIR [RUN_DIR_B] [-o FILE] [--open]`.

One run: RUN_DIR/report.html (training writes it too) with curves, learning rate, per-layer energy,
SOPs and firing rates, tokens per block (STATA), exits (early-exit models), robust accuracy (after
`efficient attack RUN_DIR`), the resolved recipe and the environment. Two runs: one page with both
side by side (curves overlaid, costs compared), by default report-A-vs-B.html here. The page is one
self-contained file: plots are inline SVG and nothing is fetched from the network.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one run dir, or two to compare")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="where to write the page (default: RUN_DIR/report.html; for two runs report-A-vs-B.html here)")
    p.add_argument("--open", action="store_true", help="open the page in the default web browser")


def run(args: argparse.Namespace) -> int:
    from efficient.errors import ConfigError
    from efficient.profiler.console import echo
    from efficient.report.html import write_comparison, write_run_report
    from efficient.report.rundata import load_run

    if len(args.runs) > 2:
        raise ConfigError(f"efficient report takes one run dir, or two to compare; got {len(args.runs)}: {' '.join(args.runs)}")
    if len(args.runs) == 1:
        path = write_run_report(args.runs[0], args.output)
    else:
        a, b = (load_run(r).name for r in args.runs)  # fails early, naming a path that is no run dir
        path = write_comparison(args.runs[0], args.runs[1], args.output or f"report-{a}-vs-{b}.html")
    echo(f"report written to {path}")
    if args.open:
        import webbrowser

        if not webbrowser.open(path.resolve().as_uri()):
            echo(f"no web browser could be started here; open {path} in one")
    return 0
