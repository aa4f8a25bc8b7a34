"""Positive-unlabeled data built from a labelled binary task: a fraction of the positives keep
their label (s = 1), everything else is unlabeled (s = 0; selected completely at random).

Training items are (x, s) -- the true label never reaches the training loss -- and validation
items are (x, y) with the true binary label. `meta["prior_u"]` is the positive rate among the
unlabeled samples (the class prior a PU method is told or must estimate).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from efficient.data import DataBundle, register_dataset
from efficient.errors import DataError


class PUView(Dataset):
    """(x, s) view of a binary dataset with a fixed labeled subset of its positives."""

    def __init__(self, base: Dataset, labeled: torch.Tensor) -> None:
        self.base, self.labeled = base, labeled

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, _ = self.base[i]
        return x, int(self.labeled[i])


@register_dataset("pu_digits")
def pu_digits(
    positive: list[int] = [0, 2, 4, 6, 8],  # noqa: B006 - read-only default
    labeled_frac: float = 0.2,
    image_size: int = 16,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    label_seed: int = 0,
) -> DataBundle:
    """Digits as PU data: `positive` digits are the positive class, `labeled_frac` of them labeled."""
    from efficient.data.vision import digits

    if not 0 < labeled_frac <= 1:
        raise DataError(f"data.labeled_frac must be in (0, 1], got {labeled_frac}")
    base = digits(image_size=image_size, val_fraction=val_fraction, split_seed=split_seed, binary_positive=list(positive))
    y = base.train.y
    g = torch.Generator().manual_seed(label_seed)
    labeled = (y == 1) & (torch.rand(len(y), generator=g) < labeled_frac)
    if labeled.sum() == 0:
        raise DataError("pu_digits: no positive got labeled; raise data.labeled_frac")
    unl = ~labeled
    prior_u = (y[unl] == 1).float().mean().item()
    meta = {**base.meta, "prior_u": prior_u, "prior": (y == 1).float().mean().item(), "n_labeled": int(labeled.sum())}
    return DataBundle(PUView(base.train, labeled.long()), base.val, task="classification", num_classes=2, input_shape=base.input_shape, meta=meta)
