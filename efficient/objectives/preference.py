"""Offline preference optimisation of a language model against a frozen reference copy.

`preference`: pairwise losses E f(beta * Delta) of the GPO family (arXiv 2402.05749), which holds
DPO (logistic), SLiC (hinge) and IPO (squared), plus robust DPO (rDPO, arXiv 2403.00409) for a
known label-flip rate and conservative DPO (label smoothing).
`kto`: Kahneman-Tversky optimisation (arXiv 2402.01306) on unpaired desirable/undesirable data.

Delta = [log pi(y_w|x) - log ref(y_w|x)] - [log pi(y_l|x) - log ref(y_l|x)], log-probabilities
summed over completion tokens (or averaged with `average_log_prob`, TRL's IPO normalisation).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.objectives import Objective, register_objective

# ----------------------------------------------------------------------------- log-probabilities


def final_logits(out: Any) -> torch.Tensor:
    """The last (deepest) logits of a language model's output: a tensor, a `.logits` / "logits"
    field, or the last entry of a list of per-exit logits."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        if "logits" in out:
            return final_logits(out["logits"])
        raise TypeError(f"model returned a dict without 'logits' (keys: {sorted(out)})")
    if hasattr(out, "logits"):
        return final_logits(out.logits)
    if isinstance(out, (list, tuple)) and out:
        return final_logits(out[-1])
    raise TypeError(f"cannot find logits in a model output of type {type(out).__name__}")


def sequence_logps(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """log p(completion | prompt) per row: sum (or mean) of the next-token log-probs where mask=1."""
    logits = final_logits(model(ids[:, :-1])).float()
    logp = torch.gather(F.log_softmax(logits, dim=-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    m = mask[:, 1:].to(logp.dtype)
    total = (logp * m).sum(-1)
    return total / m.sum(-1).clamp_min(1.0) if average else total


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen reference copy: eval mode, no gradients."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class ReferenceMixin:
    """Keeps a frozen copy of the policy as it was at `setup` and follows it across devices."""

    ref: nn.Module | None = None

    def setup(self, model: nn.Module, data: Any, recipe: Any) -> None:
        self.ref = frozen_copy(model)

    def reference(self, model: nn.Module) -> nn.Module:
        if self.ref is None:  # used without an engine: freeze the model as it is now
            self.ref = frozen_copy(model)
        p = next(model.parameters(), None)
        q = next(self.ref.parameters(), None)
        if p is not None and q is not None and q.device != p.device:
            self.ref.to(p.device)
        return self.ref


# ---------------------------------------------------------------------------------- GPO family


def _logistic(x: torch.Tensor) -> torch.Tensor:
    return -F.logsigmoid(x)


def _hinge(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(1 - x)


def _squared(x: torch.Tensor) -> torch.Tensor:
    return (x - 1) ** 2


def _exponential(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-x)


def _truncated_quadratic(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(1 - x) ** 2


def _savage(x: torch.Tensor) -> torch.Tensor:
    # (1 + e^x)^-2 = sigmoid(-x)^2; not convex for x < -ln 2 (GPO Table 1)
    return torch.sigmoid(-x) ** 2


GPO_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "logistic": _logistic,  # DPO
    "hinge": _hinge,  # SLiC
    "squared": _squared,  # IPO up to scale: (beta*D - 1)^2 = 4 tau^2 (D - 1/(2 tau))^2 with beta = 2 tau
    "exponential": _exponential,
    "truncated_quadratic": _truncated_quadratic,
    "savage": _savage,
}

LossType = Literal["sigmoid", "hinge", "ipo", "robust", "logistic", "squared", "exponential", "truncated_quadratic", "savage"]


def preference_losses(
    delta: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid", eps: float = 0.0, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-pair losses from Delta (policy log-ratio minus reference log-ratio).

    sigmoid (DPO, with cDPO `label_smoothing`), hinge, ipo = (Delta - 1/(2 beta))^2 (IPO's tau = beta),
    robust = rDPO [(1-eps) l(h) - eps l(-h)] / (1 - 2 eps) with h = beta*Delta, l = -log sigmoid,
    and the GPO members f(beta * Delta) by their names."""
    h = beta * delta
    if loss_type == "sigmoid":
        return -F.logsigmoid(h) * (1 - label_smoothing) - F.logsigmoid(-h) * label_smoothing
    if loss_type == "robust":
        if not 0 <= eps < 0.5:
            raise ConfigError(f"objective.eps (label-flip rate of rDPO) must be in [0, 0.5), got {eps}")
        # unbiased: (1-eps) L(h) + eps L(-h) = -log sigmoid(h); unbounded below, never clipped
        return (-(1 - eps) * F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)
    if loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return _hinge(h)
    if loss_type in GPO_FUNCTIONS:
        return GPO_FUNCTIONS[loss_type](h)
    raise ConfigError(f"objective.loss_type: unknown {loss_type!r}; choose one of {', '.join(LossType.__args__)}")


@register_objective("preference")
class Preference(ReferenceMixin, Objective):
    """Pairwise preference optimisation (DPO / IPO / SLiC / GPO family / rDPO / cDPO).

    Batches are (ids [2B, S], mask [2B, S]) with chosen rows first (see `efficient.data.preferences`).
    Validation reports `pref_acc`: the fraction of held-out pairs whose implicit reward
    beta * Delta prefers the chosen completion (the synthetic task labels validation pairs by
    the true reward), and `margin`, the mean Delta."""

    primary_metric = "pref_acc"
    higher_is_better = True

    def __init__(
        self,
        loss_type: LossType = "sigmoid",
        beta: float = 0.1,
        eps: float = 0.1,
        label_smoothing: float = 0.0,
        average_log_prob: bool = False,
        sft_weight: float = 0.0,
    ) -> None:
        if beta <= 0:
            raise ConfigError(f"objective.beta must be > 0, got {beta}")
        if loss_type == "robust" and not 0 <= eps < 0.5:
            raise ConfigError(f"objective.eps (label-flip rate of rDPO) must be in [0, 0.5), got {eps}; at 0.5 the labels carry no information")
        if not 0 <= label_smoothing < 0.5:
            raise ConfigError(f"objective.label_smoothing must be in [0, 0.5), got {label_smoothing}")
        if label_smoothing and loss_type != "sigmoid":
            raise ConfigError("objective.label_smoothing (conservative DPO) applies to loss_type=sigmoid only; for a flip rate use loss_type=robust with eps")
        self.loss_type, self.beta, self.eps = loss_type, beta, eps
        self.label_smoothing, self.average, self.sft_weight = label_smoothing, average_log_prob, sft_weight
        self.ref: nn.Module | None = None

    def deltas(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(Delta per pair, policy log-probs of all rows)."""
        ids, mask = batch[0], batch[1]
        pi = sequence_logps(model, ids, mask, self.average)
        with torch.no_grad():
            ref = sequence_logps(self.reference(model), ids, mask, self.average)
        B = ids.shape[0] // 2
        r = pi - ref
        return r[:B] - r[B:], pi

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        delta, pi = self.deltas(model, batch)
        losses = preference_losses(delta, self.beta, self.loss_type, self.eps, self.label_smoothing)
        loss = losses.mean()
        if self.sft_weight:  # NLL of the chosen completions per token (Idk-DPO / RPO style regulariser)
            B = delta.shape[0]
            n_tok = batch[1][:B, 1:].sum().clamp_min(1.0)
            loss = loss - self.sft_weight * pi[:B].sum() / n_tok
        return loss, {"loss": loss.detach(), "margin": delta.mean().detach(), "pref_acc": (delta > 0).float().mean().detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        delta, _ = self.deltas(model, batch)
        losses = preference_losses(delta, self.beta, self.loss_type, self.eps, self.label_smoothing)
        return {"loss": losses.sum().item(), "pref_acc": (delta > 0).sum().item(), "margin": delta.sum().item(), "n": float(delta.numel())}


# ------------------------------------------------------------------------------------------ KTO


def kto_losses(
    r: torch.Tensor, r_mismatched: torch.Tensor, desirable: torch.Tensor, beta: float = 0.1, lambda_d: float = 1.0, lambda_u: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example KTO losses and the reference point z0.

    r = log pi(y|x) - log ref(y|x); z0 = max(0, mean r on mismatched (x, y') pairs), detached.
    desirable: lambda_D (1 - sigmoid(beta (r - z0))); undesirable: lambda_U (1 - sigmoid(beta (z0 - r)))."""
    z0 = r_mismatched.detach().mean().clamp_min(0)
    d = desirable.to(torch.bool)
    v = torch.where(d, lambda_d * torch.sigmoid(beta * (r - z0)), lambda_u * torch.sigmoid(beta * (z0 - r)))
    lam = torch.where(d, torch.full_like(r, lambda_d), torch.full_like(r, lambda_u))
    return lam - v, z0


@register_objective("kto")
class KTO(ReferenceMixin, Objective):
    """KTO on unpaired batches (ids, mask, labels, kl_ids, kl_mask). Validation on pair batches
    reports `pref_acc` (chosen r > rejected r), on unpaired batches `acc` (sign(r - z0) vs label)."""

    primary_metric = "pref_acc"
    higher_is_better = True

    def __init__(self, beta: float = 0.1, lambda_d: float = 1.0, lambda_u: float = 1.0, average_log_prob: bool = False) -> None:
        if beta <= 0 or lambda_d <= 0 or lambda_u <= 0:
            raise ConfigError(f"objective.beta, lambda_d and lambda_u must be > 0, got {beta}, {lambda_d}, {lambda_u}")
        self.beta, self.lambda_d, self.lambda_u, self.average = beta, lambda_d, lambda_u, average_log_prob
        self.ref: nn.Module | None = None

    def setup(self, model: nn.Module, data: Any, recipe: Any) -> None:
        super().setup(model, data, recipe)
        meta = getattr(data, "meta", {}) or {}
        if meta.get("format", "unpaired") != "unpaired":
            raise ConfigError("objective kto needs unpaired training data: set data.format: unpaired (prompt/completion/label records)")

    def log_ratios(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, grad: bool = True) -> torch.Tensor:
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            pi = sequence_logps(model, ids, mask, self.average)
        with torch.no_grad():
            ref = sequence_logps(self.reference(model), ids, mask, self.average)
        return pi - ref

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        ids, mask, labels, kl_ids, kl_mask = batch
        r = self.log_ratios(model, ids, mask)
        r_kl = self.log_ratios(model, kl_ids, kl_mask, grad=False)  # extra no-grad forwards (KTO's cost)
        losses, z0 = kto_losses(r, r_kl, labels, self.beta, self.lambda_d, self.lambda_u)
        loss = losses.mean()
        return loss, {"loss": loss.detach(), "z0": z0.detach(), "r_desirable": _masked_mean(r, labels > 0), "r_undesirable": _masked_mean(r, labels <= 0)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        if len(batch) == 2:  # pairs
            ids, mask = batch
            r = self.log_ratios(model, ids, mask, grad=False)
            B = ids.shape[0] // 2
            return {"pref_acc": (r[:B] > r[B:]).sum().item(), "margin": (r[:B] - r[B:]).sum().item(), "n": float(B)}
        ids, mask, labels, kl_ids, kl_mask = batch
        r = self.log_ratios(model, ids, mask, grad=False)
        r_kl = self.log_ratios(model, kl_ids, kl_mask, grad=False)
        losses, z0 = kto_losses(r, r_kl, labels, self.beta, self.lambda_d, self.lambda_u)
        acc = ((r > z0) == (labels > 0)).sum().item()
        return {"loss": losses.sum().item(), "acc": acc, "pref_acc": acc, "n": float(len(labels))}


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean of `x` where `m`, NaN where `m` is empty; on the device, with no host sync."""
    return torch.where(m, x.detach(), 0).sum() / m.sum()
