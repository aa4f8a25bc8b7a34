"""snntorch 1.0's `Leaky` update order over time-major input `[T, ...]`: `leaky` (and `lif(order="snntorch")`).

snntorch applies the reset decided at t-1 after the leak of step t, and fires strictly above
threshold; spikingjelly's order (`efficient.kernels.lif`) charges, fires and resets within one step.
The orders differ in every step, so this is its own kernel, in the same four parts (see DESIGN.md,
"Conventions"): `leaky_reference` (the spec), Triton kernels, the custom op pair
`efficient::leaky_forward` / `efficient::leaky_backward` (CPU: the compiled or eager torch loop;
eager CPU calls skip the op's dispatch, see `_EagerLeaky`), and `leaky`, the entry point. What it
shares with `lif` (surrogates, backends, compiled-loop cache) lives in `efficient.kernels.lif_common`.

Dynamics, with beta and V_th per neuron (fp32 [N], differentiable) and M[-1] given or 0:

    subtract M[t] = beta*M[t-1] + X[t] - r[t]*V_th      r[t] = Theta(M[t-1] - V_th), detached
    zero     M[t] = beta*((1 - r[t])*M[t-1]) + X[t]     none: M[t] = beta*M[t-1] + X[t]
    fire     S[t] = (M[t] - V_th > 0)                   (strict, as snntorch)

The backward uses the surrogate at M[t] - V_th (see `efficient.kernels.lif_common`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from efficient.kernels._backend import eager_call, eager_function
from efficient.kernels.lif_common import (
    _BLOCK, _NUM_WARPS, CHARGE_LEAK, HAS_TRITON, _check_compiler, _check_op_args, _choice, _choose_impl, _compiled,
    _Heaviside, _register_flops, _scalar, _scalars, _surrogate_id, _triton_ready, _unviewed, check_input,
    default_alpha, surrogate_grad,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from efficient.kernels.lif_common import _surrogate_tl

__all__ = ["RESETS", "leaky", "leaky_reference"]

# snntorch `Leaky` reset mechanisms (the op's `reset` argument)
RESET_SUBTRACT, RESET_ZERO, RESET_NONE = 0, 1, 2
RESETS = {"subtract": RESET_SUBTRACT, "zero": RESET_ZERO, "none": RESET_NONE}


# ---------------------------------------------------------------------------------------------
# 1. torch reference (the spec)
# ---------------------------------------------------------------------------------------------


def _reset_id(reset_mechanism: str) -> int:
    return _choice(RESETS, reset_mechanism, "reset_mechanism")


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
        r = _Heaviside.apply(m - threshold, sid, float(alpha), True).detach()
        if rid == RESET_ZERO:
            m = beta * ((1 - r) * m) + xf[t]
        else:
            m = beta * m + xf[t]
            if rid == RESET_SUBTRACT:
                m = m - r * threshold
        spikes.append(_Heaviside.apply(m - threshold, sid, float(alpha), True))
        ms.append(m)
    return torch.stack(spikes).to(spike_dtype or x.dtype), torch.stack(ms)


# ---------------------------------------------------------------------------------------------
# 2. Triton kernels
# ---------------------------------------------------------------------------------------------

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


def _leaky_loop_forward(x, m0, beta, thr, *, reset: int, spike_dtype: torch.dtype):
    """snntorch order, x [T, N] -> (spikes [T, N], membrane [T, N] fp32); m0 is [N], beta and thr [N]
    or [1] (one value for all neurons), all fp32."""
    # only the recurrence runs per step; the cast and the spike threshold run once over all T
    xf = x if x.dtype == torch.float32 else x.float()  # `.float()` of fp32 is still a dispatched op
    m = m0
    ms = []
    # snntorch's beta * 0 (signed zeros), once for all steps: the zero reset's value, and from rest
    # (m = +0.0) step 0's leak beta * m, whose reset test m > thr is thr < 0
    zero = beta * 0.0 if reset == RESET_ZERO or m0 is None else None
    for xt in xf.unbind(0):  # one op for all T views, where indexing costs one per step
        if m is None:  # step 0 from rest: both zero-reset branches are beta * 0 + x
            base = zero + xt
            m = torch.where(thr < 0, base - thr, base) if reset == RESET_SUBTRACT else base
        elif reset == RESET_ZERO:
            m = torch.where(m > thr, zero + xt, beta * m + xt)
        elif reset == RESET_SUBTRACT:
            base = beta * m + xt
            m = torch.where(m > thr, base - thr, base)
        else:
            m = beta * m + xt
        ms.append(m)
    M = torch.stack(ms)
    return (M > thr).to(spike_dtype), M


def _leaky_loop_backward(gs, gm, m, m0, beta, thr, alpha, one, zero, *, reset: int, surrogate: int, x_dtype: torch.dtype,
                         need_beta: bool = True, need_thr: bool = True):
    """Reverse-time recurrence of the snntorch-order backward: (grad x, grad m0 or [0], grad beta [N], grad thr [N]);
    the gradient of beta (threshold) is None with `need_beta` (`need_thr`) False. `one` and `zero` are 0-d
    fp32 tensors holding 1.0 and +0.0: a Python number operand costs a wrap and a cast per op."""
    # What does not depend on the carried gradient runs once over all T (the surrogate, the spike
    # gradient's share, which steps reset); only gh[t] = a[t] + carry and the carry run per step.
    T = m.shape[0]
    gsg = (gs if gs.dtype == torch.float32 else gs.float()) * surrogate_grad(m - thr, surrogate, alpha, one)
    a = gsg if gm is None else gsg + (gm if gm.dtype == torch.float32 else gm.float())
    mp = torch.cat([(m0 if m0 is not None else zero.expand(m.shape[1]))[None], m[:-1]])  # membrane before each step
    r = mp > thr  # step t reset (its membrane crossed at t - 1)
    ghs = []  # from the last step back (appended: torch 2.11's dynamo cannot trace a list's item assignment)
    a_t, r_t = a.unbind(0), r.unbind(0)
    for t in range(T - 1, -1, -1):
        # the carry into the last step is +0.0: a + 0.0 without making the zeros
        gh = a_t[t] + (zero if t == T - 1 else carry)
        ghs.append(gh)
        if t == 0 and m0 is None:  # the carry past step 0 is m0's gradient, and there is no m0
            break
        carry = torch.where(r_t[t], zero, gh * beta) if reset == RESET_ZERO else gh * beta
    GH = torch.stack(ghs[::-1])
    gb = gt = None
    if need_beta:
        gb = torch.where(r, zero, GH * mp).sum(0) if reset == RESET_ZERO else (GH * mp).sum(0)
    if need_thr:
        gt = -(gsg + torch.where(r, GH, zero)).sum(0) if reset == RESET_SUBTRACT else -gsg.sum(0)
    gxs = GH if GH.dtype == x_dtype else GH.to(x_dtype)
    gm0 = carry if m0 is not None else m.new_empty(0)
    # a beta / threshold shared by all neurons arrives as [1]: its gradient is the sum over neurons
    if gb is not None and beta.shape[0] != m.shape[1]:
        gb = gb.sum(0, keepdim=True)
    if gt is not None and thr.shape[0] != m.shape[1]:
        gt = gt.sum(0, keepdim=True)
    return gxs, gm0, gb, gt


def _run_leaky_forward(x, m0, beta, thr, reset, spike_dtype, impl):
    if impl == "triton":
        return _triton_leaky_forward(x, m0, beta, thr, reset, spike_dtype)
    static = (("reset", reset), ("spike_dtype", spike_dtype))
    if impl == "inductor":
        return _compiled(_leaky_loop_forward, static)(*_unviewed((x, m0, beta, thr)))
    return _leaky_loop_forward(x, m0, beta, thr, **dict(static))


def _run_leaky_backward(gs, gm, m, m0, beta, thr, reset, surrogate, alpha, x_dtype, impl, need=(True, True)):
    if impl == "triton":
        return _triton_leaky_backward(gs, gm, m, m0, beta, thr, reset, surrogate, alpha, x_dtype)
    static = (("reset", reset), ("surrogate", surrogate), ("x_dtype", x_dtype), ("need_beta", need[0]),
              ("need_thr", need[1]))
    args = (gs, gm, m, m0, beta, thr, *_scalars(m.device, alpha, 1.0, 0.0))
    if impl == "inductor":
        return _compiled(_leaky_loop_backward, static)(*_unviewed(args))
    return _leaky_loop_backward(*args, **dict(static))


# ---------------------------------------------------------------------------------------------
# 3. custom op: efficient::leaky_forward / efficient::leaky_backward
# ---------------------------------------------------------------------------------------------


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


def _leaky_backward_impl(grad_spikes, grad_mem, mem, m0, beta, threshold, reset, surrogate, alpha, x_dtype, impl,
                         need=(True, True)):
    # `need`: whether beta's and the threshold's gradients are wanted (the eager path knows; the op
    # returns both)
    # the Triton kernels index dense [T, N]; the torch loops read any strides (a loss like
    # spikes.sum() hands back an expanded gradient, which would otherwise be copied in full)
    dense = (lambda t: t.contiguous()) if impl == "triton" else (lambda t: t)
    gs = dense(grad_spikes)
    gm = dense(grad_mem) if grad_mem is not None else None
    m0 = m0.contiguous() if m0 is not None else None
    return _run_leaky_backward(
        gs, gm, mem, m0, beta.contiguous(), threshold.contiguous(), reset, surrogate, alpha, x_dtype, impl, need
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


def _leaky_backward(ctx, grad_spikes, grad_mem, backward_fn=leaky_backward_op, pass_need=False):
    mem, m0, beta, threshold = ctx.saved_tensors
    if grad_spikes is None:
        grad_spikes = torch.zeros_like(mem)
    need = ctx.needs_input_grad
    extra = {"need": (need[2], need[3])} if pass_need else {}
    gx, gm0, gbeta, gthr = backward_fn(grad_spikes, grad_mem, mem, m0, beta, threshold, *ctx.params, ctx.x_dtype, ctx.impl,
                                       **extra)
    return (gx, gm0 if m0 is not None and need[1] else None, gbeta if need[2] else None,
            gthr if need[3] else None, None, None, None, None, None)


leaky_forward_op.register_autograd(_leaky_backward, setup_context=_leaky_setup_context)


# eager calls (`_backend.eager_call`): the op's checks and implementations, called directly. The
# op's Python dispatch and autograd wrapper cost ~0.2 ms per layer and step, as much as the fused
# loop itself on a conv layer's 64k neurons; under torch.compile the op is used, so graphs still see
# one opaque node.
_EagerLeaky = eager_function("_EagerLeaky", _leaky_forward_impl, _leaky_setup_context,
                             lambda ctx, gs, gm: _leaky_backward(ctx, gs, gm, backward_fn=_leaky_backward_impl,
                                                                 pass_need=True))


# snntorch order: leak 2, reset select 2, compare 1; backward: surrogate ~6, accumulate ~7
_register_flops(torch.ops.efficient.leaky_forward, 5)
_register_flops(torch.ops.efficient.leaky_backward, 13)


# ---------------------------------------------------------------------------------------------
# 4. public entry point
# ---------------------------------------------------------------------------------------------


def _per_neuron(value: float | Tensor, x: Tensor, name: str) -> Tensor:
    """`value` (a number, or a tensor broadcastable to one step of x) as fp32 [N], or [1] when it holds
    one value (the kernels broadcast it; expanding to [N] would cost a copy forward and a reduction
    backward per call), differentiable."""
    if not isinstance(value, Tensor):  # a number: one cached read-only [1] tensor (a fresh one costs five ops)
        return _scalar(x.device, float(value), name, (1,))
    t = value
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
    chosen, impl = _choose_impl(backend, impl, x)
    if chosen == "torch" or x.numel() == 0:
        s, m = leaky_reference(x, beta, threshold, reset_mechanism, surrogate, alpha, mem=mem, spike_dtype=spike_dtype)
    else:
        _check_compiler(impl, x)
        m0 = mem.reshape(-1).float() if mem is not None else None
        args = (x.reshape(x.shape[0], -1), m0, _per_neuron(beta, x, "beta"), _per_neuron(threshold, x, "threshold"),
                rid, sid, alpha, spike_dtype, impl)
        if eager_call(x, op="leaky_forward"):
            s, m = _EagerLeaky.apply(*args)  # same loops as the op, without its per-call dispatch cost
        else:
            s, m = torch.ops.efficient.leaky_forward(*args)
        s = s.view(x.shape)
        if not return_membrane:  # an unused view of the membrane would still be an op and an autograd node
            return s
        m = m.view(x.shape)
    return (s, m) if return_membrane else s

