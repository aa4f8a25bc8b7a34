"""Whether the running forward is a replay: activation recomputation (`efficient.memory`'s
`recompute` level) reruns a unit in backward, and what that rerun records about itself (STATA's
scores, kept indices and counts) was already recorded by the forward it repeats."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_state = threading.local()


def replaying() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def replay() -> Iterator[None]:
    """Mark the code inside as a replay of a forward that already ran."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
