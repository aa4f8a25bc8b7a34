"""Our neurons <-> NIR's `LIF` / `IF` / `LI` nodes, and the time-step convention that links them.

NIR describes neurons in continuous time, `tau * dv/dt = (v_leak - v) + r * I`, spike when
`v > v_threshold`, then `v = v_reset`. Our neurons are discrete, one update per time step. The two
meet by forward Euler with a step `dt` (seconds):

    v[t] = v[t-1] + (dt / tau_nir) * (v_leak - v[t-1] + r * I[t])

so only the ratio `tau = tau_nir / dt` (our tau, in time steps) matters. Export writes
`tau_nir = tau * dt` and import reads `tau = tau_nir / dt`; the `dt` used is stored in the graph's
metadata under `DT_KEY` and defaults to `DEFAULT_DT` = 1e-4 s, the value spikingjelly's and
snntorch's NIR exchanges assume. Our three neurons map as follows (spikingjelly's convention):

    LIF, decay_input=True    H = V + (X - (V - V_reset)) / tau   ->  r = 1,   v_leak = V_reset
    LIF, decay_input=False   H = V - (V - V_reset) / tau + X     ->  r = tau, v_leak = V_reset
    PLIF                     as LIF with tau = 1 / sigmoid(w) at export time
    DLIF                     H = leak * V + gain[t] * X          ->  tau = 1 / (1 - leak), r = tau * g,
                                                                    v_leak = v_reset = 0

DLIF's gain is one number per time step; NIR's parameters are constant in time, so a DLIF exports
only while its gains are all equal (g); otherwise export fails and names the layer. Soft reset
(`v_reset=None`, subtract the threshold) has no NIR form and fails too. `leak = 0` (tau = 1) is a
neuron without memory: it exports, with `tau_nir = dt`.

Import maps a node back to the same kernel configuration whenever it is one of the forms above,
so that a round trip gives bit-identical spikes; any other LIF (other r or v_leak) runs the DLIF
charge `H = (1 - dt/tau_nir) * V + (dt/tau_nir) * (r * I + v_leak)`. `IF` is that with no leak
(`H = V + dt * r * I`) and `LI` is a LIF that never fires whose output is its membrane.

Two differences with NIR remain and are documented rather than hidden: our neurons fire at
`H >= v_threshold` where NIR writes `v > v_threshold` (they differ only when the membrane lands
exactly on the threshold), and the membrane starts at `v_reset` (0 in every exported graph).
"""

from __future__ import annotations

import math
import numpy as np
import torch
from torch import nn

from efficient.errors import ArtifactError, ConfigError
from efficient.models.neurons import DLIF, LIF, PLIF, SpikingNeuron

__all__ = ["DEFAULT_DT", "DT_KEY", "NIRLeaky", "lif_node", "neuron_from_node"]

DEFAULT_DT = 1e-4
DT_KEY = "dt"
CHARGE_KEY = "efficient.charge"  # node metadata: "leak" for an exported DLIF


def _full(shape: tuple[int, ...], value: float) -> np.ndarray:
    return np.full(shape, float(value), dtype=np.float64)


def lif_node(module: nn.Module, shape: tuple[int, ...], dt: float, where: str):
    """The NIR node (`nir.LIF`) for our neuron `module` over per-sample `shape`; `where` names it in errors."""
    import nir

    if isinstance(module, DLIF):
        gains = module.gain.detach().float()
        if not bool(torch.all(gains == gains[0])):
            raise ConfigError(
                f"{where} (DLIF): its per-step gains {[round(g, 4) for g in gains.tolist()]} differ between time steps; "
                "NIR 1.0's LIF has time-constant parameters only. Export a model whose DLIF gains are equal "
                "(e.g. as initialised) or train it with neuron=lif."
            )
        tau, gain = 1.0 / (1.0 - module.leak), float(gains[0])
        # the metadata lets our import pick the same charge (leak * V + X) back, for bit-identical spikes
        return nir.LIF(tau=_full(shape, tau * dt), r=_full(shape, tau * gain), v_leak=_full(shape, 0.0),
                       v_threshold=_full(shape, module.v_threshold), v_reset=_full(shape, 0.0),
                       metadata={CHARGE_KEY: "leak"})
    if isinstance(module, (LIF, PLIF)):
        kind = type(module).__name__
        if module.v_reset is None:
            raise ConfigError(
                f"{where} ({kind}): soft reset (v_reset=None, subtract the threshold) has no NIR form; "
                "NIR's LIF resets to v_reset. Use a hard reset (v_reset=0.0) to export."
            )
        tau = module.tau
        return nir.LIF(tau=_full(shape, tau * dt), r=_full(shape, 1.0 if module.decay_input else tau),
                       v_leak=_full(shape, module.v_reset), v_threshold=_full(shape, module.v_threshold),
                       v_reset=_full(shape, module.v_reset))
    raise ConfigError(f"{where} ({type(module).__name__}): not a neuron NIR export knows (LIF, PLIF, DLIF)")


class NIRLeaky(SpikingNeuron):
    """A NIR LIF / IF / LI node that is none of our neurons' forms, on our LIF kernel (DLIF charge):
    H = leak * V + scale * I + bias, hard reset to `v_reset`; `spiking=False` (LI) returns H and never fires."""

    def __init__(self, leak: float, scale: float, bias: float, v_threshold: float, v_reset: float,
                 spiking: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.leak, self.scale, self.bias = float(leak), float(scale), float(bias)
        self.v_threshold, self.v_reset, self.spiking = float(v_threshold), float(v_reset), bool(spiking)
        self.backend, self.store_membrane = backend, False

    def forward(self, x: torch.Tensor, return_membrane: bool = False):
        current = x if self.scale == 1.0 else x * self.scale
        if self.bias:
            current = current + self.bias
        threshold = self.v_threshold if self.spiking else math.inf
        spikes, h = self._run(current, True, v_threshold=threshold, v_reset=self.v_reset, detach_reset=False,
                              surrogate="triangle", leak=self.leak)
        out = spikes if self.spiking else h.to(x.dtype)
        return (out, h) if return_membrane else out

    def extra_repr(self) -> str:
        kind = "spiking" if self.spiking else "leaky integrator (outputs membrane)"
        return (f"leak={self.leak:.6g}, scale={self.scale:.6g}, bias={self.bias:.6g}, v_threshold={self.v_threshold}, "
                f"v_reset={self.v_reset}, {kind}")


def _uniform(node, field: str, name: str, source: str) -> float:
    """The single value of a per-neuron parameter array; our kernels take one value per layer."""
    arr = np.asarray(getattr(node, field), dtype=np.float64)
    if arr.size == 0:
        raise ArtifactError(f"{source}: node {name!r} ({type(node).__name__}) has an empty {field!r} array")
    first = float(arr.reshape(-1)[0])
    if not np.all(arr == first):
        raise ArtifactError(
            f"{source}: node {name!r} ({type(node).__name__}) has per-neuron {field!r} values "
            f"(from {arr.min():.6g} to {arr.max():.6g}); our neuron kernels take one {field} per layer"
        )
    if not math.isfinite(first):
        raise ArtifactError(f"{source}: node {name!r} ({type(node).__name__}) has a non-finite {field!r} ({first})")
    return first


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def neuron_from_node(node, name: str, dt: float, source: str, backend: str = "auto") -> nn.Module:
    """Our module for NIR neuron node `node` (LIF, IF or LI) at time step `dt` (see the module docstring)."""
    import nir

    if isinstance(node, nir.IF):
        r = _uniform(node, "r", name, source)
        return NIRLeaky(1.0, dt * r, 0.0, _uniform(node, "v_threshold", name, source),
                        _uniform(node, "v_reset", name, source), backend=backend)
    tau_nir = _uniform(node, "tau", name, source)
    if not tau_nir > 0:
        raise ArtifactError(f"{source}: node {name!r} ({type(node).__name__}) has tau={tau_nir}; time constants must be > 0")
    tau = tau_nir / dt
    if tau < 1.0 and not _close(tau, 1.0):
        raise ArtifactError(
            f"{source}: node {name!r} has tau={tau_nir:g} s < dt={dt:g} s; forward Euler at this dt is unstable. "
            "Pass the dt the graph was written with (efficient.load(path, dt=...))."
        )
    r, v_leak = _uniform(node, "r", name, source), _uniform(node, "v_leak", name, source)
    if isinstance(node, nir.LI):
        return NIRLeaky(1.0 - 1.0 / tau, r / tau, v_leak / tau, 0.0, 0.0, spiking=False, backend=backend)
    v_th, v_reset = _uniform(node, "v_threshold", name, source), _uniform(node, "v_reset", name, source)
    meta = getattr(node, "metadata", None) or {}
    charge = meta.get(CHARGE_KEY)
    charge = charge.decode() if isinstance(charge, bytes) else charge
    if charge != "leak" and tau > 1.0 and not _close(tau, 1.0) and _close(v_leak, v_reset):
        if _close(r, 1.0):  # spikingjelly LIFNode(decay_input=True): the same kernel charge, bit for bit
            return LIF(tau=tau, v_threshold=v_th, v_reset=v_reset, detach_reset=False, decay_input=True, backend=backend)
        if _close(r, tau):
            return LIF(tau=tau, v_threshold=v_th, v_reset=v_reset, detach_reset=False, decay_input=False, backend=backend)
    rate = 1.0 / tau
    # DLIF written by `lif_node`: leak = 1 - 1/tau, gain = r / tau
    return NIRLeaky(1.0 - rate, r * rate, v_leak * rate, v_th, v_reset, backend=backend)
