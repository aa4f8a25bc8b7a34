"""How training progress reaches the components that depend on it (a keep-ratio warm-up, say).

A component opts in by subclassing `TracksProgress`; the trainer calls `inform_progress(model,
epoch)` before every step, which finds every such component by walking the model's modules
(through DDP and compile wrappers). One protocol, no per-model hooks to look for.
"""

from __future__ import annotations

from torch import nn


class TracksProgress:
    """Mixin for modules whose behaviour follows training progress."""

    def set_progress(self, epoch: float) -> None:
        """Training progress in (fractional) epochs: 1.5 is half-way through the second epoch."""
        raise NotImplementedError


def inform_progress(model: nn.Module, epoch: float) -> int:
    """Tell every `TracksProgress` module of `model` the current (fractional) epoch; returns how many."""
    told = 0
    for m in model.modules():
        if isinstance(m, TracksProgress):
            m.set_progress(epoch)
            told += 1
    return told
