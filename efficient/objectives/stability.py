"""Membrane-perturbation stability training (Ding et al., ICML 2024): clean + perturbed CE plus the
mean square of the simplified membrane-potential perturbation (MS-MPPD) of the last spiking layer.

    L = kappa * CE(f(x), y) + (1 - kappa) * CE(f(x~), y) + rho * mean_{t,b,n} eps[t]^2
    eps[t] = leak * eps[t-1] + dI[t],  dI = I_clean.detach() - I_perturbed

I is the input current of the last spiking layer (its module input, i.e. before a DLIF gain),
captured with a forward hook. x~ is Gaussian noise (not clamped) or one FGSM step from a tiny
random start, computed in eval mode. rho = 0 is the plain perturbed-training ablation; the
SNN-RAT weight-orthogonality step (`parseval_beta` > 0) gives the paper's AT+Reg mode.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.attacks import AttackSpec, check_eps, eval_mode, input_grad, run_attack
from efficient.errors import ConfigError
from efficient.objectives import Objective, register_objective

Perturbation = Literal["none", "gaussian", "fgsm"]


# ----------------------------------------------------------------------------- the last layer


def spiking_layers(model: nn.Module) -> list[nn.Module]:
    """Spiking neuron modules of `model` in module order."""
    from efficient.models.neurons import SpikingNeuron

    return [m for m in model.modules() if isinstance(m, SpikingNeuron)]


def last_spiking_layer(model: nn.Module) -> nn.Module:
    layers = spiking_layers(model)
    if not layers:
        raise ConfigError(
            f"objective stability needs a model with spiking neurons (efficient.models.neurons.SpikingNeuron); "
            f"{type(model).__name__} has none. Use a stable-snn-* zoo model or the classification objective."
        )
    return layers[-1]


def layer_dynamics(layer: nn.Module) -> tuple[float, float]:
    """(leak, input scale) of the neuron's membrane update V[t] = leak * V[t-1] + scale * I[t]."""
    if hasattr(layer, "leak"):
        return float(layer.leak), 1.0
    if hasattr(layer, "tau"):  # LIF: V + (X - V)/tau (decay_input) or V - V/tau + X
        tau = float(layer.tau)
        return 1.0 - 1.0 / tau, (1.0 / tau if getattr(layer, "decay_input", True) else 1.0)
    raise ConfigError(f"cannot read the leak of {type(layer).__name__}; set objective.leak explicitly")


class CurrentRecorder:
    """Collects the input of one layer (time-major `[T, B, ...]`) on every forward while recording.
    The hook is registered once per layer and stays: registering one per step would break a
    compiled step's graph."""

    def __init__(self, layer: nn.Module) -> None:
        self.seen: list[torch.Tensor] = []
        self.active = False
        layer.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: tuple, out: Any) -> None:
        if self.active:
            self.seen.append(inputs[0])

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        self.seen, self.active = [], True
        try:
            yield self.seen
        finally:
            self.active = False


_RECORDERS: "weakref.WeakKeyDictionary[nn.Module, CurrentRecorder]" = weakref.WeakKeyDictionary()


def current_recorder(layer: nn.Module) -> CurrentRecorder:
    """The layer's recorder, created (and its hook registered) on first use."""
    rec = _RECORDERS.get(layer)
    if rec is None:
        rec = _RECORDERS[layer] = CurrentRecorder(layer)
    return rec


def record_current(layer: nn.Module) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
    """Collect the input of `layer` (time-major `[T, B, ...]`) on every forward inside the block."""
    return current_recorder(layer).recording()


# ------------------------------------------------------------------------------------- MPPD


def mppd(delta: torch.Tensor, leak: float) -> torch.Tensor:
    """Simplified membrane-perturbation dynamics eps[t] = leak * eps[t-1] + delta[t], eps[-1] = 0."""
    out, e = [], torch.zeros_like(delta[0])
    for t in range(delta.shape[0]):
        e = leak * e + delta[t]
        out.append(e)
    return torch.stack(out)


def mppd_matrix(timesteps: int, leak: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """L_T(leak): lower-triangular Toeplitz, entry (t, s) = leak^(t-s) for s <= t; eps = L_T @ delta."""
    t = torch.arange(timesteps)
    d = (t[:, None] - t[None, :]).to(dtype)
    return torch.where(d >= 0, torch.tensor(leak, dtype=dtype) ** d.clamp(min=0), torch.zeros((), dtype=dtype))


def mppd_gain(timesteps: int, leak: float, gains: torch.Tensor | None = None) -> float:
    """Sharp finite-horizon L2 gain of the MPPD from input-current perturbation to eps:
    sigma_max(L_T diag(a)); multiply by ||W||_2 for the gain from spike perturbations."""
    m = mppd_matrix(timesteps, leak)
    if gains is not None:
        m = m * gains.detach().to(m.dtype).cpu()[None, :]
    return float(torch.linalg.matrix_norm(m, ord=2))


# ---------------------------------------------------------------------------- perturbations


def gaussian_perturbation(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """x + sigma * N(0, I), not clamped (as the paper's code)."""
    return (x + sigma * torch.randn_like(x)).detach()


def fgsm_perturbation(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: float, start_sigma: float = 0.001, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """One FGSM step of size `step` from x0 = x + start_sigma * z, in eval mode, clipped to [0, 1].
    `noise` is z (standard normal) if given. ||x~ - x||_inf <= step + start_sigma * max|z|."""
    z = torch.randn_like(x) if noise is None else noise
    x0 = x.detach() + start_sigma * z
    with eval_mode(model):
        g = input_grad(model, x0, y, reduction="mean")
    return (x0 + step * g.sign()).clamp(0.0, 1.0).detach()


# -------------------------------------------------------------------------- the loss terms


def stability_terms(
    model: nn.Module,
    x: torch.Tensor,
    x_pert: torch.Tensor,
    y: torch.Tensor,
    layer: nn.Module | None = None,
    leak: float | None = None,
    mppd_after_gain: bool = False,
) -> dict[str, torch.Tensor]:
    """Two forward passes (clean, perturbed) in the model's current mode; returns ce_clean, ce_pert,
    mppd (mean eps^2; clean current detached) and the clean logits."""
    layer = last_spiking_layer(model) if layer is None else layer
    lk, scale = layer_dynamics(layer) if leak is None else (leak, 1.0)
    with record_current(layer) as seen:
        logits = model(x)
        logits_pert = model(x_pert)
    if len(seen) != 2:
        raise ConfigError(f"the last spiking layer ran {len(seen)} times for two forward passes; it must run once per forward")
    clean, pert = seen[0].detach(), seen[1]
    delta = (clean - pert) * scale
    if mppd_after_gain and hasattr(layer, "gain"):
        delta = delta * layer.gain.view(-1, *([1] * (delta.dim() - 1)))
    eps = mppd(delta.float(), lk)
    return {
        "ce_clean": F.cross_entropy(logits.float(), y),
        "ce_pert": F.cross_entropy(logits_pert.float(), y),
        "mppd": eps.pow(2).mean(),
        "logits": logits,
    }


# ------------------------------------------------------------------- SNN-RAT regulariser


@torch.no_grad()
def parseval_step(model: nn.Module, beta: float, row_fraction: float = 0.3, min_rows: int = 200) -> None:
    """W <- (1 + beta) W - beta W W^T W on every Conv/Linear (rows = output channels); Linear
    layers with >= `min_rows` outputs update a random `row_fraction` of their rows (SNN-RAT)."""
    for m in model.modules():
        if not isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear)):
            continue
        w = m.weight.data
        flat = w.reshape(w.shape[0], -1)
        if isinstance(m, nn.Linear) and w.shape[0] >= min_rows:
            rows = torch.randperm(w.shape[0], device=w.device)[: int(w.shape[0] * row_fraction)]
            sub = flat[rows]
            flat[rows] = (1 + beta) * sub - beta * (sub @ sub.t() @ sub)
        else:
            w.copy_(((1 + beta) * flat - beta * (flat @ flat.t() @ flat)).reshape(w.shape))


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of a vector onto {w >= 0, sum w = 1} (sort-based, Duchi et al. 2008)."""
    u, _ = torch.sort(v, descending=True)
    css = torch.cumsum(u, 0) - 1
    k = torch.arange(1, len(v) + 1, device=v.device, dtype=v.dtype)
    # rho = the largest k with u_k > (css_k) / k, kept on the device: AT+Reg projects before every
    # step's forward, and reading rho back would make the host wait for the device each time
    rho = torch.where(u - css / k > 0, k, 0).amax().clamp(min=1)
    return torch.clamp(v - css.gather(0, rho.long().view(1) - 1) / rho, min=0)


@torch.no_grad()
def project_convex_combinations(model: nn.Module) -> None:
    """Keep every ConvexCombination's weights on the simplex."""
    from efficient.models.stable_snn import ConvexCombination

    for m in model.modules():
        if isinstance(m, ConvexCombination):
            m.comb.data.copy_(project_simplex(m.comb.data))


# -------------------------------------------------------------------------------- objective


@register_objective("stability")
class Stability(Objective):
    """MS-MPPD stability training with Gaussian (`sigma`) or FGSM (`step`) perturbations.

    `parseval_beta` > 0 adds SNN-RAT's orthogonality retraction and the simplex projection of the
    residual weights after every optimizer step (applied before the next step's forward, since
    the engine has no after-step hook; set optim.weight_decay: 0 as the paper does in this mode).
    `eval_attack` adds robust accuracy (`acc_<attack>`) to validation at `eval_eps`."""

    def __init__(
        self,
        perturbation: Perturbation = "gaussian",
        sigma: float = 8 / 255,
        step: float = 4 / 255,
        start_sigma: float = 0.001,
        kappa: float = 0.5,
        rho: float = 1.0,
        leak: float | None = None,
        mppd_after_gain: bool = False,
        parseval_beta: float = 0.0,
        parseval_row_fraction: float = 0.3,
        eval_attack: Literal["none", "fgsm", "pgd"] = "none",
        eval_eps: float = 8 / 255,
        eval_steps: int = 10,
    ) -> None:
        if perturbation not in ("none", "gaussian", "fgsm"):
            raise ConfigError(f"objective.perturbation must be none, gaussian or fgsm, got {perturbation!r}")
        if not 0.0 <= kappa <= 1.0:
            raise ConfigError(f"objective.kappa (weight of the clean CE) must be in [0, 1], got {kappa}")
        if rho < 0 or sigma < 0 or start_sigma < 0 or parseval_beta < 0:
            raise ConfigError("objective.rho, sigma, start_sigma and parseval_beta must be >= 0")
        check_eps(step, "objective.step")
        check_eps(eval_eps, "objective.eval_eps")
        if leak is not None and not 0.0 <= leak < 1.0:
            raise ConfigError(f"objective.leak must be in [0, 1), got {leak}")
        self.perturbation, self.sigma, self.fgsm_step, self.start_sigma = perturbation, sigma, step, start_sigma
        self.kappa, self.rho, self.leak, self.mppd_after_gain = kappa, rho, leak, mppd_after_gain
        self.parseval_beta, self.parseval_row_fraction = parseval_beta, parseval_row_fraction
        self.eval_spec = None if eval_attack == "none" else AttackSpec(eval_attack, eval_eps, eval_steps)
        self._layer: tuple[int, nn.Module] | None = None
        self._steps_seen = 0
        self.epoch, self.step = 0.0, 0

    def setup(self, model: nn.Module, data: Any, recipe: Any) -> None:
        self.layer(model)  # fail before training on a model without spiking layers

    def layer(self, model: nn.Module) -> nn.Module:
        if self._layer is None or self._layer[0] != id(model):
            self._layer = (id(model), last_spiking_layer(model))
            current_recorder(self._layer[1])  # its hook now, outside any compiled step
        return self._layer[1]

    def perturb(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.perturbation == "gaussian":
            return gaussian_perturbation(x, self.sigma)
        return fgsm_perturbation(model, x, y, self.fgsm_step, self.start_sigma)

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        x, y = batch
        layer = self.layer(model)
        if self.parseval_beta > 0 and self._steps_seen > 0:
            parseval_step(model, self.parseval_beta, self.parseval_row_fraction)
            project_convex_combinations(model)
        self._steps_seen += 1
        if self.perturbation == "none":  # plain CE: both CE terms would see the same input
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
            return loss, {"loss": loss.detach(), "ce_clean": loss.detach(), "acc": (logits.argmax(-1) == y).float().mean().detach()}
        x_pert = self.perturb(model, x, y)
        terms = stability_terms(model, x, x_pert, y, layer, self.leak, self.mppd_after_gain)
        loss = self.kappa * terms["ce_clean"] + (1 - self.kappa) * terms["ce_pert"] + self.rho * terms["mppd"]
        logs = {
            "loss": loss.detach(),
            "ce_clean": terms["ce_clean"].detach(),
            "ce_pert": terms["ce_pert"].detach(),
            "mppd": terms["mppd"].detach(),
            "acc": (terms["logits"].argmax(-1) == y).float().mean().detach(),
        }
        return loss, logs

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        x, y = batch
        logits = model(x)
        ok = logits.argmax(-1) == y
        out = {"loss": F.cross_entropy(logits.float(), y, reduction="sum").item(), "acc": ok.sum().item(), "n": float(len(y))}
        if self.eval_spec is not None:
            x_adv = run_attack(model, x, y, self.eval_spec)
            out[f"acc_{self.eval_spec.name}"] = (ok & (model(x_adv).argmax(-1) == y)).sum().item()
        return out
