"""ODIN (Chen et al., ICML 2024): a reward model with a quality head and a length head, trained
so that response length is explained by the length head only; RL then uses the quality head.

Heads w_Q, w_L (a 2 x d matrix without bias) are each mean-centred and L2-normalised; with h the
hidden state at the last completion token, r_Q = h.w_Q, r_L = h.w_L, r = r_Q + r_L and
    L = -log sigmoid(r(y_w) - r(y_l)) + lambda_L [(1 - rho(r_L, len)) + |rho(r_Q, len)|] + lambda_O |w_Q . w_L|
(rho: Pearson correlation over all responses of the batch; len: completion tokens). A batch of
pairs gives 2B responses: use B >= 8, a Pearson over 2 values is always +-1.
`heads: 1` trains the vanilla one-head reward model (baseline). The heads are attached to the
model as `model.reward_heads` in `setup` (so the optimizer and checkpoints include them).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.objectives import Objective, register_objective


def pearson(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    x = x.float() - x.float().mean()
    y = y.float() - y.float().mean()
    return (x * y).sum() / (x.norm() * y.norm() + eps)


def normalised_heads(w: torch.Tensor) -> torch.Tensor:
    """Each row mean-centred then L2-normalised."""
    w = w - w.mean(-1, keepdim=True)
    return w / w.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def last_hidden(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Hidden state [N, d] of the deepest layer at each row's last completion token."""
    if hasattr(model, "exit_states") and hasattr(model, "num_layers"):
        h = model.exit_states(ids, [model.num_layers])[-1].hidden
    elif hasattr(model, "forward_features"):
        h = model.forward_features(ids)
    else:
        raise ConfigError(f"objective odin: {type(model).__name__} exposes no hidden states (needs exit_states or forward_features)")
    pos = torch.arange(ids.shape[1], device=ids.device)
    last = ((mask > 0) * pos).amax(1)
    return h[torch.arange(ids.shape[0], device=ids.device), last]


def odin_terms(r_q: torch.Tensor, r_l: torch.Tensor, lengths: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The disentangling terms: length (1 - rho(r_L, len)) + |rho(r_Q, len)|, orthogonality |w_Q . w_L|."""
    return {
        "length": (1 - pearson(r_l, lengths)) + pearson(r_q, lengths).abs(),
        "ortho": (w[0] * w[1]).sum().abs(),
    }


@register_objective("odin")
class ODIN(Objective):
    """Reward-model training on pair batches (ids [2B, S], mask [2B, S]; chosen first).

    Validation: `acc` = quality reward ranks the (truly) better response first, `acc_total` the
    same for r_Q + r_L, and `rho_q` / `rho_l` / `rho_total` = Pearson correlation with length
    (per validation batch; use one large eval batch)."""

    primary_metric = "acc"

    def __init__(self, heads: Literal[1, 2] = 2, lambda_l: float = 1.0, lambda_o: float = 1.0) -> None:
        if heads not in (1, 2):
            raise ConfigError(f"objective.heads must be 1 (vanilla reward model) or 2 (ODIN), got {heads}")
        self.heads, self.lambda_l, self.lambda_o = heads, lambda_l, lambda_o

    def setup(self, model: nn.Module, data: Any, recipe: Any) -> None:
        if not hasattr(model, "reward_heads"):
            p = next(model.parameters())
            probe = torch.zeros(1, 2, dtype=torch.long, device=p.device)
            d = last_hidden(model, probe, torch.ones(1, 2, device=p.device)).shape[-1]
            g = torch.Generator().manual_seed(0)
            model.reward_heads = nn.Linear(d, self.heads, bias=False).to(p.device)
            with torch.no_grad():
                model.reward_heads.weight.copy_(torch.randn(self.heads, d, generator=g) * d**-0.5)

    def rewards(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(r_Q, r_L, normalised heads); r_L is zero for the one-head model."""
        w = normalised_heads(model.reward_heads.weight.float())
        r = last_hidden(model, ids, mask).float() @ w.T
        r_l = r[:, 1] if self.heads == 2 else torch.zeros_like(r[:, 0])
        return r[:, 0], r_l, w

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        ids, mask = batch[0], batch[1]
        r_q, r_l, w = self.rewards(model, ids, mask)
        B = ids.shape[0] // 2
        r = r_q + r_l
        rank = -F.logsigmoid(r[:B] - r[B:]).mean()
        lengths = mask.sum(1)
        logs = {"rank": rank.detach()}
        loss = rank
        if self.heads == 2:
            t = odin_terms(r_q, r_l, lengths, w)
            loss = rank + self.lambda_l * t["length"] + self.lambda_o * t["ortho"]
            logs.update({"length_term": t["length"].detach(), "ortho": t["ortho"].detach()})
        logs["loss"] = loss.detach()
        return loss, logs

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        ids, mask = batch[0], batch[1]
        r_q, r_l, _ = self.rewards(model, ids, mask)
        B = ids.shape[0] // 2
        lengths = mask.sum(1)
        r = r_q + r_l
        n = float(B)
        return {
            "acc": (r_q[:B] > r_q[B:]).sum().item(),
            "acc_total": (r[:B] > r[B:]).sum().item(),
            "rho_q": pearson(r_q, lengths).item() * n,
            "rho_l": pearson(r_l, lengths).item() * n,
            "rho_total": pearson(r, lengths).item() * n,
            "n": n,
        }
