"""Weak-to-strong auxiliary confidence loss: schedule, hardening, gradients, teacher loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

from efficient.errors import ConfigError
from efficient.objectives.weak_to_strong import (
    WeakToStrong,
    aux_coef,
    hardened_predictions,
    performance_gap_recovered,
    w2s_loss,
)


def _weak(n: int, p1: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = (torch.rand(n, generator=g) < p1).float() * 0.6 + 0.2  # soft labels 0.2 / 0.8
    return torch.stack([1 - q, q], 1)


def test_schedule_linear_and_code_jump():
    assert aux_coef(0.0) == 0.0
    assert aux_coef(0.1) == pytest.approx(0.25)
    assert aux_coef(0.2) == pytest.approx(0.5) and aux_coef(0.9) == pytest.approx(0.5)
    assert aux_coef(0.1, 0.5, 0.1, "code") == pytest.approx(0.05)  # reference code: 0.05 ...
    assert aux_coef(0.1001, 0.5, 0.1, "code") == pytest.approx(0.5)  # ... then jumps to 0.5
    assert aux_coef(0.5, 0.75, 0.2) == pytest.approx(0.75)


def test_step_zero_loss_is_ce_against_weak_soft_labels():
    logits = torch.randn(32, 2)
    weak = _weak(32, 0.3)
    expect = -(weak * F.log_softmax(logits, -1)).sum(-1).mean()
    torch.testing.assert_close(w2s_loss(logits, weak, aux_coef(0.0)), expect)


def test_hardened_balance_equals_weak_balance():
    weak = _weak(1000, 0.294, seed=1)
    logits = torch.randn(1000, 2, generator=torch.Generator().manual_seed(2))
    h = hardened_predictions(logits, weak)
    assert h.sum(1).eq(1).all()
    torch.testing.assert_close(h.mean(0), weak.mean(0), atol=2e-3, rtol=0)
    # the hardened positives are the student's most confident class-0 predictions
    p0 = torch.softmax(logits, -1)[:, 0]
    assert p0[h[:, 0] == 1].min() >= p0[h[:, 0] == 0].max()


def test_gradient_is_softmax_minus_target_over_batch():
    logits = torch.randn(16, 2, dtype=torch.float64, requires_grad=True)
    weak = _weak(16, 0.5).double()
    a = 0.3
    w2s_loss(logits, weak, a).backward()
    target = (1 - a) * weak + a * hardened_predictions(logits, weak).double()
    torch.testing.assert_close(logits.grad, (torch.softmax(logits.detach(), -1) - target) / 16)


def test_pgr():
    assert performance_gap_recovered(0.8, 0.7, 0.9) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        performance_gap_recovered(0.8, 0.7, 0.7)


def test_objective_loads_a_frozen_teacher_and_warms_up(tmp_path):
    from efficient.zoo import create, save_model

    torch.manual_seed(0)
    teacher = create("mlp-tiny", hidden=[3], num_classes=2, img_size=8)
    save_model(teacher, tmp_path / "weak.safetensors")
    obj = WeakToStrong(teacher=str(tmp_path / "weak.safetensors"))
    student = create("mlp-small", hidden=[8], num_classes=2, img_size=8)
    obj.setup(student, None, None)
    obj.total_steps = 10
    x, y = torch.rand(6, 1, 8, 8), torch.tensor([0, 1, 0, 1, 1, 0])
    torch.testing.assert_close(obj.weak_labels(x), torch.softmax(teacher(x), -1))
    assert not any(p.requires_grad for p in obj.teacher.parameters())
    obj.set_progress(0.0, 0)
    loss, logs = obj.loss(student, (x, y))
    assert logs["alpha"] == 0.0
    torch.testing.assert_close(loss, -(torch.softmax(teacher(x), -1) * F.log_softmax(student(x), -1)).sum(-1).mean())
    obj.set_progress(0.0, 5)
    assert obj.alpha() == pytest.approx(0.5)
    loss.backward()
    assert all(p.grad is None for p in obj.teacher.parameters())
    ev = obj.evaluate(student, (x, y))
    pred = student(x).argmax(-1)
    assert 0 < (pred == y).sum() < 6  # a batch where the count is informative: neither all right nor all wrong
    assert ev == {"n": 6.0, "acc": (pred == y).sum().item(),
                  "teacher_agree": (pred == teacher(x).argmax(-1)).sum().item()}


def test_objective_needs_a_teacher():
    with pytest.raises(ConfigError, match="teacher"):
        WeakToStrong()


@pytest.mark.slow
def test_recipes_run_end_to_end_with_cost_report(tmp_path):
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    weak = load_recipe(ROOT / "recipes" / "w2s_weak_digits.yaml", ["train.max_steps=2", "train.progress=false"])
    Trainer(weak, tmp_path / "weak").fit()
    strong = load_recipe(ROOT / "recipes" / "w2s_digits.yaml",
                         ["train.max_steps=2", "train.progress=false", f"objective.teacher={tmp_path / 'weak'}"])
    summary = Trainer(strong, tmp_path / "strong").fit()
    assert summary["steps"] == 2 and 0 <= summary["val"]["teacher_agree"] <= 1
    assert summary["cost"]["flops"] > 0
