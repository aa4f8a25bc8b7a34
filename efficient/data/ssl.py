"""Semi-supervised digits: a few labels per class, the rest of the training split unlabeled.

One training item = one labeled sample and `mu` unlabeled ones, each in a weak (random shift) and
a strong (shift + rotation/shear + erasing + noise) view:
    (x_l_weak [C,H,W], x_l_strong, y_l, u_weak [mu,C,H,W], u_strong [mu,C,H,W]).
An epoch passes over the unlabeled set once (in groups of `mu`), cycling the labeled samples.
Validation items are plain (x, y).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import Dataset

from efficient.data import DataBundle, register_dataset
from efficient.errors import DataError


def _augmenters(size: int, mean: tuple[float, ...], std: tuple[float, ...], normalize: bool) -> tuple[Callable, Callable, Callable]:
    from torchvision.transforms import v2

    pad = max(1, size // 8)
    norm = [v2.Normalize(mean, std)] if normalize else []
    weak = v2.Compose([v2.RandomCrop(size, padding=pad), *norm])
    strong = v2.Compose([
        v2.RandomCrop(size, padding=pad),
        v2.RandomAffine(degrees=20, shear=15, scale=(0.85, 1.15)),
        v2.Lambda(lambda t: (t + 0.1 * torch.randn_like(t)).clamp(0, 1)),
        v2.RandomErasing(p=0.5, scale=(0.02, 0.15), value=0),
        *norm,
    ])
    plain = v2.Compose(norm) if norm else (lambda t: t)
    return weak, strong, plain


class SSLPairs(Dataset):
    def __init__(self, xl: torch.Tensor, yl: torch.Tensor, xu: torch.Tensor, mu: int, weak: Callable, strong: Callable) -> None:
        self.xl, self.yl, self.xu, self.mu, self.weak, self.strong = xl, yl, xu, mu, weak, strong

    def __len__(self) -> int:
        return len(self.xu) // self.mu

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        j = i % len(self.xl)
        u = self.xu[i * self.mu : (i + 1) * self.mu]
        return (
            self.weak(self.xl[j]), self.strong(self.xl[j]), int(self.yl[j]),
            torch.stack([self.weak(t) for t in u]), torch.stack([self.strong(t) for t in u]),
        )


@register_dataset("ssl_digits")
def ssl_digits(labels_per_class: int = 4, mu: int = 7, image_size: int = 16, val_fraction: float = 0.2, split_seed: int = 0, label_seed: int = 0, normalize: bool = True) -> DataBundle:
    """Digits with `labels_per_class` labeled training images per class; `mu` unlabeled per labeled."""
    from efficient.data.vision import DIGITS_MEAN, DIGITS_STD, TensorImages, digits

    if labels_per_class < 1 or mu < 1:
        raise DataError(f"ssl_digits: labels_per_class and mu must be >= 1, got {labels_per_class}, {mu}")
    base = digits(image_size=image_size, val_fraction=val_fraction, split_seed=split_seed, normalize=False)
    x, y = base.train.x, base.train.y
    g = torch.Generator().manual_seed(label_seed)
    chosen = []
    for c in range(10):
        idx = (y == c).nonzero().flatten()
        if len(idx) < labels_per_class:
            raise DataError(f"ssl_digits: class {c} has only {len(idx)} training images (< labels_per_class={labels_per_class})")
        chosen.append(idx[torch.randperm(len(idx), generator=g)[:labels_per_class]])
    lab = torch.cat(chosen)
    mask = torch.ones(len(y), dtype=torch.bool)
    mask[lab] = False
    unl = mask.nonzero().flatten()
    unl = unl[torch.randperm(len(unl), generator=g)]
    weak, strong, plain = _augmenters(image_size, DIGITS_MEAN, DIGITS_STD, normalize)
    train = SSLPairs(x[lab], y[lab], x[unl], mu, weak, strong)
    val = TensorImages(base.val.x, base.val.y, plain)
    meta = {**base.meta, "normalized": normalize, "n_labeled": len(lab), "n_unlabeled": len(unl), "mu": mu}
    return DataBundle(train, val, task="classification", num_classes=10, input_shape=base.input_shape, meta=meta)
