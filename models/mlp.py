"""Small fully connected image classifiers: the students, teachers and merge parents of the
training recipes (weak-to-strong, CCA Merge, PU learning, InterLUDE) on digits.

`MLP` is a chain Linear -> act -> ... -> Linear; `linears()` lists the chain in order, which is
what `efficient.merge` aligns, and `features(x)` returns the last hidden layer (the embedding a
head, a fusion or a probe works on). Variants are data: `VARIANTS` below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from efficient.data.vision import DIGITS_MEAN, DIGITS_STD
from efficient.zoo import InputSpec, Variant, register_variants

Activation = Literal["relu", "gelu", "tanh", "identity"]
_ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "identity": nn.Identity}


@dataclass
class MLPConfig:
    """A digits MLP's options (recipe keys of the same names): the hidden widths, the image it
    flattens, the classes, the activation and the dropout after each hidden layer."""

    hidden: list[int] = field(default_factory=lambda: [64, 64])
    img_size: int = 16
    in_chans: int = 1
    num_classes: int = 10
    activation: Activation = "relu"
    dropout: float = 0.0


class MLP(nn.Module):
    """Flatten -> [Linear -> act] * len(hidden) -> Linear head."""

    def __init__(self, in_features: int, hidden: list[int], num_classes: int, activation: Activation = "relu", dropout: float = 0.0) -> None:
        super().__init__()
        if not hidden or any(h < 1 for h in hidden):
            raise ValueError(f"hidden must be a non-empty list of positive widths, got {hidden}")
        if activation not in _ACTS:
            raise ValueError(f"activation must be one of {sorted(_ACTS)}, got {activation!r}")
        self.in_features, self.num_classes = in_features, num_classes
        layers: list[nn.Module] = []
        d = in_features
        for h in hidden:
            layers += [nn.Linear(d, h), _ACTS[activation]()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            d = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, num_classes)
        self.embed_dim = d

    @classmethod
    def from_config(cls, config: MLPConfig) -> MLP:
        """The MLP on flattened `in_chans x img_size x img_size` images that `config` describes."""
        return cls(config.in_chans * config.img_size * config.img_size, list(config.hidden), config.num_classes,
                   config.activation, config.dropout)

    def linears(self) -> list[nn.Linear]:
        return [m for m in self.body if isinstance(m, nn.Linear)] + [self.head]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 2:
            x = x.flatten(1)
        if x.shape[1] != self.in_features:
            raise ValueError(f"MLP expects {self.in_features} input features per sample, got {tuple(x.shape[1:])}")
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


DIGITS = InputSpec((1, 16, 16), mean=DIGITS_MEAN, std=DIGITS_STD, num_classes=10)

VARIANTS: dict[str, Variant] = {
    "mlp-tiny": Variant(DIGITS, "", "digits MLP, one hidden layer of 16 (a weak teacher)", MLPConfig(hidden=[16])),
    "mlp-small": Variant(DIGITS, "", "digits MLP, two hidden layers of 64 (merge parents, SSL/PU students)", MLPConfig(hidden=[64, 64])),
    "mlp-base": Variant(DIGITS, "", "digits MLP, two hidden layers of 256 (a strong student)", MLPConfig(hidden=[256, 256])),
}

register_variants(MLP.from_config, VARIANTS, family="mlp")


class NTKTwoLayer(nn.Module):
    """f(x) = v . relu(U x / sqrt(d)) / sqrt(m), fp64: the NTK-parameterised two-layer network of the
    catapult papers (Lewkowycz et al. 2020), where the top NTK eigenvalue sets the 2/eta threshold."""

    def __init__(self, d: int, m: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.U = nn.Parameter(torch.randn(m, d, generator=g, dtype=torch.float64))
        self.v = nn.Parameter(torch.randn(m, generator=g, dtype=torch.float64))
        self.d, self.m = d, m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.relu(x @ self.U.T / math.sqrt(self.d)) @ self.v / math.sqrt(self.m)).unsqueeze(-1)
