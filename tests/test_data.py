"""Each dataset through its real loading code: digits, CIFAR (fake on-disk copy), folders, text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from efficient.data import build_data, get_dataset_builder
from efficient.errors import DataError


def test_digits_is_deterministic_stratified_and_upsampled() -> None:
    a = build_data({"name": "digits", "image_size": 16})
    b = build_data({"name": "digits", "image_size": 16})
    assert len(a.train) + len(a.val) == 1797 and abs(len(a.val) - 360) <= 1
    x, y = a.train[0]
    assert x.shape == (1, 16, 16) and 0 <= y < 10
    assert torch.equal(a.train[5][0], b.train[5][0])
    labels = torch.tensor([a.val[i][1] for i in range(len(a.val))])
    assert labels.bincount(minlength=10).min() >= 30  # stratified: every class present in val
    raw = build_data({"name": "digits", "image_size": 8, "normalize": False})
    x8, _ = raw.train[0]
    assert x8.min() >= 0 and x8.max() <= 1


def test_digits_binary_task() -> None:
    d = build_data({"name": "digits", "binary_positive": [0, 2, 4, 6, 8]})
    assert d.num_classes == 2
    ys = {d.train[i][1] for i in range(50)}
    assert ys == {0, 1}


@pytest.mark.parametrize("name,classes", [("cifar10", 10), ("cifar100", 100)])
def test_cifar_reads_torchvision_on_disk_format(fake_cifar, name: str, classes: int) -> None:
    root = fake_cifar(name)
    d = build_data({"name": name, "root": str(root), "augment": "spikformer"})
    assert len(d.train) == 20 and len(d.val) == 10 and d.num_classes == classes
    x, y = d.train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < classes
    xv, _ = get_dataset_builder(name)(root=str(root), augment="none", normalize=False).val[0]
    assert 0 <= xv.min() and xv.max() <= 1


def test_cifar_missing_offline_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(DataError) as e:
        build_data({"name": "cifar10", "root": str(tmp_path / "nowhere")})
    msg = str(e.value)
    assert "cifar-10-batches-py" in msg and "nowhere" in msg and "stata_digits.yaml" in msg


def test_imagefolder(tmp_path: Path) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (40, 40), (i * 100, 50, 200)).save(tmp_path / split / c / f"{i}.png")
    d = build_data({"name": "imagefolder", "root": str(tmp_path), "image_size": 32})
    assert d.num_classes == 2 and len(d.train) == 4
    assert d.val[0][0].shape == (3, 32, 32)
    with pytest.raises(DataError, match="is not a directory"):
        build_data({"name": "imagefolder", "root": str(tmp_path / "missing")})


def test_text_default_corpus_and_files(tmp_path: Path) -> None:
    d = build_data({"name": "text", "seq_len": 32})
    x, y = d.train[3]
    assert x.shape == (32,) and x.dtype == torch.long and torch.equal(x[1:], y[:-1])
    assert d.meta["bytes"] > 100_000 and d.num_classes == 256
    f = tmp_path / "a.txt"
    f.write_text("héllo wörld " * 50, encoding="utf-8")
    d2 = build_data({"name": "text", "files": [str(f)], "seq_len": 16})
    assert len(d2.train) > 0
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc\xff\xfe" * 100)
    with pytest.raises(DataError, match="not UTF-8"):
        build_data({"name": "text", "files": [str(bad)], "seq_len": 8})
    with pytest.raises(DataError, match="no file matches"):
        build_data({"name": "text", "files": [str(tmp_path / "*.md")]})


def test_synthetic_is_learnable_and_seeded() -> None:
    a = build_data({"name": "synthetic", "num_samples": 40, "num_classes": 4, "shape": [1, 8, 8]})
    b = build_data({"name": "synthetic", "num_samples": 40, "num_classes": 4, "shape": [1, 8, 8]})
    assert torch.equal(a.train[0][0], b.train[0][0])
    assert len(a.val) == 10
