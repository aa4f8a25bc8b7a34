"""The one error type users see for bad input: it names the file, the key and what to do."""

from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(ValueError):
    """Bad recipe, bad argument or bad artifact. The CLI prints its message without a traceback."""


class DataError(ConfigError):
    """A dataset that cannot be found or read; the message says where we looked."""


class ArtifactError(ConfigError):
    """A weights file, run dir or checkpoint that cannot be used (missing, empty, truncated,
    corrupted, or written for another model). The message names the file, says what is wrong
    with it and what to do instead."""


def did_you_mean(key: str, valid: Iterable[str]) -> str:
    """The hint ` Did you mean 'x'?` for the closest valid name (empty if none is close), to end an error message."""
    hint = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" Did you mean {hint[0]!r}?" if hint else ""


def closest(name: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Up to `n` of `choices` that look like `name`, best first (for "did you mean" hints)."""
    return difflib.get_close_matches(name, list(choices), n=n, cutoff=0.4)
