"""The one error type users see for bad input: it names the file, the key and what to do."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad recipe, bad argument or bad artifact. The CLI prints its message without a traceback."""


class DataError(ConfigError):
    """A dataset that cannot be found or read; the message says where we looked."""
