"""Checkpoints: weights as safetensors, trainer state (optimizer, scheduler, RNG, progress) apart.

Each checkpoint is written into a fresh temp directory with checksums, then swapped in with
renames (`last` -> `previous`, temp -> `last`), so a kill at any moment leaves an intact
checkpoint, and a corrupted `last` (disk full, truncation) falls back to `previous`.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from efficient.errors import ArtifactError, ConfigError
from efficient.io import read_json, read_torch, sha256_file as _sha256, write_json
from efficient.zoo import save_model

MODEL_FILE, STATE_FILE, META_FILE = "model.safetensors", "trainer.pt", "meta.json"
PREVIOUS = {"last": "previous"}  # checkpoints that keep their predecessor


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), *n[2:]))


def save_checkpoint(directory: Path, model: nn.Module, trainer_state: dict[str, Any] | None, meta: dict[str, Any]) -> None:
    """Write `directory` (e.g. run/checkpoint/last) atomically: temp dir, checksums, rename swap."""
    tmp = begin_checkpoint(directory)
    save_model(model, tmp / MODEL_FILE)
    if trainer_state is not None:
        torch.save(trainer_state, tmp / STATE_FILE)
    commit_checkpoint(tmp, directory, meta)


def begin_checkpoint(directory: Path) -> Path:
    """A fresh, empty temp directory beside `directory` for the files of its next version."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit_checkpoint(tmp: Path, directory: Path, meta: dict[str, Any]) -> None:
    """Checksum every file in `tmp` into meta.json, fsync, and swap `tmp` in for `directory`
    (`last` keeps its predecessor as `previous`)."""
    directory = Path(directory)
    parent = directory.parent
    files = sorted(f.name for f in tmp.iterdir() if f.is_file() and f.name != META_FILE)
    meta = {**meta, "sha256": {f: _sha256(tmp / f) for f in files}}
    write_json(tmp / META_FILE, meta)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    prev = parent / PREVIOUS[directory.name] if directory.name in PREVIOUS else None
    if directory.exists():
        if prev is not None:
            if prev.exists():
                shutil.rmtree(prev)
            os.replace(directory, prev)
        else:
            shutil.rmtree(directory)
    os.replace(tmp, directory)


def verify(directory: Path) -> bool:
    meta_file = directory / META_FILE
    if not meta_file.exists():
        return False
    try:
        sums = read_json(meta_file, "checkpoint meta.json").get("sha256")
        if not isinstance(sums, dict) or not sums:
            return False
        return all(isinstance(f, str) and "/" not in f and (directory / f).is_file() and _sha256(directory / f) == h for f, h in sums.items())
    except (ConfigError, OSError):
        return False


def find_resumable(run_dir: Path) -> Path:
    """The newest verified checkpoint of a run: `last`, else `previous` (corrupted or mid-swap `last`)."""
    ck = Path(run_dir) / "checkpoint"
    candidates = [ck / "last", ck / "previous"]
    for c in candidates:
        if c.exists() and (c / STATE_FILE).exists():
            if verify(c):
                return c
            warnings.warn(f"checkpoint {c} is incomplete or corrupted (checksum mismatch); falling back to the previous one", stacklevel=2)
    raise ConfigError(f"{run_dir}: no intact checkpoint to resume from (looked in {ck}/last)")


def load_trainer_state(directory: Path, keys: tuple[str, ...] = ("optimizer", "scheduler", "rng", "progress")) -> dict[str, Any]:
    """The optimizer/scheduler/RNG/progress dict of a checkpoint (tensors and plain data only);
    `keys` are the entries it must have."""
    f = Path(directory) / STATE_FILE
    st = read_torch(f)
    missing = [k for k in keys if not isinstance(st, dict) or k not in st]
    if missing:
        raise ArtifactError(f"{f}: not a trainer state of efficient (missing {', '.join(missing)}); resume from a run dir written by `efficient train`, or start a fresh run")
    return st
