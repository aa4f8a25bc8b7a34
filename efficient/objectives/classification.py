"""Cross-entropy classification with label smoothing and optional mixup/cutmix (timm's Mixup)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from efficient.objectives import Objective, register_objective


@register_objective("classification")
class Classification(Objective):
    """CE (soft-target CE while mixup/cutmix is on). `mixup_off_epoch` stops mixing from that epoch."""

    def __init__(
        self,
        label_smoothing: float = 0.0,
        mixup: float = 0.0,
        cutmix: float = 0.0,
        mixup_prob: float = 1.0,
        mixup_off_epoch: int | None = None,
    ) -> None:
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"objective.label_smoothing must be in [0, 1), got {label_smoothing}")
        if mixup < 0 or cutmix < 0:
            raise ValueError("objective.mixup and objective.cutmix are Beta alphas and must be >= 0")
        self.label_smoothing, self.mixup_off_epoch = label_smoothing, mixup_off_epoch
        self.mixup_fn = None
        self.mix_args = dict(mixup_alpha=mixup, cutmix_alpha=cutmix, prob=mixup_prob, label_smoothing=label_smoothing)
        self.epoch, self.step = 0.0, 0

    def setup(self, model: nn.Module, data: Any, recipe: Any) -> None:
        if self.mix_args["mixup_alpha"] > 0 or self.mix_args["cutmix_alpha"] > 0:
            from timm.data import Mixup

            self.mixup_fn = Mixup(num_classes=data.num_classes, **self.mix_args)

    def mixing(self) -> bool:
        return self.mixup_fn is not None and (self.mixup_off_epoch is None or self.epoch < self.mixup_off_epoch)

    def classification_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half -> fp32; float64 kept
        if target.dim() == 2:  # soft targets from mixup
            return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()
        return F.cross_entropy(logits, target, label_smoothing=self.label_smoothing)

    def prepare(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        if self.mixing() and x.shape[0] % 2 == 0:
            x, y = self.mixup_fn(x, y)
        return x, y

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        x, y = self.prepare(batch)
        logits = model(x)
        loss = self.classification_loss(logits, y)
        logs = {"loss": loss.detach()}
        if y.dim() == 1:
            logs["acc"] = (logits.argmax(-1) == y).float().mean().detach()
        return loss, logs

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        x, y = batch
        logits = model(x)
        return {
            "loss": F.cross_entropy(logits.float(), y, reduction="sum").item(),
            "acc": (logits.argmax(-1) == y).sum().item(),
            "n": float(len(y)),
        }
