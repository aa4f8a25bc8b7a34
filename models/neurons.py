"""Multi-step spiking neurons over time-major input `[T, ...]`, stateless across calls."""

from __future__ import annotations

import math

import torch
from torch import nn


class _SigmoidSpike(torch.autograd.Function):
    """Heaviside forward, sigmoid(alpha*x)' backward (spikingjelly's `surrogate.Sigmoid`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return (x >= 0).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(ctx.alpha * x)
        return g * ctx.alpha * s * (1 - s), None


class LIF(nn.Module):
    """Leaky integrate-and-fire, multi-step: `H = V + (X - (V - V_reset)) / tau`, spike, reset."""

    def __init__(
        self,
        tau: float = 2.0,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        detach_reset: bool = True,
        decay_input: bool = True,
        surrogate: str = "sigmoid",
        alpha: float = 4.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if tau <= 1.0:
            raise ValueError(f"LIF tau must be > 1 (got {tau})")
        self.tau, self.v_threshold, self.v_reset = float(tau), float(v_threshold), v_reset
        self.detach_reset, self.decay_input = detach_reset, decay_input
        self.surrogate, self.alpha, self.backend = surrogate, float(alpha), backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.zeros_like(x[0]) if self.v_reset is None else torch.full_like(x[0], self.v_reset)
        vr = 0.0 if self.v_reset is None else self.v_reset
        out = []
        for t in range(x.shape[0]):
            if self.decay_input:
                h = v + (x[t] - (v - vr)) / self.tau
            else:
                h = v - (v - vr) / self.tau + x[t]
            s = _SigmoidSpike.apply(h - self.v_threshold, self.alpha)
            sr = s.detach() if self.detach_reset else s
            v = h - sr * self.v_threshold if self.v_reset is None else h * (1 - sr) + sr * self.v_reset
            out.append(s)
        return torch.stack(out)

    def extra_repr(self) -> str:
        return (
            f"tau={self.tau}, v_threshold={self.v_threshold}, v_reset={self.v_reset}, "
            f"detach_reset={self.detach_reset}, decay_input={self.decay_input}, "
            f"surrogate={self.surrogate}(alpha={self.alpha}), backend={self.backend}"
        )
