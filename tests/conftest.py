"""Shared fixtures: tiny recipes that train in seconds on 2 CPU cores, and the settings that make
the suite behave the same on every machine (see tests/README.md)."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Inductor's compiled-kernel cache is keyed without ATEN_CPU_CAPABILITY, yet the C++ it caches was
# generated for one SIMD level: a cache filled natively then read under ATEN_CPU_CAPABILITY=default
# fails to compile ("'at::vec' has not been declared"). Runs under a forced capability get a cache
# of their own (set before torch is imported; subprocesses inherit it).
_CAPABILITY = "-".join(os.environ.get(k, "") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")).strip("-")
if _CAPABILITY and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor-efficient-{_CAPABILITY.lower()}")
# rich wraps tables to the terminal: a narrow COLUMNS would split the cells tests read
os.environ["COLUMNS"] = "200"

import torch  # noqa: E402

# Under pytest-xdist every worker is a process of its own: share the cores between them instead of
# each starting a thread per core (oversubscribed threads make every op slower).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from efficient.kernels._backend import have_cxx_compiler  # noqa: E402

# Tests that compile with inductor on CPU need a C++ compiler; without one they skip, saying so.
needs_cxx = pytest.mark.skipif(not have_cxx_compiler(), reason="no C++ compiler (g++/clang++): inductor cannot compile on CPU")

from efficient.memory.recompute import budget_supported  # noqa: E402

# Memory budgets (kept matmul/convolution outputs) need torch's checkpoint to pass them to saved-tensor hooks.
needs_budget = pytest.mark.skipif(not budget_supported(), reason=f"torch {torch.__version__}: torch.utils.checkpoint has no "
                                  "respect_saved_tensors_hooks, which memory budgets need (they raise a ConfigError)")

try:  # property tests draw the same examples on every machine and keep no local database
    from hypothesis import settings

    settings.register_profile("portable", derandomize=True, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "portable"))
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    pass

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


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    """Undo what a test (or the trainer it runs in-process) sets globally: the thread count and
    deterministic-algorithm mode, so no test depends on which tests ran before it."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    dtype = torch.get_default_dtype()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_default_dtype(dtype)


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
