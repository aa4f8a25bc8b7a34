"""Import a NIR graph as a torch module that runs time-major `[T, B, ...]` input on our neuron kernels.

`read_nir(path)` reads an HDF5 `.nir` file (errors name the file); `from_nir(graph)` builds a
`NIRNetwork`: its nodes run in topological order, a node's input is the sum of its predecessors'
outputs (NIR's rule for several incoming edges), stateless layers see `[T*B, ...]` and neurons the
whole `[T, B, ...]` sequence from rest (the time-step convention is in `efficient.export.neurons`).
Nodes we cannot run (recurrent edges, CubaLIF, Delay, ...) are named in one error.
"""

from __future__ import annotations

from graphlib import CycleError, TopologicalSorter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from efficient.errors import ArtifactError
from efficient.export.neurons import DEFAULT_DT, DT_KEY, neuron_from_node

__all__ = ["NIRNetwork", "from_nir", "graph_dt", "load_nir", "read_nir"]

NEURON_TYPES = ("LIF", "IF", "LI")
LAYER_TYPES = ("Affine", "Linear", "Conv1d", "Conv2d", "AvgPool2d", "SumPool2d", "Flatten", "Scale", "Identity")
WHY_NOT = {
    "CubaLIF": "a current-based LIF keeps a synaptic current as a second state, which our LIF kernels do not have",
    "CubaLI": "a current-based leaky integrator keeps a synaptic current as a second state, which our LIF kernels do not have",
    "Delay": "per-connection delays are not modelled by our layers",
    "I": "a pure integrator without threshold is not one of our neurons",
    "Threshold": "a stateless threshold is not one of our neurons",
    "NIRGraph": "nested sub-graphs are not flattened by this importer",
}


def read_nir(path: str | Path):
    """The `nir.NIRGraph` in HDF5 file `path`; a missing, foreign or truncated file raises ArtifactError naming it."""
    import h5py
    import nir

    p = Path(path)
    if not p.is_file():
        raise ArtifactError(f"{p}: no such NIR file")
    if not h5py.is_hdf5(p):
        raise ArtifactError(f"{p}: not a NIR file (NIR graphs are HDF5 files; this one has no HDF5 signature, "
                            "so it is another format or a truncated download)")
    try:
        with h5py.File(p, "r") as f:
            if "node" not in f:
                raise ArtifactError(f"{p}: an HDF5 file but not a NIR graph (no 'node' group; top-level keys {sorted(f.keys())})")
        graph = nir.read(p)
    except ArtifactError:
        raise
    except Exception as e:  # h5py / nir raise OSError, KeyError, ValueError, AssertionError ... for damaged files
        if "type mismatch" in str(e) or "Type inference" in str(e):  # nir.read's own type check of the edges
            raise ArtifactError(f"{p}: the NIR graph cannot be read ({type(e).__name__}: {e}); the shapes of the nodes "
                                "named there do not chain, so the graph's producer wrote it inconsistently. Export it "
                                "again with shapes that match.") from None
        raise ArtifactError(f"{p}: the NIR graph cannot be read ({type(e).__name__}: {e}); the file is damaged or "
                            "written by an incompatible NIR version. Export it again.") from None
    if not isinstance(graph, nir.NIRGraph):
        raise ArtifactError(f"{p}: holds a single {type(graph).__name__} node, not a NIR graph")
    return graph


def graph_dt(graph, dt: float | None = None) -> float:
    """The seconds per time step to import with: `dt` if given, else the graph's metadata `dt`, else DEFAULT_DT."""
    if dt is not None:
        return float(dt)
    meta = getattr(graph, "metadata", None)
    value = meta.get(DT_KEY) if isinstance(meta, dict) else None
    if value is None:
        return DEFAULT_DT
    return float(np.asarray(value).reshape(()))


class _Scale(nn.Module):
    def __init__(self, scale: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("scale", torch.as_tensor(np.asarray(scale, dtype=np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _pair(v: Any, n: int = 2) -> tuple[int, ...]:
    a = np.asarray(v).reshape(-1)
    return tuple(int(x) for x in (np.repeat(a, n) if a.size == 1 else a))


def _padding(v: Any, n: int) -> Any:
    if isinstance(v, bytes):
        v = v.decode()
    return v if isinstance(v, str) else _pair(v, n)


def _param(arr: Any) -> nn.Parameter:
    return nn.Parameter(torch.as_tensor(np.asarray(arr, dtype=np.float32)).clone())


def _layer(node, name: str, source: str) -> nn.Module:
    """Our stateless module for NIR layer `node` (applied to [T*B, ...])."""
    import nir

    if isinstance(node, (nir.Affine, nir.Linear)):
        w = np.asarray(node.weight)
        if w.ndim != 2:
            raise ArtifactError(f"{source}: node {name!r} ({type(node).__name__}) has a weight of shape {w.shape}, expected 2-D [out, in]")
        has_bias = isinstance(node, nir.Affine)
        m = nn.Linear(w.shape[1], w.shape[0], bias=has_bias)
        m.weight = _param(w)
        if has_bias:
            bias = np.asarray(node.bias).reshape(-1)
            if bias.shape[0] != w.shape[0]:
                raise ArtifactError(f"{source}: node {name!r} (Affine) has {bias.shape[0]} biases for {w.shape[0]} outputs")
            m.bias = _param(bias)
        return m
    if isinstance(node, (nir.Conv1d, nir.Conv2d)):
        n = 1 if isinstance(node, nir.Conv1d) else 2
        w = np.asarray(node.weight)
        if w.ndim != n + 2:
            raise ArtifactError(f"{source}: node {name!r} ({type(node).__name__}) has a weight of shape {w.shape}")
        groups = int(np.asarray(node.groups).reshape(()))
        cls = nn.Conv1d if n == 1 else nn.Conv2d
        m = cls(w.shape[1] * groups, w.shape[0], tuple(w.shape[2:]), stride=_pair(node.stride, n),
                padding=_padding(node.padding, n), dilation=_pair(node.dilation, n), groups=groups, bias=True)
        m.weight = _param(w)
        m.bias = _param(np.asarray(node.bias).reshape(-1) if node.bias is not None else np.zeros(w.shape[0]))
        return m
    if isinstance(node, (nir.AvgPool2d, nir.SumPool2d)):
        k = _pair(node.kernel_size)
        # a sum pool is an average pool that divides by 1
        return nn.AvgPool2d(k, _pair(node.stride), _pair(node.padding),
                            divisor_override=1 if isinstance(node, nir.SumPool2d) else None)
    if isinstance(node, nir.Flatten):
        start, end = int(node.start_dim), int(node.end_dim)
        # NIR's dims exclude the batch; ours include it (T is merged into the batch for layers)
        return nn.Flatten(start + 1 if start >= 0 else start, end + 1 if end >= 0 else end)
    if isinstance(node, nir.Scale):
        return _Scale(node.scale)
    if isinstance(node, nir.Identity):
        return nn.Identity()
    raise AssertionError(type(node))


class NIRNetwork(nn.Module):
    """A NIR graph on our kernels: `forward(x [T, B, *input_shape]) -> [T, B, *output_shape]`.

    `nodes` holds one module per compute node (names as in the graph, '.' replaced by '_');
    `input_shape` / `output_shape` are per sample; `dt` is the seconds per step it was built for.
    """

    def __init__(self, modules: dict[str, nn.Module], order: list[str], preds: dict[str, list[str]],
                 input_name: str, output_name: str, input_shape: tuple[int, ...] | None,
                 output_shape: tuple[int, ...] | None, dt: float, source: str) -> None:
        super().__init__()
        self.nodes = nn.ModuleDict(modules)
        self.order, self.preds = order, preds
        self.input_name, self.output_name = input_name, output_name
        self.input_shape, self.output_shape, self.dt, self.source = input_shape, output_shape, dt, source

    def _neuron(self, name: str) -> bool:
        from efficient.models.neurons import SpikingNeuron

        return isinstance(self.nodes[name], SpikingNeuron)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # exporters that trace a batch of one (norse, rockpool) write it into the Input type: [1, ...] also takes [...]
        shapes = [self.input_shape] + ([self.input_shape[1:]] if self.input_shape and self.input_shape[0] == 1 else [])
        if self.input_shape is not None and tuple(x.shape[2:]) not in shapes:
            raise ValueError(f"{self.source}: the graph takes time-major input [T, B, {', '.join(map(str, self.input_shape))}]; "
                             f"got {list(x.shape)}")
        values: dict[str, torch.Tensor] = {self.input_name: x}
        for name in self.order:
            srcs = self.preds[name]
            inp = values[srcs[0]]
            for s in srcs[1:]:
                inp = inp + values[s]
            if name == self.output_name:
                return inp
            mod = self.nodes[name]
            values[name] = mod(inp) if self._neuron(name) else mod(inp.flatten(0, 1)).unflatten(0, inp.shape[:2])
        raise AssertionError("output node not reached")

    def extra_repr(self) -> str:
        return f"input={self.input_shape}, output={self.output_shape}, dt={self.dt:g}"


def _shape(node, key: str) -> tuple[int, ...] | None:
    t = (node.input_type if key == "input" else node.output_type) or {}
    v = next(iter(t.values()), None) if t else None
    return None if v is None else tuple(int(d) for d in np.asarray(v).reshape(-1))


def from_nir(graph, dt: float | None = None, source: str = "NIR graph", backend: str = "auto") -> NIRNetwork:
    """`NIRNetwork` for `graph` (a `nir.NIRGraph`) at `dt` seconds per step (default: the graph's own, else 1e-4)."""
    import nir

    dt = graph_dt(graph, dt)
    if not dt > 0:
        raise ArtifactError(f"{source}: dt must be > 0 seconds per time step (got {dt})")
    nodes = dict(graph.nodes)
    unknown = {n: type(v).__name__ for n, v in nodes.items()
               if type(v).__name__ not in NEURON_TYPES + LAYER_TYPES + ("Input", "Output")}
    if unknown:
        lines = "; ".join(f"{n!r} ({k}: {WHY_NOT.get(k, 'no equivalent layer here')})" for n, k in sorted(unknown.items()))
        raise ArtifactError(f"{source}: the graph uses nodes efficient cannot run: {lines}. "
                            f"Supported: {', '.join(NEURON_TYPES + LAYER_TYPES)}")
    inputs = [n for n, v in nodes.items() if isinstance(v, nir.Input)]
    outputs = [n for n, v in nodes.items() if isinstance(v, nir.Output)]
    if len(inputs) != 1 or len(outputs) != 1:
        raise ArtifactError(f"{source}: expected one Input and one Output node, found inputs {inputs} and outputs {outputs}")
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in graph.edges:
        if a not in nodes or b not in nodes:
            missing = a if a not in nodes else b
            raise ArtifactError(f"{source}: edge ({a!r}, {b!r}) names node {missing!r}, which the graph does not have")
        preds[b].append(a)
    try:
        order = list(TopologicalSorter({n: set(p) for n, p in preds.items()}).static_order())
    except CycleError as e:
        cycle = " -> ".join(e.args[1]) if len(e.args) > 1 else "?"
        raise ArtifactError(f"{source}: the graph is recurrent ({cycle}); efficient runs each layer over all T steps "
                            "at once, so feedback edges are not supported") from None
    order = [n for n in order if n != inputs[0]]
    dangling = [n for n in order if not preds[n]]
    if dangling:
        raise ArtifactError(f"{source}: nodes {dangling} have no incoming edge (not reachable from the input)")
    modules: dict[str, nn.Module] = {}
    keys: dict[str, str] = {}
    for name in order:
        node = nodes[name]
        if isinstance(node, nir.Output):
            continue
        key = name.replace(".", "_")
        if key in modules:
            raise ArtifactError(f"{source}: node names {keys[key]!r} and {name!r} collide once '.' becomes '_'")
        keys[key] = name
        kind = type(node).__name__
        try:
            modules[key] = neuron_from_node(node, name, dt, source, backend) if kind in NEURON_TYPES else _layer(node, name, source)
        except ArtifactError:
            raise
        except Exception as e:
            raise ArtifactError(f"{source}: node {name!r} ({kind}) cannot be built: {e}") from None
    ren = {n: n.replace(".", "_") for n in nodes}
    net = NIRNetwork(modules, [ren[n] for n in order], {ren[n]: [ren[p] for p in ps] for n, ps in preds.items()},
                     ren[inputs[0]], ren[outputs[0]], _shape(nodes[inputs[0]], "input"), _shape(nodes[outputs[0]], "output"),
                     dt, source)
    net.eval()
    return net


def load_nir(path: str | Path, dt: float | None = None, backend: str = "auto") -> NIRNetwork:
    """`from_nir(read_nir(path))`: a `.nir` file as a module; errors name the file."""
    return from_nir(read_nir(path), dt=dt, source=str(path), backend=backend)
