"""Training objectives, chosen by `objective.name` in a recipe; one file per method.

An objective turns (model, batch) into a loss and logged scalars, and a validation batch into
summed metrics. The engine knows nothing else about it, so methods plug in without touching it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
from torch import nn

from efficient.errors import ConfigError, did_you_mean

OBJECTIVE_MODULES = ["efficient.objectives.classification", "efficient.objectives.lm", "efficient.objectives.preference", "efficient.objectives.weak_to_strong", "efficient.objectives.pu", "efficient.objectives.interlude", "efficient.objectives.odin", "efficient.objectives.exits", "efficient.objectives.stability", "efficient.objectives.stata"]


class Objective:
    """Base class. Subclasses take their recipe options as typed keyword arguments."""

    primary_metric: str = "acc"  # key of `evaluate` used to pick the best checkpoint
    higher_is_better: bool = True

    def setup(self, model: nn.Module, data: Any, recipe: Any) -> None:
        """Called once before training with the built model, the DataBundle and the Recipe."""

    def set_progress(self, epoch: float, step: int) -> None:
        """Called before every step; `epoch` is fractional (e.g. 2.5 = half-way through epoch 3)."""
        self.epoch, self.step = epoch, step

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        """The loss and what to log of it. Logged tensors stay on the device (detached, 0-d): the
        trainer reads them once per log interval, so a step never waits for the host."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        """Summed metrics over the batch, with the sample count under "n"."""
        raise NotImplementedError


_OBJECTIVES: dict[str, type[Objective]] = {}
_loaded = False


def register_objective(name: str) -> Callable[[type[Objective]], type[Objective]]:
    def deco(cls: type[Objective]) -> type[Objective]:
        if name in _OBJECTIVES:
            raise ValueError(f"objective {name!r} registered twice")
        _OBJECTIVES[name] = cls
        return cls

    return deco


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for m in OBJECTIVE_MODULES:
            importlib.import_module(m)


def list_objectives() -> list[str]:
    _ensure_loaded()
    return sorted(_OBJECTIVES)


def get_objective(name: str) -> type[Objective]:
    _ensure_loaded()
    if name not in _OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}.{did_you_mean(name, _OBJECTIVES)} Available: {', '.join(sorted(_OBJECTIVES))}.")
    return _OBJECTIVES[name]


def build_objective(cfg: dict[str, Any]) -> Objective:
    return get_objective(cfg["name"])(**{k: v for k, v in cfg.items() if k != "name"})
