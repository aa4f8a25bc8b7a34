"""Checks every spiking transformer of the zoo should pass, shared by its model tests.

A neuron that receives `[T*B, ...]` where it expects time-major `[T, B, ...]` integrates one
sample's input into the next sample's membrane (QKFormer issue #14): a sample's logits then depend
on the other samples of its batch and on the batch size. `assert_batch_independent` and
`assert_batch_size_invariant` catch that, in float64 so that a reordered sum cannot flip a spike at
a threshold tie. BatchNorm's batch statistics mix samples by design, so in training mode they are
frozen (running statistics) while everything else trains. `flatten_time_into` plants the bug, to
show the checks see it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from efficient.models.neurons import SpikingNeuron


@contextlib.contextmanager
def float64() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def make_fire(model: nn.Module, x: torch.Tensor, seed: int = 0) -> nn.Module:
    """BatchNorm statistics of `x` (one training pass) and affine parameters that make every neuron
    layer fire at a middling rate (a fresh network barely spikes); returns `model` in eval mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.momentum = None
        m.reset_running_stats()
    model.train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model(x)
        for m in bns:
            m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
            m.bias.copy_(torch.rand(m.bias.shape, generator=g) * 0.8 - 0.2)
    return model.eval()


def firing_rates(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Mean firing rate of every neuron layer on `x` (inference)."""
    rates: dict[str, float] = {}
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: rates.__setitem__(name, float(o.float().mean())))
             for name, m in model.named_modules() if isinstance(m, SpikingNeuron)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return rates


@contextlib.contextmanager
def training_with_frozen_batchnorm(model: nn.Module) -> Iterator[None]:
    """Training mode (STATA records scores, fused units, warm-up ratios) with BatchNorm on running statistics."""
    was = model.training
    model.train()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    try:
        yield
    finally:
        model.train(was)


def _forward(model: nn.Module, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, token features `[T, B, N, D]`). The features are compared too: a pooled head can
    hide a difference (a saturated head neuron fires either way)."""
    ctx = training_with_frozen_batchnorm(model) if train else contextlib.nullcontext()
    with ctx, torch.no_grad():
        return model(x), model.forward_features(x)


def _sample(out: tuple[torch.Tensor, torch.Tensor], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return out[0][i], out[1][:, i]


def assert_batch_independent(model: nn.Module, x: torch.Tensor, other: torch.Tensor, train: bool = False) -> None:
    """Sample 0's logits and features are the same whichever samples fill the rest of its batch."""
    mixed = torch.cat([x[:1], other[1:]])
    a, b = _sample(_forward(model, x, train), 0), _sample(_forward(model, mixed, train), 0)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=lambda m: f"sample 0 depends on the rest of its batch: {m}")


def assert_batch_size_invariant(model: nn.Module, x: torch.Tensor) -> None:
    """Eval logits and features of each sample alone equal those within the batch."""
    whole = _forward(model, x, False)
    for i in range(x.shape[0]):
        alone = _sample(_forward(model, x[i:i + 1], False), 0)
        torch.testing.assert_close(alone, _sample(whole, i), rtol=0, atol=1e-9,
                                   msg=lambda m, i=i: f"sample {i}'s eval output depends on the batch size: {m}")


def flatten_time_into(neuron: nn.Module) -> Any:
    """Make `neuron` see `[T*B, 1, ...]` (time and batch flattened into its time axis) instead of
    `[T, B, ...]`: the bug the checks above must catch. Returns the hook handle (`.remove()` undoes it)."""
    def pre(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        _m._shape = x.shape  # type: ignore[attr-defined]
        return (x.flatten(0, 1).unsqueeze(1),)

    def post(_m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out.reshape(_m._shape)  # type: ignore[attr-defined]

    h1, h2 = neuron.register_forward_pre_hook(pre), neuron.register_forward_hook(post)

    class Handle:
        def remove(self) -> None:
            h1.remove()
            h2.remove()

    return Handle()
