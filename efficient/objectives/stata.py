"""STATA objective: classification CE + lambda_intra * L_intra + lambda_inter * L_inter.

The alignment terms (our reconstruction, seeds/stata.md) act on the scores the model's STATA
`TokenPruner` returns for its last forward (`stata_outputs(model).scores`: one (s, c) pair per
pruning block, each `[T, B, N]`):

    p_t = softmax(standardize(s_t) / tau)      anchor scores, with gradient (anchor query, patch keys)
    q_t = softmax(standardize(c_t) / tau)      mean-patch-query scores = QK^T column mean, no gradient
    L_intra = mean_t KL(q_t || p_t)            the anchor learns where the whole map attends
    L_inter = mean_t KL(mean_t' p_t' || p_t)   the timesteps agree on one ranking (one kept set)

Timesteps whose scores are flat (all equal, on either side) are masked out; the terms are averaged
over valid (t, sample) pairs, then over pruning blocks.

On CUDA the closed-form forward and backward run compiled by inductor (a few fused kernels each,
where the eager bodies launch some fifty small ones per pruning block); on CPU eagerly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from efficient.models.stata import not_flat, stata_outputs
from efficient.objectives import register_objective
from efficient.objectives.classification import Classification


def _centred(s: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s - mean, population variance, the z-score's divisor sqrt(max(var, 1e-12)) + eps) per row."""
    d = s - s.mean(-1, keepdim=True)
    var = d.pow(2).mean(-1, keepdim=True)
    return d, var, var.clamp_min(1e-12).sqrt() + eps


def standardize(s: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row z-score over the last axis (population std) and the mask of rows that are not flat.
    Differentiable everywhere (the std is clamped before the sqrt, so constant rows give z ~ 0)."""
    d, var, D = _centred(s, eps)
    return d / D, not_flat(s)


def alignment_losses_reference(s: torch.Tensor, c: torch.Tensor, tau: float = 1.0,
                               eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_intra, L_inter) for one pruning block, composed of autograd ops (the spec; `s`, `c` are
    `[T, B, N]` anchor / mean-query scores)."""
    # at least fp32 (half-precision scores are upcast); float64 stays float64 for gradcheck-grade checks
    dtype = torch.promote_types(s.dtype, torch.float32)
    zs, valid_s = standardize(s.to(dtype), eps)
    zc, valid_c = standardize(c.detach().to(dtype), eps)
    logp = F.log_softmax(zs / tau, -1)
    q = F.softmax(zc / tau, -1)
    m_intra = (valid_s & valid_c).to(dtype)
    kl_intra = (torch.xlogy(q, q) - q * logp).sum(-1)  # [T, B]
    intra = (kl_intra * m_intra).sum() / m_intra.sum().clamp_min(1.0)
    m = valid_s.to(dtype)
    pbar = (logp.detach().exp() * m[..., None]).sum(0) / m.sum(0).clamp_min(1.0)[..., None]  # [B, N]
    kl_inter = (torch.xlogy(pbar, pbar) - pbar * logp).sum(-1)  # [T, B]
    inter = (kl_inter * m).sum() / m.sum().clamp_min(1.0)
    return intra, inter


def _alignment_forward(s: torch.Tensor, c: torch.Tensor, *, tau: float, eps: float):
    """(intra, inter) and what the closed-form backward needs (see `_Alignment`)."""
    dtype = torch.promote_types(s.dtype, torch.float32)
    d, var, D = _centred(s.to(dtype), eps)
    logp = F.log_softmax(d / D / tau, -1)
    zc, valid_c = standardize(c.to(dtype), eps)
    q = F.softmax(zc / tau, -1)
    valid_s = not_flat(s)
    w_intra = (valid_s & valid_c).to(dtype)
    w_intra = w_intra / w_intra.sum().clamp_min(1.0)
    intra = ((torch.xlogy(q, q) - q * logp).sum(-1) * w_intra).sum()
    m = valid_s.to(dtype)
    p = logp.exp()
    pbar = (p * m[..., None]).sum(0) / m.sum(0).clamp_min(1.0)[..., None]  # [B, N]
    w_inter = m / m.sum().clamp_min(1.0)
    inter = ((torch.xlogy(pbar, pbar) - pbar * logp).sum(-1) * w_inter).sum()
    return intra, inter, d, D, var, p, q, pbar, w_intra, w_inter


def _alignment_backward(g_intra, g_inter, d, D, var, p, q, pbar, w_intra, w_inter, *, tau: float, s_dtype: torch.dtype):
    """dL/ds of `_alignment_forward`'s losses (formula in `_Alignment`)."""
    g = -(g_intra * w_intra[..., None] * q + g_inter * w_inter[..., None] * pbar)  # dL/dlog p
    gz = (g - p * g.sum(-1, keepdim=True)) / tau
    gs = (gz - gz.mean(-1, keepdim=True)) / D
    sigma = var.clamp_min(1e-12).sqrt()
    gs = gs - d * ((gz * d).sum(-1, keepdim=True) * (var >= 1e-12) / (d.shape[-1] * sigma * D * D))
    return gs.to(s_dtype)


class _Alignment(torch.autograd.Function):
    """`alignment_losses_reference` with its gradient in closed form: one backward node of about a
    dozen ops where autograd records some thirty (every op of a training step is a kernel launch
    on a GPU). Only the anchor scores `s` get a gradient, through log p:

        dL/dlog p = -(g_intra * m_intra / M_intra) q - (g_inter * m / M) pbar
        dL/dz     = (dL/dlog p - p * sum_n dL/dlog p) / tau                 (log-softmax)
        dL/ds     = (dL/dz - mean(dL/dz)) / D - d * sum_n(dL/dz * d) / (N sigma D^2)

    with d = s - mean(s), sigma = sqrt(max(var, 1e-12)), D = sigma + eps (standardize; the last term
    is 0 where the variance is clamped). `compiled`: the two bodies run compiled by inductor."""

    @staticmethod
    def forward(ctx, s: torch.Tensor, c: torch.Tensor, tau: float, eps: float,
                compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.s_dtype, ctx.tau, ctx.compiled = s.dtype, tau, compiled
        kw = {"tau": tau, "eps": eps}
        fwd = _compiled_body("forward", **kw) if compiled else functools.partial(_alignment_forward, **kw)
        intra, inter, *saved = fwd(s, c)
        ctx.save_for_backward(*saved)
        return intra, inter

    @staticmethod
    def backward(ctx, g_intra: torch.Tensor, g_inter: torch.Tensor):
        kw = {"tau": ctx.tau, "s_dtype": ctx.s_dtype}
        bwd = _compiled_body("backward", **kw) if ctx.compiled else functools.partial(_alignment_backward, **kw)
        return bwd(g_intra, g_inter, *ctx.saved_tensors), None, None, None, None


@functools.lru_cache(maxsize=32)
def _compiled_body(which: str, **static: Any):
    """The forward or backward body compiled by inductor, once per (tau, eps, dtype) setting."""
    from efficient.kernels.lif_common import _compiled

    return _compiled(_alignment_forward if which == "forward" else _alignment_backward, tuple(static.items()))


def alignment_losses(s: torch.Tensor, c: torch.Tensor, tau: float = 1.0, eps: float = 1e-6,
                     backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(L_intra, L_inter) for one pruning block; `s`, `c` are `[T, B, N]` anchor / mean-query scores.
    The values of `alignment_losses_reference`, with a closed-form backward (`_Alignment`).
    `backend` as the kernels' (`efficient.kernels._backend`): "auto" runs the bodies compiled on
    CUDA (inductor's fused kernels) and eagerly on CPU; "compile" compiles them on any device;
    "torch" is the autograd composition itself."""
    from efficient.kernels._backend import HAS_TRITON, requested_backend

    want = requested_backend(backend, "alignment_losses")
    if want == "torch":
        return alignment_losses_reference(s, c.detach(), tau, eps)
    compiled = not torch.compiler.is_compiling() and (
        want in ("compile", "triton") or (want == "auto" and s.is_cuda and HAS_TRITON))
    intra, inter = _Alignment.apply(s, c.detach(), float(tau), float(eps), compiled)
    return intra, inter


@register_objective("stata")
class Stata(Classification):
    """CE (label smoothing / mixup as `classification`) plus STATA's intra- and inter-timestep alignment."""

    def __init__(
        self,
        label_smoothing: float = 0.0,
        mixup: float = 0.0,
        cutmix: float = 0.0,
        mixup_prob: float = 1.0,
        mixup_off_epoch: int | None = None,
        lambda_intra: float = 0.1,
        lambda_inter: float = 0.1,
        align_tau: float = 1.0,
        std_eps: float = 1e-6,
    ) -> None:
        super().__init__(label_smoothing, mixup, cutmix, mixup_prob, mixup_off_epoch)
        if lambda_intra < 0 or lambda_inter < 0:
            raise ValueError(f"objective.lambda_intra / lambda_inter must be >= 0, got {lambda_intra}, {lambda_inter}")
        if align_tau <= 0:
            raise ValueError(f"objective.align_tau must be > 0, got {align_tau}")
        self.lambda_intra, self.lambda_inter, self.tau, self.eps = lambda_intra, lambda_inter, align_tau, std_eps

    def alignment(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean over pruning blocks of (L_intra, L_inter) from the model's last forward."""
        scores = stata_outputs(model).scores
        if not scores:
            z = torch.zeros(())
            return z, z
        terms = [alignment_losses(s, c, self.tau, self.eps) for s, c in scores]
        return torch.stack([t[0] for t in terms]).mean(), torch.stack([t[1] for t in terms]).mean()

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        x, y = self.prepare(batch)
        logits = model(x)
        ce = self.classification_loss(logits, y)
        loss = ce
        logs: dict[str, float | torch.Tensor] = {"ce": ce.detach()}
        if self.lambda_intra > 0 or self.lambda_inter > 0:
            intra, inter = self.alignment(model)
            loss = ce + self.lambda_intra * intra.to(ce.device) + self.lambda_inter * inter.to(ce.device)
            logs.update({"stata/intra": intra.detach(), "stata/inter": inter.detach()})
        stats = stata_outputs(model).stats
        for k in ("keep_ratio", "tokens_out", "degenerate"):
            if k in stats:
                v = stats[k]
                logs[f"stata/{k}"] = v.detach() if isinstance(v, torch.Tensor) else float(v)
        logs["loss"] = loss.detach()
        if y.dim() == 1:
            logs["acc"] = (logits.argmax(-1) == y).float().mean().detach()
        return loss, logs
