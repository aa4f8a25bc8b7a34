"""Multi-step spiking neurons over time-major input `[T, ...]`, stateless across calls.

Each forward starts from the resting membrane (no `reset_net`), runs all T steps in one call of
`efficient.kernels.lif` (Triton on CUDA, a compiled fused loop on CPU; see `backend`) and returns
spikes shaped like the input. `SpikingNeuron` is the common base class the profiler looks for.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
from torch import nn

from efficient.kernels.lif import BACKENDS, SURROGATES, check_input, default_alpha, lif

__all__ = ["SpikingNeuron", "LIF", "PLIF", "DLIF", "override_surrogate"]


def _check_choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {sorted(choices)}")


class SpikingNeuron(nn.Module):
    """Base of multi-step neurons: forward(x [T, ...]) -> spikes [T, ...] of x's dtype.

    `forward(x, return_membrane=True)` also returns H, the pre-reset membrane (fp32, differentiable);
    with `store_membrane=True` the last H is kept in `self.membrane` (it holds the autograd graph).
    """

    store_membrane: bool = False
    membrane: Optional[torch.Tensor] = None

    def _set_lif_options(self, v_threshold: float, v_reset: float | None, detach_reset: bool, decay_input: bool,
                         surrogate: str, alpha: float | None, backend: str, store_membrane: bool, spike_dtype: torch.dtype | None) -> None:
        """Validate and store the options LIF and PLIF share (their signatures stay explicit and typed);
        alpha=None becomes the surrogate's default (spikingjelly's, see kernels.lif.SURROGATE_ALPHA)."""
        _check_choice("surrogate", surrogate, SURROGATES)
        _check_choice("backend", backend, BACKENDS)
        self.v_threshold = float(v_threshold)
        self.v_reset = None if v_reset is None else float(v_reset)
        self.detach_reset, self.decay_input = bool(detach_reset), bool(decay_input)
        self.surrogate, self.alpha, self.backend = surrogate, default_alpha(surrogate, alpha), backend
        self.store_membrane, self.spike_dtype = store_membrane, spike_dtype

    def _backend_for(self, x: torch.Tensor) -> str:
        """The backend this call runs on (subclasses may choose per model rather than per call)."""
        return self.backend

    def _run(self, x: torch.Tensor, return_membrane: bool, **kw) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        want = return_membrane or self.store_membrane
        out = lif(x, return_membrane=want, backend=self._backend_for(x), **kw)
        if not want:
            return out
        spikes, h = out
        if self.store_membrane:
            self.membrane = h
        return (spikes, h) if return_membrane else spikes


class LIF(SpikingNeuron):
    """Leaky integrate-and-fire (spikingjelly LIFNode dynamics, `step_mode="m"`).

    H = V + (X - (V - V_reset)) / tau (decay_input) or V - (V - V_reset) / tau + X; spike when
    H >= v_threshold; reset to v_reset (hard) or subtract v_threshold (v_reset=None, soft).
    `alpha=None` uses the surrogate's spikingjelly default (sigmoid 4, atan 2, triangle 1).
    """

    def __init__(
        self,
        tau: float = 2.0,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        detach_reset: bool = True,
        decay_input: bool = True,
        surrogate: str = "sigmoid",
        alpha: float | None = None,
        backend: str = "auto",
        store_membrane: bool = False,
        spike_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not tau > 1.0:
            raise ValueError(f"LIF tau must be > 1 (got {tau}); tau <= 1 makes the membrane unstable")
        self.tau = float(tau)
        self._set_lif_options(v_threshold, v_reset, detach_reset, decay_input, surrogate, alpha, backend, store_membrane, spike_dtype)

    def forward(self, x: torch.Tensor, return_membrane: bool = False):
        return self._run(
            x, return_membrane, tau=self.tau, v_threshold=self.v_threshold, v_reset=self.v_reset,
            detach_reset=self.detach_reset, decay_input=self.decay_input, surrogate=self.surrogate,
            alpha=self.alpha, spike_dtype=self.spike_dtype,
        )

    def extra_repr(self) -> str:
        return (
            f"tau={self.tau}, v_threshold={self.v_threshold}, v_reset={self.v_reset}, "
            f"detach_reset={self.detach_reset}, decay_input={self.decay_input}, "
            f"surrogate={self.surrogate}(alpha={self.alpha}), backend={self.backend}"
        )


class PLIF(SpikingNeuron):
    """Parametric LIF (Fang et al. 2021; spikingjelly ParametricLIFNode): one learnable time
    constant per layer, 1/tau = sigmoid(w) with w initialised to -log(init_tau - 1)."""

    def __init__(
        self,
        init_tau: float = 2.0,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        detach_reset: bool = True,
        decay_input: bool = True,
        surrogate: str = "sigmoid",
        alpha: float | None = None,
        backend: str = "auto",
        store_membrane: bool = False,
        spike_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not init_tau > 1.0:
            raise ValueError(f"PLIF init_tau must be > 1 (got {init_tau})")
        self.w = nn.Parameter(torch.tensor(-math.log(init_tau - 1.0)))
        self._set_lif_options(v_threshold, v_reset, detach_reset, decay_input, surrogate, alpha, backend, store_membrane, spike_dtype)

    @property
    def tau(self) -> float:
        return float(1.0 / torch.sigmoid(self.w.detach()))

    def forward(self, x: torch.Tensor, return_membrane: bool = False):
        return self._run(
            x, return_membrane, v_threshold=self.v_threshold, v_reset=self.v_reset,
            detach_reset=self.detach_reset, decay_input=self.decay_input, surrogate=self.surrogate,
            alpha=self.alpha, spike_dtype=self.spike_dtype, rate=torch.sigmoid(self.w),
        )

    def extra_repr(self) -> str:
        return (
            f"tau={self.tau:.4g} (learnable), v_threshold={self.v_threshold}, v_reset={self.v_reset}, "
            f"detach_reset={self.detach_reset}, decay_input={self.decay_input}, "
            f"surrogate={self.surrogate}(alpha={self.alpha}), backend={self.backend}"
        )


class DLIF(SpikingNeuron):
    """Stable-SNN neuron (Ding et al., ICML 2024): V[t] = leak * V[t-1] * (1 - S[t-1]) + gain[t] * I[t].

    `gain` (one learnable scalar per time step, initialised to 1) scales the input current I = x;
    hard reset to 0 with the reset path *not* detached; triangle surrogate of half-width `width`:
    dS/dV = max(0, width - |V - v_threshold|) / width**2. A forward hook on this module sees I
    (before the gain), which is what the stable-SNN MPPD objective records.
    """

    def __init__(
        self,
        timesteps: int,
        leak: float = 0.5,
        v_threshold: float = 1.0,
        width: float = 1.0,
        backend: str = "auto",
        store_membrane: bool = False,
    ) -> None:
        super().__init__()
        if int(timesteps) < 1:
            raise ValueError(f"DLIF timesteps must be >= 1 (got {timesteps})")
        if not width > 0:
            raise ValueError(f"DLIF width must be > 0 (got {width})")
        _check_choice("backend", backend, BACKENDS)
        self.timesteps, self.leak, self.v_threshold = int(timesteps), float(leak), float(v_threshold)
        self.width, self.backend, self.store_membrane = float(width), backend, store_membrane
        # the paper's triangle of half-width `width`; kept as attributes so `override_surrogate`
        # can swap the backward at attack time (the forward never depends on them)
        self.surrogate, self.alpha = "triangle", 1.0 / self.width
        self.gain = nn.Parameter(torch.ones(self.timesteps))

    def forward(self, x: torch.Tensor, return_membrane: bool = False):
        check_input(x, False)
        if x.shape[0] != self.timesteps:
            raise ValueError(
                f"DLIF was built for timesteps={self.timesteps} but got input of shape {tuple(x.shape)}; "
                f"expected [T={self.timesteps}, ...] (time-major)"
            )
        current = x * self.gain.view(-1, *([1] * (x.dim() - 1))).to(x.dtype)
        return self._run(
            current, return_membrane, v_threshold=self.v_threshold, v_reset=0.0, detach_reset=False,
            surrogate=self.surrogate, alpha=self.alpha, leak=self.leak,
        )

    def extra_repr(self) -> str:
        return (
            f"timesteps={self.timesteps}, leak={self.leak}, v_threshold={self.v_threshold}, "
            f"width={self.width}, gain=learnable[{self.timesteps}], reset=hard(0, not detached), "
            f"surrogate={self.surrogate}(alpha={self.alpha}), backend={self.backend}"
        )


@contextlib.contextmanager
def override_surrogate(model: nn.Module, surrogate: str, alpha: float | None = None) -> Iterator[int]:
    """Give every `SpikingNeuron` in `model` another surrogate inside the block, then restore each one's own.

    Spikes (the forward) are unchanged; only gradients differ. Attacks use it to differentiate a
    trained SNN through a surrogate it was not trained with (gradient-masking checks). Yields the
    number of neurons changed; raises ValueError for an unknown surrogate or a model without neurons.
    """
    _check_choice("surrogate", surrogate, SURROGATES)
    value = default_alpha(surrogate, alpha)
    found = [m for m in model.modules() if isinstance(m, SpikingNeuron)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no efficient spiking neurons (LIF, PLIF, DLIF), so it has no surrogate to override"
        )
    saved = [(m, m.surrogate, m.alpha) for m in found]
    try:
        for m in found:
            m.surrogate, m.alpha = surrogate, value
        yield len(found)
    finally:
        for m, sg, a in saved:
            m.surrogate, m.alpha = sg, a
