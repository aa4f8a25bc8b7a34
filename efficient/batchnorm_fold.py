"""BatchNorm folded into the Linear or Conv before it, for inference.

    model = efficient.load("spikformer-4-384").eval()
    folded = efficient.fold_batchnorm(model, example)   # names of the BatchNorms folded

At evaluation a BatchNorm is a per-channel affine map with fixed statistics, so a Linear or Conv
whose output goes only into that BatchNorm can absorb it: W' = W * g / sqrt(var + eps) per output
channel, b' = (b - mean) * g / sqrt(var + eps) + beta (`torch.nn.utils.fusion`). Every zoo unit
(Linear/Conv -> BatchNorm -> neuron) then runs one call fewer per forward, and the neuron sees the
same input up to rounding.

Which pairs fold is read from one forward of `example` (no declarations in the models): a BatchNorm
folds when its input is the very tensor a Linear/Conv returned and nothing else uses that tensor.
A view in between (a reshape of a Linear's [T*B*N, C] output is one), a second consumer (a residual
that adds the raw conv output) or a BatchNorm without running statistics leaves the pair as it is.
The folded BatchNorm is replaced by a `FoldedBatchNorm`: the identity at evaluation that still
answers attribute reads (code that reads `running_mean`, such as a padding by BatchNorm statistics,
reads the original) and refuses to train: folding is one-way, reload the model to train it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval
from torch.overrides import TorchFunctionMode

from efficient.errors import ConfigError
from efficient.memory.spikes import tensors_in

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class FoldedBatchNorm(nn.Module):
    """A BatchNorm folded into the layer before it: the identity at evaluation. Attribute reads go
    to the original BatchNorm (kept outside the module tree, so its parameters leave the state dict)."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_original", bn)
        self.training = bn.training

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            raise ConfigError("this BatchNorm was folded into the layer before it for inference "
                              "(efficient.fold_batchnorm); load the model again to train it")
        return x

    def extra_repr(self) -> str:
        return f"folded {object.__getattribute__(self, '_original')}"


class _Uses(TorchFunctionMode):
    """Counts, per tensor id, the calls that take the tensor and return tensors (metadata reads
    such as `x.dim()` return no tensor and do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.uses: Counter[int] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _has_tensor(out):
            for t in tensors_in((args, kwargs or {})):
                self.uses[id(t)] += 1
        return out


def _has_tensor(obj: Any) -> bool:
    return next(tensors_in(obj), None) is not None


def foldable_pairs(model: nn.Module, example: Any) -> list[tuple[str, str]]:
    """(layer name, BatchNorm name) pairs of `model` that fold, from one forward of `example`
    (a tensor or a tuple of positional inputs) in evaluation mode, without gradients."""
    names = {m: n for n, m in model.named_modules()}
    produced: dict[int, str] = {}  # id of a layer's output -> the layer's name
    fed: list[tuple[str, int]] = []  # (BatchNorm name, id of its input), in call order
    calls: Counter[str] = Counter()  # layer calls (a layer used twice folds for both or neither)
    keep: list[torch.Tensor] = []  # every recorded tensor stays alive, so no id is reused
    handles = []

    def layer_out(m: nn.Module, args: Any, out: Any) -> None:
        calls[names[m]] += 1
        # a Linear folds into a BatchNorm1d over its output features only: a 2-D output [N, C]
        if isinstance(out, torch.Tensor) and (not isinstance(m, nn.Linear) or out.dim() == 2):
            produced[id(out)] = names[m]
            uses.uses[id(out)] = 0  # the id may have been a freed tensor's: count from here
            keep.append(out)

    def norm_in(m: nn.Module, args: Any) -> None:
        calls[names[m]] += 1
        if args and isinstance(args[0], torch.Tensor):
            fed.append((names[m], id(args[0])))
            keep.append(args[0])

    uses = _Uses()
    for m in model.modules():
        if isinstance(m, _LAYERS):
            handles.append(m.register_forward_hook(layer_out))
        elif isinstance(m, _NORMS):
            handles.append(m.register_forward_pre_hook(norm_in))
    try:
        with torch.no_grad(), uses:
            model(*(example if isinstance(example, tuple) else (example,)))
    finally:
        for h in handles:
            h.remove()
    pairs = []
    for bn_name, tid in fed:
        layer = produced.get(tid)
        if layer is not None and uses.uses[tid] == 1 and calls[layer] == 1 and calls[bn_name] == 1:
            pairs.append((layer, bn_name))
    return pairs


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, (nn.ModuleList, nn.Sequential)):
        parent[int(child)] = module
    else:
        setattr(parent, child, module)


def fold_batchnorm(model: nn.Module, example: Any) -> list[str]:
    """Fold every BatchNorm that directly follows a Linear/Conv in `model` (evaluation mode, in
    place; see the module docstring). `example`: an input of the model (a small batch is enough).
    Returns the names of the folded BatchNorms."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"fold_batchnorm: model must be an nn.Module, got {type(model).__name__}")
    if model.training:
        raise ConfigError("fold_batchnorm folds evaluation-mode BatchNorm (its running statistics): call model.eval() first")
    folded = []
    for layer_name, bn_name in foldable_pairs(model, example):
        layer, bn = model.get_submodule(layer_name), model.get_submodule(bn_name)
        if not bn.track_running_stats or bn.running_mean is None:
            continue
        if isinstance(layer, nn.Linear):
            if isinstance(bn, nn.BatchNorm1d) and bn.num_features == layer.out_features:
                fused = fuse_linear_bn_eval(layer, bn)
            else:
                continue
        elif bn.num_features == layer.out_channels:
            fused = fuse_conv_bn_eval(layer, bn)
        else:
            continue
        _set(model, layer_name, fused)
        _set(model, bn_name, FoldedBatchNorm(bn))
        folded.append(bn_name)
    return folded
