"""Multi-step spiking neurons over time-major input `[T, ...]`, stateless across calls.

Each forward starts from the resting membrane (no `reset_net`), runs all T steps in one call of
`efficient.kernels.lif` (Triton on CUDA, a compiled fused loop on CPU; see `backend`) and returns
spikes shaped like the input. `SpikingNeuron` is the common base class the profiler looks for.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from efficient.kernels.bn_lif import bn_gain_lif, bn_lif, bn_lif_max_pool
from efficient.kernels.bn_max_pool import bn_max_pool
from efficient.kernels.lif import BACKENDS, SURROGATES, check_input, default_alpha, lif
from efficient.kernels.pool_offsets import pool_args
from efficient.models.replay import in_region, linear_output, rebuild_exact, rebuild_membrane

__all__ = ["SpikingNeuron", "LIF", "PLIF", "DLIF", "bn_fire", "fusable", "gain_fire", "norm_fire", "norm_pooled", "override_surrogate",
           "global_hooks", "spike_observer", "module_bookkeeper", "watched", "separate_units"]


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
        """The backend a call on `x` runs on."""
        return self.backend_for_shape(x.shape, x.device)

    def backend_for_shape(self, shape: torch.Size | tuple[int, ...], device: torch.device) -> str:
        """The backend a call on input of `shape` runs on (subclasses may choose per model rather than per call)."""
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


# ---------------------------------------------------------------------------------------------
# BatchNorm -> LIF as one op (efficient.kernels.bn_lif), for the units of the zoo
# ---------------------------------------------------------------------------------------------


_FUSE_UNITS = [True]


@contextlib.contextmanager
def separate_units() -> Iterator[None]:
    """Inside this block BatchNorm and neuron run as two calls even where they could be one op (to
    compare the two, or to step through them)."""
    _FUSE_UNITS.append(False)
    try:
        yield
    finally:
        _FUSE_UNITS.pop()


_OBSERVER = "_efficient_spike_observer"


def spike_observer(hook: Callable[..., None]) -> Callable[..., None]:
    """Mark a neuron forward hook that only reads the spikes (`hook(neuron, args, spikes)`, args
    unused): it does not keep the neuron from running fused with its BatchNorm, since `bn_fire`
    calls it with the fused op's spikes (args empty). The memory levels' spike tracker is one: with
    it the units run the same kernels as without, so their results are the same bit for bit."""
    setattr(getattr(hook, "__func__", hook), _OBSERVER, True)  # a bound method: its function
    return hook


_BOOKKEEPER = "_efficient_module_bookkeeper"


def module_bookkeeper(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a forward hook or pre-hook that only notes which module is running (the module stack of
    `efficient.memory.measure`): it does not keep a unit's modules from running as one fused op, which
    does not call it, so a meter measures the step a training run takes. What the op saves counts
    to the innermost module that was called (the unit)."""
    setattr(getattr(hook, "__func__", hook), _BOOKKEEPER, True)  # a bound method: its function
    return hook


def _marked(hook: Any, mark: str) -> bool:
    return bool(getattr(getattr(hook, "__func__", hook), mark, False))


def _observer(hook: Any) -> bool:
    return _marked(hook, _OBSERVER)


def watched(m: nn.Module) -> bool:
    """Whether a hook on `m` must see it called as a module (a spike observer or a bookkeeper need not)."""
    return bool(any(not (_observer(h) or _marked(h, _BOOKKEEPER)) for h in m._forward_hooks.values())
                or any(not _marked(h, _BOOKKEEPER) for h in m._forward_pre_hooks.values())
                or m._backward_hooks or m._backward_pre_hooks)


def global_hooks() -> bool:
    """Whether a global module hook is registered (`register_module_forward_hook` and the like): it must see
    every module called, so no op may stand in for a module call."""
    from torch.nn.modules import module as _module

    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


def _notify_observers(neuron: nn.Module, spikes: torch.Tensor) -> None:
    """Call the neuron's spike observers with a fused op's spikes (`watched` let no other hook through
    but bookkeepers, which a fused op does not call)."""
    for hook in list(neuron._forward_hooks.values()):
        if _observer(hook):
            hook(neuron, (), spikes)


def _one_call_allowed(neuron: nn.Module, *modules: nn.Module) -> bool:
    """What every fused unit asks of its modules: not inside `separate_units()`, not under autocast
    (its per-op dtype policy applies to each call), a neuron that keeps no membrane, and nothing
    watching the modules (a hook, such as the profiler's, must see them called; a `spike_observer`
    on the neuron is called with the unit's spikes instead)."""
    return (_FUSE_UNITS[-1] and not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))
            and not getattr(neuron, "store_membrane", False)
            and not any(watched(m) for m in (neuron, *modules)) and not global_hooks())


def _tracked_bn(bn: nn.Module) -> bool:
    """An affine BatchNorm with running statistics (what the fused units normalise with)."""
    return (isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.affine and bn.track_running_stats
            and bn.running_mean is not None)


def fusable(neuron: nn.Module, *modules: nn.Module) -> bool:
    """Whether `neuron` may run fused with the BatchNorm before it: a constant-tau `LIF` (not
    PLIF's learnable rate nor DLIF's gain, `gain_fire`'s) that `_one_call_allowed`, not under
    torch.compile (inductor fuses the BatchNorm it sees with what surrounds it; an opaque op would
    hide it) except inside a unit memory level `recompute` reruns (`rebuild_membrane(neuron)`:
    there the fused op's chunked backward bounds the rerun's peak, where inductor's would hold the
    whole trace)."""
    return (isinstance(neuron, LIF) and type(neuron).forward is LIF.forward
            and (not torch.compiler.is_compiling() or rebuild_membrane(neuron))
            and _one_call_allowed(neuron, *modules))


def bn_fire(z: torch.Tensor, shape: tuple[int, ...], neuron: "LIF", weight: torch.Tensor, bias: torch.Tensor,
            running_mean: torch.Tensor, running_var: torch.Tensor, training: bool, momentum: float,
            eps: float, lin_weight: torch.Tensor | None = None, lin_bias: torch.Tensor | None = None,
            running_out: list[torch.Tensor] | None = None, keep_membrane: bool | None = None) -> torch.Tensor:
    """Spikes of `neuron` on the BatchNorm of `z` [T*R, C, ...] (one fused op), shaped `shape`, the
    time-major shape the neuron would take (concrete, no -1): the same values as the separate
    calls. With `lin_weight` (and `lin_bias`), z is a Linear's input [T*M, D_in] and the Linear is
    in the op. `running_out`: the buffers that receive the new running statistics; `keep_membrane`
    False: backward rebuilds the membrane trace from z rather than keeping it (`bn_lif`); None: False
    inside a region memory level `recompute` reruns in backward (`efficient.models.replay.rebuild_membrane`:
    by chunks of channels) and at a memory level's step (`rebuild_exact`: in one piece, so the gradients
    are those of a unit that kept it bit for bit), True elsewhere."""
    steps = shape[0]
    # a recomputed region may keep the Linear's output from forward for its rerun (no matmul there)
    lin_out = None if lin_weight is None else linear_output(neuron, z, lin_weight, lin_bias)
    whole = keep_membrane is None and rebuild_exact(neuron)  # a level's step outside regions: none's gradients exactly
    if keep_membrane is None:
        keep_membrane = not (whole or rebuild_membrane(neuron))
    s = bn_lif(z, steps, weight, bias, running_mean, running_var, training, momentum, eps, tau=neuron.tau,
               v_threshold=neuron.v_threshold, v_reset=neuron.v_reset, detach_reset=neuron.detach_reset,
               decay_input=neuron.decay_input, surrogate=neuron.surrogate, alpha=neuron.alpha,
               spike_dtype=neuron.spike_dtype, backend=neuron.backend_for_shape(shape, z.device), lin_weight=lin_weight,
               lin_bias=lin_bias, lin_out=lin_out, running_out=running_out, keep_membrane=keep_membrane,
               rebuild_whole=whole)
    s = s.view(shape)
    _notify_observers(neuron, s)
    return s


def norm_fire(bn: nn.Module, neuron: nn.Module, z: torch.Tensor, shape: tuple[int, ...],
              linear: nn.Module | None = None) -> torch.Tensor:
    """`neuron(bn(z).reshape(shape))`: BatchNorm over `z` [T*R, C, ...], then the neuron over time
    on the time-major `shape` (concrete, no -1); one fused op where the pair allows it (`fusable`, an affine
    BatchNorm with running statistics), with BatchNorm's bookkeeping (batch count, momentum).
    With `linear` (an nn.Linear), z is its input [T*M, D_in]: `neuron(bn(linear(z)).reshape(shape))`,
    the Linear inside the same op. Inside a region memory level `recompute` reruns in backward, the
    fused op's backward rebuilds the membrane trace rather than keeping it (`bn_fire`)."""
    if not _fusable_pair(bn, neuron, linear):
        return neuron(bn(z if linear is None else linear(z)).reshape(shape))
    factor = _count_batch(bn)
    lin = {} if linear is None else {"lin_weight": linear.weight, "lin_bias": linear.bias}
    return bn_fire(z, tuple(shape), neuron, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.training,
                   factor, bn.eps, **lin)


def _recorded(module: nn.Module) -> bool:
    """Whether a region's unit called now is recorded for backward, or is the forward of an eager
    region that runs without autograd (`recompute._Region`): its chunked ops then keep the forward's
    temporaries to one chunk too."""
    return torch.is_grad_enabled() or (not torch.compiler.is_compiling() and in_region())


def gain_fire(bn: nn.Module, neuron: nn.Module, z: torch.Tensor, shape: tuple[int, ...],
              donate: bool = False, spikes: bool = True) -> torch.Tensor | None:
    """`neuron(bn(z).reshape(shape))` for a DLIF after an affine BatchNorm with running statistics, over
    z [T*R, C, ...] (`shape`: the time-major shape the neuron would take, concrete), inside a unit memory
    level `recompute` reruns in backward (training, eager or compiled): one call by chunks of channels
    (`bn_gain_lif`) whose backward rebuilds the BatchNorm output, current and membrane trace a chunk at
    a time, where the separate calls keep them whole for the rerun's backward. With BatchNorm's
    bookkeeping; spike observers see the spikes returned. None where it does not apply (outside a
    region, a watched module, autocast, a DLIF that stores its membrane, the reference backend): the
    caller runs the two modules. `donate`: z is a fresh output nothing else reads, so backward may
    write z's gradient into it (`bn_gain_lif(donate=True)`). `spikes` False: nothing reads the spikes
    (a unit's rerun that only its backward needs): they are not computed, and observers are not called."""
    steps = shape[0]
    if not (type(neuron) is DLIF and bn.training and _recorded(neuron) and rebuild_membrane(neuron)
            and _tracked_bn(bn) and neuron.gain.shape == (steps,) and _one_call_allowed(neuron, bn)):
        return None
    s = bn_gain_lif(z, steps, neuron.gain, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                    _update_factor(bn, counted=False), bn.eps, leak=neuron.leak, v_threshold=neuron.v_threshold,
                    surrogate=neuron.surrogate, alpha=neuron.alpha, backend=neuron.backend_for_shape(shape, z.device),
                    donate=donate, spikes=spikes)
    if s is None:
        return None
    if bn.num_batches_tracked is not None:  # BatchNorm's batch count, as its forward keeps it
        bn.num_batches_tracked.add_(1)
    s = s.view(shape)
    if spikes:
        _notify_observers(neuron, s)
    return s


def _fusable_pair(bn: nn.Module, neuron: nn.Module, linear: nn.Module | None = None) -> bool:
    """An affine BatchNorm with running statistics (and a plain Linear) that may run fused with `neuron`."""
    return (_tracked_bn(bn) and fusable(neuron, bn, *([] if linear is None else [linear]))
            and (linear is None or type(linear) is nn.Linear))


def _count_batch(bn: nn.Module) -> float:
    """BatchNorm's bookkeeping of a training call, as its forward does: the batch counter goes up by
    one; returns the running statistics' update factor."""
    if bn.training and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    return _update_factor(bn, counted=True)


def _update_factor(bn: nn.Module, counted: bool) -> float:
    """The factor of a training call's running-statistics update: momentum, or 1 / (batches counted,
    this one included) for a cumulative average (momentum None)."""
    if bn.momentum is not None:
        return bn.momentum
    if not (bn.training and bn.num_batches_tracked is not None):
        return 0.0
    return 1.0 / (float(bn.num_batches_tracked) + (0 if counted else 1))


def pooled_fire(bn: nn.Module, neuron: nn.Module, pool: nn.Module, z: torch.Tensor, steps: int,
                donate: bool = False, spikes: bool = True) -> torch.Tensor | None:
    """`pool(neuron(bn(z)))` of a conv stage, z [T*R, C, H, W], as one op that never holds the
    stage's spikes or membrane trace whole (`bn_lif_max_pool`: BatchNorm, LIF and max-pool a chunk
    of channels at a time, and so again in backward). Only inside a region memory level `recompute`
    reruns in backward (`rebuild_membrane`), where a stem stage's rerun sets the step's peak; None
    elsewhere, or where the three cannot run as one, and the caller runs them as usual. `donate`: z is
    a fresh output nothing else reads, so backward may write z's gradient into it
    (`bn_lif_max_pool(donate=True)`). `spikes` False: nothing reads the pooled spikes (a unit's rerun
    that only its backward needs): they are not computed where the op allows it
    (`bn_lif_max_pool(compute=False)`), and observers are not called."""
    if not (rebuild_membrane(neuron) and _recorded(neuron) and type(pool) is nn.MaxPool2d and not pool.return_indices
            and not watched(pool) and z.dim() == 4 and _fusable_pair(bn, neuron)):
        return None
    args = pool_args(pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)
    shape = (steps, z.shape[0] // steps, *z.shape[1:])
    out = bn_lif_max_pool(z, steps, bn.weight, bn.bias, bn.running_mean, bn.running_var, args, bn.training,
                          _update_factor(bn, counted=False),
                          bn.eps, tau=neuron.tau, v_threshold=neuron.v_threshold, v_reset=neuron.v_reset,
                          detach_reset=neuron.detach_reset, decay_input=neuron.decay_input,
                          surrogate=neuron.surrogate, alpha=neuron.alpha, spike_dtype=neuron.spike_dtype,
                          backend=neuron.backend_for_shape(shape, z.device), donate=donate, compute=spikes)
    if out is None:  # not this path after all (`bn_lif_max_pool` says where): the caller's call counts the batch
        return None
    if bn.training and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    if spikes:
        _notify_observers(neuron, out)  # a max-pool of spikes is spikes
    return out


def norm_pooled(bn: nn.Module, pool: nn.Module, z: torch.Tensor, donate: bool = False) -> torch.Tensor:
    """`pool(bn(z))` of a conv stage that pools its BatchNorm output (real values), z [N, C, H, W]. Inside a
    region memory level `recompute` reruns in backward (`rebuild_membrane`), in training, as one op by chunks
    of channels (`bn_max_pool`) that keeps z and small argmax offsets instead of BatchNorm's whole output and
    int64 indices, with BatchNorm's bookkeeping; `donate`: z is a fresh output nothing else reads, so
    backward may write z's gradient into it. Elsewhere, or where a hook must see either module called, the
    two modules run."""
    # (`rebuild_membrane()` without a module: eager only, inside a region, whose calls are recorded)
    if (rebuild_membrane() and bn.training and _tracked_bn(bn) and type(pool) is nn.MaxPool2d
            and not pool.return_indices and not watched(bn) and not watched(pool) and z.dim() == 4
            and not global_hooks()):
        args = pool_args(pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)
        out = bn_max_pool(z, bn.weight, bn.bias, bn.running_mean, bn.running_var, args,
                          _update_factor(bn, counted=False), bn.eps, donate=donate)
        if out is not None:
            if bn.num_batches_tracked is not None:
                bn.num_batches_tracked.add_(1)
            return out
    return pool(bn(z))


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
