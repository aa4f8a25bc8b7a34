"""Image datasets: digits (bundled with scikit-learn), CIFAR-10/100 (torchvision on-disk format),
any ImageNet-style folder, and a synthetic set for tests. Images come out as normalised tensors
`[C, H, W]` (set `normalize: false` for [0, 1] inputs, e.g. models that normalise inside)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from efficient.data import DataBundle, register_dataset
from efficient.errors import DataError

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DIGITS_MEAN, DIGITS_STD = (0.3,), (0.38,)

Augment = Literal["none", "basic", "spikformer"]


class TensorImages(Dataset):
    """In-memory images `[N, C, H, W]` in [0, 1] with integer labels and an optional transform."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.x, self.y, self.transform = x, y, transform

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = self.x[i]
        if self.transform is not None:
            img = self.transform(img)
        return img, int(self.y[i])


def _tensor_transform(augment: str, size: int, mean: tuple[float, ...], std: tuple[float, ...], normalize: bool, padding: int) -> Callable:
    """Augmentations on float tensors (digits, synthetic)."""
    from torchvision.transforms import v2

    ops: list[Any] = []
    if augment in ("basic", "spikformer"):
        ops += [v2.RandomCrop(size, padding=padding)]
    if normalize:
        ops.append(v2.Normalize(mean, std))
    return v2.Compose(ops) if ops else (lambda t: t)


def _split(n: int, val_fraction: float, seed: int, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic stratified split."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(n)
    tr, va = train_test_split(idx, test_size=val_fraction, random_state=seed, stratify=labels)
    return np.sort(tr), np.sort(va)


@register_dataset("digits")
def digits(
    image_size: int = 16,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    augment: Augment = "none",
    normalize: bool = True,
    binary_positive: list[int] | None = None,
) -> DataBundle:
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), bilinearly upsampled.

    `binary_positive` turns it into a binary task (label 1 for the listed digits)."""
    if not 0 < val_fraction < 1:
        raise DataError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    if image_size < 8:
        raise DataError(f"data.image_size must be >= 8 (digits are 8x8), got {image_size}")
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False).clamp_(0, 1)
    y = torch.tensor(d.target, dtype=torch.long)
    num_classes = 10
    if binary_positive is not None:
        y = torch.isin(y, torch.tensor(binary_positive)).long()
        num_classes = 2
    tr, va = _split(len(y), val_fraction, split_seed, d.target)
    train_tf = _tensor_transform(augment, image_size, DIGITS_MEAN, DIGITS_STD, normalize, padding=max(1, image_size // 8))
    val_tf = _tensor_transform("none", image_size, DIGITS_MEAN, DIGITS_STD, normalize, 0)
    return DataBundle(
        TensorImages(x[tr], y[tr], train_tf),
        TensorImages(x[va], y[va], val_tf),
        task="classification",
        num_classes=num_classes,
        input_shape=(1, image_size, image_size),
        meta={"mean": DIGITS_MEAN, "std": DIGITS_STD, "normalized": normalize},
    )


def _pil_transforms(augment: str, size: int, mean: tuple[float, ...], std: tuple[float, ...], normalize: bool, train: bool, crop_padding: int | None) -> Callable:
    """torchvision transforms on PIL images; `spikformer` = crop + flip + RandAugment(m9, n1, mstd0.4) + random erasing 0.25."""
    from torchvision import transforms as T

    ops: list[Any] = []
    if train and augment in ("basic", "spikformer"):
        if crop_padding is not None:
            ops += [T.RandomCrop(size, padding=crop_padding)]
        else:
            ops += [T.RandomResizedCrop(size)]
        ops += [T.RandomHorizontalFlip()]
        if augment == "spikformer":
            from timm.data.auto_augment import rand_augment_transform

            ops += [rand_augment_transform("rand-m9-n1-mstd0.4-inc1", {"translate_const": int(size * 0.45), "img_mean": tuple(round(255 * m) for m in mean)})]
    elif crop_padding is None:
        ops += [T.Resize(int(size / 0.875)), T.CenterCrop(size)]
    ops += [T.ToTensor()]
    if normalize:
        ops += [T.Normalize(mean, std)]
    if train and augment == "spikformer":
        from timm.data.random_erasing import RandomErasing

        ops += [RandomErasing(0.25, mode="pixel", device="cpu")]
    return T.Compose(ops)


def _cifar(cls_name: str, root: str, download: bool, augment: str, normalize: bool, mean: tuple, std: tuple, num_classes: int) -> DataBundle:
    import torchvision

    cls = getattr(torchvision.datasets, cls_name)
    folder = {"CIFAR10": "cifar-10-batches-py", "CIFAR100": "cifar-100-python"}[cls_name]
    rootp = Path(root).expanduser()
    where = rootp / folder
    hint = "Put the dataset there (torchvision's format), set data.root, or run the CPU recipe recipes/stata_digits.yaml."
    if not download and not where.exists():
        raise DataError(f"{cls_name} not found: looked for {where}. {hint} (data.download=true tries to fetch it.)")
    try:
        train = cls(str(rootp), train=True, download=download, transform=_pil_transforms(augment, 32, mean, std, normalize, True, 4))
        val = cls(str(rootp), train=False, download=False, transform=_pil_transforms("none", 32, mean, std, normalize, False, 4))
    except (RuntimeError, OSError) as e:  # offline download or corrupt files
        raise DataError(f"{cls_name} could not be loaded from {where}: {e}. {hint}") from None
    return DataBundle(train, val, task="classification", num_classes=num_classes, input_shape=(3, 32, 32), meta={"mean": mean, "std": std, "normalized": normalize})


@register_dataset("cifar10")
def cifar10(root: str = "data", download: bool = False, augment: Augment = "spikformer", normalize: bool = True) -> DataBundle:
    """CIFAR-10 in torchvision's on-disk format under `root/cifar-10-batches-py`."""
    return _cifar("CIFAR10", root, download, augment, normalize, CIFAR10_MEAN, CIFAR10_STD, 10)


@register_dataset("cifar100")
def cifar100(root: str = "data", download: bool = False, augment: Augment = "spikformer", normalize: bool = True) -> DataBundle:
    """CIFAR-100 in torchvision's on-disk format under `root/cifar-100-python`."""
    return _cifar("CIFAR100", root, download, augment, normalize, CIFAR100_MEAN, CIFAR100_STD, 100)


@register_dataset("imagefolder")
def imagefolder(
    root: str,
    image_size: int = 224,
    train_dir: str = "train",
    val_dir: str = "val",
    augment: Augment = "basic",
    normalize: bool = True,
) -> DataBundle:
    """Any ImageNet-style tree: `root/train/<class>/*.jpg`, `root/val/<class>/*.jpg`."""
    from torchvision.datasets import ImageFolder

    rootp = Path(root).expanduser()
    for sub in (train_dir, val_dir):
        if not (rootp / sub).is_dir():
            raise DataError(f"imagefolder: {rootp / sub} is not a directory (expected root/{sub}/<class>/<image>)")
    try:
        train = ImageFolder(str(rootp / train_dir), transform=_pil_transforms(augment, image_size, IMAGENET_MEAN, IMAGENET_STD, normalize, True, None))
        val = ImageFolder(str(rootp / val_dir), transform=_pil_transforms("none", image_size, IMAGENET_MEAN, IMAGENET_STD, normalize, False, None))
    except (FileNotFoundError, RuntimeError) as e:
        raise DataError(f"imagefolder: {e}") from None
    if train.classes != val.classes:
        raise DataError(f"imagefolder: class folders differ between {train_dir} and {val_dir}")
    return DataBundle(train, val, task="classification", num_classes=len(train.classes), input_shape=(3, image_size, image_size), meta={"classes": train.classes})


@register_dataset("synthetic")
def synthetic(
    num_samples: int = 256,
    num_classes: int = 10,
    shape: list[int] = [3, 32, 32],  # noqa: B006 - read-only default
    val_fraction: float = 0.25,
    seed: int = 0,
) -> DataBundle:
    """Learnable random images: each class has a fixed random template, samples add noise.

    Only for tests and benchmarks; it is never used in place of a missing real dataset."""
    if num_samples < 2 or num_classes < 1:
        raise DataError(f"synthetic: need num_samples >= 2 and num_classes >= 1 (got {num_samples}, {num_classes})")
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(num_classes, *shape, generator=g)
    y = torch.randint(0, num_classes, (num_samples,), generator=g)
    x = (0.7 * templates[y] + 0.3 * torch.rand(num_samples, *shape, generator=g)).clamp(0, 1)
    n_val = max(1, int(num_samples * val_fraction))
    return DataBundle(
        TensorImages(x[n_val:], y[n_val:]),
        TensorImages(x[:n_val], y[:n_val]),
        task="classification",
        num_classes=num_classes,
        input_shape=tuple(shape),
    )
