"""Multi-step leaky integrate-and-fire (LIF / PLIF / DLIF) over time-major input `[T, ...]`, in
spikingjelly's update order.

One kernel, four parts (see DESIGN.md, "Conventions"):

1. `lif_reference`: the spec, a readable autograd loop over T.
2. Triton kernels: forward and backward each loop over T inside one kernel; the forward saves only
   the pre-reset potential H (fp32), the backward recomputes spikes and surrogate from it.
3. One `torch.library` custom op pair, `efficient::lif_forward` / `efficient::lif_backward`, with
   fake implementations (so `torch.compile` traces models without graph breaks), an autograd
   formula and a flop formula. Its CPU/CUDA implementation is chosen by `impl` (`IMPLS`): the
   Triton kernels, or the same loop written in torch and compiled with inductor into one fused
   C++/OpenMP loop (the fast CPU path), or that loop run eagerly. Eager calls run the same
   implementations and formulas under a plain autograd.Function (`_EagerLIF`), skipping the op's
   per-call dispatch cost (`eager_call` says when).
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
comes back from the same backward. The backward uses a surrogate dS/dH = g(H - V_th) (formulas and
the `SURROGATE_ALPHA` defaults in `efficient.kernels.lif_common`); `detach_reset` cuts the gradient
through the reset's use of S.

`order="snntorch"` runs snntorch 1.0's `Leaky` order instead: public `leaky`, op
`efficient::leaky_*`, in `efficient.kernels.leaky`. What the two orders share (surrogates, ids,
backend choice, input checks, the compiled-loop cache) lives in `efficient.kernels.lif_common`.
This module re-exports both's public names and the internals tests and benchmarks reach, so it
stays the one address of the LIF kernels (to change a shared setting such as `COMPILE_MIN_NUMEL`,
assign it in `lif_common`, where it is read).
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from torch import Tensor

from efficient.kernels import leaky as _leaky_module
from efficient.kernels import lif_common as _common
from efficient.kernels._backend import BACKENDS, eager_call, eager_function, graph_kept
# re-exported: snntorch's order, and what both orders share
from efficient.kernels.leaky import (  # noqa: F401
    RESET_NONE, RESET_SUBTRACT, RESET_ZERO, RESETS, _EagerLeaky, _reset_id, leaky, leaky_backward_op, leaky_forward_op,
    leaky_reference,
)
from efficient.kernels.lif_common import (  # noqa: F401
    _BLOCK, _NUM_WARPS, CHARGE_DECAY_INPUT, CHARGE_LEAK, CHARGE_NO_DECAY, COMPILE_MIN_NUMEL, HAS_TRITON, IMPLS,
    SURROGATE_ALPHA, SURROGATE_ATAN, SURROGATE_SIGMOID, SURROGATE_STE, SURROGATE_TRIANGLE, SURROGATES,
    _check_compiler, _check_op_args, _choose_impl, _compiled, _Heaviside, _register_flops, _scalars, _surrogate_id,
    _triton_ready, _unviewed, check_input, default_alpha, resolve_backend, surrogate_grad,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from efficient.kernels.lif_common import _surrogate_tl

__all__ = [
    "BACKENDS", "IMPLS", "SURROGATES", "SURROGATE_ALPHA", "default_alpha", "ORDERS", "RESETS", "leaky",
    "leaky_reference", "lif", "lif_reference", "check_input", "resolve_backend", "surrogate_grad",
]

# update orders of `lif`: charge-fire-reset (spikingjelly, ours) or snntorch's (reset of the previous
# step subtracted after the leak, `efficient.kernels.leaky`)
ORDERS = ("spikingjelly", "snntorch")


# ---------------------------------------------------------------------------------------------
# 1. torch reference (the spec)
# ---------------------------------------------------------------------------------------------


def _charge_mode(tau: float, decay_input: bool, leak: Optional[float]) -> tuple[int, float]:
    if leak is not None:
        return CHARGE_LEAK, float(leak)
    return (CHARGE_DECAY_INPUT if decay_input else CHARGE_NO_DECAY), float(tau)


def _charge(x: Tensor, v: Tensor, rate, c, v_reset: float, charge: int) -> Tensor:
    """H from input x and previous membrane v; `rate` (PLIF) multiplies where `c` = tau divides."""
    if charge == CHARGE_LEAK:
        return c * v + x
    if charge == CHARGE_DECAY_INPUT:
        d = x - (v - v_reset)
        return v + (d * rate if rate is not None else d / c)
    d = v - v_reset
    return v - (d * rate if rate is not None else d / c) + x


def _charge_fused(x: Tensor, v: Tensor, rate, c: Tensor, v_reset: Tensor, charge: int, zero_reset: bool) -> Tensor:
    """`_charge` in fewer ops for the fused loop (0-d tensor scalars), the same values bit for bit:
    a +0.0 reset is not subtracted (v - 0.0 == v, signed zeros included), and v +- d / c is one
    `addcdiv` (it rounds the quotient, then the sum, as the two ops do; (-d) / c == -(d / c))."""
    if charge == CHARGE_LEAK or rate is not None:
        return _charge(x, v, rate, c, v_reset, charge)
    if charge == CHARGE_DECAY_INPUT:
        return torch.addcdiv(v, x - (v if zero_reset else v - v_reset), c)
    return torch.addcdiv(v, v if zero_reset else v - v_reset, c, value=-1.0) + x


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
        s = _Heaviside.apply(h - v_threshold, sid, float(alpha), False)
        sr = s.detach() if detach_reset else s
        v = h - sr * v_threshold if v_reset is None else sr * vr + (1.0 - sr) * h
        spikes.append(s)
        hs.append(h)
    return torch.stack(spikes).to(spike_dtype or x.dtype), torch.stack(hs)


# ---------------------------------------------------------------------------------------------
# 2. Triton kernels
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    # the charge modes as Triton compile-time constants (jit code reads only constexpr globals);
    # divisions use div_rn, as torch on CPU (see `_surrogate_tl`)
    _TL_DECAY_INPUT = tl.constexpr(CHARGE_DECAY_INPUT)
    _TL_LEAK = tl.constexpr(CHARGE_LEAK)

    @triton.jit
    def _lif_step_tl(x, v, k, c, v_th, v_reset, CHARGE: tl.constexpr, HAS_RATE: tl.constexpr, HARD: tl.constexpr):
        """One step from input x and membrane v (fp32): (H, spike, the membrane after the reset).
        `k` is PLIF's rate (used with HAS_RATE), `c` tau or the DLIF leak."""
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
        if HARD:
            v = tl.where(spike, v_reset, h)
        else:
            v = tl.where(spike, h - v_th, h)
        return h, spike, v

    @triton.jit
    def _lif_grad_h_tl(h, gs, carry, v_th, v_reset, alpha, HARD: tl.constexpr, DETACH: tl.constexpr,
                       SURROGATE: tl.constexpr):
        """dL/dH[t] from the spike's gradient gs and the carry dL/dV[t] from step t+1 (fp32)."""
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
        return gh

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
        else:
            k = 0.0  # unused without a rate
        for _t in range(T):
            x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            h, spike, v = _lif_step_tl(x, v, k, c, v_th, v_reset, CHARGE, HAS_RATE, HARD)
            tl.store(h_ptr + offs, h, mask=mask)
            tl.store(s_ptr + offs, spike.to(s_ptr.dtype.element_ty), mask=mask)
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
            gh = _lif_grad_h_tl(h, gs, carry, v_th, v_reset, alpha, HARD, DETACH, SURROGATE)
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
    gv0 = torch.empty(N, dtype=torch.float32, device=h.device) if v0 is not None else None
    nblocks = triton.cdiv(N, _BLOCK)
    # per-block partial rate gradients, only for PLIF: every program writes its own slot, so the
    # buffer needs no zero-fill (a launch); without a rate the kernel writes none, and the op fills in
    # its 0-d output
    grate = torch.empty(nblocks, dtype=torch.float32, device=h.device) if rate is not None else None
    hard = v_reset is not None
    last = T - 1  # kernels walk backwards from the last step
    _lif_bwd_kernel[(nblocks,)](
        gs[last], gm[last] if gm is not None else h[last], h[last],
        rate if rate is not None else h, v0 if v0 is not None else h, gx[last], grate if grate is not None else h,
        gv0 if v0 is not None else h, N, T, float(c), float(v_th), float(v_reset) if hard else 0.0, float(alpha),
        CHARGE=charge, HAS_RATE=rate is not None, HAS_GM=gm is not None, HARD=hard,
        DETACH=detach, SURROGATE=surrogate, HAS_V0=v0 is not None, BLOCK=_BLOCK, num_warps=_NUM_WARPS,
    )
    return gx, (grate.sum() if grate is not None else None), gv0


# ---------------------------------------------------------------------------------------------
# fused torch loops: the CPU path (compiled by inductor into one OpenMP loop nest) and its eager twin
# ---------------------------------------------------------------------------------------------


def _charge_step(xt, v, rate, c, v_reset, charge: int, zero_reset: bool):
    """One step's membrane H[t] from x[t] and the membrane v before it (None: from rest, where a +0.0 reset's
    charge is v_reset + x / c bit for bit, in one op)."""
    return torch.addcdiv(v_reset, xt, c) if v is None else _charge_fused(xt, v, rate, c, v_reset, charge, zero_reset)


def _after_spike(h, v_th, v_reset, hard: bool):
    """The membrane after a step whose H is `h`: reset to v_reset (hard) or lowered by v_th where it spiked."""
    return torch.where(h >= v_th, v_reset, h) if hard else torch.where(h >= v_th, h - v_th, h)


def _loop_forward(x, rate, c, v_th, v_reset, v0, *, charge: int, hard: bool, spike_dtype: torch.dtype,
                  zero_reset: bool = False, membrane: bool = True, spikes: bool = True):
    """x [T, N] -> (spikes [T, N], H [T, N] fp32); scalars arrive as 0-d fp32 tensors, v0 [N] or None;
    `zero_reset`: v_reset is +0.0 (its subtraction is skipped); `membrane` False: H is not returned
    (None), and compiled, never written; `spikes` False: the spikes are not made (None), and each step's
    H is written into the one [T, N] buffer as it comes (a backward rebuilding H holds no more)."""
    # only the recurrence runs per step; casts and the spike threshold run once over all T (fewer
    # dispatched ops per call: on small tensors the host cost of each op is the cost)
    xf = x if x.dtype == torch.float32 else x.float()  # `.float()` of fp32 is still a dispatched op
    # From rest with a +0.0 reset, step 0's charge v + (x - v) / c is v_reset + x / c bit for bit
    # (x - (+0.0) == x, signed zeros included): one op, and no resting membrane is made.
    from_rest = v0 is None and zero_reset and charge == CHARGE_DECAY_INPUT and rate is None
    # otherwise the resting membrane is a broadcast view of the 0-d v_reset (read only, no allocation)
    v = None if from_rest else v_reset.expand(xf.shape[1:]) if v0 is None else v0.float()
    hs = []
    steps = xf.unbind(0)  # one op for all T views, where indexing costs one per step
    H = None if spikes else torch.empty(xf.shape, dtype=torch.float32, device=xf.device)
    for t, xt in enumerate(steps):
        h = _charge_step(xt, v, rate, c, v_reset, charge, zero_reset)
        if H is None:
            hs.append(h)
        else:
            H[t] = h
        if t + 1 < len(steps):  # the membrane after the last step is not returned
            v = _after_spike(h, v_th, v_reset, hard)
    if H is not None:
        return None, H
    if not membrane:  # each step's spikes written into the stacked output: H is never one buffer
        return torch.stack([(h >= v_th).to(spike_dtype) for h in hs]), None
    H = torch.stack(hs)
    return (H >= v_th).to(spike_dtype), H


def _backward_terms(gs, gm, h, v_th, v_reset, alpha, one, hard: bool, detach: bool, surrogate: int):
    """What a backward step needs besides the carried gradient, over any steps of H: the spikes' share
    a = dL/dS * dS/dH (+ dL/dH) and the reset's factor r on the carry (None: the carry passes unchanged)."""
    sg = surrogate_grad(h - v_th, surrogate, alpha, one)
    a = (gs if gs.dtype == torch.float32 else gs.float()) * sg
    if gm is not None:
        a = a + (gm if gm.dtype == torch.float32 else gm.float())
    if hard:
        r = h < v_th
        # as fp32 once: a bool operand would be cast to 1.0 / 0.0 inside every step's product
        r = r.to(a.dtype) if detach else r + (v_reset - h) * sg
    elif detach:
        r = None
    else:
        r = torch.sub(one, v_th * sg)
    return a, r


def _loop_backward(
    gs, gm, h, rate, c, v_th, v_reset, alpha, one, v0, *,
    charge: int, hard: bool, detach: bool, surrogate: int, x_dtype: torch.dtype,
):
    """Reverse-time recurrence of the backward; returns (grad x [T, N], grad rate 0-d, grad v0 [N] or [0])."""
    # Everything that does not depend on the carried gradient runs once over all T: the surrogate,
    # the reset gradient and the spike gradient's share (a = dL/dS * dS/dH + dL/dH); only
    # gh[t] = a[t] + carry * r[t] and the carry run per step.
    T = h.shape[0]
    a, r = _backward_terms(gs, gm, h, v_th, v_reset, alpha, one, hard, detach, surrogate)
    ghs = []  # from the last step back (appended: torch 2.11's dynamo cannot trace a list's item assignment)
    a_t = a.unbind(0)
    r_t = r.unbind(0) if r is not None else None
    for t in range(T - 1, -1, -1):
        if t == T - 1:
            # the carry into the last step is +0.0: a + (+0.0) * r is add(a, r, alpha=0.0) bit for bit
            # (signed zeros and NaN included), without making the zeros
            gh = torch.add(a_t[t], one if r_t is None else r_t[t], alpha=0.0)
        else:
            gh = a_t[t] + (carry if r_t is None else carry * r_t[t])
        ghs.append(gh)
        if t == 0 and v0 is None:  # the carry past step 0 is v0's gradient, and there is no v0
            break
        if charge == CHARGE_LEAK:
            carry = gh * c
        else:
            # gh - gh / c as one addcdiv: gh + (-gh) / c rounds as the two ops do
            carry = gh - gh * rate if rate is not None else torch.addcdiv(gh, gh, c, value=-1.0)
    GH = torch.stack(ghs[::-1])
    if charge == CHARGE_DECAY_INPUT:
        gx = GH * rate if rate is not None else GH / c
    else:
        gx = GH
    gk = None  # None where there is nothing to differentiate: the custom op fills in its tensors
    if rate is not None:  # d H[t] / d rate from the membrane before step t (after its reset)
        first = torch.zeros_like(h[:1]) + v_reset if v0 is None else v0.float()[None]
        after = torch.where(h[:-1] >= v_th, v_reset, h[:-1]) if hard else torch.where(h[:-1] >= v_th, h[:-1] - v_th, h[:-1])
        vp = torch.cat([first, after])
        dk = (h - vp) / rate if charge == CHARGE_DECAY_INPUT else v_reset - vp
        gk = (GH * dk).sum()
    gv0 = carry if v0 is not None else None
    return (gx if gx.dtype == x_dtype else gx.to(x_dtype)), gk, gv0


def _step_backward(
    h_t, g, gm, carry, c, v_th, v_reset, alpha, one, *,
    charge: int, hard: bool, detach: bool, surrogate: int, first: bool, last: bool,
):
    """Step t of `_loop_backward`'s recurrence, the same arithmetic, all of it one fused loop under
    inductor: writes grad x[t] over H[t] (each element read before it is written) and returns the carry
    into step t - 1 (None at the `last` step when there is no v0 to differentiate)."""
    a, r = _backward_terms(g, gm, h_t, v_th, v_reset, alpha, one, hard, detach, surrogate)
    if first:  # no carry into the last step: add(a, r, alpha=0.0), as `_loop_backward`
        gh = torch.add(a, one if r is None else r, alpha=0.0)
    else:
        gh = a + (carry if r is None else carry * r)
    out = None
    if not last:
        out = gh * c if charge == CHARGE_LEAK else torch.addcdiv(gh, gh, c, value=-1.0)
    h_t.copy_(gh / c if charge == CHARGE_DECAY_INPUT else gh)
    return out


def _stepwise_backward(gs, gm, h, c, v_th, v_reset, alpha, one, v0, static, overwrite):
    """(grad x, None, grad v0) from H one compiled step at a time (`_step_backward`), grad x written over
    H itself (`overwrite`: nothing reads H after this backward) or over a copy of it. Beside H and the
    spikes' gradient it holds two steps' carries, where `_loop_backward` makes three tensors of H's size
    (the surrogate's share, the reset gradient, the stacked gradients); fewer passes over memory too."""
    out = h if overwrite else h.clone()
    T = h.shape[0]
    carry = None
    for t in range(T - 1, -1, -1):
        step = _compiled(_step_backward, static + (("first", t == T - 1), ("last", t == 0 and v0 is None)))
        carry = step(*_unviewed((out[t], gs[t], None if gm is None else gm[t], carry, c, v_th, v_reset, alpha, one)))
    return out, None, carry


def _step_forward(x_t, h_t, s_t, v, c, v_th, v_reset, *, charge: int, hard: bool, spike_dtype: torch.dtype,
                  zero_reset: bool, from_rest: bool, last: bool):
    """Step t of `_loop_forward`, the same arithmetic, one fused loop under inductor: writes H[t] into `h_t`
    (None: over x[t] itself, each element read before it is written) and the spikes into `s_t`, and returns
    the membrane after the step (None at the `last`); `v` None at step 0 without v0 (from rest, or from a
    membrane at v_reset)."""
    xt = x_t if x_t.dtype == torch.float32 else x_t.float()
    if v is None and not from_rest:  # `_loop_forward`'s resting membrane, a broadcast view of v_reset
        v = v_reset.expand(xt.shape)
    h = _charge_step(xt, v, None, c, v_reset, charge, zero_reset)
    (x_t if h_t is None else h_t).copy_(h)
    s_t.copy_((h >= v_th).to(spike_dtype))
    return None if last else _after_spike(h, v_th, v_reset, hard)


def _stepwise_forward(x, c, v_th, v_reset, v0, static, over):
    """(spikes, H) from x one compiled step at a time (`_step_forward`), H written over x itself (`over`: the
    caller's x is read by nothing else, fp32) or into a new buffer: beside x and the spikes it holds two
    steps' membranes, where `_loop_forward` stacks every step's H (and x's copy of them), and on a CPU it
    was faster (a [4, 6.3 M] input: 35.9 against 52.9 ms)."""
    kw = dict(static)
    s = torch.empty(x.shape, dtype=kw["spike_dtype"], device=x.device)
    H = x if over else torch.empty(x.shape, dtype=torch.float32, device=x.device)
    from_rest = v0 is None and kw["zero_reset"] and kw["charge"] == CHARGE_DECAY_INPUT
    v, T = (None if v0 is None else v0.float()), x.shape[0]
    for t in range(T):
        step = _compiled(_step_forward, static + (("from_rest", t == 0 and from_rest), ("last", t == T - 1)))
        v = step(*_unviewed((x[t], None if over else H[t], s[t], v, c, v_th, v_reset)))
    return s, H


# the compiled forward one fused loop per step (`_stepwise_forward`) where it makes H and each step has at
# least `STEPWISE_FORWARD_MIN` elements (below, the one all-T loop's single call costs less on the host)
STEPWISE_FORWARD = True
STEPWISE_FORWARD_MIN = 1 << 16


def _run_forward(x, rate, c, v_th, v_reset, charge, spike_dtype, impl, v0=None, membrane=True, spikes=True,
                 over=False):
    """(spikes, H) of the CPU loops (or the Triton kernel); `membrane` False: (spikes, None), H not made
    where the loop is compiled (the Triton kernel always writes it); `spikes` False (the eager loop): (None, H),
    for a backward that rebuilds H. `over`: x is the caller's to write over (nothing reads it after this call),
    and the compiled loop writes H into x's storage where x is contiguous fp32."""
    if impl == "triton":
        return _triton_forward(x, rate, c, v_th, v_reset, charge, spike_dtype, v0)
    hard = v_reset is not None
    vr = float(v_reset) if hard else 0.0
    zero_reset = vr == 0.0 and math.copysign(1.0, vr) > 0  # a -0.0 reset still subtracts (signed zeros)
    static = (("charge", charge), ("hard", hard), ("spike_dtype", spike_dtype), ("zero_reset", zero_reset))
    if not membrane:
        static += (("membrane", False),)
    args = (x, rate, *_scalars(x.device, c, v_th, vr), v0)
    if impl == "inductor" and membrane and spikes and rate is None and STEPWISE_FORWARD and x.dim() == 2 \
            and x.shape[1] >= STEPWISE_FORWARD_MIN:
        over = over and x.dtype == torch.float32 and x.is_contiguous()
        return _stepwise_forward(x, *args[2:5], v0, static, over)
    if impl == "inductor":
        return _compiled(_loop_forward, static)(*_unviewed(args))
    return _loop_forward(*args, **dict(static), spikes=spikes)


# the compiled backward one fused loop per step (`_stepwise_backward`); False: the all-T loop
# (`_loop_backward`), which bench/neurons.py and bench/rebuild_paths.py --compare lif-steps time beside it
STEPWISE_BACKWARD = True


def _run_backward(gs, gm, h, rate, c, v_th, v_reset, charge, surrogate, alpha, detach, x_dtype, impl, v0=None,
                  overwrite=False):
    """(grad x, grad rate, grad v0) of the implementation `impl`. `overwrite`: H is the caller's to write
    over (nothing reads it after this call), and the compiled loop writes grad x into H's storage."""
    if impl == "triton":
        return _triton_backward(gs, gm, h, rate, c, v_th, v_reset, charge, surrogate, alpha, detach, x_dtype, v0)
    hard = v_reset is not None
    static = (("charge", charge), ("hard", hard), ("detach", detach), ("surrogate", surrogate))
    scalars = _scalars(h.device, c, v_th, v_reset if hard else 0.0, alpha, 1.0)
    if impl == "inductor" and rate is None and STEPWISE_BACKWARD:  # PLIF's rate gradient reads every step's: all-T
        gx, _, gv0 = _stepwise_backward(gs, gm, h, *scalars, v0, static, overwrite)
        return (gx if gx.dtype == x_dtype else gx.to(x_dtype)), None, gv0
    args = (gs, gm, h, rate, *scalars, v0)
    static += (("x_dtype", x_dtype),)
    if impl == "inductor":
        return _compiled(_loop_backward, static)(*_unviewed(args))
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
    return _lif_forward_impl(x, rate, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, v0)


def _lif_forward_impl(x, rate, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, spike_dtype, impl, v0=None):
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
    gx, gk, gv0 = _lif_backward_impl(grad_spikes, grad_h, h, rate, c, v_threshold, v_reset, charge, surrogate, alpha,
                                     detach_reset, x_dtype, impl, v0)
    # the loops leave out what their caller does not differentiate; an op returns tensors
    return gx, (h.new_zeros(()) if gk is None else gk), (h.new_empty(0) if gv0 is None else gv0)


def _lif_backward_impl(grad_spikes, grad_h, h, rate, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset,
                       x_dtype, impl, v0=None, overwrite=False):
    gs = grad_spikes.contiguous()
    gm = grad_h.contiguous() if grad_h is not None else None
    v0 = v0.contiguous() if v0 is not None else None
    return _run_backward(
        gs, gm, h, rate, c, v_threshold, v_reset, charge, surrogate, alpha, detach_reset, x_dtype, impl, v0, overwrite
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
    ctx.h_out = weakref.ref(output[1])  # dead once the caller has dropped H (and every view of it)
    ctx.params = (c, v_th, v_reset, charge, surrogate, alpha, detach)
    ctx.x_dtype, ctx.impl = x.dtype, impl
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_spikes, grad_h, backward_fn=lif_backward_op):
    h, rate, v0 = ctx.saved_tensors
    if grad_spikes is None:
        grad_spikes = torch.zeros_like(h)
    gx, grate, gv0 = backward_fn(grad_spikes, grad_h, h, rate, *ctx.params, ctx.x_dtype, ctx.impl, v0)
    grate = grate.to(rate.dtype).reshape(rate.shape) if rate is not None and ctx.needs_input_grad[1] else None
    gv0 = gv0 if v0 is not None and ctx.needs_input_grad[11] else None
    return gx, grate, None, None, None, None, None, None, None, None, None, gv0


lif_forward_op.register_autograd(_backward, setup_context=_setup_context)


# eager calls (`_backend.eager_call`): the op's checks, implementations and saved tensors, without
# its per-call dispatch
def _eager_backward(ctx, grad_spikes, grad_h):
    """The eager backward writes grad x over the saved H where nothing can read H again: the caller
    dropped it (no `return_membrane`) and no later backward runs through this graph."""
    overwrite = ctx.h_out() is None and not graph_kept()
    return _backward(ctx, grad_spikes, grad_h,
                     backward_fn=lambda *args: _lif_backward_impl(*args, overwrite=overwrite))


_EagerLIF = eager_function("_EagerLIF", _lif_forward_impl, _setup_context, _eager_backward)


# forward per element and step: charge 4, compare 1, reset select 1;
# backward: surrogate ~6, reset gradient ~3, accumulate ~4.
_register_flops(torch.ops.efficient.lif_forward, 6)
_register_flops(torch.ops.efficient.lif_backward, 13)


# ---------------------------------------------------------------------------------------------
# 4. public entry point
# ---------------------------------------------------------------------------------------------


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
    chosen, impl = _choose_impl(backend, impl, x)
    if v_init is not None and v_init.shape != x.shape[1:]:
        raise ValueError(f"v_init must have the shape of one step {tuple(x.shape[1:])}, got {tuple(v_init.shape)}")
    if chosen == "torch" or x.numel() == 0:
        s, h = lif_reference(
            x, c, v_threshold, vr, detach_reset, decay_input, surrogate, alpha,
            rate=rate, leak=leak, spike_dtype=spike_dtype, v_init=v_init,
        )
    else:
        _check_compiler(impl, x)
        # a strided [T, N] view reaches the op as it is (the op makes one dense copy if it must)
        x2 = x.reshape(x.shape[0], -1)
        r = rate.reshape(()).float() if rate is not None else None
        v0 = v_init.reshape(-1).float() if v_init is not None else None
        args = (x2, r, c, float(v_threshold), vr, charge, sid, alpha, bool(detach_reset), spike_dtype, impl, v0)
        # eager: the op's implementation without its dispatch cost; traced or observed: the op
        s, h = _EagerLIF.apply(*args) if eager_call(x, op="lif_forward") else torch.ops.efficient.lif_forward(*args)
        s = s.view(x.shape)
        if not return_membrane:  # an unused view of H would still be an op and an autograd node
            return s
        h = h.view(x.shape)
    return (s, h) if return_membrane else s

