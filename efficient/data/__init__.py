"""Datasets chosen by name in a recipe's `data.name`. A builder returns a `DataBundle`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset

from efficient.errors import ConfigError, did_you_mean

# Keys of `data` handled by the engine's loaders, not by the dataset builder (with their types and defaults).
DATA_LOADER_KEYS: dict[str, Any] = {"batch_size": int, "eval_batch_size": Optional[int], "num_workers": int}
DATA_LOADER_DEFAULTS: dict[str, Any] = {"batch_size": 64, "eval_batch_size": None, "num_workers": 0}

DATA_MODULES = ["efficient.data.vision", "efficient.data.text", "efficient.data.preferences", "efficient.data.pu", "efficient.data.ssl",
                "efficient.data.events", "efficient.data.cluttered"]


@dataclass
class DataBundle:
    """Train and validation splits plus what a model needs to know about them."""

    train: Dataset
    val: Dataset
    task: str  # "classification" | "lm" | ...
    num_classes: int | None = None
    input_shape: tuple[int, ...] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


_DATASETS: dict[str, Callable[..., DataBundle]] = {}
_loaded = False


def register_dataset(name: str) -> Callable[[Callable[..., DataBundle]], Callable[..., DataBundle]]:
    def deco(fn: Callable[..., DataBundle]) -> Callable[..., DataBundle]:
        if name in _DATASETS:
            raise ValueError(f"dataset {name!r} registered twice")
        _DATASETS[name] = fn
        return fn

    return deco


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for m in DATA_MODULES:
            importlib.import_module(m)


def list_datasets() -> list[str]:
    _ensure_loaded()
    return sorted(_DATASETS)


def get_dataset_builder(name: str) -> Callable[..., DataBundle]:
    _ensure_loaded()
    if name not in _DATASETS:
        raise ConfigError(f"unknown dataset {name!r}.{did_you_mean(name, _DATASETS)} Available: {', '.join(sorted(_DATASETS))}.")
    return _DATASETS[name]


def build_data(cfg: dict[str, Any]) -> DataBundle:
    """Build from a validated `data` section (loader keys are ignored here)."""
    kwargs = {k: v for k, v in cfg.items() if k != "name" and k not in DATA_LOADER_KEYS}
    return get_dataset_builder(cfg["name"])(**kwargs)


def first_input(batch: Any) -> Any:
    """The model input of a data batch: the tensor itself, the first of an (inputs, targets) pair, or
    the input entry of a dict batch."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        for k in ("input", "inputs", "x", "input_ids", "image", "images"):
            if k in batch:
                return batch[k]
        raise ConfigError(f"data batch is a dict with keys {sorted(batch)}; expected one of input/inputs/x/input_ids/image")
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    raise ConfigError(f"data batches must be tensors, (inputs, targets) pairs or dicts; got {type(batch).__name__}")
