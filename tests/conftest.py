"""Shared fixtures: tiny recipes that train in seconds on 2 CPU cores."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

TINY_RECIPE = """
model:
  name: spikformer-tiny
  embed_dim: 16
  depth: 1
  num_heads: 2
  timesteps: 2
data:
  name: synthetic
  num_samples: 48
  num_classes: 3
  shape: [1, 16, 16]
  batch_size: 8
objective:
  name: classification
optim:
  name: adamw
  lr: 0.01
schedule:
  name: cosine
  warmup_epochs: 0.5
train:
  epochs: 2
  seed: 0
  threads: 1
  log_every: 1
  progress: false
profile:
  enabled: false
"""


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY_RECIPE)
    return p


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    np.random.seed(0)


def write_fake_cifar(root: Path, n_train: int = 20, n_test: int = 10, classes: int = 10, name: str = "cifar10") -> Path:
    """A tiny CIFAR in torchvision's on-disk pickle format, so the real loader code runs."""
    rng = np.random.default_rng(0)
    if name == "cifar10":
        base = root / "cifar-10-batches-py"
        base.mkdir(parents=True)
        label_key = "labels"
        files = {"data_batch_%d" % i: n_train // 5 for i in range(1, 6)} | {"test_batch": n_test}
        meta_file, meta = "batches.meta", {"label_names": [f"c{i}" for i in range(classes)]}
    else:
        base = root / "cifar-100-python"
        base.mkdir(parents=True)
        label_key = "fine_labels"
        files = {"train": n_train, "test": n_test}
        meta_file, meta = "meta", {"fine_label_names": [f"c{i}" for i in range(classes)]}
    for fname, n in files.items():
        d = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), label_key: rng.integers(0, classes, n).tolist()}
        with open(base / fname, "wb") as f:
            pickle.dump(d, f)
    with open(base / meta_file, "wb") as f:
        pickle.dump(meta, f)
    return base


@pytest.fixture
def fake_cifar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a tiny CIFAR-10/100 and point torchvision's integrity check at its checksums."""
    import hashlib

    import torchvision

    def make(name: str = "cifar10") -> Path:
        root = tmp_path / "data"
        base = write_fake_cifar(root, name=name, classes=10 if name == "cifar10" else 100)
        cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
        md5 = lambda f: hashlib.md5((base / f).read_bytes()).hexdigest()  # noqa: E731
        monkeypatch.setattr(cls, "train_list", [[f, md5(f)] for f, _ in cls.train_list])
        monkeypatch.setattr(cls, "test_list", [[f, md5(f)] for f, _ in cls.test_list])
        monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5(cls.meta["filename"])})
        return root

    return make


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny ops (on 2 shared cores thread hand-offs cost more than
    the math); modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
