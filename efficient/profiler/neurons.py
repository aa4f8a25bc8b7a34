"""Which modules are spiking neurons: ours (`efficient.models.neurons.SpikingNeuron`), spikingjelly
2.0's (`BaseNode`) and snntorch's (`SpikingNeuron`).

Libraries are only consulted when already imported: a model cannot hold their neurons
otherwise, and importing them here would cost seconds for nothing.
"""

from __future__ import annotations

import sys

from torch import nn


def _our_base() -> type | None:
    mod = sys.modules.get("efficient.models.neurons")
    return getattr(mod, "SpikingNeuron", None) if mod is not None else None


def _peer_bases() -> dict[str, type]:
    out: dict[str, type] = {}
    sj = sys.modules.get("spikingjelly.activation_based.neuron")
    if sj is not None and hasattr(sj, "BaseNode"):
        out["spikingjelly"] = sj.BaseNode
    snn = sys.modules.get("snntorch")
    if snn is not None and hasattr(snn, "SpikingNeuron"):
        out["snntorch"] = snn.SpikingNeuron
    return out


def neuron_library(m: nn.Module) -> str | None:
    """'efficient', 'spikingjelly', 'snntorch' or None when `m` is not a spiking neuron."""
    base = _our_base()
    if base is not None and isinstance(m, base):
        return "efficient"
    for lib, peer in _peer_bases().items():
        if isinstance(m, peer):
            return lib
    return None


def is_spiking_neuron(m: nn.Module) -> bool:
    return neuron_library(m) is not None


def neuron_kind(m: nn.Module) -> str:
    """'<library> multi-step' when one call sees all time steps [T, ...], else '<library> single-step'."""
    lib = neuron_library(m) or "?"
    if lib == "efficient":
        return "efficient multi-step"
    if lib == "spikingjelly":
        return f"spikingjelly {'multi' if getattr(m, 'step_mode', 's') == 'm' else 'single'}-step"
    return f"{lib} single-step"
