"""Early-exit LM training (EE-LLM): L = L_final + sum_i w_i(it) * L_i over the model's early exits.

L_i is the token-mean next-token cross-entropy of exit i. Weights ramp from `weight_init` to
`weights` over `warmup_iters` steps (linear or cosine); with all weights 0 this is plain LM
training. LayerSkip's curricula (Elhoushi et al. 2024) switch early exits on and off by step: an
inactive exit has weight 0 and is not computed. `rotational`: one early exit per step, in turn;
`gradual`: exit i of n (1 = shallowest) is active from step (n - i) / n * `curriculum_iters` on,
so the deepest trains from the start and all from step (n-1)/n * `curriculum_iters`.
The model must provide `exit_layers`, `num_layers` and `exit_states(idx, layers)`
(efficient.models.ee_gpt, efficient.hf).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.objectives import Objective, register_objective


def exit_weight(step: float, init: float, target: float, warmup_iters: int, style: str = "linear") -> float:
    """w(it) = init + (target - init) * r(min(it / W, 1)), r(u) = u or (1 - cos(pi u)) / 2; W = 0 -> target."""
    if warmup_iters <= 0:
        return target
    u = min(max(step, 0) / warmup_iters, 1.0)
    r = u if style == "linear" else 0.5 * (1 - math.cos(math.pi * u))
    return init + (target - init) * r


def stage_aux_loss(local_loss: torch.Tensor, output: torch.Tensor, output_grad: torch.Tensor) -> torch.Tensor:
    """EE-LLM's pipeline-stage loss: the stage's own exit losses plus <x_i, sg(g_i)>, where g_i is
    d(later stages' loss)/d(output). Its parameter gradients equal those of the total loss."""
    return local_loss + (output * output_grad.detach()).sum()


def token_ce(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, dynamic: bool, fused: bool, chunk_size: int) -> torch.Tensor:
    """Mean CE of `hidden @ weight.T`; `dynamic` weights each token by its detached max-prob."""
    if fused:
        from efficient.kernels.linear_ce import linear_ce

        return linear_ce(hidden, weight, target, confidence_weighted=dynamic, chunk_size=chunk_size)
    logits = hidden @ weight.T
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, -2)
    if not dynamic:
        return F.cross_entropy(logits, target.flatten())
    logp = F.log_softmax(logits, -1)
    ce = -logp.gather(-1, target.flatten()[:, None])[:, 0]
    return (ce * logp.detach().amax(-1).exp()).mean()


def _per_exit(v: float | Sequence[float], n: int, key: str) -> list[float]:
    vals = [float(v)] * n if isinstance(v, (int, float)) else [float(x) for x in v]
    if len(vals) != n:
        raise ConfigError(f"objective.{key}: expected one value per early exit ({n}), got {len(vals)}: {list(vals)}")
    return vals


@register_objective("exits")
class ExitLoss(Objective):
    """Final-head CE plus weighted early-exit CEs. Logs each exit's loss and current weight."""

    primary_metric = "loss"
    higher_is_better = False

    def __init__(
        self,
        weights: list[float] | float = 1.0,
        weight_init: list[float] | float = 0.0,
        warmup_iters: int = 0,
        warmup_style: Literal["linear", "cosine"] = "linear",
        temperatures: list[float] | float = 1.0,
        dynamic_token_weights: bool = False,
        fused: bool = False,
        chunk_size: int = 1024,
        curriculum: Literal["none", "rotational", "gradual"] = "none",
        curriculum_iters: int = 0,
    ) -> None:
        if warmup_iters < 0:
            raise ConfigError(f"objective.warmup_iters must be >= 0, got {warmup_iters}")
        if warmup_style not in ("linear", "cosine"):
            raise ConfigError(f"objective.warmup_style must be 'linear' or 'cosine', got {warmup_style!r}")
        if chunk_size < 1:
            raise ConfigError(f"objective.chunk_size must be >= 1, got {chunk_size}")
        if curriculum not in ("none", "rotational", "gradual"):
            raise ConfigError(f"objective.curriculum must be 'none', 'rotational' or 'gradual', got {curriculum!r}")
        if curriculum == "gradual" and curriculum_iters < 1:
            raise ConfigError(f"objective.curriculum_iters: the gradual curriculum enables exits over this many steps; must be >= 1, got {curriculum_iters}")
        self.curriculum, self.curriculum_iters = curriculum, curriculum_iters
        self.raw = {"weights": weights, "weight_init": weight_init, "temperatures": temperatures}
        self.warmup_iters, self.warmup_style = warmup_iters, warmup_style
        self.dynamic, self.fused, self.chunk_size = dynamic_token_weights, fused, chunk_size
        self.layers: list[int] | None = None
        self.epoch, self.step = 0.0, 0

    def setup(self, model: nn.Module, data: Any = None, recipe: Any = None) -> None:
        if not hasattr(model, "exit_states"):
            raise ConfigError(f"objective 'exits' needs an early-exit model (e.g. ee-gpt-tiny); {type(model).__name__} has no exits")
        self.layers = list(model.exit_layers[:-1])
        n = len(self.layers)
        self.targets = _per_exit(self.raw["weights"], n, "weights")
        self.inits = _per_exit(self.raw["weight_init"], n, "weight_init")
        self.temps = _per_exit(self.raw["temperatures"], n, "temperatures")
        if any(t <= 0 for t in self.temps):
            raise ConfigError(f"objective.temperatures must be > 0, got {self.temps}")

    def active_exits(self, step: int) -> list[int]:
        """The early exits the curriculum trains at `step` (all of them without one)."""
        n = len(self.layers)
        if self.curriculum == "rotational" and n:
            return [self.layers[step % n]]
        if self.curriculum == "gradual":
            return [k for i, k in enumerate(self.layers, 1) if step * n >= (n - i) * self.curriculum_iters]
        return list(self.layers)

    def weights(self) -> dict[int, float]:
        """Current weight of each early exit (by layer); 0 for exits the curriculum leaves out."""
        on = set(self.active_exits(self.step))
        return {k: exit_weight(self.step, w0, w1, self.warmup_iters, self.warmup_style) if k in on else 0.0
                for k, w0, w1 in zip(self.layers, self.inits, self.targets)}

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        if self.layers is None:
            self.setup(model)
        x, y = batch
        w = self.weights()
        active = [k for k, wk in w.items() if wk != 0]  # exits at weight 0 are not computed at all
        states = model.exit_states(x, active + [model.num_layers])
        temp = dict(zip(self.layers, self.temps))
        final = token_ce(states[-1].hidden, states[-1].weight, y, False, self.fused, self.chunk_size)
        total, logs = final, {"loss_final": final.detach()}
        for s in states[:-1]:
            # exit temperature divides the logits on the training path only (EE-LLM)
            li = token_ce(s.hidden / temp[s.layer], s.weight, y, self.dynamic, self.fused, self.chunk_size)
            total = total + w[s.layer] * li
            logs[f"loss_exit{s.layer}"], logs[f"w_exit{s.layer}"] = li.detach(), w[s.layer]
        logs["loss"] = total.detach()
        return total, logs

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        """Summed CE of every exit (`loss` is the final head's) and the token count `n`."""
        x, y = batch
        out: dict[str, float] = {"n": float(y.numel())}
        for s in model.exit_states(x):
            logits = s.hidden @ s.weight.T
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            ce = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum").item()
            out["loss" if s.layer == model.num_layers else f"loss_exit{s.layer}"] = ce
        return out
