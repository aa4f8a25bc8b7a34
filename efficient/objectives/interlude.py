"""InterLUDE (Huang et al., ICML 2024): semi-supervised learning with labeled-unlabeled
interactions, on top of FixMatch.

The batch is interleaved so each labeled sample's neighbours are its unlabeled group:
[l_w, u_w * mu, l_s, u_s * mu] per labeled sample. Embedding fusion at one module:
h' = (1 - delta) h + delta roll(h, -1) along the batch (training only). Losses:
    L_sup = CE(f(l_w), y)
    L_u   = mean of mask * CE(f(u_s), argmax p_w),  p_w = softmax(f(u_w) / T), mask = max p_w >= tau
    L_rel = MSE(Delta_U, Delta_L),  Delta_L = softmax(f(l_w)/T_s) - softmax(f(l_s)/T_s) (detached),
            Delta_U = mean over the mu neighbours of softmax(f(u_w)/T_s) - softmax(f(u_s)/T_s)
    L = L_sup + lambda_u L_u + lambda_rel L_rel.
With delta = 0 and lambda_rel = 0 this is FixMatch. Batches come from `ssl_digits`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.objectives import Objective, register_objective


def interleave(xl_w: torch.Tensor, xl_s: torch.Tensor, u_w: torch.Tensor, u_s: torch.Tensor) -> torch.Tensor:
    """[B, ...] x2 and [B, mu, ...] x2 -> [B * 2 * (1 + mu), ...] as [l_w, u_w*mu, l_s, u_s*mu] per sample."""
    return torch.cat([xl_w.unsqueeze(1), u_w, xl_s.unsqueeze(1), u_s], dim=1).flatten(0, 1)


def deinterleave(out: torch.Tensor, mu: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `interleave` on outputs [N, ...] -> l_w [B], l_s [B], u_w [B, mu], u_s [B, mu]."""
    o = out.reshape(-1, 2 * (1 + mu), *out.shape[1:])
    return o[:, 0], o[:, 1 + mu], o[:, 1 : 1 + mu], o[:, 2 + mu :]


def fuse(h: torch.Tensor, delta: float) -> torch.Tensor:
    """Embedding fusion with the next sample in the batch."""
    return (1 - delta) * h + delta * torch.roll(h, shifts=-1, dims=0)


@contextlib.contextmanager
def fusion_at(module: nn.Module, delta: float) -> Iterator[None]:
    handle = module.register_forward_hook(lambda _m, _i, out: fuse(out, delta))
    try:
        yield
    finally:
        handle.remove()


def delta_consistency(l_w: torch.Tensor, l_s: torch.Tensor, u_w: torch.Tensor, u_s: torch.Tensor, t_s: float = 1.0) -> torch.Tensor:
    """MSE between the unlabeled neighbours' mean weak-strong gap and the labeled gap (detached)."""
    d_l = (torch.softmax(l_w.float() / t_s, -1) - torch.softmax(l_s.float() / t_s, -1)).detach()
    d_u = (torch.softmax(u_w.float() / t_s, -1) - torch.softmax(u_s.float() / t_s, -1)).mean(1)
    return F.mse_loss(d_u, d_l)


def fixmatch_unlabeled(u_w: torch.Tensor, u_s: torch.Tensor, tau: float = 0.95, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked CE of strong views against confident weak pseudo-labels, mask rate)."""
    p = torch.softmax(u_w.detach().float().flatten(0, 1) / temperature, -1)
    conf, pseudo = p.max(-1)
    mask = (conf >= tau).float()
    ce = F.cross_entropy(u_s.float().flatten(0, 1), pseudo, reduction="none")
    return (ce * mask).mean(), mask.mean()


@register_objective("interlude")
class InterLUDE(Objective):
    """`fusion_module` names the module whose output is fused (default `body.1`, the first hidden
    activation of the zoo MLPs; "" turns fusion off)."""

    def __init__(
        self,
        delta: float = 0.1,
        fusion_module: str = "body.1",
        lambda_u: float = 1.0,
        lambda_rel: float = 1.0,
        tau: float = 0.95,
        pseudo_temperature: float = 1.0,
        consistency_temperature: float = 1.0,
    ) -> None:
        if not 0 <= delta < 1:
            raise ConfigError(f"objective.delta must be in [0, 1), got {delta}")
        if not 0 < tau <= 1:
            raise ConfigError(f"objective.tau must be in (0, 1], got {tau}")
        self.delta, self.fusion_module, self.lambda_u, self.lambda_rel = delta, fusion_module, lambda_u, lambda_rel
        self.tau, self.t_pseudo, self.t_s = tau, pseudo_temperature, consistency_temperature

    def setup(self, model: nn.Module, data: Any, recipe: Any) -> None:
        if self.fusion_module and self.delta > 0:
            names = dict(model.named_modules())
            if self.fusion_module not in names:
                raise ConfigError(f"objective.fusion_module: {type(model).__name__} has no module {self.fusion_module!r}; e.g. one of {list(names)[1:8]}")

    def logits(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, ...]:
        xl_w, xl_s, _, u_w, u_s = batch
        mu = u_w.shape[1]
        x = interleave(xl_w, xl_s, u_w, u_s)
        ctx = fusion_at(dict(model.named_modules())[self.fusion_module], self.delta) if self.fusion_module and self.delta > 0 else contextlib.nullcontext()
        with ctx:
            out = model(x)
        return deinterleave(out, mu)

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        y = batch[2]
        l_w, l_s, u_w, u_s = self.logits(model, batch)
        sup = F.cross_entropy(l_w.float(), y)
        unsup, mask_rate = fixmatch_unlabeled(u_w, u_s, self.tau, self.t_pseudo)
        rel = delta_consistency(l_w, l_s, u_w, u_s, self.t_s) if self.lambda_rel else sup.new_zeros(())
        loss = sup + self.lambda_u * unsup + self.lambda_rel * rel
        return loss, {"loss": loss.detach(), "sup": sup.detach(), "unsup": unsup.detach(), "rel": rel.detach(), "mask": mask_rate.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits.float(), y, reduction="sum").item(), "acc": (logits.argmax(-1) == y).sum().item(), "n": float(len(y))}
