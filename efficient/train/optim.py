"""Optimizers and the per-step learning-rate schedule built from a recipe's `optim` / `schedule`."""

from __future__ import annotations

import math

import torch
from torch import nn

from efficient.config import OptimConfig, ScheduleConfig


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


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.decay_1d)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)


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
