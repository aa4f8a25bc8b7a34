"""Subcommands of the `efficient` CLI, one module each."""


def print_values(title: str, values: dict[str, float], key: str, value: str) -> None:
    """A two-column rich table of named numbers (4 decimals), as eval and merge print them; the
    names stay whole and the table fits the console width."""
    from rich.console import Console

    from efficient.profiler.console import Column, FitTable, number

    Console().print(FitTable([Column(key, list(values), name=True), number(value, [f"{v:.4f}" for v in values.values()])],
                             title=title))
