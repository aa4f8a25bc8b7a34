"""The machinery the checks share: finding spiking layers, running observed passes (hooks that
record each spiking layer's input and spikes and may change its input first), keeping the model as
it was, random inputs and currents, and relative differences between passes."""

from __future__ import annotations

import contextlib
import math
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import torch
from torch import Tensor, nn


def spiking_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> spiking neuron module of `model` (ours, spikingjelly's, snntorch's), the outermost
    where one neuron holds another, in module order."""
    from efficient.profiler.neurons import is_spiking_neuron

    out: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if is_spiking_neuron(m) and not any(name.startswith(p + ".") for p in out if p):
            out[name] = m
    return out


def _is_multi_step(m: nn.Module) -> bool:
    from efficient.profiler.neurons import neuron_kind

    return "multi" in neuron_kind(m)


def _rest(model: nn.Module, reset: Callable[[nn.Module], Any] | None) -> None:
    """Peers' neurons back to rest (spikingjelly `reset()`, snntorch `reset_mem()`), then `reset`."""
    from efficient.profiler.neurons import neuron_library

    for m in model.modules():
        if type(m).__module__.startswith("spikingjelly") and callable(getattr(m, "reset", None)):
            m.reset()
        elif neuron_library(m) == "snntorch" and callable(getattr(m, "reset_mem", None)):
            m.reset_mem()
    if reset is not None:
        reset(model)


def _snapshot(model: nn.Module) -> list[tuple[nn.Module, str, Tensor, Tensor]]:
    return [(m, k, b, b.detach().clone()) for m in model.modules() for k, b in m._buffers.items() if b is not None]


def _restore(buffers: list[tuple[nn.Module, str, Tensor, Tensor]]) -> None:
    with torch.no_grad():
        for m, k, b, saved in buffers:
            if m._buffers.get(k) is b and b.shape == saved.shape:
                b.copy_(saved)
            else:
                m._buffers[k] = saved.clone()


@contextlib.contextmanager
def _kept_as_it_was(model: nn.Module) -> Iterator[list[tuple[nn.Module, str, Tensor, Tensor]]]:
    """Restore every module's mode and every buffer after the checks (train-mode passes move
    BatchNorm statistics), and leave peers' neurons at rest. On CPU our neurons with backend "auto"
    run their eager reference meanwhile: the same spikes, without a compile per shape. Yields the
    buffers as they were, for restoring between passes."""
    from efficient.profiler.api import _eager_neurons_on_cpu

    modes = [(m, m.training) for m in model.modules()]
    buffers = _snapshot(model)
    try:
        with _eager_neurons_on_cpu(model):
            yield buffers
    finally:
        _restore(buffers)
        for m, mode in modes:
            m.training = mode
        _rest(model, None)


@contextlib.contextmanager
def _batch_norm_on_running_stats() -> Iterator[None]:
    """Meanwhile, BatchNorm normalises with its running statistics in training too (and leaves them
    as they are), through `torch.nn.functional.batch_norm`, which BatchNorm modules and functional
    code (e.g. a fused q/k/v unit) call: batch statistics couple samples by design."""
    import torch.nn.functional as F

    original = F.batch_norm

    def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None = None,
                   bias: Tensor | None = None, training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
        if running_mean is not None and running_var is not None:
            training = False
        return original(input, running_mean, running_var, weight, bias, training, momentum, eps)

    F.batch_norm = batch_norm
    try:
        yield
    finally:
        F.batch_norm = original


def _set_mode(model: nn.Module, train: bool) -> None:
    """Train or eval; in train mode BatchNorm layers keep to their running statistics (frozen)."""
    model.train(train)
    if train:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def _tensors(out: Any) -> list[Tensor]:
    """The tensors of a model output: a tensor, or those inside tuples, lists and dicts."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    return []


def _spikes_of(out: Any) -> Tensor | None:
    ts = _tensors(out)
    return ts[0] if ts else None


Inject = Callable[[str, int, Tensor], Tensor]  # (layer, call index, input) -> the input it gets instead
Part = Callable[[str, int, Tensor], "Tensor | None"]  # (layer, call index, tensor) -> the entries compared
Record = Literal["store", "graph", "compare", "count"]


@dataclass
class _Diff:
    """The largest relative change of one thing between two passes: the model output (layer None),
    or a spiking layer's input or spikes over all its calls."""

    layer: str | None
    what: str  # "output", "input" or "spikes"
    rel: float

    @property
    def where(self) -> str:
        return "output" if self.layer is None else f"{self.layer} {self.what}"


@dataclass
class _Counts:
    """A spiking layer's spikes over one pass: nonzero entries, entries, entries neither 0 nor 1."""

    nonzero: int = 0
    numel: int = 0
    off: int = 0
    examples: list[float] = field(default_factory=list)  # a few of the values neither 0 nor 1


@dataclass
class _Pass:
    """What one pass saw: the model output's tensors, the spiking layers in call order, and by the
    way it was recorded, their calls (input, spikes) or per part the changes against another pass,
    or per layer the counts of its spikes."""

    out: list[Tensor]
    order: list[str]
    calls: dict[str, list[tuple[Tensor | None, Tensor | None]]] = field(default_factory=dict)
    scales: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # stored calls: (input, spikes) scale
    diffs: dict[str, list[_Diff]] = field(default_factory=dict)  # part -> changes; "<part>|mixed": after time mixing
    counts: dict[str, _Counts] = field(default_factory=dict)
    mixed: tuple[str | None, str] | None = None  # (last spiking layer before, what) of the first op mixing time steps


def _compact(t: Tensor) -> Tensor:
    """A detached copy of spikes; binary ones as bool (an eighth of fp64, a quarter of fp32; exact)."""
    t = t.detach()
    if t.is_floating_point() and t.numel() and bool(((t == 0) | (t == 1)).all()):
        return t.to(torch.bool)
    return t.clone()


class _Tap:
    """Hooks on the spiking layers that see each call's input (after `inject` changed it, if given)
    and spikes, and record them as `record` says: "store" compact copies, "graph" the tensors
    themselves (for autograd), "compare" only their largest relative change against the same call
    of pass `against` over each of `parts` (nothing kept), "count" only their spike counts."""

    def __init__(self, layers: dict[str, nn.Module], inject: Inject | None = None, record: Record = "store",
                 against: _Pass | None = None, parts: dict[str, Part] | None = None) -> None:
        if record == "compare" and (against is None or not parts):
            raise ValueError("record='compare' needs a pass to compare against and the parts to compare")
        self.layers, self.inject, self.record, self.against, self.parts = layers, inject, record, against, parts or {}
        self.calls: dict[str, list[tuple[Tensor | None, Tensor | None]]] = {}
        self.scales: dict[str, list[tuple[float, float]]] = {}
        self.ncalls: dict[str, int] = {}
        self.order: list[str] = []
        self.worst: dict[tuple[str, str, str], float] = {}  # (part, layer, what) -> largest change
        self.counts: dict[str, _Counts] = {}
        self.mixed: tuple[str | None, str] | None = None
        self._last: str | None = None
        self._pending: dict[str, list[Tensor | None]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> _Tap:
        for name, m in self.layers.items():
            self._handles.append(m.register_forward_pre_hook(self._pre(name)))
            self._handles.append(m.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    def mark_mixed(self, what: str) -> None:
        """An op that mixes time steps by design ran: changes seen from here on are kept apart."""
        if self.mixed is None:
            self.mixed = (self._last, what)

    def _pre(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            x = args[0] if args and isinstance(args[0], Tensor) else None
            if x is not None and self.inject is not None:
                x = self.inject(name, self.ncalls.get(name, 0), x)
                args = (x, *args[1:])
            self._pending.setdefault(name, []).append(x)
            return args if self.inject is not None else None
        return hook

    def _post(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            x = self._pending[name].pop() if self._pending.get(name) else None
            s = _spikes_of(out)
            k = self.ncalls.get(name, 0)
            if k == 0:
                self.order.append(name)
            self.ncalls[name] = k + 1
            self._last = name
            if self.record == "graph":
                self.calls.setdefault(name, []).append((x, s))
            elif self.record == "store":
                self.calls.setdefault(name, []).append((None if x is None else x.detach().clone(),
                                                        None if s is None else _compact(s)))
                self.scales.setdefault(name, []).append((1.0 if x is None else _scale(x), 1.0 if s is None else _scale(s)))
            elif self.record == "count":
                self._count(name, s)
            else:
                self._compare(name, k, x, s)
        return hook

    def _count(self, name: str, s: Tensor | None) -> None:
        if s is None:
            return
        c = self.counts.setdefault(name, _Counts())
        s = s.detach()
        c.nonzero += int(torch.count_nonzero(s))
        c.numel += s.numel()
        off = (s != 0) & (s != 1)
        c.off += int(off.sum())
        if len(c.examples) < 3 and c.off:
            c.examples += [float(v) for v in s[off].reshape(-1)[: 3 - len(c.examples)]]

    def _compare(self, name: str, k: int, x: Tensor | None, s: Tensor | None) -> None:
        base = self.against.calls.get(name, []) if self.against is not None else []
        scales = self.against.scales.get(name, []) if self.against is not None else []
        for i, (what, new) in enumerate((("input", x), ("spikes", s))):
            old = base[k][i] if k < len(base) else None
            scale = scales[k][i] if k < len(scales) else 1.0
            for part, pick in self.parts.items():
                pa = pick(name, k, old) if old is not None else None
                pb = pick(name, k, new) if new is not None else None
                if pa is None and pb is None:
                    continue
                rel = _rel(pa, pb, scale)
                key = (part if self.mixed is None else f"{part}|mixed", name, what)
                self.worst[key] = max(self.worst.get(key, 0.0), rel)

    def result(self, out: Any) -> _Pass:
        p = _Pass([t.detach() if self.record == "graph" else t.detach().clone() for t in _tensors(out)], list(self.order),
                  calls=self.calls, scales=self.scales, counts=self.counts, mixed=self.mixed)
        if self.record == "compare" and self.against is not None:
            names = self.order + [n for n in self.against.order if n not in self.ncalls]
            for part in [*self.parts, *(f"{q}|mixed" for q in self.parts)]:
                diffs: list[_Diff] = []
                for name in names:
                    moved = len(self.against.calls.get(name, [])) != self.ncalls.get(name, 0) and not part.endswith("|mixed")
                    for what in ("input", "spikes"):
                        rel = math.inf if moved else self.worst.get((part, name, what))
                        if rel is not None:
                            diffs.append(_Diff(name, what, rel))
                p.diffs[part] = diffs
        return p


@contextlib.contextmanager
def _watch_time_mixing(model: nn.Module, tap: _Tap) -> Iterator[None]:
    """Tells `tap` when the first op that mixes time steps by design runs: a STATA token selection
    that prunes (one token set for every step, chosen from every step's scores), or the call of a
    module whose `mixes_time` is True (a model's own declaration, e.g. attention over time)."""
    stata = sys.modules.get("efficient.models.stata")
    pruner = getattr(stata, "TokenPruner", None)
    patched: list[nn.Module] = []
    handles: list[Any] = []
    why = "STATA token selection (one token set for every step, chosen from every step's scores)"
    for name, m in model.named_modules():
        if pruner is not None and isinstance(m, pruner):
            def select(*args: Any, _original: Callable[..., Any] = m.select, **kwargs: Any) -> Any:
                out = _original(*args, **kwargs)
                if out is not None:
                    tap.mark_mixed(why)
                return out
            m.select = select  # an instance attribute in front of the method, deleted after
            patched.append(m)
        if getattr(m, "mixes_time", False) is True:
            label = f"{name or type(m).__name__} (mixes_time)"
            handles.append(m.register_forward_pre_hook(lambda mod, args, _label=label: tap.mark_mixed(_label)))
    try:
        yield
    finally:
        for m in patched:
            del m.select
        for h in handles:
            h.remove()


@dataclass
class _Setup:
    """What every check needs: the model, its spiking layers (multi-step or not), the check batch
    `x` of `n` samples and its batch axis, T, the caller's reset, the seed and the tolerance."""

    model: nn.Module
    layers: dict[str, nn.Module]
    multi: dict[str, bool]
    x: Tensor
    n: int
    batch_dim: int  # of x: 1 when time-major, else 0
    time_major: bool
    T: int | None
    reset: Callable[[nn.Module], Any] | None
    seed: int
    rtol: float
    buffers: list[tuple[nn.Module, str, Tensor, Tensor]] = field(default_factory=list)  # as they were
    prime: bool = False  # set once the state check finds state kept across calls


DRIVE = 3.0  # spread of the drive current added at every spiking layer's input (thresholds near 1)


def _drive(s: _Setup, inject: Inject | None) -> Inject:
    """Adds to every spiking layer's input a random current that depends only on the layer, the
    call and the seed, the same in every pass (normal, spread DRIVE), then applies `inject`: the
    layers fire whatever the weights, so a change of membrane shows in their spikes."""
    def drive(name: str, k: int, x: Tensor) -> Tensor:
        if not x.is_floating_point():
            return x if inject is None else inject(name, k, x)
        g = _generator(s.seed * 1_000_003 + zlib.crc32(name.encode()) * 101 + k)
        x = x + (torch.randn(x.shape, generator=g) * DRIVE).to(x.device, x.dtype)
        return x if inject is None else inject(name, k, x)
    return drive


def _run(s: _Setup, x: Tensor, train: bool, inject: Inject | None = None, *, rest: bool = True,
         clean: Tensor | None = None, record: Record = "store", against: _Pass | None = None,
         parts: dict[str, Part] | None = None, drive: bool = True, mixing: bool = False) -> _Pass:
    """One pass without gradients, from rest unless `rest=False` (then only `reset` runs first),
    recorded as `_Tap` says; with `drive`, every spiking layer's input gets the drive current (see
    `_drive`) before `inject` changes it. Once the model is known to keep state across calls
    (`s.prime`), a pass first runs on its clean input `clean` (default x), so two passes compared
    start from the same leftover state. A train pass puts back the buffers it moved. With `mixing`,
    changes after the first op that mixes time steps by design are kept apart (`_watch_time_mixing`)."""
    if rest:
        _rest(s.model, s.reset)
    elif s.reset is not None:
        s.reset(s.model)
    _set_mode(s.model, train)
    frozen = _batch_norm_on_running_stats() if train else contextlib.nullcontext()
    try:
        with _seeded(s.seed, x.device), torch.no_grad(), frozen:
            if s.prime and rest:
                with _Tap(s.layers, _drive(s, None) if drive else None, "count"):
                    s.model(x if clean is None else clean)
                if s.reset is not None:
                    s.reset(s.model)
            with _Tap(s.layers, _drive(s, inject) if drive else inject, record, against, parts) as tap:
                with _watch_time_mixing(s.model, tap) if mixing else contextlib.nullcontext():
                    out = s.model(x)
    finally:
        if train:
            _restore(s.buffers)
    return tap.result(out)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The same random numbers (dropout masks) in every pass, without touching the caller's RNG."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_like(x: Tensor, g: torch.Generator) -> Tensor:
    """Values like x's but unrelated to them: binary stays binary, integers stay in x's range,
    floats are uniform over x's range (or normal when x is constant)."""
    if x.dtype == torch.bool:
        return torch.rand(x.shape, generator=g).to(x.device) < 0.5
    if not x.is_floating_point():
        lo, hi = int(x.min()), int(x.max())
        return torch.randint(lo, hi + 1, x.shape, generator=g).to(x.device, x.dtype)
    xf = x.detach().float()
    lo, hi = float(xf.min()), float(xf.max())
    if bool(((xf == 0) | (xf == 1)).all()):
        p = max(float(xf.mean()), 0.1)
        return (torch.rand(x.shape, generator=g) < p).to(x.device, x.dtype)
    if hi > lo:
        return (torch.rand(x.shape, generator=g) * (hi - lo) + lo).to(x.device, x.dtype)
    return (torch.randn(x.shape, generator=g) + lo).to(x.device, x.dtype)


def _current_like(x: Tensor, g: torch.Generator) -> Tensor:
    """Random input currents of x's size: normal around x's mean with three times x's spread (at
    least 3), strong enough to make a neuron with a threshold near 1 (or near x's scale) fire."""
    xf = x.detach().float()
    std = float(xf.std()) if xf.numel() > 1 else 0.0
    scale = max(3.0 * std, 3.0) if math.isfinite(std) else 3.0
    mean = float(xf.mean()) if xf.numel() else 0.0
    return (torch.randn(x.shape, generator=g) * scale + (mean if math.isfinite(mean) else 0.0)).to(x.device, x.dtype)


def _scale(t: Tensor) -> float:
    """max |t|, or 1 where t is all zero (or empty): what a difference is relative to."""
    if t.dtype == torch.bool or not t.numel():
        return 1.0
    m = float(t.detach().abs().max())
    return m if m > 0 and math.isfinite(m) else 1.0


def _rel(a: Tensor | None, b: Tensor | None, scale: float) -> float:
    """max |a - b| / scale (inf when one is missing or the shapes differ; NaN where both are NaN is equal)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    d = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(a), (a - b).abs())
    m = float(d.max())
    return m / scale if math.isfinite(m) else math.inf


def _batch_dim(t: Tensor | None, s: _Setup, multi: bool) -> int | None:
    """The batch axis of a spiking layer's tensor: 1 for a multi-step layer's `[T, B, ...]`, 0 for `[B, ...]`."""
    if t is None or t.dim() == 0:
        return None
    if multi and t.dim() >= 2 and t.shape[1] == s.n and (s.T is None or t.shape[0] == s.T):
        return 1
    return 0 if t.shape[0] == s.n else None


def _batch_part(t: Tensor | None, s: _Setup, multi: bool, keep: Tensor) -> Tensor | None:
    """The entries of samples `keep` in a spiking layer's tensor: `[T, B, ...]` (multi-step),
    `[B, ...]`, or `[T*B, ...]` (time and batch flattened, as a buggy caller passes it)."""
    d = _batch_dim(t, s, multi)
    if d is not None:
        return t.index_select(d, keep)
    if t is not None and t.dim() >= 1 and multi and s.T and t.shape[0] == s.T * s.n:
        return t.reshape(s.T, s.n, *t.shape[1:]).index_select(1, keep)
    return None


def _out_batch_dim(t: Tensor, s: _Setup) -> int | None:
    if t.dim() >= 2 and t.shape[1] == s.n and (s.time_major or t.shape[0] != s.n):
        return 1
    if t.dim() >= 1 and t.shape[0] == s.n:
        return 0
    return None


def _culprit(diffs: list[_Diff], rtol: float) -> str:
    """Where a change first shows: the first spiking layer whose spikes changed while its input did
    not (it mixes them itself), else the first input that changed (an op before it does)."""
    by_layer: dict[str, dict[str, float]] = {}
    for d in diffs:
        if d.layer is not None:
            by_layer.setdefault(d.layer, {})[d.what] = d.rel
    for layer, v in by_layer.items():
        if v.get("input", 0.0) <= rtol < v.get("spikes", 0.0):
            return f"first seen in the spikes of {layer}, whose input did not change: the layer itself does it"
        if v.get("input", 0.0) > rtol:
            return f"first seen in the input of {layer}: an op before it does it"
    return "no spiking layer shows it: it happens after the last one (or where the axes could not be told)"


def _worst(diffs: list[_Diff]) -> _Diff | None:
    return max(diffs, key=lambda d: d.rel, default=None)
