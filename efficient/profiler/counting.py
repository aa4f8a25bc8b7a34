"""Operator-level counting: a torch dispatch mode that sees every aten/custom op of a forward pass.

Each matmul/conv-like op is charged to the innermost module running when it was issued. Its
operands are classified unit by unit (`split_operand`: token rows of matmul operands, samples of
convolution inputs): binary units are charged synaptic operations (nonzeros x fan-out, the
accumulates a spike actually triggers), real-valued units multiply-accumulates, integer units as
the `Convention` says. A tensor mixing them (an anchor row among spike rows) is split, not rounded
to its costliest class.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from efficient.profiler.conventions import MAX_INTEGER, PRESETS, Convention
from efficient.profiler.layers import LayerCounts
from efficient.profiler.neurons import is_spiking_neuron, neuron_kind

aten = torch.ops.aten

# Spike x spike matmul (e.g. Q K^T of spiking self-attention): "operand" charges nnz(left operand)
# x fan-out, like any spike-driven matmul; "coincidence" charges only coinciding (1, 1) pairs,
# i.e. sum of the product, which is spikingjelly 2.0's SynOpCounter convention.
SPIKE_MATMUL_CONVENTIONS = ("operand", "coincidence")


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
    # integer-valued operands: MACs or accumulates they were charged (part of macs / sops)
    int_macs: int = 0
    int_acs: int = 0
    # real-valued operand units: MACs, and whether this layer saw any (for the conventions block)
    real_macs: int = 0
    mixed_ops: int = 0  # ops with an operand split into units of different classes
    # memory accesses: (kind, buffer bytes) -> 32-bit words, for the memory-access energy model
    memory: dict[tuple[str, int], int] = field(default_factory=dict)

    def access(self, kind: str, words: int, buffer_bytes: int) -> None:
        if words:
            key = (kind, int(buffer_bytes))
            self.memory[key] = self.memory.get(key, 0) + int(words)


@dataclass
class Split:
    """An operand's values by unit class: elements, nonzeros and value sums of its binary (spike),
    integer and real-valued units, and a float mask of the elements of each class."""

    numel: int
    bin_nnz: int = 0
    int_numel: int = 0
    int_sum: float = 0.0
    int_nnz: int = 0
    real_numel: int = 0
    real_nnz: int = 0
    bin_mask: torch.Tensor | None = None  # None: every unit is binary (or none is; see the counts)
    int_mask: torch.Tensor | None = None
    real_mask: torch.Tensor | None = None

    @property
    def all_binary(self) -> bool:
        return self.int_numel == 0 and self.real_numel == 0

    @property
    def has_spikes(self) -> bool:
        return self.bin_nnz > 0

    @property
    def mixed(self) -> bool:
        return sum(bool(v) for v in (self.numel - self.int_numel - self.real_numel, self.int_numel, self.real_numel)) > 1

    @property
    def nnz(self) -> int:
        return self.bin_nnz + self.int_nnz + self.real_nnz


def _unit_dims(x: torch.Tensor, per_sample: bool) -> tuple[int, ...]:
    """Dims reduced to form a unit: a sample (all but dim 0) for convolutions, else the contiguous
    (stride-1) axis, the feature axis of a token row even through a transposed view such as K^T."""
    if per_sample:
        return tuple(range(1, x.dim()))
    if x.dim() == 0:
        return ()
    unit = next((d for d in range(x.dim() - 1, -1, -1) if x.stride(d) == 1 and x.shape[d] > 1), x.dim() - 1)
    return (unit,)


def split_operand(x: torch.Tensor, per_sample: bool = False, max_int: int = MAX_INTEGER, whole: bool = False) -> Split:
    """Classify `x` unit by unit (see `_unit_dims`) into binary, integer and real-valued units.

    Vectorised: a binary tensor costs two passes (as a whole-tensor check would); a mixed one a few
    more. All-zero units are spikes (free) when the tensor carries spikes, else they join the
    integer or real units beside them (a zero-padded real input is computed densely). `whole`: the
    tensor is one unit (per-tensor classification, as spikingjelly's counters)."""
    n = x.numel()
    if x.dtype == torch.bool:
        return Split(n, bin_nnz=int(torch.count_nonzero(x)))
    if n == 0 or x.is_complex() or x.device.type == "meta":
        return Split(n, real_numel=n) if n else Split(0)
    with torch.no_grad():
        is01 = (x == 0) | (x == 1)
        if bool(is01.all()):
            return Split(n, bin_nnz=int(torch.count_nonzero(x)))
        dims = () if whole else _unit_dims(x, per_sample)
        if not dims:
            is_int = bool(((x == torch.trunc(x)) & (x >= 0) & (x <= max_int)).all())
            return Split(n, int_numel=n, int_sum=float(x.double().sum()), int_nnz=int(torch.count_nonzero(x))) if is_int \
                else Split(n, real_numel=n, real_nnz=int(torch.count_nonzero(x)))
        bin_u = is01.all(dim=dims, keepdim=True)
        isint = (x == torch.trunc(x)) & (x >= 0) & (x <= max_int)
        int_u = isint.all(dim=dims, keepdim=True) & ~bin_u
        real_u = ~(bin_u | int_u)
        nonzero = x != 0
        zero_u = ~nonzero.any(dim=dims, keepdim=True)
        if not bool((bin_u & ~zero_u).any()):  # no spike unit: zero units are computed like their neighbours
            if bool(real_u.any()):
                real_u = real_u | zero_u
            else:
                int_u = int_u | zero_u
            bin_u = bin_u & ~zero_u
        full = torch.ones_like(x, dtype=torch.bool)
        bm, im, rm = (full & bin_u), (full & int_u), (full & real_u)
        xi = torch.where(im, x, torch.zeros((), dtype=x.dtype, device=x.device))
        return Split(
            n,
            bin_nnz=int(torch.count_nonzero(nonzero & bm)),
            int_numel=int(im.sum()), int_sum=float(xi.double().sum()), int_nnz=int(torch.count_nonzero(nonzero & im)),
            real_numel=int(rm.sum()), real_nnz=int(torch.count_nonzero(nonzero & rm)),
            bin_mask=bm, int_mask=im, real_mask=rm,
        )


class _Ctx:
    """The state a rule needs: the convention, whether the first op was charged, spike checks of
    parameters (cached per pass), and whether counting is paused (work done by the profiler itself)."""

    def __init__(self, convention: Convention) -> None:
        self.conv = convention
        self.spike_matmul = convention.spike_matmul
        self.split_cache: dict[tuple, Split] = {}
        self.first_done = False
        self.first_layer: str | None = None

    def split(self, w: torch.Tensor, per_sample: bool = False) -> Split:
        """`split_operand` under the convention's granularity; parameters (and views of them, weights
        reused over T loops) are classified once per pass, keyed by storage, layout and version."""
        whole = self.conv.granularity == "tensor"
        base = w if isinstance(w, torch.nn.Parameter) else w._base
        if not isinstance(base, torch.nn.Parameter):  # activations: storage may be reused, no cache
            return split_operand(w, per_sample, whole=whole)
        key = (w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()), w._version, w.dtype,
               per_sample)
        if key not in self.split_cache:
            self.split_cache[key] = split_operand(w, per_sample, whole=whole)
        return self.split_cache[key]

    def is_param(self, w: torch.Tensor) -> bool:
        return isinstance(w, torch.nn.Parameter) or isinstance(w._base, torch.nn.Parameter)


def _after_first(ctx: _Ctx, acc: LayerAcc) -> bool:
    """True when this op is charged by nonzeros (papers' count) because an earlier op was the first layer."""
    if ctx.conv.after_first != "nonzero":
        return False
    if not ctx.first_done:
        ctx.first_done = True
        ctx.first_layer = acc.name
        return False
    return True


def _charge_units(ctx: _Ctx, acc: LayerAcc, s: Split, fan: int) -> None:
    """Charge one driving operand unit class by unit class, each element reaching `fan` outputs."""
    acc.sops += s.bin_nnz * fan
    acc.in_nnz += s.bin_nnz
    acc.in_numel += s.numel - s.int_numel - s.real_numel
    acc.real_macs += s.real_numel * fan
    acc.macs += s.real_numel * fan
    if s.int_numel:
        _charge_int(ctx, acc, s.int_numel * fan, s.int_sum * fan, s.int_nnz * fan)
    if s.mixed:
        acc.mixed_ops += 1


def _charge_int(ctx: _Ctx, acc: LayerAcc, dense: float, weighted: float, nonzero: float) -> None:
    how = ctx.conv.integer
    if how == "mac":
        acc.macs += int(dense)
        acc.int_macs += int(dense)
    else:
        v = int(round(weighted)) if how == "accumulate" else int(nonzero)
        acc.sops += v
        acc.int_acs += v


def _mask(s: Split, which: str, x: torch.Tensor) -> torch.Tensor:
    m = getattr(s, which + "_mask")
    if m is None:  # a uniform split: the whole tensor or nothing
        whole = {"bin": s.all_binary, "int": s.int_numel == s.numel, "real": s.real_numel == s.numel}[which]
        return torch.full_like(x, float(whole), dtype=torch.float64)
    return m.to(torch.float64)


def _charge_matmul(ctx: _Ctx, acc: LayerAcc, a: torch.Tensor, b: torch.Tensor, dense: int,
                   fan_a: int, fan_b: int, matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Charge a matmul-like op with operands a (fan-out fan_a per element) and b (fan_b).

    The driving operand is the one holding spikes (a first); it is charged unit by unit. When a
    is partly real and b is all spikes, b's spikes drive a's non-binary units."""
    acc.dense_macs += dense
    sa = ctx.split(a)
    sb = ctx.split(b)
    if _after_first(ctx, acc):
        driver, fan = (b, fan_b) if (sb.all_binary and not sa.all_binary and not ctx.is_param(b)) else (a, fan_a)
        s = sb if driver is b else sa
        if ctx.conv.real_rows == "exact" and s.real_numel:
            _charge_units(ctx, acc, replace_nonreal(s), fan)
            acc.macs += s.real_numel * fan
            acc.real_macs += s.real_numel * fan
        else:
            acc.sops += s.nnz * fan
            acc.in_nnz += s.nnz
            acc.in_numel += s.numel
        return
    if sa.all_binary and sb.all_binary:
        operand = sa.bin_nnz * fan_a
        with torch.no_grad():
            coinc = int(matmul(a.double(), b.double()).sum(dtype=torch.float64).item())
        acc.spike_spike_operand += operand
        acc.spike_spike_coincidence += coinc
        acc.sops += operand if ctx.spike_matmul == "operand" else coinc
        acc.in_nnz += sa.bin_nnz
        acc.in_numel += a.numel()
    elif sb.all_binary and sb.bin_nnz >= 0 and not ctx.is_param(b) and not sa.has_spikes:
        _charge_units(ctx, acc, sb, fan_b)  # b's spikes drive every row of a
    elif sb.all_binary and not ctx.is_param(b):
        # a mixes spike units with others, b is spikes: a's spike units are spike x spike, b's spikes
        # drive a's other units: one AC per (non-binary element of a, nonzero of b) pair
        with torch.no_grad():
            bm = _mask(sa, "bin", a)
            ab = a.double() * bm
            operand = sa.bin_nnz * fan_a
            coinc = int(matmul(ab, b.double()).sum(dtype=torch.float64).item())
            driven = int(matmul(1.0 - bm, (b != 0).double()).sum(dtype=torch.float64).item())
        acc.spike_spike_operand += operand
        acc.spike_spike_coincidence += coinc
        acc.sops += (operand if ctx.spike_matmul == "operand" else coinc) + driven
        acc.in_nnz += sa.bin_nnz
        acc.in_numel += a.numel()
        acc.mixed_ops += 1
    elif sa.has_spikes or sa.all_binary or not sb.has_spikes:
        _charge_units(ctx, acc, sa, fan_a)
    else:
        _charge_units(ctx, acc, sb, fan_b)


def replace_nonreal(s: Split) -> Split:
    """The split with its real units removed (charged separately as MACs)."""
    return Split(s.numel - s.real_numel, bin_nnz=s.bin_nnz + s.int_nnz, int_numel=0)


def _mm(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any, offset: int = 0) -> None:
    a, b = args[offset], args[offset + 1]
    m, k = a.shape
    n = b.shape[1]
    _charge_matmul(ctx, acc, a, b, m * k * n, n, m, torch.mm)


def _bmm(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any, offset: int = 0) -> None:
    a, b = args[offset], args[offset + 1]
    bs, m, k = a.shape
    n = b.shape[2]
    _charge_matmul(ctx, acc, a, b, bs * m * k * n, n, m, torch.bmm)


def _mv(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any, offset: int = 0) -> None:
    a, v = args[offset], args[offset + 1]
    m, k = a.shape
    _charge_matmul(ctx, acc, a, v, m * k, 1, m, torch.mv)


def _dot(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any) -> None:
    a, b = args[0], args[1]
    _charge_matmul(ctx, acc, a, b, a.numel(), 1, 1, lambda x, y: x * y)


def _occupancy(x: torch.Tensor, w: torch.Tensor, stride, padding, dilation, transposed, output_padding, groups) -> float:
    """Sum over input elements of value x (output positions each reaches) per output channel group:
    x convolved with an all-ones kernel, borders exact."""
    if transposed:
        ones = torch.ones((w.shape[0], w.shape[1], *w.shape[2:]), dtype=x.dtype, device=x.device)
        occ = aten.convolution.default(x, ones, None, stride, padding, dilation, True, output_padding, groups)
        return float(occ.sum(dtype=torch.float64))
    ones = torch.ones((groups, w.shape[1], *w.shape[2:]), dtype=x.dtype, device=x.device)
    occ = aten.convolution.default(x, ones, None, stride, padding, dilation, False, [0] * len(stride), groups)
    return float(occ.sum(dtype=torch.float64)) * (w.shape[0] // groups)


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
    sx = ctx.split(x, per_sample=True)
    geo = (stride, padding, dilation, transposed, output_padding, groups)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    per_elem = dense / max(x.numel(), 1)  # dense MACs per input element (a sample's share / its size)

    def occ(values: torch.Tensor) -> int:
        with torch.no_grad():
            return int(round(_occupancy(values.to(dt), w, *geo)))

    def charge_real_and_int() -> None:
        """Real-valued samples as MACs, integer ones by the convention."""
        real_macs = int(per_elem * sx.real_numel)
        acc.macs += real_macs
        acc.real_macs += real_macs
        if sx.int_numel:
            im = _mask(sx, "int", x).to(dt)
            weighted = occ(x.to(dt) * im) if ctx.conv.integer == "accumulate" else 0
            nonzero = occ((x != 0).to(dt) * im) if ctx.conv.integer == "nonzero" else 0
            _charge_int(ctx, acc, per_elem * sx.int_numel, weighted, nonzero)
        if sx.mixed:
            acc.mixed_ops += 1

    if _after_first(ctx, acc):
        keep_real = ctx.conv.real_rows == "exact" and sx.real_numel
        nz = (x != 0).to(dt) * (1.0 - _mask(sx, "real", x).to(dt) if keep_real else 1.0)
        acc.sops += occ(nz)
        acc.in_nnz += sx.nnz - (sx.real_nnz if keep_real else 0)
        acc.in_numel += x.numel() - (sx.real_numel if keep_real else 0)
        if keep_real:
            acc.macs += int(per_elem * sx.real_numel)
            acc.real_macs += int(per_elem * sx.real_numel)
        return
    sw = None if sx.has_spikes or sx.all_binary else ctx.split(w)
    if sx.all_binary or sx.has_spikes:
        # Exact fan-out, borders included: convolve the spike mask with an all-ones kernel per
        # group; every output position counts the nonzero inputs that reach it, times Cout/groups.
        bm = (x != 0).to(dt) * (_mask(sx, "bin", x).to(dt) if not sx.all_binary else 1.0)
        acc.sops += occ(bm)
        acc.in_nnz += sx.bin_nnz
        acc.in_numel += x.numel() - sx.int_numel - sx.real_numel
        charge_real_and_int()
    elif sw is not None and sw.all_binary:
        ref = x if transposed else out
        acc.sops += sw.bin_nnz * batch * math.prod(ref.shape[2:])
        acc.in_nnz += sw.bin_nnz
        acc.in_numel += w.numel()
    else:
        charge_real_and_int()


def _sdpa(ctx: _Ctx, acc: LayerAcc, args: tuple, kwargs: dict, out: Any) -> None:
    # Fused softmax attention: Q K^T classified by its operands; P V with P real-valued (softmax),
    # so V's spikes drive it when V is binary.
    q, k, v = args[0], args[1], args[2]
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:  # grouped KV heads (GQA): each serves Hq / Hkv query heads
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    *lead, lq, e = q.shape
    s = k.shape[-2]
    ev = v.shape[-1]
    b = math.prod(lead)
    _charge_matmul(ctx, acc, q.reshape(b, lq, e), k.reshape(b, s, e).transpose(1, 2), b * lq * s * e, s, lq, torch.bmm)
    p = torch.full((b, lq, s), 0.5, dtype=q.dtype, device=q.device)  # stands for the softmax output: real-valued
    _charge_matmul(ctx, acc, p, v.reshape(b, s, ev), b * lq * s * ev, ev, lq, torch.bmm)


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

    def __init__(self, stack: "ModuleStack", convention: Convention | str = "operand") -> None:
        super().__init__()
        if isinstance(convention, str):  # a spike_matmul choice on the default convention
            if convention not in SPIKE_MATMUL_CONVENTIONS:
                raise ValueError(f"spike_matmul must be one of {SPIKE_MATMUL_CONVENTIONS}, got {convention!r}")
            from dataclasses import replace

            convention = replace(PRESETS["efficient"], spike_matmul=convention)
        self.stack = stack
        self.ctx = _Ctx(convention)
        self.unknown_ops: dict[str, int] = {}
        self.paused = False  # the profiler's own work (NeuroBench's binarised copies) is not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        rule = RULES.get(func)
        if rule is not None:
            acc = self.stack.current()
            before = (acc.macs, acc.sops, acc.in_nnz)
            rule(self.ctx, acc, args, kwargs, out)
            _record_accesses(acc, func, args, out, before)
            name = func.__name__.split(".")[0]
            acc.ops[name] = acc.ops.get(name, 0) + 1
        else:
            ns = getattr(func, "namespace", "aten")
            if ns not in _SAFE_NAMESPACES:
                key = f"{ns}::{func.__name__}"
                self.unknown_ops[key] = self.unknown_ops.get(key, 0) + 1
        return out


WORD_BYTES = 4  # the memory model's access width: 32-bit words


def _operands(func: Any, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation operand, weight-like operand) of a counted op."""
    if func in (aten.addmm.default, aten.baddbmm.default, aten.addmv.default):
        return args[1], args[2]
    return args[0], args[1]


def _record_accesses(acc: LayerAcc, func: Any, args: tuple, out: Any, before: tuple[int, int, int]) -> None:
    """Memory traffic of one counted op (see `memory_access`): one weight read per MAC or AC; one
    read per input spike event, and per real input (each MAC reads its input for a convolution,
    a matmul reads each real input once for its whole row); a read and a write of the target
    membrane potential per AC; one write per output of an op computed with MACs."""
    d_macs, d_sops, d_events = acc.macs - before[0], acc.sops - before[1], acc.in_nnz - before[2]
    a, b = _operands(func, args)
    out_t = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(out_t, torch.Tensor):
        return
    conv = func in (aten.convolution.default, aten._convolution.default)
    acc.access("weights", d_macs + d_sops, b.numel() * WORD_BYTES)
    real_reads = d_macs if conv else d_macs // max(int(out_t.shape[-1]) if out_t.dim() else 1, 1)
    acc.access("inputs", d_events + real_reads, a.numel() * WORD_BYTES)
    acc.access("potentials", 2 * d_sops, out_t.numel() * WORD_BYTES)
    if d_macs:
        acc.access("outputs", out_t.numel(), out_t.numel() * WORD_BYTES)


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
            steps = s.shape[0] if kind.endswith("multi-step") and s.dim() >= 2 else 1
            per_step = s.numel() // max(steps, 1) * WORD_BYTES
            acc.access("potentials", 2 * s.numel(), per_step)
            acc.access("spikes", nz, per_step)

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
