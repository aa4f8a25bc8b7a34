"""One backend resolver for every kernel: the `backend=` argument and the `EFFICIENT_BACKEND` variable.

Every public kernel function takes `backend="auto"` and accepts every value of `BACKENDS`; for
`"auto"` the environment variable `EFFICIENT_BACKEND` (if set to anything but "auto" or "") takes
over. Kernels differ in which implementations they have, so each value maps to the nearest one:

    value     lif (has the fused loop)                  ssa, token_select, spike_pack, linear_ce,
                                                        exit_confidence
    -------   ---------------------------------------   ---------------------------------------------
    auto      CUDA: triton (loop without triton).       CUDA: triton (torch without triton).
              CPU: compile for >= compile_min_numel     CPU: torch; ssa/token_select/spike_pack use triton
              elements (or unknown size) when a C++     when TRITON_INTERPRET=1 (the interpreter).
              compiler exists, else loop.
    triton    triton                                    triton
    torch     torch (the autograd reference loop)       torch (the reference)
    compile   compile (inductor-compiled fused loop)    the compiled kernel where the device has one:
                                                        triton on CUDA with triton, else torch
    loop      loop (the fused loop, eagerly)            torch (the eager, uncompiled path)

One exception, from measurement: exit_confidence's 'auto' stays on torch on CUDA (its Triton kernel
lost to cuBLAS + softmax on an H200; see that module). An explicit `backend=` argument wins over the variable. Unknown values, in the argument or the
variable, raise a ValueError that names where the value came from and the allowed values. Whether
the chosen implementation can run (Triton needs CUDA or the interpreter) is checked by the kernel.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = [
    "BACKENDS", "ENV_VAR", "HAS_TRITON", "eager_call", "eager_function", "have_cxx_compiler", "interpreter_on",
    "register_flops", "requested_backend", "resolve_backend",
]

BACKENDS = ("auto", "triton", "torch", "compile", "loop")
ENV_VAR = "EFFICIENT_BACKEND"

# looked up once at import: the resolver also runs inside torch.compile tracing
_HAVE_CXX = any(shutil.which(cc) for cc in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if cc)


def eager_call(x: torch.Tensor, function_modes: bool = True, op: str | None = None) -> bool:
    """Whether a kernel call may run its custom op's implementation directly (under a plain
    `torch.autograd.Function`, `eager_function`, where it has a gradient) instead of the op. The op's
    Python dispatch and autograd wrapper cost 0.1-0.2 ms per call, more than a small layer's
    arithmetic; the op is kept where something must see it as one node: torch.compile and export
    (tracing), a Python dispatch mode (FakeTensor, FLOP counters), a functorch transform, a tensor
    subclass, and with `function_modes` a torch-function mode (memory's spike tracking follows some
    ops, such as the token gather, by name; a neuron's compiled CPU loop runs outside the mode only
    inside the op, and dynamo cannot trace the mode's handler), unless every active mode says it
    need not see `op` (`mode.sees_op(op)` is False): `eager_function` then runs the implementation
    with the modes off, as the op would, without the op's dispatch."""
    return (type(x) is torch.Tensor and not torch.compiler.is_compiling()
            and not torch._C._len_torch_dispatch_stack()
            and not (function_modes and not _modes_let_through(op))
            and not torch._C._are_functorch_transforms_active())


def _modes_let_through(op: str | None) -> bool:
    """No torch-function mode is active, or `op` is named and no active mode needs to see it."""
    n = torch._C._len_torch_function_stack()
    if not n:
        return True
    if op is None:
        return False
    return not any(getattr(torch._C._get_function_stack_at(i), "sees_op", lambda name: True)(op) for i in range(n))


def graph_kept() -> bool:
    """Whether the backward now running keeps its graph (`retain_graph` or `create_graph`), so a saved
    tensor may be read again by a later backward; True outside a backward, or where torch cannot say."""
    kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if kept is None else bool(kept())


def eager_function(name: str, forward, setup_context, backward) -> type:
    """A `torch.autograd.Function` named `name` that runs a custom op's implementation `forward`
    with the op's own `setup_context(ctx, inputs, output)` and `backward(ctx, *grads)`: the op's
    semantics without its dispatch (see `eager_call`)."""

    def fwd(ctx, *inputs):
        if torch._C._len_torch_function_stack():  # modes that let the op through (eager_call) see nothing inside it
            with torch._C.DisableTorchFunction():
                out = forward(*inputs)
        else:
            out = forward(*inputs)
        setup_context(ctx, inputs, out)
        return out

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(backward),
                                                   "__doc__": eager_function.__doc__})


def register_flops(*pairs) -> None:
    """Let torch.utils.flop_counter (and every FLOP counter built on it) see the arithmetic inside custom
    ops: `pairs` of (op, formula(*argument shapes, out_shape=..., **kwargs) -> flops)."""
    try:
        from torch.utils.flop_counter import register_flop_formula
    except ImportError:  # pragma: no cover - older torch
        return
    for op, formula in pairs:
        try:
            register_flop_formula(op)(formula)
        except RuntimeError:  # pragma: no cover - re-import of the module
            pass


def have_cxx_compiler() -> bool:
    """Whether a C++ compiler exists (inductor needs one to compile on CPU)."""
    return _HAVE_CXX


def interpreter_on() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def requested_backend(backend: str, kernel: str = "kernel") -> str:
    """The value asked for: `backend`, or for "auto" the `EFFICIENT_BACKEND` value if one is set.

    Raises ValueError naming `kernel`, the source of the value and the allowed values.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{kernel}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    env = os.environ.get(ENV_VAR, "").strip()
    if env not in BACKENDS and env != "":
        raise ValueError(
            f"{kernel}: environment variable {ENV_VAR}={env!r} is not a backend; "
            f"set it to one of {BACKENDS} or unset it"
        )
    return env or "auto"


def resolve_backend(
    backend: str,
    device: torch.device,
    kernel: str = "kernel",
    *,
    fused_loop: bool = False,
    numel: Optional[int] = None,
    compile_min_numel: int = 0,
    interpreter_auto: bool = False,
    cuda_auto: str = "triton",
) -> str:
    """The implementation a kernel runs for `backend` on `device` (see the module table).

    `fused_loop`: the kernel has the compiled/eager fused loop (returns one of triton, torch,
    compile, loop); otherwise it returns triton or torch. `numel`/`compile_min_numel`: the size
    from which 'auto' compiles on CPU. `interpreter_auto`: 'auto' picks Triton's interpreter on
    CPU when TRITON_INTERPRET=1. `cuda_auto`: what 'auto' runs on CUDA for a kernel without the
    fused loop ("triton", or "torch" where the Triton kernel measured slower).
    """
    want = requested_backend(backend, kernel)
    cuda_triton = device.type == "cuda" and HAS_TRITON
    if fused_loop:
        if want != "auto":
            return want
        if device.type == "cuda":
            return "triton" if HAS_TRITON else "loop"
        if device.type == "cpu" and have_cxx_compiler() and (numel is None or numel >= compile_min_numel):
            return "compile"
        return "loop"
    if want in ("triton", "torch"):
        return want
    if want == "auto":
        if cuda_triton:
            return cuda_auto
        return "triton" if interpreter_auto and HAS_TRITON and interpreter_on() else "torch"
    if want == "compile":
        return "triton" if cuda_triton else "torch"
    return "torch"  # loop
