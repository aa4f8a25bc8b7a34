"""Operator-level counting: a torch dispatch mode that sees every aten/custom op of a forward pass.

Each matmul/conv-like op is charged to the innermost module running when it was issued. An op
whose operand is binary (all values in {0, 1}) is charged synaptic operations (nonzeros x
fan-out, the accumulates a spike actually triggers); otherwise multiply-accumulates.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from efficient.profiler.layers import LayerCounts
from efficient.profiler.neurons import is_spiking_neuron, neuron_kind

aten = torch.ops.aten

# Spike x spike matmul (e.g. Q K^T of spiking self-attention): "operand" charges nnz(left operand)
# x fan-out, like any spike-driven matmul; "coincidence" charges only coinciding (1, 1) pairs,
# i.e. sum of the product, which is spikingjelly 2.0's SynOpCounter convention.
SPIKE_MATMUL_CONVENTIONS = ("operand", "coincidence")


def spike_nnz(x: torch.Tensor) -> int | None:
    """Nonzero count when every value is 0 or 1 (a spike tensor), else None.

    The integer residual stream ({0, 1, 2, ...}) is not spikes. Two passes: nonzeros == ones.
    """
    if x.dtype == torch.bool:
        return int(torch.count_nonzero(x))
    if x.is_complex() or x.device.type == "meta":
        return None
    if x.numel() == 0:
        return 0
    if x.dim() >= 2 and x.numel() > 4096:
        # cheap early exit for real-valued tensors (any layout, no copy): the first 2-D slice
        head = x[(0,) * (x.dim() - 2)] if x.dim() > 2 else x[0]
        if not bool(((head == 0) | (head == 1)).all()):
            return None
    nz = int(torch.count_nonzero(x))
    ones = int(torch.count_nonzero(x == 1))
    return nz if nz == ones else None


def is_binary(x: torch.Tensor) -> bool:
    """True when every value is 0 or 1."""
    return spike_nnz(x) is not None


@dataclass
class LayerAcc(LayerCounts):
    """Running counts for one module (the innermost module that issued the ops)."""

    ops: dict[str, int] = field(default_factory=dict)
    in_nnz: int = 0  # nonzeros of binary (spike) operands that drove SOPs
    in_numel: int = 0
    out_nnz: int = 0  # neurons: spikes emitted
    out_numel: int = 0
    per_step: list[float] | None = None  # neurons: firing rate per time step
    neuron: str | None = None  # neuron kind, when this module is a spiking neuron
    calls: int = 0
    # spike x spike matmuls, both conventions, so the report can state the difference
    spike_spike_operand: int = 0
    spike_spike_coincidence: int = 0


class _Ctx:
    """The state a rule needs: which conventions apply, and spike checks of parameters."""

    def __init__(self, spike_matmul: str) -> None:
        self.spike_matmul = spike_matmul
        self.weight_cache: dict[tuple, int | None] = {}

    def weight_nnz(self, w: torch.Tensor) -> int | None:
        """spike_nnz for an operand that is often a (transposed) weight: parameters are checked
        once per pass, keyed by storage, layout and version (weights reused over T loops)."""
        base = w if isinstance(w, torch.nn.Parameter) else w._base
        if not isinstance(base, torch.nn.Parameter):  # activations: storage may be reused, no cache
            return spike_nnz(w)
        key = (w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()), w._version, w.dtype)
        if key not in self.weight_cache:
            self.weight_cache[key] = spike_nnz(w)
        return self.weight_cache[key]


def _charge_matmul(ctx: _Ctx, acc: LayerAcc, a: torch.Tensor, b: torch.Tensor, dense: int,
                   fan_a: int, fan_b: int, product: Callable[[], torch.Tensor]) -> None:
    """Charge a matmul-like op with operands a (fan-out fan_a per element) and b (fan_b)."""
    acc.dense_macs += dense
    nz_a = spike_nnz(a)
    nz_b = ctx.weight_nnz(b)
    if nz_a is not None and nz_b is not None:
        operand = nz_a * fan_a
        coinc = int(product().sum(dtype=torch.float64).item())
        acc.spike_spike_operand += operand
        acc.spike_spike_coincidence += coinc
        acc.sops += operand if ctx.spike_matmul == "operand" else coinc
        acc.in_nnz += nz_a
        acc.in_numel += a.numel()
    elif nz_a is not None:
        acc.sops += nz_a * fan_a
        acc.in_nnz += nz_a
        acc.in_numel += a.numel()
    elif nz_b is not None:
        acc.sops += nz_b * fan_b
        acc.in_nnz += nz_b
        acc.in_numel += b.numel()
    else:
        acc.macs += dense


def _mm(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any, offset: int = 0) -> None:
    a, b = args[offset], args[offset + 1]
    m, k = a.shape
    n = b.shape[1]
    _charge_matmul(ctx, acc, a, b, m * k * n, n, m, lambda: torch.mm(a.double(), b.double()))


def _bmm(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any, offset: int = 0) -> None:
    a, b = args[offset], args[offset + 1]
    bs, m, k = a.shape
    n = b.shape[2]
    _charge_matmul(ctx, acc, a, b, bs * m * k * n, n, m, lambda: torch.bmm(a.double(), b.double()))


def _mv(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any, offset: int = 0) -> None:
    a, v = args[offset], args[offset + 1]
    m, k = a.shape
    _charge_matmul(ctx, acc, a, v, m * k, 1, m, lambda: torch.mv(a.double(), v.double()))


def _dot(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any) -> None:
    a, b = args[0], args[1]
    _charge_matmul(ctx, acc, a, b, a.numel(), 1, 1, lambda: (a.double() * b.double()))


def _conv(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any) -> None:
    x, w = args[0], args[1]
    stride, padding, dilation, transposed, output_padding, groups = args[3:9]
    batch = x.shape[0]
    if transposed:
        # each input position scatters into Cout/groups * k outputs
        dense = batch * math.prod(x.shape[2:]) * w.shape[0] * w.shape[1] * math.prod(w.shape[2:])
    else:
        dense = batch * math.prod(out.shape[2:]) * w.shape[0] * w.shape[1] * math.prod(w.shape[2:])
    acc.dense_macs += dense
    nz_x = spike_nnz(x)
    nz_w = None if nz_x is not None else ctx.weight_nnz(w)
    if nz_x is not None:
        # Exact fan-out, borders included: convolve the spike mask with an all-ones kernel per
        # group; every output position counts the nonzero inputs that reach it, times Cout/groups.
        with torch.no_grad():
            mask = (x != 0).to(torch.float64 if x.dtype == torch.float64 else torch.float32)
            if transposed:
                ones = torch.ones((w.shape[0], w.shape[1], *w.shape[2:]), dtype=mask.dtype, device=x.device)
                occ = aten.convolution.default(mask, ones, None, stride, padding, dilation, True, output_padding, groups)
                sops = int(occ.sum(dtype=torch.float64).item())
            else:
                ones = torch.ones((groups, w.shape[1], *w.shape[2:]), dtype=mask.dtype, device=x.device)
                occ = aten.convolution.default(mask, ones, None, stride, padding, dilation, False,
                                               [0] * len(stride), groups)
                sops = int(occ.sum(dtype=torch.float64).item()) * (w.shape[0] // groups)
        acc.sops += sops
        acc.in_nnz += nz_x
        acc.in_numel += x.numel()
    elif nz_w is not None:
        ref = x if transposed else out
        acc.sops += nz_w * batch * math.prod(ref.shape[2:])
        acc.in_nnz += nz_w
        acc.in_numel += w.numel()
    else:
        acc.macs += dense


def _sdpa(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any) -> None:
    # Fused softmax attention: Q K^T and P V, both real-valued (softmax output is never binary).
    q, k, v = args[0], args[1], args[2]
    *lead, lq, e = q.shape
    s = k.shape[-2]
    ev = v.shape[-1]
    dense = math.prod(lead) * lq * s * (e + ev)
    acc.dense_macs += dense
    acc.macs += dense


RULES: dict[Any, Callable[..., None]] = {
    aten.mm.default: _mm,
    aten.addmm.default: lambda c, a, args, kw, o: _mm(c, a, args, kw, o, 1),
    aten.bmm.default: _bmm,
    aten.baddbmm.default: lambda c, a, args, kw, o: _bmm(c, a, args, kw, o, 1),
    aten.mv.default: _mv,
    aten.addmv.default: lambda c, a, args, kw, o: _mv(c, a, args, kw, o, 1),
    aten.dot.default: _dot,
    aten.vdot.default: _dot,
    aten.convolution.default: _conv,
    aten._convolution.default: _conv,
}
for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
    if hasattr(aten, _name):
        RULES[getattr(aten, _name).default] = _sdpa

# Op namespaces known to hold no hidden matmuls: elementwise or bookkeeping.
_SAFE_NAMESPACES = {"aten", "prim", "prims", "efficient", "profiler", "_c10d_functional", "c10d"}


class CountingMode(TorchDispatchMode):
    """Counts the ops of everything run inside it; attribute with `ModuleStack`."""

    def __init__(self, stack: "ModuleStack", spike_matmul: str = "operand") -> None:
        super().__init__()
        if spike_matmul not in SPIKE_MATMUL_CONVENTIONS:
            raise ValueError(f"spike_matmul must be one of {SPIKE_MATMUL_CONVENTIONS}, got {spike_matmul!r}")
        self.stack = stack
        self.ctx = _Ctx(spike_matmul)
        self.unknown_ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rule = RULES.get(func)
        if rule is not None:
            acc = self.stack.current()
            rule(self.ctx, acc, args, kwargs, out)
            name = func.__name__.split(".")[0]
            acc.ops[name] = acc.ops.get(name, 0) + 1
        else:
            ns = getattr(func, "namespace", "aten")
            if ns not in _SAFE_NAMESPACES:
                key = f"{ns}::{func.__name__}"
                self.unknown_ops[key] = self.unknown_ops.get(key, 0) + 1
        return out


UNATTRIBUTED = "<unattributed>"


class ModuleStack:
    """Tracks the running module through global forward hooks; collects per-module counts and
    neuron firing statistics."""

    def __init__(self, model: nn.Module, root_name: str | None = None) -> None:
        self.model = model
        self.names: dict[int, str] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            self.names.setdefault(id(m), name)
        self.root_label = root_name or type(model).__name__
        self._stack: list[nn.Module] = []
        self.layers: "OrderedDict[str, LayerAcc]" = OrderedDict()
        self.unattributed_modules: dict[str, int] = {}
        self.block_tokens: dict[str, list[int]] = {}
        self._block_ids: dict[int, str] = {}
        self._handles: list[Any] = []

    def watch_blocks(self, blocks: dict[str, nn.Module]) -> None:
        self._block_ids = {id(m): n for n, m in blocks.items()}

    def _label(self, m: nn.Module) -> str:
        name = self.names.get(id(m))
        if name is None:
            return UNATTRIBUTED
        return name or self.root_label

    def acc_for(self, m: nn.Module | None) -> LayerAcc:
        if m is None:
            label, typ = UNATTRIBUTED, "-"
        else:
            label, typ = self._label(m), type(m).__name__
            if label == UNATTRIBUTED:
                self.unattributed_modules[typ] = self.unattributed_modules.get(typ, 0) + 1
        acc = self.layers.get(label)
        if acc is None:
            acc = self.layers[label] = LayerAcc(label, typ if label != UNATTRIBUTED else "-")
        return acc

    def current(self) -> LayerAcc:
        return self.acc_for(self._stack[-1] if self._stack else None)

    def _pre(self, m: nn.Module, args: tuple) -> None:
        self._stack.append(m)
        bname = self._block_ids.get(id(m))
        if bname is not None and args and isinstance(args[0], torch.Tensor):
            self.block_tokens.setdefault(bname, []).append(_tokens(args[0]))

    def _post(self, m: nn.Module, args: tuple, out: Any) -> None:
        if self._stack and self._stack[-1] is m:
            self._stack.pop()
        elif m in self._stack:  # an exception unwound inner modules
            while self._stack and self._stack.pop() is not m:
                pass
        if is_spiking_neuron(m):
            self._record_neuron(m, out)

    def _record_neuron(self, m: nn.Module, out: Any) -> None:
        spikes = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(spikes, torch.Tensor) or spikes.numel() == 0:
            return
        acc = self.acc_for(m)
        kind = neuron_kind(m)
        acc.neuron = kind
        acc.calls += 1
        with torch.no_grad():
            s = spikes.detach()
            if acc.per_step is None:
                acc.per_step = []
            if kind.endswith("multi-step") and s.dim() >= 2:
                # time-major [T, ...]: one pass gives spikes per step, hence the rate per step
                per_t = torch.count_nonzero(s.reshape(s.shape[0], -1), dim=1).tolist()
                n = s[0].numel()
                nz = int(sum(per_t))
                rates = [c / n for c in per_t]
                if acc.calls == 1:
                    acc.per_step.extend(rates)
                else:
                    _add_into(acc.per_step, rates, acc.calls)
            else:
                nz = int(torch.count_nonzero(s))
                acc.per_step.append(nz / s.numel())
            acc.out_nnz += nz
            acc.out_numel += s.numel()

    def __enter__(self) -> "ModuleStack":
        from torch.nn.modules import module as _mod

        self._handles = [
            _mod.register_module_forward_pre_hook(self._pre),
            _mod.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack.clear()


def _add_into(running: list[float], rates: list[float], calls: int) -> None:
    """Running mean of per-step rates over repeated multi-step calls of one neuron."""
    if len(running) != len(rates):
        running.extend(rates)
        return
    for i, r in enumerate(rates):
        running[i] += (r - running[i]) / calls


def _tokens(x: torch.Tensor) -> int:
    """Tokens in a block input: [T,B,N,C] -> N; [B,N,C] -> N; [T,B,C,H,W] -> H*W."""
    if x.dim() == 4:
        return int(x.shape[2])
    if x.dim() == 3:
        return int(x.shape[1])
    if x.dim() == 5:
        return int(x.shape[3] * x.shape[4])
    return int(x.shape[-2]) if x.dim() >= 2 else int(x.numel())
