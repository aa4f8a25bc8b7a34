"""NIR nodes for spikingjelly 2.0 and snntorch 1.0 neurons, so `to_nir` exports their models too.

The models `efficient.accelerate` takes (spikingjelly `LIFNode` / `ParametricLIFNode` / `IFNode`,
snntorch `Leaky`) in `nn.Sequential` chains with Linear / Conv2d (+BatchNorm2d) / AvgPool2d /
Flatten layers. What each neuron becomes (forward Euler at `dt`, as in `efficient.export.neurons`):

    spikingjelly LIFNode / ParametricLIFNode   as our LIF: r = 1 (decay_input) or tau, v_leak = V_reset
    spikingjelly IFNode       H = V + X            ->  IF, r = 1/dt (so dt * r * X = X)
    snntorch Leaky, "zero"    H = beta * V + X     ->  LIF, tau = 1/(1-beta) steps, r = tau, v_leak = 0
                                                      (beta = 1: IF, r = 1/dt)

snntorch computes a step's membrane from the previous one zeroed where it fired (`reset_delay`),
which is NIR's reset to `v_reset = 0` followed by the next step's charge. Reset by subtraction
(spikingjelly `v_reset=None`, snntorch "subtract") and snntorch's "none" have no NIR 1.0 form and
fail naming the layer, as do inhibition, state quantisation, graded spikes and per-neuron values.

Shapes: spikingjelly multi-step models are called with `[T, B, ...]` and single-step ones with
`[B, ...]`; snntorch models step by step with `[B, ...]`. Their Flatten layers see `[B, ...]`
(spikingjelly merges T into B), which `input_layout` tells `to_nir`.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from efficient.errors import ConfigError

__all__ = ["batch_major", "peer_library", "peer_neuron_node", "peer_sample_shape"]


def _sj_neuron_module() -> Any:
    return sys.modules.get("spikingjelly.activation_based.neuron")


def _snntorch() -> Any:
    return sys.modules.get("snntorch")


def peer_library(model: nn.Module) -> str | None:
    """"spikingjelly" or "snntorch" if `model` holds that library's neurons (the first found), else None."""
    from efficient.profiler.neurons import neuron_library

    for m in model.modules():
        lib = neuron_library(m)
        if lib in ("spikingjelly", "snntorch"):
            return lib
    return None


def _sj_step_mode(model: nn.Module) -> str:
    sj = _sj_neuron_module()
    modes = {m.step_mode for m in model.modules() if isinstance(m, sj.BaseNode)}
    if len(modes) != 1:
        raise ConfigError(f"{type(model).__name__}: its spikingjelly neurons mix step modes {sorted(modes)}; "
                          "set one with spikingjelly.activation_based.functional.set_step_mode(net, 'm')")
    return modes.pop()


def peer_sample_shape(model: nn.Module, library: str, sample_input: torch.Tensor) -> tuple[int, ...]:
    """Per-sample shape of one time step of `sample_input` for a spikingjelly / snntorch model."""
    multi = library == "spikingjelly" and _sj_step_mode(model) == "m"
    want = "[T, B, ...] (multi-step spikingjelly)" if multi else "one time step [B, ...]"
    lead = 2 if multi else 1
    if sample_input.dim() < lead + 1:
        raise ConfigError(f"sample_input for this {library} model is {want}; got shape {list(sample_input.shape)}")
    return tuple(sample_input.shape[lead:])


def batch_major(layer: nn.Module) -> bool:
    """True for spikingjelly's step-aware layers (their Flatten dims count on [B, ...] in either step mode)."""
    base = sys.modules.get("spikingjelly.activation_based.base")
    return base is not None and isinstance(layer, (base.StepModule, base.MultiStepModule))


def _scalar(value: Any, where: str, what: str) -> float:
    """One number for a layer parameter that may be a float or a (per-neuron) tensor."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().double().reshape(-1)
        if flat.numel() == 0 or not bool(torch.all(flat == flat[0])):
            raise ConfigError(f"{where}: per-neuron {what} values are not exported (one value per layer); "
                              "give the layer a single value")
        return float(flat[0])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"{where}: {what}={value!r} is not a number")


def _full(shape: tuple[int, ...], value: float) -> np.ndarray:
    return np.full(shape, float(value), dtype=np.float64)


def _if_node(shape: tuple[int, ...], dt: float, v_threshold: float, v_reset: float):
    import nir

    return nir.IF(r=_full(shape, 1.0 / dt), v_threshold=_full(shape, v_threshold), v_reset=_full(shape, v_reset))


def _lif_node(shape: tuple[int, ...], dt: float, tau: float, r: float, v_threshold: float, v_reset: float):
    import nir

    return nir.LIF(tau=_full(shape, tau * dt), r=_full(shape, r), v_leak=_full(shape, v_reset),
                   v_threshold=_full(shape, v_threshold), v_reset=_full(shape, v_reset))


def _sj_node(m: Any, shape: tuple[int, ...], dt: float, where: str):
    sj = _sj_neuron_module()
    kind = f"{where} (spikingjelly {type(m).__name__})"
    if not isinstance(m, (sj.LIFNode, sj.ParametricLIFNode, sj.IFNode)):
        raise ConfigError(f"{kind}: no NIR export for this neuron (LIFNode, ParametricLIFNode and IFNode export)")
    if m.v_reset is None:
        raise ConfigError(f"{kind}: soft reset (v_reset=None, subtract the threshold) has no NIR form; NIR's "
                          "neurons reset to v_reset. Use a hard reset (v_reset=0.0) to export.")
    v_th, v_reset = _scalar(m.v_threshold, kind, "v_threshold"), _scalar(m.v_reset, kind, "v_reset")
    if isinstance(m, sj.IFNode):
        return _if_node(shape, dt, v_th, v_reset)
    tau = 1.0 / float(m.w.detach().double().sigmoid()) if isinstance(m, sj.ParametricLIFNode) else _scalar(m.tau, kind, "tau")
    return _lif_node(shape, dt, tau, 1.0 if m.decay_input else tau, v_th, v_reset)


def _snntorch_node(m: Any, shape: tuple[int, ...], dt: float, where: str):
    snn = _snntorch()
    kind = f"{where} (snntorch {type(m).__name__})"
    if not isinstance(m, snn.Leaky):
        why = ("it keeps a synaptic current as a second state; NIR's CubaLIF would hold it, but efficient exports "
               "one-state neurons only" if isinstance(m, snn.Synaptic) else "no NIR export for this neuron")
        raise ConfigError(f"{kind}: {why} (Leaky exports)")
    if m.reset_mechanism != "zero":
        raise ConfigError(f"{kind}: reset_mechanism={m.reset_mechanism!r} has no NIR form (NIR's LIF resets the "
                          "membrane to v_reset); use reset_mechanism='zero' to export")
    for flag, why in (("inhibition", "couples the neurons of a layer"), ("state_quant", "quantises the membrane")):
        if getattr(m, flag):
            raise ConfigError(f"{kind}: {flag} {why}; NIR has no such neuron")
    if not getattr(m, "reset_delay", True):
        raise ConfigError(f"{kind}: reset_delay=False resets within the step; NIR's LIF resets after the spike")
    if _scalar(m.graded_spikes_factor, kind, "graded_spikes_factor") != 1.0:
        raise ConfigError(f"{kind}: graded spikes (graded_spikes_factor != 1) have no NIR form")
    beta = min(max(_scalar(m.beta, kind, "beta"), 0.0), 1.0)  # snntorch clamps beta to [0, 1] in its step
    v_th = _scalar(m.threshold, kind, "threshold")
    if beta == 1.0:
        return _if_node(shape, dt, v_th, 0.0)
    tau = 1.0 / (1.0 - beta)
    return _lif_node(shape, dt, tau, tau, v_th, 0.0)


def peer_neuron_node(m: nn.Module, shape: tuple[int, ...], dt: float, where: str):
    """The NIR node for spikingjelly / snntorch neuron `m`, or None if `m` is not one of theirs."""
    sj, snn = _sj_neuron_module(), _snntorch()
    if sj is not None and isinstance(m, sj.BaseNode):
        return _sj_node(m, shape, dt, where)
    if snn is not None and isinstance(m, snn.SpikingNeuron):
        return _snntorch_node(m, shape, dt, where)
    return None
