"""NeuroBench's metrics (Yik et al., Nature Communications 2025; `neurobench` 2.3) measured in the
profiled pass, with NeuroBench's definitions: the same modules hooked, the same counts, the same
averages, so the numbers equal what `neurobench.benchmarks.Benchmark` reports on one batch.

- footprint: bytes of parameters and buffers, before the pass (snntorch's membrane state is a buffer).
- connection_sparsity: zero weights / weights of the leaf nn.Linear / nn.Conv1d-3d modules, rounded to 4 decimals.
- activation_sparsity: 1 - nonzero / all outputs of the activation modules (nn.ReLU, nn.Sigmoid and
  spiking neurons), pooled over layers, time steps and samples.
- synaptic_operations: per call of an nn.Linear / nn.Conv1d-3d module, Effective ops = the number of
  (nonzero input, nonzero weight) pairs that meet (the layer run on binarised input and weights, bias
  left out); they are ACs when every input value is in {-1, 0, 1}, else MACs. Dense = the same with
  every input and weight set to 1 (borders of a padded convolution excluded). Each is per sample.
- membrane_updates: snntorch neurons (the ones exposing `mem`): every neuron at a neuron's first call,
  then the neurons whose membrane changed during each later call; per sample.

Modules are found as NeuroBench finds them: walking the children of the model (the model itself not
included), a matching module is taken and not walked into. A module listed twice is hooked twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from efficient.profiler.neurons import is_spiking_neuron, neuron_library

CONNECTION_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
RECURRENT_LAYERS = (nn.RNNBase, nn.RNNCellBase)
ACTIVATION_LAYERS = (nn.ReLU, nn.Sigmoid)

DEFINITIONS = {
    "footprint": "bytes of parameters + buffers",
    "connection_sparsity": "zero weights / weights of leaf Linear/Conv1d/Conv2d/Conv3d modules, rounded to 4 decimals",
    "activation_sparsity": "1 - nonzero/all outputs of ReLU, Sigmoid and spiking-neuron modules, pooled over layers, steps, samples",
    "synaptic_operations": "per Linear/Conv call: #(nonzero input, nonzero weight) pairs, bias excluded; ACs when all inputs "
                           "are in {-1, 0, 1}, else MACs; Dense: all inputs and weights set to 1; per sample",
    "membrane_updates": "snntorch neurons: all neurons at the first call, then neurons whose membrane changed per call; per sample",
}


def _walk(module: nn.Module, match: Any) -> list[nn.Module]:
    """NeuroBench's discovery: children that match are taken, others with children walked into."""
    out: list[nn.Module] = []
    for child in module.children():
        if match(child):
            out.append(child)
        elif list(child.children()):
            out.extend(_walk(child, match))
    return out


def _is_activation(m: nn.Module) -> bool:
    return isinstance(m, ACTIVATION_LAYERS) or is_spiking_neuron(m)


def footprint(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())


def connection_sparsity(model: nn.Module) -> float | None:
    """None when the model holds no Linear/Conv weights (NeuroBench divides by zero there)."""
    zeros = weights = 0

    def leaf_counts(m: nn.Module) -> None:
        nonlocal zeros, weights
        kids = list(m.children())
        if kids:
            for c in kids:
                leaf_counts(c)
        elif isinstance(m, CONNECTION_LAYERS):
            zeros += int((m.weight == 0).sum())
            weights += m.weight.numel()

    for child in model.children():
        leaf_counts(child)
    return round(zeros / weights, 4) if weights else None


class NeuroBenchCollector:
    """Forward hooks on the modules NeuroBench would hook, counting as its metrics do during one pass.
    `pause` is a context manager that keeps the collector's own ops out of the profiler's counts."""

    def __init__(self, model: nn.Module, pause: Any = None) -> None:
        self.model = model
        self.pause = pause
        self.effective_macs = 0
        self.effective_acs = 0
        self.dense = 0
        self.spikes = 0
        self.outputs = 0
        self.membrane_updates = 0
        self.per_layer: dict[int, dict[str, int]] = {}  # id(module) -> {"macs", "acs"}
        self.unsupported: list[str] = []
        self._handles: list[Any] = []
        self._mem_first: dict[int, bool] = {}

    def __enter__(self) -> "NeuroBenchCollector":
        # static metrics before the pass, as NeuroBench runs them before its workload (snntorch keeps
        # membrane state in buffers, which a pass resizes)
        self.footprint = footprint(self.model)
        self.connection_sparsity = connection_sparsity(self.model)
        for m in _walk(self.model, lambda c: isinstance(c, CONNECTION_LAYERS + RECURRENT_LAYERS)):
            if isinstance(m, RECURRENT_LAYERS):
                self.unsupported.append(type(m).__name__)
                continue
            self._handles.append(m.register_forward_pre_hook(self._connection))
        for m in _walk(self.model, _is_activation):
            self._handles.append(m.register_forward_hook(self._activation))
            if neuron_library(m) == "snntorch":
                holder: dict[str, Any] = {}
                self._handles.append(m.register_forward_pre_hook(lambda mod, a, h=holder: self._mem_pre(mod, h)))
                self._handles.append(m.register_forward_hook(lambda mod, a, o, h=holder: self._mem_post(mod, h)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _paused(self):
        import contextlib

        return self.pause() if self.pause is not None else contextlib.nullcontext()

    def _connection(self, layer: nn.Module, args: tuple) -> None:
        x = args[0] if len(args) == 1 else args
        if not isinstance(x, torch.Tensor):
            self.unsupported.append(f"{type(layer).__name__} with {len(args)} inputs")
            return
        with torch.no_grad(), self._paused():
            x = x.detach()
            spiking = not bool(((x != 0) & (x != 1) & (x != -1)).any())
            xb = (x != 0).to(torch.float64)
            wb = (layer.weight != 0).to(torch.float64)
            eff = int(self._run(layer, xb, wb).sum())
            dense = int(self._run(layer, torch.ones_like(xb), torch.ones_like(wb)).sum())
        row = self.per_layer.setdefault(id(layer), {"macs": 0, "acs": 0, "dense": 0})
        row["dense"] += dense
        self.dense += dense
        if spiking:
            self.effective_acs += eff
            row["acs"] += eff
        else:
            self.effective_macs += eff
            row["macs"] += eff

    @staticmethod
    def _run(layer: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if isinstance(layer, nn.Linear):
            return F.linear(x, w)
        return layer._conv_forward(x, w, None)

    def _activation(self, layer: nn.Module, args: tuple, out: Any) -> None:
        y = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(y, torch.Tensor):
            with self._paused():
                self.spikes += int(torch.count_nonzero(y))
            self.outputs += y.numel()

    def _mem_pre(self, layer: nn.Module, holder: dict[str, Any]) -> None:
        holder["pre"] = getattr(layer, "mem", None)

    def _mem_post(self, layer: nn.Module, holder: dict[str, Any]) -> None:
        post = getattr(layer, "mem", None)
        if not isinstance(post, torch.Tensor):
            return
        if not self._mem_first.get(id(holder)):
            self._mem_first[id(holder)] = True
            self.membrane_updates += post.numel()
            return
        with torch.no_grad(), self._paused():
            self.membrane_updates += int(torch.count_nonzero(holder["pre"] - post))

    def metrics(self, samples: int) -> dict[str, Any]:
        n = max(samples, 1)
        has_snntorch = bool(self._mem_first)
        return {
            "footprint": self.footprint,
            "connection_sparsity": self.connection_sparsity,
            "activation_sparsity": (self.outputs - self.spikes) / self.outputs if self.outputs else 0.0,
            "synaptic_operations": {"Effective_MACs": self.effective_macs / n, "Effective_ACs": self.effective_acs / n,
                                    "Dense": self.dense / n},
            "membrane_updates": self.membrane_updates / n if has_snntorch else None,
            "samples": samples,
            "not_counted": sorted(set(self.unsupported)),
            "definitions": DEFINITIONS,
            "source": "NeuroBench 2.3 (Yik et al., Nature Communications 2025): neurobench.metrics.static / workload",
        }
