"""Merge two trained runs of the same architecture into one model (`cca`, `permute` or `average`).

CCA Merge (Horoi et al., ICML 2024) aligns B's hidden features to A's with the
linear map of a canonical correlation analysis on a calibration pass, then averages the weights:
    Sigma_AA^-1/2 Sigma_AB Sigma_BB^-1/2 = U S V^T,   T = Sigma_BB^-1/2 V U^T Sigma_AA^1/2,
so that z_A ~ T^T z_B. B's layer l gets its output rows mapped by T^T and layer l+1 its input
columns by T^-T (T^-1 = Sigma_AA^-1/2 U V^T Sigma_BB^1/2), then A and B' are averaged.
`permute` matches neurons one-to-one on activation correlation (Hungarian), `average` is plain
weight averaging. Models are chains of `nn.Linear` with elementwise activations between them
(`model.linears()` if defined, else the Linear modules in registration order).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Literal

import torch
from torch import nn

from efficient.errors import ConfigError

Method = Literal["cca", "permute", "average"]
METHODS = ("cca", "permute", "average")


def linear_chain(model: nn.Module) -> list[nn.Linear]:
    layers = model.linears() if hasattr(model, "linears") else [m for m in model.modules() if isinstance(m, nn.Linear)]
    for a, b in zip(layers, layers[1:]):
        if a.out_features != b.in_features:
            raise ConfigError(f"merge: {type(model).__name__} is not a chain of Linear layers ({a.out_features} outputs feed {b.in_features} inputs); only MLP-like models can be merged")
    if len(layers) < 2:
        raise ConfigError("merge: the model needs at least two Linear layers (one hidden merge point)")
    return layers


@torch.no_grad()
def hidden_features(model: nn.Module, batches: Iterable[Any]) -> list[torch.Tensor]:
    """Activations at every merge point: the inputs of Linear layers 2..L, concatenated over batches."""
    layers = linear_chain(model)
    feats: list[list[torch.Tensor]] = [[] for _ in layers[1:]]
    hooks = [layer.register_forward_pre_hook(lambda _m, inp, i=i: feats[i].append(inp[0].detach().double().flatten(0, -2))) for i, layer in enumerate(layers[1:])]
    was = model.training
    model.eval()
    try:
        for x in batches:
            model(x)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return [torch.cat(f) for f in feats]


def _sym_power(S: torch.Tensor, p: float) -> torch.Tensor:
    w, V = torch.linalg.eigh(S)
    return (V * w.clamp_min(1e-12).pow(p)) @ V.T


def cca_transform(za: torch.Tensor, zb: torch.Tensor, gamma: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, T^-1) with z_A ~ T^T z_B, from features [N, d] of A and B at one merge point.

    gamma is the ridge added to both covariances (align-n-merge's default 0.1)."""
    za = za.double() - za.double().mean(0)
    zb = zb.double() - zb.double().mean(0)
    n, d = za.shape
    eye = torch.eye(d, dtype=torch.float64)
    saa = za.T @ za / (n - 1) + gamma * eye
    sbb = zb.T @ zb / (n - 1) + gamma * eye
    sab = za.T @ zb / (n - 1)
    saa_h, saa_ih = _sym_power(saa, 0.5), _sym_power(saa, -0.5)
    sbb_h, sbb_ih = _sym_power(sbb, 0.5), _sym_power(sbb, -0.5)
    U, _, Vh = torch.linalg.svd(saa_ih @ sab @ sbb_ih)
    T = sbb_ih @ Vh.T @ U.T @ saa_h
    T_inv = saa_ih @ U @ Vh @ sbb_h
    return T, T_inv


def permutation_transform(za: torch.Tensor, zb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, P^T) with z_A ~ P^T z_B: the one-to-one neuron matching maximising activation correlation."""
    from scipy.optimize import linear_sum_assignment

    za = za.double() - za.double().mean(0)
    zb = zb.double() - zb.double().mean(0)
    corr = (za / za.norm(dim=0).clamp_min(1e-12)).T @ (zb / zb.norm(dim=0).clamp_min(1e-12))  # [dA, dB]
    rows, cols = linear_sum_assignment(corr.numpy(), maximize=True)
    P = torch.zeros_like(corr)
    P[torch.as_tensor(cols), torch.as_tensor(rows)] = 1.0  # B neuron cols[k] -> A neuron rows[k]
    return P, P.T


def merge_models(a: nn.Module, b: nn.Module, batches: list[Any], method: Method = "cca", gamma: float = 0.1) -> nn.Module:
    """A new model with A's architecture: the average of A and B after aligning B to A."""
    if method not in METHODS:
        raise ConfigError(f"merge: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    la, lb = linear_chain(a), linear_chain(b)
    if [(l.in_features, l.out_features) for l in la] != [(l.in_features, l.out_features) for l in lb]:
        raise ConfigError("merge: the two models have different layer shapes; merge runs of the same architecture")
    merged = copy.deepcopy(a)
    lm = linear_chain(merged)
    maps: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * (len(la) - 1)
    if method != "average":
        fa, fb = hidden_features(a, batches), hidden_features(b, batches)
        for i, (za, zb) in enumerate(zip(fa, fb)):
            maps[i] = cca_transform(za, zb, gamma) if method == "cca" else permutation_transform(za, zb)
    with torch.no_grad():
        for k, (A, B, M) in enumerate(zip(la, lb, lm)):
            w = B.weight.double()
            bias = B.bias.double() if B.bias is not None else None
            if k < len(maps) and maps[k] is not None:  # output rows into A's space: T^T
                T = maps[k][0]
                w = T.T @ w
                bias = T.T @ bias if bias is not None else None
            if k > 0 and maps[k - 1] is not None:  # input columns: W T^-T undoes the previous map
                w = w @ maps[k - 1][1].T
            M.weight.copy_(((A.weight.double() + w) / 2).to(M.weight.dtype))
            if M.bias is not None:
                M.bias.copy_(((A.bias.double() + bias) / 2).to(M.bias.dtype))
    outside = [n for n, p in merged.named_parameters() if id(p) not in {id(q) for l in lm for q in l.parameters()}]
    if outside:  # e.g. norms or embeddings: they would need their own alignment
        raise ConfigError(f"merge: parameters {outside[:3]} are outside the Linear chain and cannot be aligned; only plain MLP chains are supported")
    return merged


@torch.no_grad()
def accuracy(model: nn.Module, loader: Iterable[Any]) -> float:
    """Top-1 accuracy of a classifier over (x, y) batches."""
    model.eval()
    correct = total = 0
    for x, y in loader:
        correct += (model(x).argmax(-1) == y).sum().item()
        total += len(y)
    return correct / max(1, total)
