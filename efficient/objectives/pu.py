"""PU learning with a probability-boundary fence (PULCPBF, Li et al., ICML 2024), as we
reconstruct it from the abstract (no reference code was available).

Stage 1 (in `setup`, its own optimiser): K weak classifiers minimise the asymmetric risk
    R_g(f) = E_P l(f, +1) + g E_U l(f, -1)      (logistic loss),
whose minimiser has sigmoid(f*) = p_P / (p_P + g p_U): its boundary sits where the posterior
eta(x) = g * prior. A grid of g_k = t_k / prior gives a fence of thresholds t_1 < ... < t_K.
Stage 2 (the recipe's model): a sample's number of positive votes v places eta(x) in
(t_v, t_{v+1}) (t_0 = 0, t_{K+1} = 1); unlabeled samples get labels y ~ Bernoulli(midpoint),
redrawn every step, labeled positives keep y = 1, and after `self_train_from` of training the
student's own confident predictions (max prob >= `confidence`) replace the drawn labels.
Batches are (x, s) with s = 1 for labeled positives (see `efficient.data.pu`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.objectives import Objective, register_objective


def asymmetric_pu_risk(logits: torch.Tensor, s: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
    """Sum over heads of E_P softplus(-f_k) + g_k E_U softplus(f_k); logits [N, K], s [N] (1 = labeled positive)."""
    pos, unl = s.bool(), ~s.bool()
    if not pos.any() or not unl.any():
        raise ValueError("the asymmetric PU risk needs labeled positives and unlabeled samples in the batch")
    risk_p = F.softplus(-logits[pos]).mean(0)
    risk_u = F.softplus(logits[unl]).mean(0)
    return (risk_p + gammas.to(logits) * risk_u).sum()


def fence_posterior(votes: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Midpoint of the fence interval (t_v, t_{v+1}) that `votes` positive weak classifiers place eta in."""
    t = torch.cat([thresholds.new_zeros(1), thresholds.sort().values, thresholds.new_ones(1)])
    v = votes.long().clamp(0, len(thresholds))
    return (t[v] + t[v + 1]) / 2


class Fence(nn.Module):
    """K weak classifiers: linear (hidden = 0, the default) or sharing one small hidden layer; logits [N, K].

    Weak on purpose: a flexible fence memorises the unlabeled positives as negatives."""

    def __init__(self, in_features: int, k: int, hidden: int = 0) -> None:
        super().__init__()
        if hidden:
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, k))
        else:
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def train_fence(x: torch.Tensor, s: torch.Tensor, thresholds: list[float], prior: float, steps: int = 300, lr: float = 0.01, hidden: int = 0, seed: int = 0, weight_decay: float = 1e-3) -> Fence:
    """Stage 1: full-batch AdamW on the asymmetric risks of all fence members at once."""
    torch.manual_seed(seed)
    fence = Fence(x[0].numel(), len(thresholds), hidden)
    gammas = torch.tensor(thresholds) / prior
    opt = torch.optim.AdamW(fence.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        loss = asymmetric_pu_risk(fence(x), s, gammas)
        opt.zero_grad()
        loss.backward()
        opt.step()
    fence.eval()
    for p in fence.parameters():
        p.requires_grad_(False)
    return fence


@register_objective("pu")
class PULearning(Objective):
    """Two-stage PU training; validation `acc` is against the true binary labels."""

    def __init__(
        self,
        prior: float | None = None,
        thresholds: list[float] = [0.1, 0.3, 0.5, 0.7, 0.9],  # noqa: B006 - read-only default
        fence_steps: int = 300,
        fence_lr: float = 0.01,
        fence_hidden: int = 0,
        self_train_from: float = 0.5,
        confidence: float = 0.95,
        naive: bool = False,
    ) -> None:
        if prior is not None and not 0 < prior < 1:
            raise ConfigError(f"objective.prior (positive rate among unlabeled samples) must be in (0, 1), got {prior}")
        if not thresholds or any(not 0 < t < 1 for t in thresholds) or len(set(thresholds)) != len(thresholds):
            raise ConfigError(f"objective.thresholds must be distinct posterior levels in (0, 1), got {thresholds}")
        self.prior, self.thresholds = prior, sorted(thresholds)
        self.fence_steps, self.fence_lr, self.fence_hidden = fence_steps, fence_lr, fence_hidden
        self.self_train_from, self.confidence, self.naive = self_train_from, confidence, naive
        self.fence: Fence | None = None
        self.total_steps, self.step = 1, 0

    def setup(self, model: nn.Module, data: Any, recipe: Any) -> None:
        if self.prior is None:
            self.prior = (getattr(data, "meta", {}) or {}).get("prior_u")
            if self.prior is None:
                raise ConfigError("objective.prior: the dataset does not state its unlabeled class prior; set objective.prior")
        if recipe is not None:
            steps = recipe.train.epochs * max(1, len(data.train) // recipe.data["batch_size"])
            self.total_steps = min(steps, recipe.train.max_steps) if recipe.train.max_steps else steps
        if self.naive:  # PN baseline: unlabeled = negative
            return
        xs, ss = zip(*(data.train[i] for i in range(len(data.train))))
        self.fence = train_fence(torch.stack(xs), torch.tensor(ss), self.thresholds, self.prior, self.fence_steps, self.fence_lr, self.fence_hidden)

    @torch.no_grad()
    def soft_labels(self, x: torch.Tensor) -> torch.Tensor:
        """Fence midpoint posterior eta_hat(x) per sample."""
        self.fence.to(x.device)
        votes = (self.fence(x) > 0).sum(-1)
        return fence_posterior(votes, torch.tensor(self.thresholds, device=x.device))

    def targets(self, logits: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if self.naive:
            return s.long()
        y = torch.bernoulli(self.soft_labels(x)).long()
        if self.step / max(1, self.total_steps) >= self.self_train_from:
            p = torch.softmax(logits.detach().float(), -1)
            sure = p.max(-1).values >= self.confidence
            y = torch.where(sure, p.argmax(-1), y)
        return torch.where(s.bool(), torch.ones_like(y), y)

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        x, s = batch
        logits = model(x)
        y = self.targets(logits, x, s)
        loss = F.cross_entropy(logits.float(), y)
        return loss, {"loss": loss.detach(), "pos_rate": y.float().mean().detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        x, y = batch
        pred = model(x).argmax(-1)
        out = {"acc": (pred == y).sum().item(), "tp": ((pred == 1) & (y == 1)).sum().item(), "n": float(len(y))}
        out["pos_pred"] = (pred == 1).sum().item()
        out["pos_true"] = (y == 1).sum().item()
        return out
