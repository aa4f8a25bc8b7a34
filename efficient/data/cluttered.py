"""Cluttered digits: a benchmark where most tokens are background, as in CIFAR and ImageNet.

Each canvas (32x32, or 64x64) holds one scikit-learn digit, bilinearly upsampled to 16x16 at a
random position, plus `distractors` fragments (random crops of other digits, placed outside the
digit's box so the label stays clean) and additive uniform pixel noise. With 4x4-pixel patches a
32x32 canvas has 64 tokens of which about a quarter lie on the digit, so a token selector has real
work to do. Train and validation canvases are built from disjoint source images (digits and
fragments alike), everything is drawn from `seed`, and each sample's digit box is kept
(`ClutteredImages.boxes`) so a selector's coverage of the digit can be measured
(`token_coverage`, `digit_tokens`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from efficient.data import DataBundle, register_dataset
from efficient.data.vision import TensorImages, _split
from efficient.errors import DataError


class ClutteredImages(TensorImages):
    """Canvases `[N, 1, S, S]` with labels, each sample's digit box `boxes[i] = (top, left, size)`
    in pixels and the source image it was drawn from (`sources[i]`, an index into scikit-learn's digits)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, boxes: torch.Tensor, sources: torch.Tensor,
                 fragment_sources: torch.Tensor, transform=None) -> None:
        super().__init__(x, y, transform)
        self.boxes, self.sources, self.fragment_sources = boxes, sources, fragment_sources

    @property
    def canvas_size(self) -> int:
        return int(self.x.shape[-1])

    def token_coverage(self, patch: int = 4) -> torch.Tensor:
        """`[N, (S/patch)**2]`: the fraction of each token's pixels inside the sample's digit box."""
        return token_coverage(self.boxes, self.canvas_size, patch)

    def digit_tokens(self, patch: int = 4, min_coverage: float = 0.5) -> torch.Tensor:
        """`[N, (S/patch)**2]` bool: tokens whose patch lies at least `min_coverage` inside the digit box."""
        return self.token_coverage(patch) >= min_coverage


def token_coverage(boxes: torch.Tensor, canvas_size: int, patch: int) -> torch.Tensor:
    """Fraction of each `patch` x `patch` token (row-major, as a patch stem flattens its grid) covered
    by the square box `(top, left, size)` of each sample: `[N, 3]` -> `[N, (canvas_size/patch)**2]`."""
    if patch < 1 or canvas_size % patch:
        raise DataError(f"token_coverage: patch {patch} must divide the canvas size {canvas_size}")
    g = canvas_size // patch
    lo = torch.arange(g) * patch  # first pixel of each patch row / column

    def overlap(start: torch.Tensor, size: torch.Tensor) -> torch.Tensor:  # [N] -> [N, g] pixels in common
        a = torch.maximum(lo[None], start[:, None])
        b = torch.minimum(lo[None] + patch, (start + size)[:, None])
        return (b - a).clamp_min(0)

    top, left, size = boxes[:, 0].long(), boxes[:, 1].long(), boxes[:, 2].long()
    rows, cols = overlap(top, size), overlap(left, size)
    return (rows[:, :, None] * cols[:, None, :]).flatten(1).float() / (patch * patch)


def _free_positions(canvas: int, frag: int, top: int, left: int, size: int) -> np.ndarray:
    """Top-left corners `[M, 2]` of a `frag` x `frag` square inside the canvas that does not overlap the box."""
    r, c = np.meshgrid(np.arange(canvas - frag + 1), np.arange(canvas - frag + 1), indexing="ij")
    clear = (r + frag <= top) | (r >= top + size) | (c + frag <= left) | (c >= left + size)
    return np.stack([r[clear], c[clear]], 1)


def _render(digits16: np.ndarray, targets: np.ndarray, pool: np.ndarray, rng: np.random.Generator, canvas: int,
            distractors: int, fragment: int, noise: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Canvases for the source images `targets`, fragments cut from other images of `pool` (the same split)."""
    n, size = len(targets), digits16.shape[-1]
    x = np.zeros((n, canvas, canvas), np.float32)
    boxes = np.zeros((n, 3), np.int64)
    frag_src = np.full((n, max(distractors, 1)), -1, np.int64)
    free_at: dict[tuple[int, int], np.ndarray] = {}  # box corner -> free fragment corners
    for i, src in enumerate(targets):
        top, left = (int(v) for v in rng.integers(0, canvas - size + 1, size=2))
        boxes[i] = (top, left, size)
        if (top, left) not in free_at:
            free_at[top, left] = _free_positions(canvas, fragment, top, left, size)
        free = free_at[top, left]
        for j in range(distractors):
            other = pool[rng.integers(len(pool) - 1)]
            other = pool[-1] if other == src else other  # any image of the split but the target itself
            fr, fc = rng.integers(0, size - fragment + 1, size=2)
            pr, pc = free[rng.integers(len(free))]
            patch = digits16[other, fr:fr + fragment, fc:fc + fragment]
            np.maximum(x[i, pr:pr + fragment, pc:pc + fragment], patch, out=x[i, pr:pr + fragment, pc:pc + fragment])
            frag_src[i, j] = other
        x[i, top:top + size, left:left + size] = np.maximum(x[i, top:top + size, left:left + size], digits16[src])
        if noise > 0:
            x[i] = np.minimum(x[i] + rng.uniform(0.0, noise, size=(canvas, canvas)).astype(np.float32), 1.0)
    return x, boxes, frag_src[:, :distractors]


@register_dataset("cluttered_digits")
def cluttered_digits(
    canvas_size: Literal[32, 64] = 32,
    distractors: int = 4,
    fragment_size: int = 8,
    noise: float = 0.2,
    train_per_digit: int = 2,
    val_per_digit: int = 2,
    val_fraction: float = 0.2,
    seed: int = 0,
    normalize: bool = True,
) -> DataBundle:
    """scikit-learn's digits, each upsampled to 16x16 and placed at a random position on a
    `canvas_size` canvas with `distractors` fragments (`fragment_size` crops of other digits of the
    same split) and uniform pixel noise in [0, `noise`]. Source images are split (stratified) into
    train and validation by `seed`; every source gives `train_per_digit` / `val_per_digit` canvases."""
    if canvas_size not in (32, 64):
        raise DataError(f"data.canvas_size must be 32 or 64, got {canvas_size!r}")
    if distractors < 0:
        raise DataError(f"data.distractors must be >= 0 (fragments per canvas), got {distractors}")
    if not 1 <= fragment_size <= 16:
        raise DataError(f"data.fragment_size must be in 1..16 (a crop of a 16x16 digit), got {fragment_size}")
    if not 0 <= noise <= 1:
        raise DataError(f"data.noise must be in [0, 1] (amplitude of uniform pixel noise on [0, 1] images), got {noise}")
    if train_per_digit < 1 or val_per_digit < 1:
        raise DataError(f"data.train_per_digit and data.val_per_digit must be >= 1, got {train_per_digit}, {val_per_digit}")
    if not 0 < val_fraction < 1:
        raise DataError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    from sklearn.datasets import load_digits

    d = load_digits()
    src = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    digits16 = F.interpolate(src, size=(16, 16), mode="bilinear", align_corners=False).clamp_(0, 1)[:, 0].numpy()
    tr, va = _split(len(d.target), val_fraction, seed, d.target)
    rng_train, rng_val = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))

    def make(sources: np.ndarray, per: int, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
        targets = np.repeat(sources, per)
        x, boxes, frags = _render(digits16, targets, sources, rng, canvas_size, distractors, fragment_size, noise)
        return (torch.from_numpy(x).unsqueeze(1), torch.from_numpy(d.target[targets]).long(), torch.from_numpy(boxes),
                torch.from_numpy(targets), torch.from_numpy(frags))

    xt, yt, bt, st, ft = make(tr, train_per_digit, rng_train)
    xv, yv, bv, sv, fv = make(va, val_per_digit, rng_val)
    # normalise with the training canvases' own statistics (mostly background: not the digits' 0.3 / 0.38)
    mean, std = (round(float(xt.mean()), 4),), (round(float(xt.std()), 4),)
    tf = (lambda t: (t - mean[0]) / std[0]) if normalize else None
    return DataBundle(
        ClutteredImages(xt, yt, bt, st, ft, tf),
        ClutteredImages(xv, yv, bv, sv, fv, tf),
        task="classification",
        num_classes=10,
        input_shape=(1, canvas_size, canvas_size),
        meta={"mean": mean, "std": std, "normalized": normalize, "digit_size": 16},
    )
