"""Next-token cross-entropy for language models that return logits `[B, S, V]`."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from efficient.objectives import Objective, register_objective


@register_objective("lm")
class LanguageModeling(Objective):
    primary_metric = "loss"
    higher_is_better = False

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        return loss, {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        x, y = batch
        logits = model(x)
        n_tok = y.numel()
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        return {"loss": loss, "n": float(n_tok)}
