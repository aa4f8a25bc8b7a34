"""Drop-in acceleration: run existing spikingjelly and snntorch models on our LIF kernels.

    model, report = efficient.accelerate(model)
    print(report)          # what runs on our kernels, what stays as it was, and why

`accelerate` changes `model` in place: each neuron it can express exactly becomes an instance of a
subclass of its own class (so `isinstance`, parameter and buffer names, `reset_net`,
`snntorch.utils.reset`, optimizers and checkpoints keep working) whose multi-step path calls
`efficient.kernels.lif`. Nothing that cannot be expressed exactly is approximated: it is listed in
`report.skipped` with the reason.

- spikingjelly 2.0 `LIFNode`, `ParametricLIFNode`, `IFNode` in multi-step mode: every reset, detach
  and decay option, surrogates Sigmoid / ATan / PiecewiseQuadratic with their alpha, `store_v_seq`;
  the membrane is carried across calls until `functional.reset_net`, as in spikingjelly.
- snntorch 1.0 `Leaky` (subtract / zero / none reset, fixed or learnable beta and threshold,
  scalar or per neuron, atan or sigmoid surrogate): `leaky.multi_step(x_seq)` runs all T steps in
  one kernel call (snntorch's update order). A per-step call (`leaky(x_t)`) stays snntorch's step.
  `nn.Sequential` stacks of step-wise layers and `init_hidden=True` Leaky neurons gain
  `stack.multi_step(x_seq)`, which returns what the usual `for t: out = stack(x[t])` loop returns,
  stacked over time; the loop itself (in the caller's code) is not rewritten.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from efficient.kernels import _backend
from efficient.kernels.lif import BACKENDS, leaky, lif

__all__ = ["accelerate", "AccelerateReport", "Replaced", "Skipped"]


@dataclass
class Replaced:
    """A module that now runs on our kernels."""

    path: str
    type: str
    runs_as: str
    note: str = ""


@dataclass
class Skipped:
    """A module left as it was."""

    path: str
    type: str
    reason: str


@dataclass
class AccelerateReport:
    """What `accelerate` replaced, and what it left and why."""

    replaced: list[Replaced] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"accelerated {len(self.replaced)} module(s), left {len(self.skipped)}"]
        for r in self.replaced:
            note = f": {r.note}" if r.note else ""
            lines.append(f"  replaced {r.path or '<model>'} ({r.type}) -> {r.runs_as}{note}")
        for s in self.skipped:
            lines.append(f"  left     {s.path or '<model>'} ({s.type}): {s.reason}")
        return "\n".join(lines)


def _backend_for(module: Any, x: Tensor) -> str:
    """"auto" = Triton on CUDA and, on CPU, the compiled fused loop at every size: a training loop
    repays its one-time compilation (tens of seconds per neuron configuration), and the eager loop
    is no faster than the libraries' own steps."""
    backend = module._efficient_backend
    if backend == "auto" and x.device.type == "cpu" and _backend.have_cxx_compiler():
        return "compile"
    return backend


def _type_name(m: nn.Module) -> str:
    for cls in type(m).__mro__:
        if not cls.__name__.startswith("Accelerated"):
            return f"{cls.__module__}.{cls.__qualname__}"
    return type(m).__qualname__  # pragma: no cover


# ---------------------------------------------------------------------------------------------
# spikingjelly 2.0
# ---------------------------------------------------------------------------------------------

_SJ_SURROGATES = {"Sigmoid": "sigmoid", "ATan": "atan", "PiecewiseQuadratic": "triangle"}


def _sj_surrogate(fn: Any) -> tuple[Optional[str], Optional[float], str]:
    name = _SJ_SURROGATES.get(type(fn).__name__)
    if name is None or not type(fn).__module__.startswith("spikingjelly"):
        return None, None, f"surrogate {type(fn).__name__} has no kernel here (supported: {sorted(_SJ_SURROGATES)})"
    if not getattr(fn, "spiking", True):
        return None, None, "surrogate in non-spiking mode (spiking=False) outputs no spikes"
    alpha = getattr(fn, "alpha", None)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return None, None, f"surrogate alpha {alpha!r} is not a number"
    return name, float(alpha), ""


def _sj_multi_step(node: Any, x_seq: Tensor, **charge: Any) -> Tensor:
    """One multi-step call of a spikingjelly node on our kernel, from and to its stored membrane."""
    (v,) = node.materialize_states((x_seq,), tuple(node._memories.values()), "m")
    spikes, h = lif(
        x_seq, v_threshold=node.v_threshold, v_reset=node.v_reset, detach_reset=node.detach_reset,
        surrogate=node._efficient_surrogate, alpha=node._efficient_alpha, v_init=v.expand(x_seq.shape[1:]),
        return_membrane=True, backend=_backend_for(node, x_seq), **charge,
    )
    sr = spikes.detach() if node.detach_reset else spikes
    h = h.to(v.dtype)

    def reset(s: Tensor, hh: Tensor) -> Tensor:  # spikingjelly's reset, in its floating-point order
        return hh - node.v_threshold * s if node.v_reset is None else s * node.v_reset + (1.0 - s) * hh

    if node.store_v_seq:
        v_seq = reset(sr, h)
        node.v_seq, node._memories["v"] = v_seq, v_seq[-1]
    else:
        node._memories["v"] = reset(sr[-1], h[-1])
    return spikes


def _sj_classes() -> dict[type, type]:
    """spikingjelly class -> its accelerated subclass (built once spikingjelly is imported)."""
    if _SJ_CACHE:
        return _SJ_CACHE
    neuron = sys.modules.get("spikingjelly.activation_based.neuron")
    if neuron is None:
        return {}

    class AcceleratedLIFNode(neuron.LIFNode):
        """spikingjelly LIFNode whose multi-step forward runs `efficient.kernels.lif`."""

        def multi_step_forward(self, x_seq: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return _sj_multi_step(self, x_seq, tau=self.tau, decay_input=self.decay_input)

    class AcceleratedParametricLIFNode(neuron.ParametricLIFNode):
        """spikingjelly ParametricLIFNode (learnable `w`, 1/tau = sigmoid(w)) on `efficient.kernels.lif`."""

        def multi_step_forward(self, x_seq: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return _sj_multi_step(self, x_seq, rate=self.w.sigmoid(), decay_input=self.decay_input)

    class AcceleratedIFNode(neuron.IFNode):
        """spikingjelly IFNode (H = V + X) on `efficient.kernels.lif`."""

        def multi_step_forward(self, x_seq: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return _sj_multi_step(self, x_seq, leak=1.0)

    _SJ_CACHE.update({
        neuron.LIFNode: AcceleratedLIFNode,
        neuron.ParametricLIFNode: AcceleratedParametricLIFNode,
        neuron.IFNode: AcceleratedIFNode,
    })
    return _SJ_CACHE


_SJ_CACHE: dict[type, type] = {}


def _sj_check(m: Any) -> tuple[str, Optional[float], str]:
    """(surrogate, alpha, '') if `m` can run on our kernel, else ('', None, why not)."""
    if getattr(m, "step_mode", "s") != "m":
        return "", None, "single-step mode: spikingjelly steps it (set_step_mode(net, 'm') to accelerate)"
    if getattr(m, "_neuron_precision", None) is not None:
        return "", None, "explicit neuron precision is set; the kernel computes in fp32"
    if not isinstance(m.v_threshold, (int, float)) or not (m.v_reset is None or isinstance(m.v_reset, (int, float))):
        return "", None, "v_threshold / v_reset are not plain numbers"
    sg, alpha, why = _sj_surrogate(m.surrogate_function)
    if sg is None:
        return "", None, why
    if hasattr(m, "tau") and not isinstance(m.tau, (int, float)):
        return "", None, "tau is not a number"
    return sg, alpha, ""


# ---------------------------------------------------------------------------------------------
# snntorch 1.0
# ---------------------------------------------------------------------------------------------


def _snn_surrogate(fn: Any) -> tuple[Optional[str], Optional[float], str]:
    qual = getattr(fn, "__qualname__", "")
    known = ("atan.<locals>.inner", "sigmoid.<locals>.inner")
    if getattr(fn, "__module__", None) == "snntorch.surrogate" and qual in known:
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        alpha = cells.get("alpha", cells.get("slope"))
        if isinstance(alpha, (int, float)):
            return ("atan" if qual.startswith("atan") else "sigmoid"), float(alpha), ""
    return None, None, f"surrogate {qual or type(fn).__name__} has no kernel here (supported: atan, sigmoid)"


def _snn_check(m: Any) -> tuple[str, Optional[float], str]:
    if m.inhibition:
        return "", None, "inhibition couples neurons within a step"
    if m.state_quant:
        return "", None, "state_quant quantizes the membrane inside the step"
    if not getattr(m, "reset_delay", True):
        return "", None, "reset_delay=False (immediate reset) is not snntorch's default order"
    if m.surrogate_disable:
        return "", None, "surrogate_disable: a step without gradient"
    sg, alpha, why = _snn_surrogate(m.spike_grad)
    return (sg or "", alpha, why)


def _snn_leaky_multi_step(self: Any, x_seq: Tensor, mem: Optional[Tensor] = None) -> Any:
    """All T steps of snntorch `Leaky` at once: returns what T calls return, stacked over time."""
    mem = self.mem if mem is None else mem  # buffers are read once: each read is a Module.__getattr__
    if mem.shape != x_seq.shape[1:]:
        mem = torch.zeros_like(x_seq[0], device=mem.device)
    spikes, mems = leaky(
        x_seq, self.beta.clamp(0, 1), self.threshold, self.reset_mechanism, self._efficient_surrogate,
        self._efficient_alpha, mem=mem, spike_dtype=x_seq.dtype, return_membrane=True,
        backend=_backend_for(self, x_seq),
    )
    mems = mems.to(x_seq.dtype)
    # snntorch always scales by its graded-spike factor; testing the factor for 1 first would read a tensor on the
    # host: a device sync per call and a graph break under torch.compile
    spikes = spikes * self.graded_spikes_factor
    self.mem = mems[-1]
    if self.output or not self.init_hidden:
        return spikes, mems
    return spikes


def _snn_classes() -> dict[type, type]:
    if _SNN_CACHE:
        return _SNN_CACHE
    snn = sys.modules.get("snntorch")
    if snn is None:
        return {}

    class AcceleratedLeaky(snn.Leaky):
        """snntorch Leaky with `multi_step(x_seq)` on `efficient.kernels.lif.leaky`; per-step calls are snntorch's."""

        multi_step = _snn_leaky_multi_step

    _SNN_CACHE[snn.Leaky] = AcceleratedLeaky
    return _SNN_CACHE


_SNN_CACHE: dict[type, type] = {}

# layers that act on each time step independently and identically, so [T, B, ...] can run as [T*B, ...]
_STEPWISE = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Flatten, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
    nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.Identity,
    nn.ReLU, nn.LeakyReLU, nn.Sigmoid, nn.Tanh, nn.GELU,
)


class AcceleratedSequential(nn.Sequential):
    """nn.Sequential of step-wise layers and init_hidden snntorch Leaky neurons, with `multi_step`.

    `stack(x_t)` is unchanged (one step, snntorch's code); `stack.multi_step(x_seq)` runs [T, ...] at
    once and returns what the per-step loop returns, stacked over time.
    """

    def multi_step(self, x_seq: Tensor) -> Any:
        out: Any = x_seq
        for layer in self:
            if hasattr(layer, "multi_step"):
                out = layer.multi_step(out)
            else:
                T, B = out.shape[:2]
                y = layer(out.flatten(0, 1))
                out = y.reshape(T, B, *y.shape[1:])
        return out


def _stack_blocker(seq: nn.Sequential, leaky_type: type) -> str:
    """'' if every child of `seq` is step-wise or an init_hidden Leaky (only the last with output=True)."""
    kids = list(seq)
    for i, k in enumerate(kids):
        if isinstance(k, leaky_type):
            if not k.init_hidden:
                return f"child {i} is a Leaky without init_hidden (its state is passed by the caller)"
            if k.output and i != len(kids) - 1:
                return f"child {i} returns (spk, mem) mid-stack"
        elif type(k) not in _STEPWISE:
            return f"child {i} ({type(k).__name__}) is not known to act on each step independently"
    return "" if any(isinstance(k, leaky_type) for k in kids) else "no Leaky neuron inside"


# ---------------------------------------------------------------------------------------------
# the walk
# ---------------------------------------------------------------------------------------------


def accelerate(model: nn.Module, backend: str = "auto") -> tuple[nn.Module, AccelerateReport]:
    """Run the spikingjelly / snntorch neurons of `model` on our LIF kernels, in place.

    Returns (model, report): `report.replaced` lists what now runs on the kernels, `report.skipped`
    every neuron (or candidate stack) left as it was, with the reason. `backend` is passed to
    `efficient.kernels.lif`; "auto" is Triton on CUDA and the compiled fused loop on CPU (its first
    call compiles, once per neuron configuration), "loop" the same loop uncompiled.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {sorted(BACKENDS)}")
    report = AccelerateReport()
    sj, snn_mod = sys.modules.get("spikingjelly.activation_based.neuron"), sys.modules.get("snntorch")
    sj_map, snn_map = _sj_classes(), _snn_classes()
    for path, m in list(model.named_modules()):
        cls = type(m)
        if sj is not None and isinstance(m, sj.BaseNode):
            target = sj_map.get(cls)
            if target is None:
                if cls not in sj_map.values():
                    report.skipped.append(Skipped(path, _type_name(m), "no kernel for this neuron type"))
                continue
            sg, alpha, why = _sj_check(m)
            if why:
                report.skipped.append(Skipped(path, _type_name(m), why))
                continue
            m.__class__ = target
            m._efficient_surrogate, m._efficient_alpha, m._efficient_backend = sg, alpha, backend
            report.replaced.append(Replaced(path, _type_name(m), "efficient.kernels.lif (multi-step)",
                                            "membrane carried across calls until reset_net"))
        elif snn_mod is not None and isinstance(m, snn_mod.SpikingNeuron):
            target = snn_map.get(cls)
            if target is None:
                if cls not in snn_map.values():
                    why = ("two states (synaptic current and membrane); the kernel holds one"
                           if isinstance(m, snn_mod.Synaptic) else "no kernel for this neuron type")
                    report.skipped.append(Skipped(path, _type_name(m), why))
                continue
            sg, alpha, why = _snn_check(m)
            if why:
                report.skipped.append(Skipped(path, _type_name(m), why))
                continue
            m.__class__ = target
            m._efficient_surrogate, m._efficient_alpha, m._efficient_backend = sg, alpha, backend
            if not any(i is m for i in snn_mod.SpikingNeuron.instances):
                snn_mod.SpikingNeuron.instances.append(m)  # a copied model: let snntorch.utils.reset find it
            report.replaced.append(Replaced(
                path, _type_name(m), "efficient.kernels.lif.leaky via .multi_step(x_seq)",
                "per-step calls (one time step each) stay snntorch's step",
            ))
    if snn_mod is not None:
        leaky_type = snn_mod.Leaky
        for path, m in list(model.named_modules()):
            if type(m) is not nn.Sequential or not any(isinstance(k, leaky_type) for k in m):
                continue
            why = _stack_blocker(m, leaky_type)
            if why or not all(isinstance(k, tuple(snn_map.values())) for k in m if isinstance(k, leaky_type)):
                report.skipped.append(Skipped(path, _type_name(m), "stays per-step: " + (why or "a neuron was left")))
                continue
            m.__class__ = AcceleratedSequential
            report.replaced.append(Replaced(path, "torch.nn.Sequential", "AcceleratedSequential.multi_step(x_seq)",
                                            "a caller's `for t: stack(x[t])` loop still steps; call multi_step"))
    if sj is not None and report.replaced:
        net_config = sys.modules.get("spikingjelly.activation_based.functional.net_config")
        if net_config is not None and hasattr(net_config, "invalidate_reset_cache"):
            net_config.invalidate_reset_cache(model)
    return model, report
