"""Subcommands of the `efficient` CLI, one module each."""


def print_values(title: str, values: dict[str, float], key: str, value: str) -> None:
    """A two-column rich table of named numbers (4 decimals), as eval and merge print them."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column(key)
    table.add_column(value, justify="right")
    for k, v in values.items():
        table.add_row(k, f"{v:.4f}")
    Console().print(table)
