"""Export spiking networks to a NIR graph (`to_nir`) and write it to an HDF5 `.nir` file (`write_nir`).

The graph describes one time step of the network on one sample: what our models do at each step
of their time-major `[T, B, ...]` input. Where our model repeats an image over T (direct encoding)
and averages the logits over T, the graph's input is the image presented at every step and its
output the logits of that step; the caller repeats and averages (see `efficient.export`).

Supported layers: `nn.Sequential` / `nn.ModuleList` chains of `nn.Linear`, `nn.Conv2d` (a following
`nn.BatchNorm2d` is folded into it), a lone `nn.BatchNorm1d/2d` (an affine / a depthwise 1x1
convolution), `nn.AvgPool2d`, `nn.Flatten` (its dims counted on time-major `[T, B, ...]`), `nn.Identity`, `nn.Dropout` (inference: identity), our
LIF / PLIF / DLIF, and the stable-SNN `SpikingVGG` and `SpikingWRN` (whose convex residual
combination becomes two `Scale` nodes summed at their common target). Spiking transformers fail
with the reason: NIR 1.0 has no node for a product of two activations (spiking self-attention) nor
for a data-dependent choice of tokens (STATA).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.export.neurons import DEFAULT_DT, DT_KEY, lif_node
from efficient.export.peers import batch_major, peer_library, peer_neuron_node, peer_sample_shape
from efficient.models.neurons import SpikingNeuron

__all__ = ["to_nir", "write_nir"]

Shape = tuple[int, ...]


def _np(t: torch.Tensor) -> np.ndarray:
    """A layer tensor as fp32 numpy (BN folding is done in float64 first; neuron parameters stay float64)."""
    return t.detach().cpu().float().numpy() if t.is_floating_point() else t.detach().cpu().numpy()


def _bn_affine(bn: nn.modules.batchnorm._BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference-mode batch norm as y = a * x + b per channel."""
    if bn.running_mean is None or bn.running_var is None:
        raise ConfigError(f"{type(bn).__name__} without running statistics cannot be folded for inference")
    a = torch.ones_like(bn.running_var) if bn.weight is None else bn.weight.detach().clone()
    a = a / torch.sqrt(bn.running_var + bn.eps)
    b = -bn.running_mean * a
    if bn.bias is not None:
        b = b + bn.bias.detach()
    return a.double(), b.double()


class _Builder:
    """Collects NIR nodes and edges; `tails` are the nodes whose outputs (summed) feed the next node."""

    def __init__(self, dt: float, flatten_offset: int = 2) -> None:
        self.nodes: dict[str, Any] = {}
        self.edges: list[tuple[str, str]] = []
        self.dt = dt
        # leading dims a plain nn.Flatten sees before the sample's: 2 on time-major [T, B, ...] (our
        # models, spikingjelly multi-step), 1 on one step [B, ...] (snntorch, spikingjelly single-step)
        self.flatten_offset = flatten_offset

    def add(self, name: str, node: Any, tails: list[str]) -> list[str]:
        name = name.replace(".", "_") or "node"
        base, i = name, 1
        while name in self.nodes:
            i += 1
            name = f"{base}_{i}"
        self.nodes[name] = node
        self.edges += [(t, name) for t in tails]
        return [name]


def _shape_after(layer: nn.Module, shape: Shape) -> Shape:
    """Per-sample output shape of a stateless layer (run on one zero sample; a spikingjelly layer in
    multi-step mode on one step of it)."""
    lead = 2 if getattr(layer, "step_mode", "s") == "m" else 1
    with torch.no_grad():
        return tuple(layer(torch.zeros(*(1,) * lead, *shape)).shape[lead:])


def _conv_node(conv: nn.Conv2d, shape: Shape, where: str, bn: nn.Module | None = None):
    import nir

    if conv.padding_mode != "zeros":
        raise ConfigError(f"{where} (Conv2d): padding_mode={conv.padding_mode!r}; NIR convolutions are zero-padded")
    if isinstance(conv.padding, str):
        raise ConfigError(f"{where} (Conv2d): padding={conv.padding!r}; give explicit integer padding to export")
    w = conv.weight.detach().double()
    b = conv.bias.detach().double() if conv.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    if bn is not None:
        a, c = _bn_affine(bn)
        w, b = w * a.view(-1, 1, 1, 1), b * a + c
    return nir.Conv2d(input_shape=tuple(shape[-2:]), weight=_np(w), stride=tuple(conv.stride), padding=tuple(conv.padding),
                      dilation=tuple(conv.dilation), groups=conv.groups, bias=_np(b))


def _channel_affine(a: torch.Tensor, b: torch.Tensor, shape: Shape):
    """Per-channel y = a * x + b as NIR: a 1x1 convolution with a diagonal weight on [C, H, W], an
    affine on [C]. (Not a depthwise convolution: nir 1.0.8's type inference ignores `groups`.)"""
    import nir

    c = a.numel()
    if len(shape) == 3:
        return nir.Conv2d(input_shape=tuple(shape[-2:]), weight=_np(torch.diag(a).view(c, c, 1, 1)), stride=(1, 1),
                          padding=(0, 0), dilation=(1, 1), groups=1, bias=_np(b))
    if len(shape) == 1:
        return nir.Affine(weight=_np(torch.diag(a)), bias=_np(b))
    raise ConfigError(f"a per-channel affine on samples of shape {shape} has no NIR form here (expected [C] or [C, H, W])")


def _unsupported_transformer(model: nn.Module) -> ConfigError | None:
    """The reason a spiking transformer cannot be written in NIR 1.0, naming the first module at fault."""
    from efficient.models.spiking_transformer import SpikingTransformer

    if not isinstance(model, SpikingTransformer):
        return None
    pruner = getattr(model, "stata", None)
    if pruner is not None and (pruner.prune_at or pruner.n_prefix):
        blocks = ", ".join(f"blocks.{i}" for i in sorted(pruner.prune_at)) or "the anchor token"
        return ConfigError(
            f"stata (TokenPruner, at {blocks}): STATA's token selection keeps a data-dependent top-k of the tokens, "
            "and NIR 1.0 graphs have fixed shapes and no gather node, so this model cannot be exported to NIR"
        )
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind in ("SSA", "SDSA"):
            what = "Q K^T V" if kind == "SSA" else "Q * (K * V summed over tokens)"
            return ConfigError(
                f"{name} ({kind}): spiking self-attention multiplies spike tensors with each other ({what}); "
                "NIR 1.0 has no node for a product of two activations, so this model cannot be exported to NIR"
            )
    return ConfigError(f"{type(model).__name__}: spiking transformers cannot be exported to NIR 1.0")


def _lower(m: nn.Module, b: _Builder, tails: list[str], shape: Shape, where: str) -> tuple[list[str], Shape]:
    """Append module `m` (at path `where`) after `tails`; returns the new tails and per-sample shape."""
    import nir

    from efficient.models import stable_snn

    if isinstance(m, (nn.Sequential, nn.ModuleList)) and type(m).__name__ == "SeqToANNContainer":
        # spikingjelly's container runs its layers on [T*B, ...]: a plain Flatten in it counts from B
        outer, b.flatten_offset = b.flatten_offset, 1
        try:
            return _lower(nn.Sequential(*m), b, tails, shape, where)
        finally:
            b.flatten_offset = outer
    if isinstance(m, (nn.Sequential, nn.ModuleList)):
        items = list(m.named_children())
        i = 0
        while i < len(items):
            name, child = items[i]
            path = f"{where}.{name}" if where else name
            nxt = items[i + 1][1] if i + 1 < len(items) else None
            if isinstance(child, nn.Conv2d) and isinstance(nxt, nn.BatchNorm2d):  # fold BN into the conv
                tails = b.add(path, _conv_node(child, shape, path, nxt), tails)
                shape = _shape_after(child, shape)  # batch norm keeps the shape
                i += 2
                continue
            tails, shape = _lower(child, b, tails, shape, path)
            i += 1
        return tails, shape
    if isinstance(m, SpikingNeuron):
        return b.add(where, lif_node(m, shape, b.dt, where), tails), shape
    peer = peer_neuron_node(m, shape, b.dt, where)
    if peer is not None:
        return b.add(where, peer, tails), shape
    if isinstance(m, nn.Linear):
        if shape[-1] != m.in_features or len(shape) != 1:
            raise ConfigError(f"{where} (Linear): expects [{m.in_features}] per sample, the graph gives {list(shape)}; flatten first")
        w = _np(m.weight)
        node = nir.Affine(weight=w, bias=_np(m.bias)) if m.bias is not None else nir.Linear(weight=w)
        return b.add(where, node, tails), (m.out_features,)
    if isinstance(m, nn.Conv2d):
        return b.add(where, _conv_node(m, shape, where), tails), _shape_after(m, shape)
    if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
        return b.add(where, _channel_affine(*_bn_affine(m), shape), tails), shape
    if isinstance(m, stable_snn.Normalize):
        a = (1.0 / m.std.reshape(-1)).double()
        return b.add(where, _channel_affine(a, -m.mean.reshape(-1).double() * a, shape), tails), shape
    if isinstance(m, nn.AvgPool2d):
        if m.ceil_mode or m.divisor_override is not None or (not m.count_include_pad and m.padding not in (0, (0, 0))):
            raise ConfigError(f"{where} (AvgPool2d): ceil_mode, divisor_override and count_include_pad=False have no NIR form")
        pair = lambda v: np.array(v if isinstance(v, (tuple, list)) else (v, v))  # noqa: E731
        node = nir.AvgPool2d(kernel_size=pair(m.kernel_size), stride=pair(m.stride), padding=pair(m.padding))
        return b.add(where, node, tails), _shape_after(m, shape)
    if isinstance(m, nn.Flatten):
        # the layer sees [T, B, ...] or [B, ...] (see _Builder): the leading dims are not the sample's; NIR's dims are
        lead = 1 if batch_major(m) else b.flatten_offset
        start, end = (d - lead if d >= 0 else d for d in (m.start_dim, m.end_dim))
        if start < 0 and m.start_dim >= 0:
            seen = "[T, B, ...]" if lead == 2 else "[B, ...]"
            raise ConfigError(f"{where} (Flatten): start_dim={m.start_dim} would flatten time or batch ({seen} input); "
                              f"flatten from dim {lead}")
        s, e = start % len(shape), end % len(shape)
        out = shape[:s] + (int(np.prod(shape[s:e + 1])),) + shape[e + 1:]
        return b.add(where, nir.Flatten(input_type={"input": np.array(shape)}, start_dim=start, end_dim=end), tails), out
    if isinstance(m, (nn.Identity, nn.Dropout)):
        return tails, shape
    if isinstance(m, stable_snn.ConvUnit):
        tails = b.add(f"{where}.conv", _conv_node(m.conv, shape, f"{where}.conv", m.bn), tails)
        shape = _shape_after(nn.Sequential(m.conv, m.bn).eval(), shape)
        return _lower(m.neuron, b, tails, shape, f"{where}.neuron")
    if isinstance(m, stable_snn.SpikingVGG):
        tails, shape = _lower(m.normalize, b, tails, shape, "normalize")
        tails, shape = _lower(m.features, b, tails, shape, "features")
        tails, shape = _lower(nn.Flatten(2), b, tails, shape, "flatten")
        for name in ("fc1", "neuron1", "fc2", "neuron2", "head"):
            tails, shape = _lower(getattr(m, name), b, tails, shape, name)
        return tails, shape
    if isinstance(m, stable_snn.WideBlock):
        return _lower_wide_block(m, b, tails, shape, where)
    if isinstance(m, stable_snn.SpikingWRN):
        tails, shape = _lower(m.normalize, b, tails, shape, "normalize")
        tails, shape = _lower(m.stem, b, tails, shape, "stem")
        tails, shape = _lower(m.blocks, b, tails, shape, "blocks")
        tails, shape = _lower(m.bn, b, tails, shape, "bn")
        tails, shape = _lower(m.neuron, b, tails, shape, "neuron")
        tails, shape = _lower(nn.AvgPool2d(tuple(shape[-2:])), b, tails, shape, "global_pool")
        tails, shape = _lower(nn.Flatten(2), b, tails, shape, "flatten")
        return _lower(m.head, b, tails, shape, "head")
    err = _unsupported_transformer(m)
    if err is not None:
        raise err
    raise ConfigError(
        f"{where or 'model'} ({type(m).__name__}): no NIR export for this layer. Exportable: Sequential chains of Linear, "
        "Conv2d (+BatchNorm2d), BatchNorm, AvgPool2d, Flatten, LIF/PLIF/DLIF, spikingjelly LIFNode/ParametricLIFNode/"
        "IFNode, snntorch Leaky, and the stable-SNN VGG/WRN models"
    )


def _lower_wide_block(m: nn.Module, b: _Builder, tails: list[str], shape: Shape, where: str) -> tuple[list[str], Shape]:
    """x -> bn1 -> neuron1 = a; skip = x or shortcut(a); h = conv2(neuron2(bn2(conv1(a)))); w0*skip + w1*h."""
    import nir

    a, s_a = _lower(m.bn1, b, tails, shape, f"{where}.bn1")
    a, s_a = _lower(m.neuron1, b, a, s_a, f"{where}.neuron1")
    if m.shortcut is None:
        skip, s_skip = tails, shape
    else:
        skip, s_skip = _lower(m.shortcut, b, a, s_a, f"{where}.shortcut")
    h = b.add(f"{where}.conv1", _conv_node(m.conv1, s_a, f"{where}.conv1", m.bn2), a)
    s_h = _shape_after(nn.Sequential(m.conv1, m.bn2).eval(), s_a)
    h, s_h = _lower(m.neuron2, b, h, s_h, f"{where}.neuron2")
    h, s_h = _lower(m.conv2, b, h, s_h, f"{where}.conv2")
    if s_h != s_skip:
        raise ConfigError(f"{where} (WideBlock): shortcut {list(s_skip)} and residual {list(s_h)} differ in shape")
    w = m.convex.comb.detach().double()
    out = b.add(f"{where}.convex.skip", nir.Scale(scale=np.full(s_h, float(w[0]), dtype=np.float32)), skip)
    out += b.add(f"{where}.convex.residual", nir.Scale(scale=np.full(s_h, float(w[1]), dtype=np.float32)), h)
    return out, s_h


def _sample_shape(model: nn.Module, sample_input: torch.Tensor, library: str | None) -> Shape:
    """Per-sample shape of one time step: images `[B, ...]` for the stable-SNN models (repeated over
    T inside), one step or `[T, B, ...]` for spikingjelly / snntorch models (`efficient.export.peers`),
    time-major `[T, B, ...]` for everything else."""
    from efficient.models.stable_snn import _SpikingNet

    if library is not None:
        return peer_sample_shape(model, library, sample_input)
    if isinstance(model, _SpikingNet):
        if sample_input.dim() < 2:
            raise ConfigError(f"sample_input for {type(model).__name__} is an image batch [B, C, H, W]; got {list(sample_input.shape)}")
        return tuple(sample_input.shape[1:])
    if sample_input.dim() < 3:
        raise ConfigError(f"sample_input must be time-major [T, B, ...] (got shape {list(sample_input.shape)})")
    return tuple(sample_input.shape[2:])


def to_nir(model: nn.Module, sample_input: torch.Tensor, dt: float = DEFAULT_DT):
    """The `nir.NIRGraph` of `model` for one time step (see the module docstring); `sample_input` is
    what `model` is called with (it fixes the shapes), `dt` the seconds per step (`efficient.export.neurons`)."""
    import nir

    if not dt > 0:
        raise ConfigError(f"dt must be > 0 seconds per time step (got {dt})")
    err = _unsupported_transformer(model)
    if err is not None:
        raise err
    library = peer_library(model)
    shape = _sample_shape(model, sample_input, library)
    one_step = library == "snntorch" or (library == "spikingjelly" and sample_input.dim() == len(shape) + 1)
    b = _Builder(float(dt), flatten_offset=1 if one_step else 2)
    tails = b.add("input", nir.Input(input_type={"input": np.array(shape)}), [])
    was_training = model.training
    model.eval()
    try:
        tails, out_shape = _lower(model, b, tails, shape, "")
    finally:
        model.train(was_training)
    b.add("output", nir.Output(output_type={"output": np.array(out_shape)}), tails)
    meta = {DT_KEY: float(dt), "producer": "efficient"}
    try:
        return nir.NIRGraph(nodes=b.nodes, edges=b.edges, metadata=meta, type_check=True)
    except Exception as e:  # nir's own type inference refused the graph: a bug on our side, say where
        raise ConfigError(f"NIR rejected the exported graph of {type(model).__name__}: {e}") from None


def write_nir(graph, path: str | Path) -> Path:
    """Write `graph` to `path` (HDF5, NIR's format) atomically; returns the path."""
    import nir

    from efficient.io import atomic_path

    path = Path(path)
    with atomic_path(path) as tmp:
        nir.write(tmp, graph)
    return path
