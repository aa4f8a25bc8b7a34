"""Optimizers and the per-step learning-rate schedule built from a recipe's `optim` / `schedule`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from efficient.config import OptimConfig, Recipe, ScheduleConfig, check_optimizer_in_backward  # noqa: F401 - re-exported
from efficient.errors import ConfigError


def param_groups(model: nn.Module, weight_decay: float, decay_1d: bool) -> list[dict]:
    """Weight decay on matrices/kernels only; norms, biases and other 1-D params get none (timm's rule)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim > 1 or decay_1d else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, in_backward: bool = False) -> torch.optim.Optimizer:
    """The recipe's optimizer over `param_groups`; `in_backward`: as an `InBackwardOptimizer`."""
    groups = param_groups(model, cfg.weight_decay, cfg.decay_1d)
    if cfg.name == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    elif cfg.name == "adam":
        opt = torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    else:
        opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    return InBackwardOptimizer(opt) if in_backward else opt


class InBackwardOptimizer(torch.optim.Optimizer):
    """An optimizer that updates each parameter inside backward, as soon as its gradient is
    accumulated, and frees that gradient: a step never holds all parameter gradients at once
    (PyTorch's "optimizer step in backward" recipe; torchtune's `optimizer_in_bwd`).

    It wraps an optimizer whose update is per parameter (SGD, Adam, AdamW; not one that couples
    parameters, such as a global-norm clip, which the trainer refuses beside it). Every parameter gets
    a group of its own (its settings copied from its group in `base`) and an inner optimizer of
    `base`'s class over that group; the inner optimizers share this one's `state` and group dicts, so
    an LR scheduler, `state_dict` and `load_state_dict` act on this optimizer as on any other. The
    update is the base optimizer's, element for element.

    Updates happen only inside `stepping()` (the trainer wraps its `loss.backward()` in it); any other
    backward (an attack's, a measurement's) accumulates gradients as usual, and `step()` then applies
    them as a plain optimizer would; so does a parameter that did not require gradients when this
    optimizer was made (it has no hook) and was unfrozen since."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [p]}
                  for g in base.param_groups for p in g["params"]]
        if not groups:
            raise ValueError("InBackwardOptimizer: the base optimizer has no parameters")
        super().__init__(groups, dict(base.defaults))
        self._inner: dict[torch.Tensor, torch.optim.Optimizer] = {
            g["params"][0]: type(base)([g]) for g in self.param_groups}  # the group's values override the class defaults
        self._link()
        self._armed = False
        self._stepped: set[torch.Tensor] = set()
        # a frozen parameter gets no hook: should it get a gradient later, `step()` applies it after backward
        self._handles = [p.register_post_accumulate_grad_hook(self._update) for p in self._inner if p.requires_grad]

    def _link(self) -> None:
        """Point each inner optimizer at this one's group dict of its parameter and at the shared state
        (again after `load_state_dict`, which replaces both)."""
        for g in self.param_groups:
            inner = self._inner[g["params"][0]]
            inner.param_groups = [g]
            inner.state = self.state  # keyed by parameter: one shared moment store

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    def _update(self, p: torch.Tensor) -> None:
        if not self._armed or p.grad is None:
            return
        if p in self._stepped:
            raise RuntimeError(
                "InBackwardOptimizer: a parameter's gradient was accumulated twice in one backward (the update "
                "would use a partial gradient); use a plain optimizer for this model (train.optimizer_in_backward: false)"
            )
        self._stepped.add(p)
        with torch.no_grad():
            self._inner[p].step()
        p.grad = None

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """Inside: each parameter is updated (and its gradient freed) when backward accumulates it."""
        self._armed, self._stepped = True, set()
        try:
            yield
        finally:
            self._armed, self._stepped = False, set()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Applies gradients still held (from a backward outside `stepping()`); after a backward
        inside it there are none left, and this is a no-op."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, inner in self._inner.items():
            if p.grad is not None:
                inner.step()
        return loss

    def remove_hooks(self) -> None:
        """Detach from the parameters (the optimizer updates nothing in backward afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def lr_at(step: int, total_steps: int, steps_per_epoch: int, base_lr: float, cfg: ScheduleConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    warm = int(round(cfg.warmup_epochs * steps_per_epoch))
    cool = int(round(cfg.cooldown_epochs * steps_per_epoch))
    if step < warm:
        return cfg.warmup_lr + (base_lr - cfg.warmup_lr) * step / warm
    span = max(1, total_steps - warm - cool)
    u = min(1.0, (step - warm) / span)
    if cfg.name == "constant":
        return base_lr
    if cfg.name == "linear":
        return cfg.min_lr + (base_lr - cfg.min_lr) * (1 - u)
    return cfg.min_lr + (base_lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * u))


def build_scheduler(opt: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int, base_lr: float, cfg: ScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, total_steps, steps_per_epoch, base_lr, cfg) / base_lr)
