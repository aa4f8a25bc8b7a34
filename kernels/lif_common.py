"""What the two multi-step LIF update orders share: spikingjelly's (`efficient.kernels.lif`) and
snntorch's `Leaky` (`efficient.kernels.leaky`).

Both orders are the same kind of kernel, a fused loop over T per neuron with a surrogate gradient,
dispatched the same way; this module holds that common ground below both, so neither imports the
other's internals:

- surrogate gradients (`SURROGATES`, `SURROGATE_ALPHA`, `surrogate_grad`, the spike function
  `_Heaviside`) and the integer ids the custom ops take (surrogates, charge modes);
- choosing an implementation: `resolve_backend` (`COMPILE_MIN_NUMEL`), `IMPLS`, input checks;
- the inductor-compiled CPU loops (`_compiled`, one compile per static configuration) and the
  0-d scalar tensors they read;
- the Triton surrogate, launch sizes and availability check;
- flop formulas, so counters see the ops' arithmetic.

The backward uses a surrogate dS/dH = g(H - V_th): sigmoid `alpha*sig(alpha*u)*(1-sig(alpha*u))`,
atan `(alpha/2) / (1 + (pi/2*alpha*u)^2)`, triangle `max(0, alpha - alpha^2*|u|)` (spikingjelly's
PiecewiseQuadratic; the stable-SNN triangle of width w is alpha = 1/w), or ste, the straight-through
estimator `alpha` everywhere (1 by default; no spikingjelly counterpart, used by attacks that probe
gradient masking, see efficient.attack_suite). `alpha=None` takes the
surrogate's default in spikingjelly (`SURROGATE_ALPHA`: sigmoid 4, atan 2, triangle 1), so switching
the name gives the function users know.

NaN input is not an error by default (checking costs a pass and a device sync): a NaN membrane
never fires (every comparison with NaN is false), so it stays NaN and its gradient is NaN. Pass
`check_finite=True` to `lif` or `leaky` to raise instead.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Optional

import torch
from torch import Tensor

from efficient.kernels import _backend

try:  # Triton is optional on CPU-only installs; the "triton" backend then raises a clear error.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

COMPILE_MIN_NUMEL = 1 << 20
# surrogate ids (the op's `surrogate` argument) and their names
SURROGATE_SIGMOID, SURROGATE_ATAN, SURROGATE_TRIANGLE, SURROGATE_STE = 0, 1, 2, 3
SURROGATES = {"sigmoid": SURROGATE_SIGMOID, "atan": SURROGATE_ATAN, "triangle": SURROGATE_TRIANGLE, "ste": SURROGATE_STE}
# default alpha per surrogate: spikingjelly 2.0's defaults (surrogate.Sigmoid alpha=4.0,
# surrogate.ATan alpha=2.0, surrogate.PiecewiseQuadratic alpha=1.0); the straight-through
# estimator passes the gradient unchanged (alpha 1)
SURROGATE_ALPHA = {"sigmoid": 4.0, "atan": 2.0, "triangle": 1.0, "ste": 1.0}
# charge modes of `efficient::lif_forward`; the float constant `c` of the op is tau for the first
# two, lambda for LEAK (which snntorch's order also is: M = beta*M + X)
CHARGE_DECAY_INPUT, CHARGE_NO_DECAY, CHARGE_LEAK = 0, 1, 2
# op implementations: "triton" kernels, "inductor" = compiled torch loop, "loop" = same loop eagerly
IMPLS = ("triton", "inductor", "loop")
# backend -> custom-op implementation ("torch" runs the reference, not the op)
_IMPL_OF_BACKEND = {"triton": "triton", "compile": "inductor", "loop": "loop"}


# ---------------------------------------------------------------------------------------------
# surrogate gradients and names (the references' and the loops' spike function)
# ---------------------------------------------------------------------------------------------


def _choice(table: dict, key, what: str):
    """table[key], or a ValueError naming the choices."""
    try:
        return table[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {what} {key!r}; choose one of {sorted(table)}") from None


def _surrogate_id(surrogate: str) -> int:
    return _choice(SURROGATES, surrogate, "surrogate")


def default_alpha(surrogate: str, alpha: Optional[float] = None) -> float:
    """`alpha` if given, else the surrogate's spikingjelly default (`SURROGATE_ALPHA`)."""
    if alpha is not None:
        return float(alpha)
    return _choice(SURROGATE_ALPHA, surrogate, "surrogate")


def surrogate_grad(u: Tensor, surrogate: int, alpha: float | Tensor, one: Optional[Tensor] = None) -> Tensor:
    """dS/dH at u = H - V_th for a surrogate id of `SURROGATES` (spikingjelly formulas). `one`, a 0-d
    fp32 tensor holding 1.0, spares the eager loops the number 1.0: a Python number operand is wrapped
    and cast on every call (three more dispatches inside the op), where a tensor is read as is."""
    if surrogate == SURROGATE_SIGMOID:
        sg = torch.sigmoid(u * alpha)
        return (1.0 - sg if one is None else torch.sub(one, sg)) * sg * alpha
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
    """S = Theta(u) forward (a spike at u >= 0, spikingjelly; `strict`: only at u > 0, snntorch),
    surrogate derivative backward."""

    @staticmethod
    def forward(ctx, u: Tensor, surrogate: int, alpha: float, strict: bool = False) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(u)
        ctx.surrogate, ctx.alpha = surrogate, alpha
        return (u > 0 if strict else u >= 0).to(u.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        (u,) = ctx.saved_tensors
        return g * surrogate_grad(u, ctx.surrogate, ctx.alpha), None, None, None


# ---------------------------------------------------------------------------------------------
# Triton: the surrogate both backward kernels call, launch sizes, availability
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    # the surrogate ids as Triton compile-time constants (jit code reads only constexpr globals)
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


# ---------------------------------------------------------------------------------------------
# fused torch loops: compiled by inductor into one OpenMP loop nest (the CPU path)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _compiled(base: types.FunctionType, static: tuple):
    """`base` (a fused loop) compiled by inductor, once per static configuration (keyword arguments
    `static`), each with its own dynamo cache, so no recompile limit."""
    # dynamo keys its cache (and recompile limit) by code object: give each configuration its own
    code = base.__code__.replace(co_name=f"{base.__name__}_{len(_compiled_names)}")
    _compiled_names.append(code.co_name)
    fn = types.FunctionType(code, base.__globals__, code.co_name, base.__defaults__, base.__closure__)
    fn.__kwdefaults__ = {**(base.__kwdefaults__ or {}), **dict(static)}
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    def run(*args):
        # one dispatch state for every caller (the custom op with and without autograd, the eager
        # path): dynamo guards on the tensors' dispatch keys and would compile once per state
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return compiled(*args)

    return run


_compiled_names: list[str] = []


def _unviewed(args: tuple) -> tuple:
    """Tensors as non-views (detach drops `_base`, no copy): dynamo otherwise guards on the layout of
    each view's base, and recompiles (up to its limit, then runs eagerly) for every new one."""
    return tuple(a.detach() if isinstance(a, Tensor) else a for a in args)


def _scalars(device, *values):
    return [_scalar(device, float(v), slot) for slot, v in enumerate(values)]


@functools.lru_cache(maxsize=256)
def _scalar(device: torch.device, value: float, slot: int | str, shape: tuple[int, ...] = ()) -> Tensor:
    """An fp32 tensor of `shape` (0-d by default; (1,) for an argument that may also be per-neuron)
    filled with `value`, made once per (device, value, argument slot): the loops only read it (new
    values stay runtime inputs, so no recompile), and a fresh tensor per call is an allocation and a
    fill. Per slot, so two equal arguments are never one aliased tensor (dynamo guards on aliasing)."""
    return torch.full(shape, value, dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------
# custom ops: argument checks and flop formulas
# ---------------------------------------------------------------------------------------------


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


def _elementwise_flops(numel: int, per_element: int) -> int:
    return int(numel) * per_element


def _register_flops(op, per_element: int) -> None:
    """Let torch.utils.flop_counter (and the profiler) see an op's arithmetic: `per_element` flops for
    each element of its first argument (the [T, N] input or spike gradient)."""
    _backend.register_flops(
        (op, lambda shape, *args, out_shape=None, **kwargs: _elementwise_flops(math.prod(shape), per_element)))


# ---------------------------------------------------------------------------------------------
# entry points: input checks and the choice of implementation
# ---------------------------------------------------------------------------------------------


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


def _choose_impl(backend: str, impl: Optional[str], x: Tensor) -> tuple[Optional[str], Optional[str]]:
    """(backend resolved for x, custom-op implementation): `impl` given runs the op with it (backend
    then None); otherwise the resolved backend's implementation, None for "torch" (the reference)."""
    if impl is not None:
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; choose one of {IMPLS}")
        if backend != "auto":
            raise ValueError(f"pass either backend ({backend!r}) or impl ({impl!r}), not both")
        return None, impl
    chosen = resolve_backend(backend, x.device, x.numel())
    return chosen, _IMPL_OF_BACKEND.get(chosen)


def _check_compiler(impl: Optional[str], x: Tensor) -> None:
    if impl == "inductor" and x.device.type == "cpu" and not _backend.have_cxx_compiler():
        raise RuntimeError("backend='compile' needs a C++ compiler on CPU (g++ or clang++); use backend='torch'")
