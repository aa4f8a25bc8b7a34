"""Multi-step leaky integrate-and-fire (LIF / PLIF / DLIF) over time-major input `[T, ...]`.

One file, four parts (see DESIGN.md, "Conventions"):

1. `lif_reference`: the spec, a readable autograd loop over T.
2. Triton kernels: forward and backward each loop over T inside one kernel; the forward saves only
   the pre-reset potential H (fp32), the backward recomputes spikes and surrogate from it.
3. One `torch.library` custom op pair, `efficient::lif_forward` / `efficient::lif_backward`, with
   fake implementations (so `torch.compile` traces models without graph breaks), an autograd
   formula and a flop formula. Its CPU/CUDA implementation is chosen by `impl` (`IMPLS`): the
   Triton kernels, or the same loop written in torch and compiled with inductor into one fused
   C++/OpenMP loop (the fast CPU path), or that loop run eagerly.
4. `lif`: the public entry point; `backend="auto"|"triton"|"torch"|"compile"|"loop"`, env
   `EFFICIENT_BACKEND` overrides `auto` (resolved by `efficient.kernels._backend`). `auto` = Triton
   on CUDA; on CPU the compiled loop for inputs of at least COMPILE_MIN_NUMEL elements, and the same
   loop run eagerly ("loop") below that (compiling costs tens of seconds once per configuration,
   which small inputs never repay). `impl=` runs the custom op with one implementation directly.

Dynamics (spikingjelly's LIFNode / ParametricLIFNode formulas, in the same floating-point order):

    charge   decay_input:  H[t] = V[t-1] + (X[t] - (V[t-1] - V_reset)) / tau
             no decay:     H[t] = V[t-1] - (V[t-1] - V_reset) / tau + X[t]
             leak (DLIF):  H[t] = lambda * V[t-1] + X[t]          (stable-SNN, Ding et al. 2024)
    fire     S[t] = Theta(H[t] - V_th)            (Theta(0) = 1: a spike fires at equality)
    reset    hard: V[t] = V_reset if S[t] else H[t];  soft (v_reset=None): V[t] = H[t] - S[t] * V_th
    V[-1] = V_reset (hard) or 0 (soft). PLIF replaces `/ tau` by `* rate` with rate = sigmoid(w).

`v_init` starts from a given membrane (spikingjelly's state carried across calls); its gradient
comes back from the same backward. `order="snntorch"` (public `leaky`, op `efficient::leaky_*`) is
snntorch 1.0's `Leaky` order, where the reset decided at t-1 is applied after the leak of step t:

    subtract M[t] = beta*M[t-1] + X[t] - r[t]*V_th      r[t] = Theta(M[t-1] - V_th), detached
    zero     M[t] = beta*((1 - r[t])*M[t-1]) + X[t]     none: M[t] = beta*M[t-1] + X[t]
    fire     S[t] = (M[t] - V_th > 0)                   (strict, as snntorch)

with beta and V_th per neuron (fp32 [N], differentiable) and M[-1] given or 0.

The backward uses a surrogate dS/dH = g(H - V_th): sigmoid `alpha*sig(alpha*u)*(1-sig(alpha*u))`,
atan `(alpha/2) / (1 + (pi/2*alpha*u)^2)`, triangle `max(0, alpha - alpha^2*|u|)` (spikingjelly's
PiecewiseQuadratic; the stable-SNN triangle of width w is alpha = 1/w), or ste, the straight-through
estimator `alpha` everywhere (1 by default; no spikingjelly counterpart, used by attacks that probe
gradient masking, see efficient.attack_suite). `alpha=None` takes the
surrogate's default in spikingjelly (`SURROGATE_ALPHA`: sigmoid 4, atan 2, triangle 1), so switching
the name gives the function users know. `detach_reset` cuts the gradient through the reset's use of S.

NaN input is not an error by default (checking costs a pass and a device sync): a NaN membrane
never fires (every comparison with NaN is false), so it stays NaN and its gradient is NaN. Pass
`check_finite=True` to `lif` to raise instead.
"""

from __future__ import annotations

import functools
import math
import os
import types
from typing import Optional

import torch
from torch import Tensor

from efficient.kernels import _backend
from efficient.kernels._backend import BACKENDS

try:  # Triton is optional on CPU-only installs; the "triton" backend then raises a clear error.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = [
    "BACKENDS",
    "IMPLS",
    "SURROGATES",
    "SURROGATE_ALPHA",
    "default_alpha",
    "ORDERS",
    "RESETS",
    "leaky",
    "leaky_reference",
    "lif",
    "lif_reference",
    "check_input",
    "resolve_backend",
    "surrogate_grad",
]

COMPILE_MIN_NUMEL = 1 << 20
# surrogate ids (the op's `surrogate` argument) and their names
SURROGATE_SIGMOID, SURROGATE_ATAN, SURROGATE_TRIANGLE, SURROGATE_STE = 0, 1, 2, 3
SURROGATES = {"sigmoid": SURROGATE_SIGMOID, "atan": SURROGATE_ATAN, "triangle": SURROGATE_TRIANGLE, "ste": SURROGATE_STE}
# default alpha per surrogate: spikingjelly 2.0's defaults (surrogate.Sigmoid alpha=4.0,
# surrogate.ATan alpha=2.0, surrogate.PiecewiseQuadratic alpha=1.0); the straight-through
# estimator passes the gradient unchanged (alpha 1)
SURROGATE_ALPHA = {"sigmoid": 4.0, "atan": 2.0, "triangle": 1.0, "ste": 1.0}
# charge modes; the float constant `c` of the op is tau for the first two, lambda for LEAK
CHARGE_DECAY_INPUT, CHARGE_NO_DECAY, CHARGE_LEAK = 0, 1, 2
# snntorch `Leaky` reset mechanisms (the update order "snntorch", see `leaky`)
RESET_SUBTRACT, RESET_ZERO, RESET_NONE = 0, 1, 2
RESETS = {"subtract": RESET_SUBTRACT, "zero": RESET_ZERO, "none": RESET_NONE}
# update orders of `lif`: charge-fire-reset (spikingjelly, ours) or snntorch's (reset of the previous
# step subtracted after the leak)
ORDERS = ("spikingjelly", "snntorch")
# op implementations: "triton" kernels, "inductor" = compiled torch loop, "loop" = same loop eagerly
IMPLS = ("triton", "inductor", "loop")


# ---------------------------------------------------------------------------------------------
# 1. torch reference (the spec)
# ---------------------------------------------------------------------------------------------


def default_alpha(surrogate: str, alpha: Optional[float] = None) -> float:
    """`alpha` if given, else the surrogate's spikingjelly default (`SURROGATE_ALPHA`)."""
    if alpha is not None:
        return float(alpha)
    try:
        return SURROGATE_ALPHA[surrogate]
    except (KeyError, TypeError):
        raise ValueError(f"unknown surrogate {surrogate!r}; choose one of {sorted(SURROGATES)}") from None


def surrogate_grad(u: Tensor, surrogate: int, alpha: float) -> Tensor:
    """dS/dH at u = H - V_th for a surrogate id of `SURROGATES` (spikingjelly formulas)."""
    if surrogate == SURROGATE_SIGMOID:
        sg = torch.sigmoid(u * alpha)
        return (1.0 - sg) * sg * alpha
    if surrogate == SURROGATE_ATAN:
        a = alpha / 2
        z = (math.pi * a) * u
        return a / (1 + z * z)
    if surrogate == SURROGATE_TRIANGLE:
        return (alpha - (alpha * alpha) * u.abs()).clamp_min(0.0)
    if surrogate == SURROGATE_STE:
        return torch.zeros_like(u) + alpha
    raise ValueError(f"unknown surrogate id {surrogate}; expected one of {SURROGATES}")


class _Heaviside(torch.autograd.Function):
    """S = Theta(u) forward, surrogate derivative backward."""

    @staticmethod
    def forward(ctx, u: Tensor, surrogate: int, alpha: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(u)
        ctx.surrogate, ctx.alpha = surrogate, alpha
        return (u >= 0).to(u.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        (u,) = ctx.saved_tensors
        return g * surrogate_grad(u, ctx.surrogate, ctx.alpha), None, None


def _charge(x: Tensor, v: Tensor, rate, c, v_reset: float, charge: int) -> Tensor:
    """H from input x and previous membrane v; `rate` (PLIF) multiplies where `c` = tau divides."""
    if charge == CHARGE_LEAK:
        return c * v + x
    if charge == CHARGE_DECAY_INPUT:
        d = x - (v - v_reset)
        return v + (d * rate if rate is not None else d / c)
    d = v - v_reset
    return v - (d * rate if rate is not None else d / c) + x


def lif_reference(
    x: Tensor,
    tau: float = 2.0,
    v_threshold: float = 1.0,
    v_reset: Optional[float] = 0.0,
    detach_reset: bool = True,
    decay_input: bool = True,
    surrogate: str = "sigmoid",
    alpha: Optional[float] = None,
    *,
    rate: Optional[Tensor] = None,
    leak: Optional[float] = None,
    spike_dtype: Optional[torch.dtype] = None,
    v_init: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Plain autograd loop over T. Returns (spikes in `spike_dtype` or x.dtype, H in fp32 or float64).

    `v_init` (shaped like x[0]) is the membrane before the first step instead of the resting value.

    `rate` (a tensor, PLIF's 1/tau) replaces `/ tau` by `* rate`; `leak` selects the DLIF charge
    `H = leak * V + X` (tau, rate and decay_input are then unused). `alpha=None`: the surrogate's default.
    """
    sid = _surrogate_id(surrogate)
    alpha = default_alpha(surrogate, alpha)
    charge, c = _charge_mode(tau, decay_input, leak)
    vr = 0.0 if v_reset is None else float(v_reset)
    xf = x if x.dtype == torch.float64 else x.float()  # fp32 compute; float64 kept for gradcheck
    v = torch.full_like(xf[0], vr) if v_init is None else v_init.to(xf.dtype).expand_as(xf[0])
    spikes, hs = [], []
    for t in range(x.shape[0]):
        h = _charge(xf[t], v, rate, c, vr, charge)
        s = _Heaviside.apply(h - v_threshold, sid, float(alpha))
        sr = s.detach() if detach_reset else s
        v = h - sr * v_threshold if v_reset is None else sr * vr + (1.0 - sr) * h
        spikes.append(s)
        hs.append(h)
    return torch.stack(spikes).to(spike_dtype or x.dtype), torch.stack(hs)


class _HeavisideStrict(torch.autograd.Function):
    """S = (u > 0) forward (snntorch fires strictly above threshold), surrogate derivative backward."""

    @staticmethod
    def forward(ctx, u: Tensor, surrogate: int, alpha: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(u)
        ctx.surrogate, ctx.alpha = surrogate, alpha
        return (u > 0).to(u.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        (u,) = ctx.saved_tensors
        return g * surrogate_grad(u, ctx.surrogate, ctx.alpha), None, None


def leaky_reference(
    x: Tensor,
    beta: float | Tensor,
    threshold: float | Tensor = 1.0,
    reset_mechanism: str = "subtract",
    surrogate: str = "atan",
    alpha: Optional[float] = None,
    *,
    mem: Optional[Tensor] = None,
    spike_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor]:
    """snntorch's `Leaky` (reset_delay=True) over T, as snntorch writes it. Returns (spikes, membrane fp32).

    r[t] = Theta(M[t-1] - thr) (detached); subtract: M[t] = beta*M[t-1] + X[t] - r[t]*thr; zero:
    M[t] = beta*((1 - r[t])*M[t-1]) + X[t]; none: M[t] = beta*M[t-1] + X[t]; S[t] = (M[t] - thr > 0).
    M[-1] = `mem` (default 0). beta and threshold broadcast against x[0] (scalar or per neuron);
    beta is used as given (snntorch clamps it to [0, 1] before calling this).
    """
    sid, alpha = _surrogate_id(surrogate), default_alpha(surrogate, alpha)
    rid = _reset_id(reset_mechanism)
    xf = x if x.dtype == torch.float64 else x.float()
    m = torch.zeros_like(xf[0]) if mem is None else mem.to(xf.dtype).expand_as(xf[0])
    spikes, ms = [], []
    for t in range(x.shape[0]):
        r = _HeavisideStrict.apply(m - threshold, sid, float(alpha)).detach()
        if rid == RESET_ZERO:
            m = beta * ((1 - r) * m) + xf[t]
        else:
            m = beta * m + xf[t]
            if rid == RESET_SUBTRACT:
                m = m - r * threshold
        spikes.append(_HeavisideStrict.apply(m - threshold, sid, float(alpha)))
        ms.append(m)
    return torch.stack(spikes).to(spike_dtype or x.dtype), torch.stack(ms)


# ---------------------------------------------------------------------------------------------
# 2. Triton kernels
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    # the charge modes and surrogate ids as Triton compile-time constants (jit code reads only constexpr globals)
    _TL_DECAY_INPUT = tl.constexpr(CHARGE_DECAY_INPUT)
    _TL_LEAK = tl.constexpr(CHARGE_LEAK)
    _TL_SIGMOID = tl.constexpr(SURROGATE_SIGMOID)
    _TL_ATAN = tl.constexpr(SURROGATE_ATAN)
    _TL_STE = tl.constexpr(SURROGATE_STE)

    # divisions use div_rn (IEEE round-to-nearest, as torch on CPU): a plain `/` lowers to an
    # approximate division on NVIDIA GPUs, which could move H across the threshold
    @triton.jit
    def _surrogate_tl(u, alpha, SURROGATE: tl.constexpr):
        if SURROGATE == _TL_SIGMOID:
            sg = 1.0 / (1.0 + tl.exp(-(u * alpha)))
            out = (1.0 - sg) * sg * alpha
        elif SURROGATE == _TL_ATAN:
            a = alpha * 0.5
            z = (3.141592653589793 * a) * u
            out = tl.math.div_rn(a, 1.0 + z * z)
        elif SURROGATE == _TL_STE:
            out = u * 0.0 + alpha
        else:  # triangle
            out = tl.maximum(alpha - (alpha * alpha) * tl.abs(u), 0.0)
        return out

    @triton.jit
    def _lif_fwd_kernel(
        x_ptr, rate_ptr, v0_ptr, s_ptr, h_ptr, N, T, c, v_th, v_reset, stride_xt, stride_xn,
        CHARGE: tl.constexpr, HAS_RATE: tl.constexpr, HARD: tl.constexpr, HAS_V0: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # x is read through its own strides (a transposed or sliced [T, N] view needs no copy);
        # spikes and H are written dense row-major
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        x_ptrs = x_ptr + offs * stride_xn
        if HAS_V0:
            v = tl.load(v0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            v = tl.zeros([BLOCK], dtype=tl.float32) + v_reset  # v_reset is 0.0 for soft reset
        if HAS_RATE:
            k = tl.load(rate_ptr).to(tl.float32)
        for _t in range(T):
            x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            if CHARGE == _TL_LEAK:
                h = c * v + x
            elif CHARGE == _TL_DECAY_INPUT:
                if HAS_RATE:
                    h = v + (x - (v - v_reset)) * k
                else:
                    h = v + tl.math.div_rn(x - (v - v_reset), c)
            else:
                if HAS_RATE:
                    h = v - (v - v_reset) * k + x
                else:
                    h = v - tl.math.div_rn(v - v_reset, c) + x
            spike = h >= v_th
            tl.store(h_ptr + offs, h, mask=mask)
            tl.store(s_ptr + offs, spike.to(s_ptr.dtype.element_ty), mask=mask)
            if HARD:
                v = tl.where(spike, v_reset, h)
            else:
                v = tl.where(spike, h - v_th, h)
            x_ptrs += stride_xt
            h_ptr += N
            s_ptr += N

    @triton.jit
    def _lif_bwd_kernel(
        gs_ptr, gm_ptr, h_ptr, rate_ptr, v0_ptr, gx_ptr, grate_ptr, gv0_ptr, N, T, c, v_th, v_reset, alpha,
        CHARGE: tl.constexpr, HAS_RATE: tl.constexpr, HAS_GM: tl.constexpr, HARD: tl.constexpr,
        DETACH: tl.constexpr, SURROGATE: tl.constexpr, HAS_V0: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # pointers arrive at step T-1 and walk back one step (N elements) per iteration
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        carry = tl.zeros([BLOCK], dtype=tl.float32)  # dL/dV[t] coming from step t+1
        if HAS_RATE:
            k = tl.load(rate_ptr).to(tl.float32)
            gk = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(T):
            h = tl.load(h_ptr + offs, mask=mask, other=0.0)
            gs = tl.load(gs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            sg = _surrogate_tl(h - v_th, alpha, SURROGATE)
            if HARD:
                rg = tl.where(h >= v_th, 0.0, 1.0)
                if not DETACH:
                    rg += (v_reset - h) * sg
                gh = gs * sg + carry * rg
            else:
                if DETACH:
                    gh = gs * sg + carry
                else:
                    gh = gs * sg + carry * (1.0 - v_th * sg)
            if HAS_GM:
                gh += tl.load(gm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                gm_ptr -= N
            if CHARGE == _TL_DECAY_INPUT:
                if HAS_RATE:
                    gx = gh * k
                else:
                    gx = tl.math.div_rn(gh, c)
            else:
                gx = gh
            tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=mask)
            if CHARGE == _TL_LEAK:
                carry = gh * c
            elif HAS_RATE:
                carry = gh - gh * k
            else:
                carry = gh - tl.math.div_rn(gh, c)
            if HAS_RATE:
                # dH/drate needs V[t-1]: the reset of H[t-1], or the initial V at t = 0
                first = i == T - 1
                hp = tl.load(h_ptr - N + offs, mask=mask & (i < T - 1), other=0.0)
                if HARD:
                    vp = tl.where(hp >= v_th, v_reset, hp)
                else:
                    vp = tl.where(hp >= v_th, hp - v_th, hp)
                if HAS_V0:
                    vp = tl.where(first, tl.load(v0_ptr + offs, mask=mask, other=0.0).to(tl.float32), vp)
                else:
                    vp = tl.where(first, v_reset, vp)
                if CHARGE == _TL_DECAY_INPUT:
                    dk = tl.math.div_rn(h - vp, k)  # = X[t] - (V[t-1] - V_reset), without saving X
                else:
                    dk = v_reset - vp
                gk += tl.where(mask, gh * dk, 0.0)
            h_ptr -= N
            gs_ptr -= N
            gx_ptr -= N
        if HAS_RATE:
            tl.store(grate_ptr + pid, tl.sum(gk, axis=0))
        if HAS_V0:
            tl.store(gv0_ptr + offs, carry, mask=mask)  # dL/dV[-1]


if HAS_TRITON:
    _TL_RESET_SUBTRACT = tl.constexpr(RESET_SUBTRACT)
    _TL_RESET_ZERO = tl.constexpr(RESET_ZERO)

    @triton.jit
    def _leaky_fwd_kernel(
        x_ptr, m0_ptr, beta_ptr, thr_ptr, s_ptr, m_ptr, N, T,
        RESET: tl.constexpr, HAS_M0: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # snntorch order: the reset decided by M[t-1] is applied after the leak of step t
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        b = tl.load(beta_ptr + offs, mask=mask, other=0.0)
        thr = tl.load(thr_ptr + offs, mask=mask, other=0.0)
        if HAS_M0:
            m = tl.load(m0_ptr + offs, mask=mask, other=0.0)
        else:
            m = tl.zeros([BLOCK], dtype=tl.float32)
        for _t in range(T):
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            r = m > thr
            if RESET == _TL_RESET_ZERO:
                m = tl.where(r, b * 0.0 + x, b * m + x)
            elif RESET == _TL_RESET_SUBTRACT:
                base = b * m + x
                m = tl.where(r, base - thr, base)
            else:
                m = b * m + x
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(s_ptr + offs, (m > thr).to(s_ptr.dtype.element_ty), mask=mask)
            x_ptr += N
            m_ptr += N
            s_ptr += N

    @triton.jit
    def _leaky_bwd_kernel(
        gs_ptr, gm_ptr, m_ptr, m0_ptr, beta_ptr, thr_ptr, gx_ptr, gm0_ptr, gbeta_ptr, gthr_ptr, N, T, alpha,
        RESET: tl.constexpr, HAS_M0: tl.constexpr, HAS_GM: tl.constexpr, SURROGATE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # pointers arrive at step T-1 and walk back one step (N elements) per iteration
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        b = tl.load(beta_ptr + offs, mask=mask, other=0.0)
        thr = tl.load(thr_ptr + offs, mask=mask, other=0.0)
        if HAS_M0:
            m0 = tl.load(m0_ptr + offs, mask=mask, other=0.0)
        else:
            m0 = tl.zeros([BLOCK], dtype=tl.float32)
        carry = tl.zeros([BLOCK], dtype=tl.float32)  # dL/dM[t] coming from step t+1
        gb = tl.zeros([BLOCK], dtype=tl.float32)
        gt = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(T):
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            mp = tl.load(m_ptr - N + offs, mask=mask & (i < T - 1), other=0.0)
            mp = tl.where(i == T - 1, m0, mp)  # M[t-1], or the initial membrane at t = 0
            gsg = tl.load(gs_ptr + offs, mask=mask, other=0.0).to(tl.float32) * _surrogate_tl(m - thr, alpha, SURROGATE)
            gh = gsg + carry
            if HAS_GM:
                gh += tl.load(gm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                gm_ptr -= N
            tl.store(gx_ptr + offs, gh.to(gx_ptr.dtype.element_ty), mask=mask)
            r = mp > thr
            if RESET == _TL_RESET_ZERO:
                gb += tl.where(r, 0.0, gh * mp)
                carry = tl.where(r, 0.0, gh * b)
                gt -= gsg
            elif RESET == _TL_RESET_SUBTRACT:
                gb += gh * mp
                carry = gh * b
                gt -= gsg + tl.where(r, gh, 0.0)
            else:
                gb += gh * mp
                carry = gh * b
                gt -= gsg
            m_ptr -= N
            gs_ptr -= N
            gx_ptr -= N
        tl.store(gbeta_ptr + offs, gb, mask=mask)
        tl.store(gthr_ptr + offs, gt, mask=mask)
        if HAS_M0:
            tl.store(gm0_ptr + offs, carry, mask=mask)


_BLOCK = 1024
_NUM_WARPS = 8  # 4 elements a thread: 4 warps hold the PLIF backward in 190 registers on sm_90


def _triton_ready(x: Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' needs the triton package; use backend='torch' or 'compile'")
    if x.device.type != "cuda" and not _backend.interpreter_on():
        raise RuntimeError(
            f"backend='triton' runs on CUDA tensors (got device {x.device}); on CPU use backend='auto' "
            "or 'compile', or set TRITON_INTERPRET=1 before importing triton to run the interpreter"
        )


def _triton_forward(x, rate, c, v_th, v_reset, charge, spike_dtype, v0=None):
    _triton_ready(x)
    T, N = x.shape
    s = torch.empty((T, N), dtype=spike_dtype, device=x.device)
    h = torch.empty((T, N), dtype=torch.float32, device=x.device)
    hard = v_reset is not None
    grid = (triton.cdiv(N, _BLOCK),)
    _lif_fwd_kernel[grid](
        x, rate if rate is not None else h, v0 if v0 is not None else h, s, h, N, T, float(c), float(v_th),
        float(v_reset) if hard else 0.0, x.stride(0), x.stride(1),
        CHARGE=charge, HAS_RATE=rate is not None, HARD=hard, HAS_V0=v0 is not None,
        BLOCK=_BLOCK, num_warps=_NUM_WARPS,
    )
    return s, h


def _triton_backward(gs, gm, h, rate, c, v_th, v_reset, charge, surrogate, alpha, detach, x_dtype, v0=None):
    _triton_ready(h)
    T, N = h.shape
    gx = torch.empty((T, N), dtype=x_dtype, device=h.device)
    gv0 = torch.empty(N if v0 is not None else 0, dtype=torch.float32, device=h.device)
    nblocks = triton.cdiv(N, _BLOCK)
    grate = torch.zeros(nblocks if rate is not None else 1, dtype=torch.float32, device=h.device)
    hard = v_reset is not None
    last = T - 1  # kernels walk backwards from the last step
    _lif_bwd_kernel[(nblocks,)](
        gs[last], gm[last] if gm is not None else h[last], h[last],
        rate if rate is not None else h, v0 if v0 is not None else h, gx[last], grate,
        gv0 if v0 is not None else h, N, T, float(c), float(v_th), float(v_reset) if hard else 0.0, float(alpha),
        CHARGE=charge, HAS_RATE=rate is not None, HAS_GM=gm is not None, HARD=hard,
        DETACH=detach, SURROGATE=surrogate, HAS_V0=v0 is not None, BLOCK=_BLOCK, num_warps=_NUM_WARPS,
    )
    return gx, grate.sum(), gv0


def _triton_leaky_forward(x, m0, beta, thr, reset, spike_dtype):
    _triton_ready(x)
    T, N = x.shape
    beta, thr = beta.expand(N).contiguous(), thr.expand(N).contiguous()  # the kernel reads one value per neuron
    s = torch.empty((T, N), dtype=spike_dtype, device=x.device)
    m = torch.empty((T, N), dtype=torch.float32, device=x.device)
    _leaky_fwd_kernel[(triton.cdiv(N, _BLOCK),)](
        x, m0 if m0 is not None else beta, beta, thr, s, m, N, T,
        RESET=reset, HAS_M0=m0 is not None, BLOCK=_BLOCK, num_warps=_NUM_WARPS,
    )
    return s, m


def _triton_leaky_backward(gs, gm, m, m0, beta, thr, reset, surrogate, alpha, x_dtype):
    _triton_ready(m)
    T, N = m.shape
    shared = (beta.shape[0] != N, thr.shape[0] != N)
    beta, thr = beta.expand(N).contiguous(), thr.expand(N).contiguous()
    gx = torch.empty((T, N), dtype=x_dtype, device=m.device)
    gm0 = torch.empty(N if m0 is not None else 0, dtype=torch.float32, device=m.device)
    gbeta = torch.empty(N, dtype=torch.float32, device=m.device)
    gthr = torch.empty(N, dtype=torch.float32, device=m.device)
    last = T - 1
    _leaky_bwd_kernel[(triton.cdiv(N, _BLOCK),)](
        gs[last], gm[last] if gm is not None else m[last], m[last], m0 if m0 is not None else beta, beta, thr,
        gx[last], gm0 if m0 is not None else gbeta, gbeta, gthr, N, T, float(alpha),
        RESET=reset, HAS_M0=m0 is not None, HAS_GM=gm is not None, SURROGATE=surrogate,
        BLOCK=_BLOCK, num_warps=_NUM_WARPS,
    )
    gbeta = gbeta.sum(0, keepdim=True) if shared[0] else gbeta
    gthr = gthr.sum(0, keepdim=True) if shared[1] else gthr
    return gx, gm0, gbeta, gthr


# ---------------------------------------------------------------------------------------------
# fused torch loops: the CPU path (compiled by inductor into one OpenMP loop nest) and its eager twin
# ---------------------------------------------------------------------------------------------


def _loop_forward(x, rate, c, v_th, v_reset, v0, *, charge: int, hard: bool, spike_dtype: torch.dtype):
    """x [T, N] -> (spikes [T, N], H [T, N] fp32); scalars arrive as 0-d fp32 tensors, v0 [N] or None."""
    v = torch.zeros_like(x[0], dtype=torch.float32) + v_reset if v0 is None else v0.float()
    hs, ss = [], []
    for t in range(x.shape[0]):
        h = _charge(x[t].float(), v, rate, c, v_reset, charge)
        spike = h >= v_th
        v = torch.where(spike, v_reset, h) if hard else torch.where(spike, h - v_th, h)
        hs.append(h)
        ss.append(spike.to(spike_dtype))
    return torch.stack(ss), torch.stack(hs)


def _loop_backward(
    gs, gm, h, rate, c, v_th, v_reset, alpha, v0, *,
    charge: int, hard: bool, detach: bool, surrogate: int, x_dtype: torch.dtype,
):
    """Reverse-time recurrence of the backward; returns (grad x [T, N], grad rate 0-d, grad v0 [N] or [0])."""
    T = h.shape[0]
    carry = torch.zeros_like(h[0])
    gxs = [None] * T
    gk = h.new_zeros(())
    for t in range(T - 1, -1, -1):
        ht = h[t]
        sg = surrogate_grad(ht - v_th, surrogate, alpha)
        if hard:
            rg = (ht < v_th).to(ht.dtype)
            if not detach:
                rg = rg + (v_reset - ht) * sg
            gh = gs[t].float() * sg + carry * rg
        elif detach:
            gh = gs[t].float() * sg + carry
        else:
            gh = gs[t].float() * sg + carry * (1.0 - v_th * sg)
        if gm is not None:
            gh = gh + gm[t].float()
        if charge == CHARGE_DECAY_INPUT:
            gx = gh * rate if rate is not None else gh / c
        else:
            gx = gh
        gxs[t] = gx.to(x_dtype)
        if charge == CHARGE_LEAK:
            carry = gh * c
        else:
            carry = gh - (gh * rate if rate is not None else gh / c)
        if rate is not None:
            if t > 0:
                hp = h[t - 1]
                vp = torch.where(hp >= v_th, v_reset, hp) if hard else torch.where(hp >= v_th, hp - v_th, hp)
            else:
                vp = torch.zeros_like(ht) + v_reset if v0 is None else v0.float()
            dk = (ht - vp) / rate if charge == CHARGE_DECAY_INPUT else v_reset - vp
            gk = gk + (gh * dk).sum()
    gv0 = carry if v0 is not None else h.new_empty(0)
    return torch.stack(gxs), gk, gv0


def _leaky_loop_forward(x, m0, beta, thr, *, reset: int, spike_dtype: torch.dtype):
    """snntorch order, x [T, N] -> (spikes [T, N], membrane [T, N] fp32); m0 is [N], beta and thr [N]
    or [1] (one value for all neurons), all fp32."""
    m = torch.zeros_like(x[0], dtype=torch.float32) if m0 is None else m0
    ms, ss = [], []
    for t in range(x.shape[0]):
        xt = x[t].float()
        r = m > thr
        if reset == RESET_ZERO:
            m = torch.where(r, beta * 0.0 + xt, beta * m + xt)
        elif reset == RESET_SUBTRACT:
            base = beta * m + xt
            m = torch.where(r, base - thr, base)
        else:
            m = beta * m + xt
        ms.append(m)
        ss.append((m > thr).to(spike_dtype))
    return torch.stack(ss), torch.stack(ms)


def _leaky_loop_backward(gs, gm, m, m0, beta, thr, alpha, *, reset: int, surrogate: int, x_dtype: torch.dtype):
    """Reverse-time recurrence of the snntorch-order backward: (grad x, grad m0 or [0], grad beta [N], grad thr [N])."""
    T = m.shape[0]
    carry = torch.zeros_like(m[0])
    gb = torch.zeros_like(m[0])
    gt = torch.zeros_like(m[0])
    gxs = [None] * T
    for t in range(T - 1, -1, -1):
        mt = m[t]
        mp = m[t - 1] if t > 0 else (m0 if m0 is not None else torch.zeros_like(mt))
        gsg = gs[t].float() * surrogate_grad(mt - thr, surrogate, alpha)
        gh = gsg + carry
        if gm is not None:
            gh = gh + gm[t].float()
        gxs[t] = gh.to(x_dtype)
        r = mp > thr
        if reset == RESET_ZERO:
            gb = gb + torch.where(r, 0.0, gh * mp)
            carry = torch.where(r, 0.0, gh * beta)
            gt = gt - gsg
        else:
            gb = gb + gh * mp
            carry = gh * beta
            gt = gt - (gsg + torch.where(r, gh, 0.0)) if reset == RESET_SUBTRACT else gt - gsg
    gm0 = carry if m0 is not None else m.new_empty(0)
    # a beta / threshold shared by all neurons arrives as [1]: its gradient is the sum over neurons
    if beta.shape[0] != m.shape[1]:
        gb = gb.sum(0, keepdim=True)
    if thr.shape[0] != m.shape[1]:
        gt = gt.sum(0, keepdim=True)
    return torch.stack(gxs), gm0, gb, gt


def _run_leaky_forward(x, m0, beta, thr, reset, spike_dtype, impl):
    if impl == "triton":
        return _triton_leaky_forward(x, m0, beta, thr, reset, spike_dtype)
    static = (("reset", reset), ("spike_dtype", spike_dtype))
    if impl == "inductor":
        return _compiled("leaky_forward", static)(*_unviewed((x, m0, beta, thr)))
    return _leaky_loop_forward(x, m0, beta, thr, **dict(static))


def _run_leaky_backward(gs, gm, m, m0, beta, thr, reset, surrogate, alpha, x_dtype, impl):
    if impl == "triton":
        return _triton_leaky_backward(gs, gm, m, m0, beta, thr, reset, surrogate, alpha, x_dtype)
    static = (("reset", reset), ("surrogate", surrogate), ("x_dtype", x_dtype))
    args = (gs, gm, m, m0, beta, thr, *_scalars(m.device, alpha))
    if impl == "inductor":
        return _compiled("leaky_backward", static)(*_unviewed(args))
    return _leaky_loop_backward(*args, **dict(static))


@functools.lru_cache(maxsize=None)
def _compiled(fn_name: str, static: tuple):
    """One inductor-compiled loop per static configuration (own dynamo cache, so no recompile limit)."""
    base = {
        "forward": _loop_forward, "backward": _loop_backward,
        "leaky_forward": _leaky_loop_forward, "leaky_backward": _leaky_loop_backward,
    }[fn_name]
    # dynamo keys its cache (and recompile limit) by code object: give each configuration its own
    code = base.__code__.replace(co_name=f"{base.__name__}_{len(_compiled_names)}")
    _compiled_names.append(code.co_name)
    fn = types.FunctionType(code, base.__globals__, code.co_name, base.__defaults__, base.__closure__)
    fn.__kwdefaults__ = dict(static)
    return torch.compile(fn, dynamic=True, fullgraph=True)


_compiled_names: list[str] = []


def _unviewed(args: tuple) -> tuple:
    """Tensors as non-views (detach drops `_base`, no copy): dynamo otherwise guards on the layout of
    each view's base, and recompiles (up to its limit, then runs eagerly) for every new one."""
    return tuple(a.detach() if isinstance(a, Tensor) else a for a in args)


def _scalars(device, *values):
    return [_scalar(device, float(v), slot) for slot, v in enumerate(values)]


@functools.lru_cache(maxsize=256)
def _scalar(device: torch.device, value: float, slot: int) -> Tensor:
    """A 0-d fp32 tensor per (device, value, argument slot), made once: the loops only read it (new
    values stay runtime inputs, so no recompile), and a fresh tensor per call is an allocation and a
    fill. Per slot, so two equal arguments are never one aliased tensor (dynamo guards on aliasing)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _run_forward(x, rate, c, v_th, v_reset, charge, spike_dtype, impl, v0=None):
    if impl == "triton":
        return _triton_forward(x, rate, c, v_th, v_reset, charge, spike_dtype, v0)
    hard = v_reset is not None
    static = (("charge", charge), ("hard", hard), ("spike_dtype", spike_dtype))
    args = (x, rate, *_scalars(x.device, c, v_th, v_reset if hard else 0.0), v0)
    if impl == "inductor":
        return _compiled("forward", static)(*_unviewed(args))
    return _loop_forward(*args, **dict(static))


def _run_backward(gs, gm, h, rate, c, v_th, v_reset, charge, surrogate, alpha, detach, x_dtype, impl, v0=None):
    if impl == "triton":
        return _triton_backward(gs, gm, h, rate, c, v_th, v_reset, charge, surrogate, alpha, detach, x_dtype, v0)
    hard = v_reset is not None
    static = (
        ("charge", charge), ("hard", hard), ("detach", detach), ("surrogate", surrogate), ("x_dtype", x_dtype),
    )
    args = (gs, gm, h, rate, *_scalars(h.device, c, v_th, v_reset if hard else 0.0, alpha), v0)
    if impl == "inductor":
        return _compiled("backward", static)(*_unviewed(args))
    return _loop_backward(*args, **dict(static))


# ---------------------------------------------------------------------------------------------
# 3. custom op: efficient::lif_forward / efficient::lif_backward
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("efficient::lif_forward", mutates_args=())
def lif_forward_op(
    x: Tensor,
    rate: Optional[Tensor],
    c: float,
    v_threshold: float,
    v_reset: Optional[float],
    charge: int,
    surrogate: int,
    alpha: float,
    detach_reset: bool,
    spike_dtype: torch.dtype,
    impl: str,
    v0: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """x [T, N], any strides -> (spikes [T, N] spike_dtype, H [T, N] fp32), both contiguous.

    `c` is tau (or lambda for the LEAK charge); surrogate/alpha/detach_reset are used by the backward.
    `v0` [N] fp32 is the membrane before step 0 (default: the resting value). The Triton kernel
    reads x through its strides; the CPU loops index a dense [T, N], so a strided x is copied once
    for them.
    """
    _check_op_args(x, charge, surrogate, impl)
    _check_state(v0, x, "v0")
    v0 = v0.contiguous() if v0 is not None else None
    x = x if impl == "triton" else x.contiguous()
    return _run_forward(x, rate, c, v_threshold, v_reset, charge, spike_dtype, impl, v0)


def _check_state(state: Optional[Tensor], x: Tensor, name: str) -> None:
    if state is not None and (state.shape != x.shape[1:] or state.dtype != torch.float32):
        raise ValueError(
            f"{name} must be fp32 of shape {tuple(x.shape[1:])} (one value per neuron), got "
            f"{tuple(state.shape)} {state.dtype}"
        )


def _check_op_args(x: Tensor, charge: int, surrogate: int, impl: str) -> None:
    """The op takes the flattened [T, N] view that `lif` builds; say so instead of crashing a kernel."""
    if x.dim() != 2 or x.shape[0] < 1 or not x.is_floating_point():
        raise ValueError(
            f"efficient::lif_forward expects a floating [T>=1, N] tensor, got shape {tuple(x.shape)}, "
            f"dtype {x.dtype}; call efficient.kernels.lif.lif, which flattens [T, ...] inputs"
        )
    if charge not in (CHARGE_DECAY_INPUT, CHARGE_NO_DECAY, CHARGE_LEAK) or surrogate not in SURROGATES.values():
        raise ValueError(f"efficient::lif_forward: unknown charge mode {charge} or surrogate id {surrogate}")
    if impl not in IMPLS:
        raise ValueError(f"efficient::lif_forward: unknown impl {impl!r}; choose one of {IMPLS}")


@lif_forward_op.register_fake
def _(x, rate, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, v0=None):
    _check_op_args(x, charge, surrogate, impl)
    _check_state(v0, x, "v0")
    return x.new_empty(x.shape, dtype=spike_dtype), x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("efficient::lif_backward", mutates_args=())
def lif_backward_op(
    grad_spikes: Tensor,
    grad_h: Optional[Tensor],
    h: Tensor,
    rate: Optional[Tensor],
    c: float,
    v_threshold: float,
    v_reset: Optional[float],
    charge: int,
    surrogate: int,
    alpha: float,
    detach_reset: bool,
    x_dtype: torch.dtype,
    impl: str,
    v0: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of lif_forward from H (and v0) alone: (grad x [T, N] in x_dtype, grad rate 0-d fp32,
    grad v0 [N] fp32, or an empty tensor without v0)."""
    gs = grad_spikes.contiguous()
    gm = grad_h.contiguous() if grad_h is not None else None
    v0 = v0.contiguous() if v0 is not None else None
    return _run_backward(
        gs, gm, h, rate, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, x_dtype, impl, v0
    )


@lif_backward_op.register_fake
def _(grad_spikes, grad_h, h, rate, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, x_dtype, impl,
      v0=None):
    n = h.shape[1] if v0 is not None else 0
    return h.new_empty(h.shape, dtype=x_dtype), h.new_empty((), dtype=torch.float32), h.new_empty(n)


def _setup_context(ctx, inputs, output) -> None:
    x, rate, c, v_th, v_reset, charge, surrogate, alpha, detach, spike_dtype, impl, *rest = inputs
    v0 = rest[0] if rest else None
    ctx.save_for_backward(output[1], rate, v0)  # only H (fp32), the 0-d rate and v0: x is not kept
    ctx.params = (c, v_th, v_reset, charge, surrogate, alpha, detach)
    ctx.x_dtype, ctx.impl = x.dtype, impl
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_spikes, grad_h):
    h, rate, v0 = ctx.saved_tensors
    if grad_spikes is None:
        grad_spikes = torch.zeros_like(h)
    gx, grate, gv0 = lif_backward_op(grad_spikes, grad_h, h, rate, *ctx.params, ctx.x_dtype, ctx.impl, v0)
    grate = grate.to(rate.dtype).reshape(rate.shape) if rate is not None and ctx.needs_input_grad[1] else None
    gv0 = gv0 if v0 is not None and ctx.needs_input_grad[11] else None
    return gx, grate, None, None, None, None, None, None, None, None, None, gv0


lif_forward_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("efficient::leaky_forward", mutates_args=())
def leaky_forward_op(
    x: Tensor,
    m0: Optional[Tensor],
    beta: Tensor,
    threshold: Tensor,
    reset: int,
    surrogate: int,
    alpha: float,
    spike_dtype: torch.dtype,
    impl: str,
) -> tuple[Tensor, Tensor]:
    """snntorch order: x [T, N] -> (spikes [T, N] spike_dtype, membrane [T, N] fp32), both contiguous.

    `m0` is fp32 [N]; `beta`, `threshold` fp32 [N] (per neuron) or [1] (shared by all neurons);
    `reset` is an id of `RESETS`; surrogate/alpha are used by the backward.
    """
    return _leaky_forward_impl(x, m0, beta, threshold, reset, surrogate, alpha, spike_dtype, impl)


def _leaky_forward_impl(x, m0, beta, threshold, reset, surrogate, alpha, spike_dtype, impl):
    _check_leaky_args(x, m0, beta, threshold, reset, surrogate, impl)
    return _run_leaky_forward(
        x.contiguous(), m0.contiguous() if m0 is not None else None, beta.contiguous(), threshold.contiguous(),
        reset, spike_dtype, impl,
    )


def _check_leaky_args(x, m0, beta, threshold, reset, surrogate, impl) -> None:
    _check_op_args(x, CHARGE_LEAK, surrogate, impl)
    for name, t, sizes in (("m0", m0, (x.shape[1],)), ("beta", beta, (x.shape[1], 1)),
                           ("threshold", threshold, (x.shape[1], 1))):
        if t is not None and (t.dim() != 1 or t.shape[0] not in sizes or t.dtype != torch.float32):
            shapes = " or ".join(f"[{n}]" for n in sizes)
            raise ValueError(
                f"efficient::leaky_forward: {name} must be fp32 {shapes} (N={x.shape[1]}), got {tuple(t.shape)} "
                f"{t.dtype}; call efficient.kernels.lif.leaky, which broadcasts it"
            )
    if reset not in RESETS.values():
        raise ValueError(f"efficient::leaky_forward: unknown reset id {reset}; expected one of {RESETS}")


@leaky_forward_op.register_fake
def _(x, m0, beta, threshold, reset, surrogate, alpha, spike_dtype, impl):
    _check_leaky_args(x, m0, beta, threshold, reset, surrogate, impl)
    return x.new_empty(x.shape, dtype=spike_dtype), x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("efficient::leaky_backward", mutates_args=())
def leaky_backward_op(
    grad_spikes: Tensor,
    grad_mem: Optional[Tensor],
    mem: Tensor,
    m0: Optional[Tensor],
    beta: Tensor,
    threshold: Tensor,
    reset: int,
    surrogate: int,
    alpha: float,
    x_dtype: torch.dtype,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of leaky_forward from the membrane alone: (grad x [T, N] x_dtype, grad m0 [N] (empty
    without m0), grad beta and grad threshold shaped like beta and threshold, all fp32 but grad x)."""
    return _leaky_backward_impl(grad_spikes, grad_mem, mem, m0, beta, threshold, reset, surrogate, alpha, x_dtype, impl)


def _leaky_backward_impl(grad_spikes, grad_mem, mem, m0, beta, threshold, reset, surrogate, alpha, x_dtype, impl):
    # the Triton kernels index dense [T, N]; the torch loops read any strides (a loss like
    # spikes.sum() hands back an expanded gradient, which would otherwise be copied in full)
    dense = (lambda t: t.contiguous()) if impl == "triton" else (lambda t: t)
    gs = dense(grad_spikes)
    gm = dense(grad_mem) if grad_mem is not None else None
    m0 = m0.contiguous() if m0 is not None else None
    return _run_leaky_backward(
        gs, gm, mem, m0, beta.contiguous(), threshold.contiguous(), reset, surrogate, alpha, x_dtype, impl
    )


@leaky_backward_op.register_fake
def _(grad_spikes, grad_mem, mem, m0, beta, threshold, reset, surrogate, alpha, x_dtype, impl):
    n = mem.shape[1]
    return (mem.new_empty(mem.shape, dtype=x_dtype), mem.new_empty(n if m0 is not None else 0),
            mem.new_empty(beta.shape[0]), mem.new_empty(threshold.shape[0]))


def _leaky_setup_context(ctx, inputs, output) -> None:
    x, m0, beta, threshold, reset, surrogate, alpha, spike_dtype, impl = inputs
    ctx.save_for_backward(output[1], m0, beta, threshold)  # the membrane and the per-neuron inputs, not x
    ctx.params = (reset, surrogate, alpha)
    ctx.x_dtype, ctx.impl = x.dtype, impl
    ctx.set_materialize_grads(False)


def _leaky_backward(ctx, grad_spikes, grad_mem, backward_fn=leaky_backward_op):
    mem, m0, beta, threshold = ctx.saved_tensors
    if grad_spikes is None:
        grad_spikes = torch.zeros_like(mem)
    gx, gm0, gbeta, gthr = backward_fn(grad_spikes, grad_mem, mem, m0, beta, threshold, *ctx.params, ctx.x_dtype, ctx.impl)
    need = ctx.needs_input_grad
    return (gx, gm0 if m0 is not None and need[1] else None, gbeta if need[2] else None,
            gthr if need[3] else None, None, None, None, None, None)


leaky_forward_op.register_autograd(_leaky_backward, setup_context=_leaky_setup_context)


class _EagerLeaky(torch.autograd.Function):
    """`efficient::leaky_forward` and its backward for eager CPU calls: the same checks and loops as
    the custom op, called directly. The op's Python dispatch and autograd wrapper cost ~0.2 ms per
    layer and step, as much as the fused loop itself on a conv layer's 64k neurons; under
    torch.compile (and on CUDA) the op is used, so graphs still see one opaque node."""

    @staticmethod
    def forward(ctx, *inputs):  # type: ignore[override]
        out = _leaky_forward_impl(*inputs)
        _leaky_setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad_spikes, grad_mem):  # type: ignore[override]
        return _leaky_backward(ctx, grad_spikes, grad_mem, backward_fn=_leaky_backward_impl)


def _elementwise_flops(numel: int, per_element: int) -> int:
    return int(numel) * per_element


try:  # flop formulas let torch.utils.flop_counter (and the profiler) see the neuron's arithmetic
    from torch.utils.flop_counter import register_flop_formula

    # forward per element and step: charge 4, compare 1, reset select 1;
    # backward: surrogate ~6, reset gradient ~3, accumulate ~4.
    @register_flop_formula(torch.ops.efficient.lif_forward)
    def _lif_forward_flops(x_shape, *args, out_shape=None, **kwargs) -> int:
        return _elementwise_flops(math.prod(x_shape), 6)

    @register_flop_formula(torch.ops.efficient.lif_backward)
    def _lif_backward_flops(gs_shape, *args, out_shape=None, **kwargs) -> int:
        return _elementwise_flops(math.prod(gs_shape), 13)

    # snntorch order: leak 2, reset select 2, compare 1; backward: surrogate ~6, accumulate ~7
    @register_flop_formula(torch.ops.efficient.leaky_forward)
    def _leaky_forward_flops(x_shape, *args, out_shape=None, **kwargs) -> int:
        return _elementwise_flops(math.prod(x_shape), 5)

    @register_flop_formula(torch.ops.efficient.leaky_backward)
    def _leaky_backward_flops(gs_shape, *args, out_shape=None, **kwargs) -> int:
        return _elementwise_flops(math.prod(gs_shape), 13)

except (ImportError, RuntimeError):  # pragma: no cover - older torch, or re-import of this module
    pass


# ---------------------------------------------------------------------------------------------
# 4. public entry point
# ---------------------------------------------------------------------------------------------


def _surrogate_id(surrogate: str) -> int:
    try:
        return SURROGATES[surrogate]
    except (KeyError, TypeError):
        raise ValueError(f"unknown surrogate {surrogate!r}; choose one of {sorted(SURROGATES)}") from None


def _reset_id(reset_mechanism: str) -> int:
    try:
        return RESETS[reset_mechanism]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reset_mechanism {reset_mechanism!r}; choose one of {sorted(RESETS)}") from None


def _charge_mode(tau: float, decay_input: bool, leak: Optional[float]) -> tuple[int, float]:
    if leak is not None:
        return CHARGE_LEAK, float(leak)
    return (CHARGE_DECAY_INPUT if decay_input else CHARGE_NO_DECAY), float(tau)


def resolve_backend(backend: str, device: torch.device, numel: Optional[int] = None) -> str:
    """Concrete LIF backend (triton, torch, compile or loop) for `backend` on `device`, for an input
    of `numel` elements: the shared resolver with the fused loop (see `efficient.kernels._backend`)."""
    return _backend.resolve_backend(
        backend, device, "lif", fused_loop=True, numel=numel, compile_min_numel=COMPILE_MIN_NUMEL
    )


def check_input(x: Tensor, check_finite: bool = False) -> None:
    """Raise ValueError for input a LIF cannot take: not a float tensor [T>=1, ...], or non-finite values."""
    if not isinstance(x, Tensor):
        raise ValueError(f"LIF input must be a torch.Tensor [T, ...], got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(
            f"LIF input must be floating point (float32/bfloat16/float16), got dtype {x.dtype}; "
            "convert it first, e.g. x.float()"
        )
    if x.dim() < 2:
        raise ValueError(
            f"LIF input must be time-major [T, ...] with at least 2 dims (time and neurons), got shape "
            f"{tuple(x.shape)}; for one neuron population use x.unsqueeze(-1)"
        )
    if x.shape[0] == 0:
        raise ValueError(f"LIF input has T=0 time steps (shape {tuple(x.shape)}); need T >= 1")
    if check_finite and not torch.isfinite(x).all():
        bad = (~torch.isfinite(x.reshape(x.shape[0], -1))).any(1).nonzero().flatten().tolist()
        raise ValueError(f"LIF input has NaN/inf values at time steps {bad}")


# backend -> custom-op implementation ("torch" runs the reference, not the op)
_IMPL_OF_BACKEND = {"triton": "triton", "compile": "inductor", "loop": "loop"}


def lif(
    x: Tensor,
    tau: float = 2.0,
    v_threshold: float = 1.0,
    v_reset: Optional[float] = 0.0,
    detach_reset: bool = True,
    decay_input: bool = True,
    surrogate: str = "sigmoid",
    alpha: Optional[float] = None,
    *,
    rate: Optional[Tensor] = None,
    leak: Optional[float] = None,
    spike_dtype: Optional[torch.dtype] = None,
    return_membrane: bool = False,
    backend: str = "auto",
    impl: Optional[str] = None,
    check_finite: bool = False,
    v_init: Optional[Tensor] = None,
    order: str = "spikingjelly",
) -> Tensor | tuple[Tensor, Tensor]:
    """Multi-step LIF over `x` [T, ...] from rest (V[-1] = V_reset, or 0 for soft reset) or from `v_init`.

    Returns spikes shaped like x (dtype `spike_dtype`, default x.dtype); with
    `return_membrane=True` also H, the pre-reset membrane [T, ...] in fp32 (differentiable).
    `rate` = PLIF's learnable 1/tau (0-d tensor); `leak` = DLIF's fixed lambda (H = lambda*V + X).
    `alpha=None` takes the surrogate's default (`SURROGATE_ALPHA`). `impl` ("triton", "inductor"
    or "loop", see `IMPLS`) runs the custom op with that implementation instead of resolving
    `backend` (for tests and benchmarks); it cannot be combined with a backend other than "auto".
    `v_init` (shaped like x[0], differentiable) is the membrane before step 0, for stateful callers.

    `order="snntorch"` runs snntorch's update order instead (see `leaky`): `leak` is beta (required),
    `v_reset=None` resets by subtraction, `v_reset=0.0` to zero; spikes fire strictly above threshold;
    tau, rate, decay_input and detach_reset do not apply (snntorch always detaches its reset).
    """
    if order == "snntorch":
        if leak is None or rate is not None or (v_reset is not None and float(v_reset) != 0.0):
            raise ValueError(
                "order='snntorch' takes beta as `leak`, no `rate`, and v_reset None (subtract) or 0.0 (zero); "
                "for per-neuron beta/threshold or reset 'none' call efficient.kernels.lif.leaky"
            )
        return leaky(
            x, leak, v_threshold, "subtract" if v_reset is None else "zero", surrogate, alpha, mem=v_init,
            spike_dtype=spike_dtype, return_membrane=return_membrane, backend=backend, impl=impl,
            check_finite=check_finite,
        )
    if order != "spikingjelly":
        raise ValueError(f"unknown order {order!r}; choose one of {ORDERS}")
    check_input(x, check_finite)
    sid = _surrogate_id(surrogate)
    alpha = default_alpha(surrogate, alpha)
    charge, c = _charge_mode(tau, decay_input, leak)
    if charge != CHARGE_LEAK and rate is None and not c > 0:
        raise ValueError(f"tau must be > 0 (got {tau})")
    if rate is not None and leak is not None:
        raise ValueError("pass either rate (PLIF) or leak (DLIF), not both")
    if rate is not None and rate.numel() != 1:
        raise ValueError(f"rate must be a single value (0-d tensor), got shape {tuple(rate.shape)}")
    spike_dtype = spike_dtype or x.dtype
    vr = None if v_reset is None else float(v_reset)
    if impl is not None:
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; choose one of {IMPLS}")
        if backend != "auto":
            raise ValueError(f"pass either backend ({backend!r}) or impl ({impl!r}), not both")
        chosen = None
    else:
        chosen = resolve_backend(backend, x.device, x.numel())
        impl = _IMPL_OF_BACKEND.get(chosen)
    if v_init is not None and v_init.shape != x.shape[1:]:
        raise ValueError(f"v_init must have the shape of one step {tuple(x.shape[1:])}, got {tuple(v_init.shape)}")
    if chosen == "torch" or x.numel() == 0:
        s, h = lif_reference(
            x, c, v_threshold, vr, detach_reset, decay_input, surrogate, alpha,
            rate=rate, leak=leak, spike_dtype=spike_dtype, v_init=v_init,
        )
    else:
        if impl == "inductor" and x.device.type == "cpu" and not _backend.have_cxx_compiler():
            raise RuntimeError("backend='compile' needs a C++ compiler on CPU (g++ or clang++); use backend='torch'")
        # a strided [T, N] view reaches the op as it is (the op makes one dense copy if it must)
        x2 = x.reshape(x.shape[0], -1)
        r = rate.reshape(()).float() if rate is not None else None
        v0 = v_init.reshape(-1).float() if v_init is not None else None
        s, h = torch.ops.efficient.lif_forward(
            x2, r, c, float(v_threshold), vr, charge, sid, alpha, bool(detach_reset), spike_dtype, impl, v0
        )
        s, h = s.view(x.shape), h.view(x.shape)
    return (s, h) if return_membrane else s


def _per_neuron(value: float | Tensor, x: Tensor, name: str) -> Tensor:
    """`value` (a number, or a tensor broadcastable to one step of x) as fp32 [N], or [1] when it holds
    one value (the kernels broadcast it; expanding to [N] would cost a copy forward and a reduction
    backward per call), differentiable."""
    t = value if isinstance(value, Tensor) else torch.tensor(float(value), device=x.device)
    if t.numel() == 1 and t.dim() <= x.dim() - 1:
        return t.float().reshape(1)
    try:
        return t.float().expand(x.shape[1:]).reshape(-1)
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} does not broadcast to one step of the input {tuple(x.shape[1:])}"
        ) from None


def leaky(
    x: Tensor,
    beta: float | Tensor,
    threshold: float | Tensor = 1.0,
    reset_mechanism: str = "subtract",
    surrogate: str = "atan",
    alpha: Optional[float] = None,
    *,
    mem: Optional[Tensor] = None,
    spike_dtype: Optional[torch.dtype] = None,
    return_membrane: bool = False,
    backend: str = "auto",
    impl: Optional[str] = None,
    check_finite: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Multi-step snntorch `Leaky` (update order "snntorch", see `leaky_reference`) over `x` [T, ...].

    `beta`, `threshold` are numbers or tensors broadcastable to x[0] (scalar or per neuron), and
    differentiable; `mem` (shaped like x[0]) is the membrane before step 0 (default 0). Returns
    spikes, with `return_membrane=True` also the membrane M [T, ...] fp32 (snntorch's `mem` per step).
    Backends as in `lif`.
    """
    check_input(x, check_finite)
    sid, alpha = _surrogate_id(surrogate), default_alpha(surrogate, alpha)
    rid = _reset_id(reset_mechanism)
    spike_dtype = spike_dtype or x.dtype
    if mem is not None and mem.shape != x.shape[1:]:
        raise ValueError(f"mem must have the shape of one step {tuple(x.shape[1:])}, got {tuple(mem.shape)}")
    if impl is not None:
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; choose one of {IMPLS}")
        if backend != "auto":
            raise ValueError(f"pass either backend ({backend!r}) or impl ({impl!r}), not both")
        chosen = None
    else:
        chosen = resolve_backend(backend, x.device, x.numel())
        impl = _IMPL_OF_BACKEND.get(chosen)
    if chosen == "torch" or x.numel() == 0:
        s, m = leaky_reference(x, beta, threshold, reset_mechanism, surrogate, alpha, mem=mem, spike_dtype=spike_dtype)
    else:
        if impl == "inductor" and x.device.type == "cpu" and not _backend.have_cxx_compiler():
            raise RuntimeError("backend='compile' needs a C++ compiler on CPU (g++ or clang++); use backend='torch'")
        m0 = mem.reshape(-1).float() if mem is not None else None
        args = (x.reshape(x.shape[0], -1), m0, _per_neuron(beta, x, "beta"), _per_neuron(threshold, x, "threshold"),
                rid, sid, alpha, spike_dtype, impl)
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            s, m = _EagerLeaky.apply(*args)  # same loops as the op, without its per-call dispatch cost
        else:
            s, m = torch.ops.efficient.leaky_forward(*args)
        s, m = s.view(x.shape), m.view(x.shape)
    return (s, m) if return_membrane else s

