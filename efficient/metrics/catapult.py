"""Catapults and AGOP alignment (Zhu et al., ICML 2024): SGD loss spikes are catapults in the top
eigendirections of the tangent kernel, and they improve the alignment of the average gradient
outer product (AGOP) with the true one.

AGOP: G(f) = (1/n) sum_i J_x(x_i)^T J_x(x_i) with J_x the input Jacobian of the outputs.
Alignment: Frobenius cosine <G1, G2> / (|G1| |G2|).
Tangent kernel (MSE on outputs): K = (1/n) J_theta J_theta^T over all (sample, output) pairs;
gradient descent with step eta is stable only while eta < 2 / lambda_max(K) (a catapult when not).
Both use per-sample Jacobians (torch.func): tiny models only, and log them every k steps.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap


def _inputs(batch) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def agop(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """AGOP [D, D] over the flattened input dimension D."""
    shape = x.shape[1:]

    def f(xi: torch.Tensor) -> torch.Tensor:
        return model(xi.reshape(1, *shape)).reshape(-1)

    J = vmap(jacrev(f))(x.flatten(1))  # [n, C, D]
    return torch.einsum("ncd,nce->de", J, J) / x.shape[0]


def frobenius_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30)).item()


def agop_alignment(model: nn.Module, batch, target: torch.Tensor | None = None, max_samples: int = 64) -> dict[str, float]:
    """{"agop_trace", "agop_top_frac" (share of the top eigenvalue), "agop_align" (vs `target`, if given)}."""
    x = _inputs(batch)[:max_samples]
    was = model.training
    model.eval()
    try:
        G = agop(model, x).detach()
    finally:
        model.train(was)
    ev = torch.linalg.eigvalsh(G.double())
    out = {"agop_trace": G.trace().item(), "agop_top_frac": (ev[-1] / ev.sum().clamp_min(1e-30)).item()}
    if target is not None:
        out["agop_align"] = frobenius_cosine(G, target.to(G))
    return out


def tangent_kernel(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """K = (1/n) J J^T [n*C, n*C] with J the Jacobian of all outputs w.r.t. all parameters."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def f(p: dict, xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xi.unsqueeze(0),)).reshape(-1)

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)  # {name: [n, C, *shape]}
    J = torch.cat([j.flatten(2) for j in jac.values()], dim=2)  # [n, C, P]
    J = J.flatten(0, 1)
    return J @ J.T / x.shape[0]


def ntk_top_eigenvalue(model: nn.Module, batch, max_samples: int = 32) -> dict[str, float]:
    """{"ntk_top_eig": lambda_max(K), "ntk_critical_lr": 2 / lambda_max} on the first samples of the batch."""
    x = _inputs(batch)[:max_samples]
    was = model.training
    model.eval()
    try:
        lam = torch.linalg.eigvalsh(tangent_kernel(model, x).double())[-1].item()
    finally:
        model.train(was)
    return {"ntk_top_eig": lam, "ntk_critical_lr": 2.0 / lam if lam > 0 else float("inf")}
