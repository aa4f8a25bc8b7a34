"""Weak-to-strong generalisation (Burns et al., ICML 2024): train a strong student on a weak
teacher's soft labels, with the auxiliary confidence loss

    L = (1 - a_t) CE(f(x), f_w(x)) + a_t CE(f(x), h(x)),

h = the student's own prediction hardened at the threshold that makes the hardened class balance
equal the weak labels' balance (binary, as in openai/weak-to-strong `logconf_loss_fn`; with more
classes, h is the plain argmax). Targets are detached. a_t warms up: `linear` (default)
a_max * min(1, step_frac / warmup_frac); `code` reproduces the reference code's jump
(a_max * step_frac while step_frac <= warmup_frac, then a_max).
Performance gap recovered: PGR = (acc_w2s - acc_weak) / (acc_ceiling - acc_weak).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.objectives import Objective, register_objective


def aux_coef(step_frac: float, alpha_max: float = 0.5, warmup_frac: float = 0.2, warmup: str = "linear") -> float:
    if warmup == "code":
        return alpha_max * step_frac if step_frac <= warmup_frac else alpha_max
    return alpha_max * min(1.0, step_frac / warmup_frac) if warmup_frac > 0 else alpha_max


def hardened_predictions(logits: torch.Tensor, weak_probs: torch.Tensor) -> torch.Tensor:
    """One-hot student predictions; binary: class 0 where p_0 >= the quantile that matches the weak balance."""
    probs = torch.softmax(logits.detach().float(), -1)
    if probs.shape[1] != 2:
        return F.one_hot(probs.argmax(-1), probs.shape[1]).to(probs.dtype)
    threshold = torch.quantile(probs[:, 0], weak_probs.float().mean(0)[1].clamp(0, 1))
    is0 = (probs[:, 0] >= threshold).to(probs.dtype)
    return torch.stack([is0, 1 - is0], dim=1)


def w2s_loss(logits: torch.Tensor, weak_probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """Mean over the batch of (1 - alpha) CE(logits, weak) + alpha CE(logits, hardened)."""
    target = (1 - alpha) * weak_probs.detach().float() + alpha * hardened_predictions(logits, weak_probs)
    return torch.sum(-target * F.log_softmax(logits.float(), -1), -1).mean()


def performance_gap_recovered(acc_w2s: float, acc_weak: float, acc_ceiling: float) -> float:
    if acc_ceiling == acc_weak:
        raise ValueError("PGR is undefined when the ceiling equals the weak accuracy")
    return (acc_w2s - acc_weak) / (acc_ceiling - acc_weak)


@register_objective("weak_to_strong")
class WeakToStrong(Objective):
    """Student = the recipe's model; teacher = a trained run (`teacher: runs/weak`), frozen.

    Validation reports `acc` against the ground truth and `teacher_agree`, the fraction of
    predictions that agree with the teacher's."""

    def __init__(self, teacher: str = "", alpha_max: float = 0.5, warmup_frac: float = 0.2, warmup: Literal["linear", "code"] = "linear", teacher_temperature: float = 1.0) -> None:
        if not teacher:
            raise ConfigError("objective.teacher: give the run dir (or .safetensors) of the trained weak model")
        if not 0 <= alpha_max <= 1 or not 0 <= warmup_frac <= 1:
            raise ConfigError(f"objective.alpha_max and warmup_frac must be in [0, 1], got {alpha_max}, {warmup_frac}")
        self.teacher_src, self.alpha_max, self.warmup_frac, self.warmup, self.temp = teacher, alpha_max, warmup_frac, warmup, teacher_temperature
        self.teacher: nn.Module | None = None
        self.total_steps, self.step = 1, 0

    def setup(self, model: nn.Module, data: Any, recipe: Any) -> None:
        from efficient.zoo import load

        self.teacher = load(self.teacher_src)
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        if recipe is not None:
            steps = recipe.train.epochs * max(1, len(data.train) // recipe.data["batch_size"])
            self.total_steps = min(steps, recipe.train.max_steps) if recipe.train.max_steps else steps

    def alpha(self) -> float:
        return aux_coef(min(1.0, self.step / max(1, self.total_steps)), self.alpha_max, self.warmup_frac, self.warmup)

    @torch.no_grad()
    def weak_labels(self, x: torch.Tensor) -> torch.Tensor:
        p = next(self.teacher.parameters())
        if p.device != x.device:
            self.teacher.to(x.device)
        return torch.softmax(self.teacher(x).float() / self.temp, -1)

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        x, _ = batch  # ground truth is never used for training
        weak = self.weak_labels(x)
        logits = model(x)
        a = self.alpha()
        loss = w2s_loss(logits, weak, a)
        return loss, {"loss": loss.detach(), "alpha": a, "teacher_agree": (logits.argmax(-1) == weak.argmax(-1)).float().mean().detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        x, y = batch
        pred = model(x).argmax(-1)
        return {"acc": (pred == y).sum().item(), "teacher_agree": (pred == self.weak_labels(x).argmax(-1)).sum().item(), "n": float(len(y))}
