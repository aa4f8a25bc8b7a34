"""Subcommands of the `efficient` CLI, one module each."""
