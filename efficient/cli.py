"""The `efficient` command: parses arguments and hands them to one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# name -> module defining `add_arguments(parser)` and `run(args) -> int`; its docstring is the help.
SUBCOMMANDS: dict[str, str] = {
    "train": "efficient.commands.train",
    "eval": "efficient.commands.evaluate",
    "validate": "efficient.commands.validate",
    "zoo": "efficient.commands.zoo",
    "profile": "efficient.commands.profile",
    "check": "efficient.commands.check",
    "generate": "efficient.commands.generate",
    "attack": "efficient.commands.attack",
    "merge": "efficient.commands.merge",
    "export": "efficient.commands.export",
    "import": "efficient.commands.nir_import",
    "report": "efficient.commands.report",
}


class _NoCudaRuntimeNotice(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." line, which
    `torch.utils.cpp_extension` logs on import (when inductor first compiles our CPU kernels) on any
    machine with a CUDA toolkit but no GPU: nothing to act on for a CPU run. Other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def build_parser() -> argparse.ArgumentParser:
    from efficient import __version__

    parser = argparse.ArgumentParser(
        prog="efficient",
        description="Neuromorphic and efficient models: train recipes, browse the zoo, profile costs.",
    )
    parser.add_argument("--version", action="version", version=f"efficient {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in SUBCOMMANDS.items():
        mod = importlib.import_module(modname)
        doc = (mod.__doc__ or "").strip().splitlines()
        p = sub.add_parser(name, help=doc[0] if doc else None, description=(mod.__doc__ or "").strip())
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from efficient.errors import ConfigError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may come after options (`train x.yaml --out d a.b=1`)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides or []) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    notice_filter = _NoCudaRuntimeNotice()
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    cpp_logger.addFilter(notice_filter)
    try:
        return int(args._run(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        if os.environ.get("EFFICIENT_DEBUG"):
            raise
        return 2
    except KeyboardInterrupt as e:
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        return 130
    finally:
        cpp_logger.removeFilter(notice_filter)


if __name__ == "__main__":
    sys.exit(main())
