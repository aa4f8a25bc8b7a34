"""cluttered_digits: determinism, split by source image, shapes, the digit's box and its tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from efficient.config import validate
from efficient.data import build_data
from efficient.data.cluttered import token_coverage
from efficient.errors import ConfigError, DataError

FAST = {"name": "cluttered_digits", "train_per_digit": 1, "val_per_digit": 1}


def digits16() -> torch.Tensor:
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().images, dtype=torch.float32).unsqueeze(1) / 16.0
    return F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False).clamp_(0, 1)[:, 0]


def test_same_seed_same_canvases_other_seed_other_canvases():
    a, b = build_data({**FAST, "seed": 3}), build_data({**FAST, "seed": 3})
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.val.x, b.val.x)
    assert torch.equal(a.train.boxes, b.train.boxes) and torch.equal(a.val.y, b.val.y)
    c = build_data({**FAST, "seed": 4})
    assert not torch.equal(a.train.boxes, c.train.boxes)
    assert set(a.val.sources.tolist()) != set(c.val.sources.tolist())


def test_split_by_source_image_digits_and_fragments():
    d = build_data({**FAST, "train_per_digit": 2})
    tr, va = set(d.train.sources.tolist()), set(d.val.sources.tolist())
    assert not tr & va and len(tr) + len(va) == 1797
    assert len(d.train) == 2 * len(tr) and len(d.val) == len(va)
    assert set(d.train.fragment_sources.flatten().tolist()) <= tr  # fragments come from the same split
    assert set(d.val.fragment_sources.flatten().tolist()) <= va
    assert (d.train.fragment_sources != d.train.sources[:, None]).all()  # never a piece of the digit itself
    labels = d.val.y.bincount(minlength=10)
    assert labels.min() >= 30  # stratified: every class in validation


@pytest.mark.parametrize("size", [32, 64])
def test_shapes_normalisation_and_the_digit_in_its_box(size: int):
    d = build_data({**FAST, "canvas_size": size})
    x, y = d.train[0]
    assert x.shape == (1, size, size) and x.dtype == torch.float32 and 0 <= y < 10
    assert d.input_shape == (1, size, size) and d.num_classes == 10
    xs = torch.stack([d.train[i][0] for i in range(len(d.train))])
    assert abs(xs.mean().item()) < 1e-3 and abs(xs.std().item() - 1) < 1e-2  # normalised by its own statistics
    clean = build_data({**FAST, "canvas_size": size, "noise": 0.0, "normalize": False})
    ref = digits16()
    for i in range(0, len(clean.train), 97):  # fragments never cover the digit: its box holds the digit exactly
        top, left, s = clean.train.boxes[i].tolist()
        assert s == 16 and 0 <= top <= size - 16 and 0 <= left <= size - 16
        assert torch.equal(clean.train.x[i, 0, top:top + s, left:left + s], ref[clean.train.sources[i]])
    bare = build_data({**FAST, "canvas_size": size, "noise": 0.0, "distractors": 0, "normalize": False})
    top, left, s = bare.val.boxes[0].tolist()
    outside = bare.val.x[0, 0].clone()
    outside[top:top + s, left:left + s] = 0
    assert outside.abs().sum() == 0  # no fragments, no noise: nothing but the digit
    noisy = build_data({**FAST, "canvas_size": size, "noise": 0.3, "distractors": 0, "normalize": False})
    top, left, s = noisy.val.boxes[0].tolist()
    background = torch.ones(size, size, dtype=torch.bool)
    background[top:top + s, left:left + s] = False
    bg = noisy.val.x[0, 0][background]
    assert bg.min() >= 0 and bg.max() <= 0.3 and abs(bg.mean().item() - 0.15) < 0.02  # uniform noise in [0, 0.3]
    assert noisy.val.x.max() <= 1


def test_about_a_quarter_of_the_tokens_carry_the_digit_at_patch_4():
    d = build_data(FAST)
    cov = d.val.token_coverage(4)
    assert cov.shape == (len(d.val), 64)
    assert torch.allclose(cov.sum(1), torch.full((len(d.val),), 16.0))  # 16x16 pixels = 16 tokens of area
    frac = d.val.digit_tokens(4).float().mean().item()
    assert 0.2 <= frac <= 0.3
    # a box aligned with the grid covers exactly a 4x4 block of tokens
    aligned = token_coverage(torch.tensor([[8, 4, 16]]), 32, 4).view(8, 8)
    expect = torch.zeros(8, 8)
    expect[2:6, 1:5] = 1
    assert torch.equal(aligned, expect)
    half = token_coverage(torch.tensor([[2, 0, 16]]), 32, 4).view(8, 8)
    assert half[0, 0] == 0.5 and half[4, 0] == 0.5 and half[1, 0] == 1 and half[5, 0] == 0
    with pytest.raises(DataError, match="patch 5 must divide"):
        token_coverage(torch.tensor([[0, 0, 16]]), 32, 5)


def test_bad_keys_and_values_are_rejected():
    ok = validate({"model": {"name": "spikformer-tiny"}, "data": {"name": "cluttered_digits", "distractors": 2}})
    assert ok.data["distractors"] == 2
    with pytest.raises(ConfigError, match=r"data\.distractor: unknown key\. Did you mean 'distractors'\?"):
        validate({"model": {"name": "spikformer-tiny"}, "data": {"name": "cluttered_digits", "distractor": 2}})
    with pytest.raises(ConfigError, match=r"data\.canvas_size: expected one of 32, 64"):
        validate({"model": {"name": "spikformer-tiny"}, "data": {"name": "cluttered_digits", "canvas_size": 48}})
    with pytest.raises(ConfigError, match=r"data\.noise: expected a number"):
        validate({"model": {"name": "spikformer-tiny"}, "data": {"name": "cluttered_digits", "noise": "high"}})
    for bad, match in [({"distractors": -1}, "distractors must be >= 0"), ({"noise": 1.5}, r"noise must be in \[0, 1\]"),
                       ({"fragment_size": 20}, "fragment_size must be in 1..16"), ({"val_fraction": 1.0}, "val_fraction"),
                       ({"train_per_digit": 0}, "train_per_digit")]:
        with pytest.raises(DataError, match=match):
            build_data({**FAST, **bad})
