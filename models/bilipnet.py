"""Certified bi-Lipschitz layers (BiLipNet / PLNet, Wang & Manchester, ICML 2024).

- `cayley(W)`: for W = [U; V] (m x n, m >= n), Z = U - U^T + V^T V and
  R = [(I+Z)^-1 (I-Z); -2 V (I+Z)^-1] has orthonormal columns (R^T R = I).
- `MonLipLayer(mu, nu)`: y = mu x + (nu - mu) R^T relu(R x + b) + b_y with R = cayley(a W/|W|).
  Its Jacobian mu I + (nu - mu) R^T D R (0 <= D <= I) is symmetric with eigenvalues in [mu, nu],
  so <f(x)-f(x'), x-x'> >= mu |x-x'|^2 and |f(x)-f(x')| <= nu |x-x'| for any parameters.
  (The paper's MonLipNet chains several such units; this is its one-unit form.)
- `BiLipNet`: orthogonal -> [MonLip(mu^(1/L), nu^(1/L)) -> orthogonal] * L, so
  mu |dx| <= |df| <= nu |dx| -- a certified, invertible map.
- `PLNet`: F(x) = 0.5 |BiLipNet(x)|^2 + c satisfies the Polyak-Lojasiewicz inequality
  0.5 |grad F|^2 >= mu^2 (F - c).
- `bilipnet-digits`: a classifier whose logits are certified (scale * nu)-Lipschitz in the input
  (the zoo's variants are data: `VARIANTS` below).
The n x n inverse of each Cayley map is cached in eval mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from efficient.data.vision import DIGITS_MEAN, DIGITS_STD
from efficient.zoo import InputSpec, Variant, register_variants


def cayley(W: torch.Tensor) -> torch.Tensor:
    """Orthonormal-column matrix [m, n] from any W [m, n] with m >= n."""
    m, n = W.shape
    if m < n:
        raise ValueError(f"cayley needs a tall matrix (rows >= cols), got {tuple(W.shape)}")
    U, V = W[:n], W[n:]
    eye = torch.eye(n, dtype=W.dtype, device=W.device)
    Z = U - U.T + V.T @ V
    inv = torch.linalg.inv(eye + Z)
    return torch.cat([inv @ (eye - Z), -2 * V @ inv], dim=0)


class CayleyParam(nn.Module):
    """A learnable orthonormal-column matrix: cayley(a W / |W|_F), cached while in eval mode."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.empty(rows, cols))
        nn.init.xavier_normal_(self.W)
        self.a = nn.Parameter(self.W.detach().norm().reshape(1).clone())
        self._cache: torch.Tensor | None = None

    def train(self, mode: bool = True) -> "CayleyParam":
        self._cache = None
        return super().train(mode)

    def forward(self) -> torch.Tensor:
        if not self.training and self._cache is not None:
            return self._cache
        R = cayley(self.a * self.W / self.W.norm())
        if not self.training:
            self._cache = R.detach()
        return R


class OrthogonalLayer(nn.Module):
    """y = Q x with Q square orthogonal (norm preserving)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.Q = CayleyParam(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.Q().T


class MonLipLayer(nn.Module):
    """mu-strongly monotone, nu-Lipschitz layer on R^features with `hidden` >= features units."""

    def __init__(self, features: int, hidden: int, mu: float = 0.1, nu: float = 10.0) -> None:
        super().__init__()
        if not 0 < mu <= nu:
            raise ValueError(f"MonLipLayer needs 0 < mu <= nu, got mu={mu}, nu={nu}")
        if hidden < features:
            raise ValueError(f"MonLipLayer needs hidden >= features, got {hidden} < {features}")
        self.mu, self.nu = mu, nu
        self.R = CayleyParam(hidden, features)
        self.b = nn.Parameter(torch.zeros(hidden))
        self.b_y = nn.Parameter(torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        R = self.R()
        return self.mu * x + (self.nu - self.mu) * torch.relu(x @ R.T + self.b) @ R + self.b_y


class BiLipNet(nn.Module):
    """Certified mu |dx| <= |f(x) - f(x')| <= nu |dx| on R^features."""

    def __init__(self, features: int, hidden: int | None = None, depth: int = 2, mu: float = 0.1, nu: float = 10.0) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"BiLipNet depth must be >= 1, got {depth}")
        hidden = hidden or 2 * features
        self.mu, self.nu, self.features = mu, nu, features
        mu_k, nu_k = mu ** (1 / depth), nu ** (1 / depth)
        layers: list[nn.Module] = [OrthogonalLayer(features)]
        for _ in range(depth):
            layers += [MonLipLayer(features, hidden, mu_k, nu_k), OrthogonalLayer(features)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def lipschitz_bounds(self) -> tuple[float, float]:
        """(lower, upper) certified bounds on |f(x) - f(x')| / |x - x'|."""
        return self.mu, self.nu


class PLNet(nn.Module):
    """F(x) = 0.5 |g(x)|^2 + c with g a BiLipNet: a scalar function satisfying the PL inequality."""

    def __init__(self, features: int, hidden: int | None = None, depth: int = 2, mu: float = 0.1, nu: float = 10.0) -> None:
        super().__init__()
        self.g = BiLipNet(features, hidden, depth, mu, nu)
        self.c = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * self.g(x).pow(2).sum(-1) + self.c


@dataclass
class BiLipClassifierConfig:
    """A BiLipNet classifier's options (recipe keys of the same names): the image it flattens, the
    classes, the BiLipNet's hidden width, depth and bounds mu <= nu, and the logit scale."""

    img_size: int = 8
    in_chans: int = 1
    num_classes: int = 10
    hidden: int = 128
    depth: int = 2
    mu: float = 0.1
    nu: float = 2.0
    scale: float = 10.0


class BiLipClassifier(nn.Module):
    """Flatten -> BiLipNet -> fixed-norm readout (orthonormal rows) * scale: logits are certified
    (scale * nu)-Lipschitz in the (flattened, normalised) input, a robust head."""

    def __init__(self, in_features: int, num_classes: int = 10, hidden: int | None = None, depth: int = 2, mu: float = 0.1, nu: float = 2.0, scale: float = 10.0) -> None:
        super().__init__()
        if num_classes > in_features:
            raise ValueError("BiLipClassifier needs num_classes <= in_features")
        self.in_features, self.num_classes, self.scale = in_features, num_classes, scale
        self.body = BiLipNet(in_features, hidden, depth, mu, nu)
        self.readout = CayleyParam(in_features, num_classes)  # columns orthonormal -> |readout^T| = 1
        self.bias = nn.Parameter(torch.zeros(num_classes))

    @classmethod
    def from_config(cls, config: BiLipClassifierConfig) -> BiLipClassifier:
        """The classifier on flattened `in_chans x img_size x img_size` images that `config` describes."""
        return cls(config.in_chans * config.img_size * config.img_size, config.num_classes, config.hidden, config.depth,
                   config.mu, config.nu, config.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x.flatten(1))
        return self.scale * (h @ self.readout()) + self.bias

    def lipschitz_bound(self) -> float:
        """Certified upper bound on |logits(x) - logits(x')|_2 / |x - x'|_2."""
        return self.scale * self.body.nu


PAPER = "Monotone, Bi-Lipschitz, and Polyak-Lojasiewicz Networks (Wang & Manchester, ICML 2024)"

VARIANTS: dict[str, Variant] = {
    "bilipnet-digits": Variant(InputSpec((1, 8, 8), mean=DIGITS_MEAN, std=DIGITS_STD, num_classes=10), PAPER,
                               "BiLipNet classifier on 8x8 digits: certified (scale * nu)-Lipschitz logits", BiLipClassifierConfig()),
}

register_variants(BiLipClassifier.from_config, VARIANTS, family="bilipnet")


def certified_radius(logits: torch.Tensor, lipschitz: float) -> torch.Tensor:
    """L2 radius within which the top class cannot change: margin / (sqrt(2) * L)."""
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) / (math.sqrt(2) * lipschitz)
