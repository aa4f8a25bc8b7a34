"""What one training step keeps for backward, measured per module and block.

    mem = activation_memory(model, x)                    # the model at the level it has
    mem = activation_memory(model, x, level="bits")      # at a memory level, then back to the one it had
    mem.total_bytes, mem.by_block["blocks.0"], mem.packed_bytes
    print(mem.table())

One training forward (train mode, grad enabled), the loss, and by default the backward run while
saved-tensor hooks record every tensor autograd keeps for backward. What counts, and how:

- Bytes: a saved tensor counts its storage's `nbytes`. A view into a larger storage (a reshape, a
  head split, one q/k/v slice of a fused projection) counts that whole storage, and a storage counts
  once however many views of it are saved. A spike tensor kept as bits (level `bits`/`recompute`)
  counts its packed record, ceil(numel / 8) bytes, once per save (each save is a record of its own).
- Not activations, not counted: the model's parameters and buffers (and views of them, such as the
  `weight.t()` a Linear saves); what a recomputed region saves inside it (it keeps only its input).
- Kept: only tensors still held when forward and loss have run are counted; one the graph dropped
  during the forward (a branch whose output died) is not.
- Attribution: to the innermost module of `model.named_modules()` running when the tensor was first
  saved (a unit that runs as one fused op, as in training, calls no child: its saves count to it); ""
  is the model's own forward outside its children, `LOSS` ("(loss)") what `loss_fn` saved outside the
  model. `by_block` sums modules per top-level block: a child of the model, or an item
  of a child ModuleList / ModuleDict (`patch_embed`, `blocks.0`, `head`).
- Not seen: tensors an autograd Function keeps as attributes of `ctx` instead of through
  `save_for_backward`, and whatever a `torch.compile`d region saves: a compiled model (or one in
  DistributedDataParallel) is measured through the eager module it wraps.

How it composes with a memory level: the measuring hooks are entered around forward + loss, but a
level's bits hooks are entered in the model's forward pre-hook, inside them, and saved-tensor hooks
do not nest (the innermost pair alone runs). So while measuring, `BitsHooks.observer` is set, and it
reports what every save inside the model became (its packed record, or the tensor itself); the
outer hooks see what is saved outside the model, and a model without a level.

`write_run_memory` measures a trained run's level against `none` and writes `memory.json` into its
run dir, which `efficient report` shows.
"""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from efficient.memory.levels import LEVELS, MemoryPlan, apply, check_level, restore
from efficient.memory.spikes import PackedSaved, RecomputedNorm, tensors_in as _tensors
from efficient.models.neurons import module_bookkeeper
from efficient.data import first_input

MEMORY_FILE = "memory.json"  # in a run dir: `write_run_memory`'s record, shown by `efficient report`
LOSS = "(loss)"  # saves outside the model's forward: what loss_fn kept
MODEL = ""  # saves in the model's own forward, outside its children (its name in named_modules)


def fmt_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass
class ActivationMemory:
    """Bytes one training step keeps for backward (conventions in the module docstring).

    total_bytes = packed_bytes + dense_bytes = sum(by_module.values()) = sum(by_block.values()).
    tensors: distinct records counted (a storage saved several times is one; each packed save is
    one), packed_tensors of them as bits. step_time_s: wall time of the measured forward + loss
    (+ backward), hooks included: one step without warm-up, indicative only."""

    total_bytes: int
    by_module: dict[str, int]
    by_block: dict[str, int]
    packed_bytes: int
    dense_bytes: int
    tensors: int
    level: str
    packed_tensors: int = 0
    step_time_s: float | None = None
    backward: bool = True
    input: str = ""
    model: str = ""
    conventions: dict[str, str] = field(default_factory=dict)

    def ratio(self, base: ActivationMemory) -> float | None:
        """total_bytes / base.total_bytes (None when base keeps nothing)."""
        return self.total_bytes / base.total_bytes if base.total_bytes else None

    def top_blocks(self, k: int = 8) -> list[tuple[str, int]]:
        return sorted(self.by_block.items(), key=lambda kv: -kv[1])[:k]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ActivationMemory:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def table(self, blocks: int | None = None) -> str:
        """Plain text: the totals, then bytes per block (largest first; `blocks` of them)."""
        rows = self.top_blocks(blocks if blocks is not None else len(self.by_block))
        head = (f"activation memory at level {self.level}: {fmt_bytes(self.total_bytes)} kept for backward "
                f"({fmt_bytes(self.packed_bytes)} as bits, {fmt_bytes(self.dense_bytes)} dense; {self.tensors} tensors)")
        if self.input:
            head += f"\ninput: {self.input}"
        width = max([len("block")] + [len(_label(b)) for b, _ in rows])
        lines = [head, f"{'block':<{width}}  {'bytes':>10}  share"]
        for b, n in rows:
            share = 100 * n / self.total_bytes if self.total_bytes else 0.0
            lines.append(f"{_label(b):<{width}}  {fmt_bytes(n):>10}  {share:5.1f}%")
        return "\n".join(lines)


def _label(name: str) -> str:
    return "(model)" if name == MODEL else name


CONVENTIONS = {
    "bytes": "storage nbytes of each tensor autograd keeps for backward; a storage counts once however many views "
             "of it are saved; spikes kept as bits count their packed record (ceil(numel / 8) bytes)",
    "excluded": "parameters and buffers (and views of them); saves inside recomputed regions",
    "attribution": "innermost module running at the first save ('' = the model's own forward, '(loss)' = loss_fn)",
}


# ---------------------------------------------------------------------------------------------
# the recorder


def _storage(t: torch.Tensor) -> tuple[tuple[Any, ...], int]:
    """(key, bytes) of the memory `t` lives in: its storage, or the tensor alone when it has none."""
    try:
        s = t.untyped_storage()
        return (str(t.device), s.data_ptr()), s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, subclasses without a storage
        return ("tensor", id(t)), t.numel() * t.element_size()


@dataclass
class _Saved:
    ref: Callable[[], Any]  # the object autograd keeps; dead once the graph dropped it
    key: tuple[Any, ...]
    nbytes: int
    module: str
    packed: bool


class _Recorder:
    """Module stack (forward pre/post hooks on every named module) and the saves seen while recording."""

    def __init__(self, model: nn.Module) -> None:
        self.skip = {_storage(t)[0] for t in [*model.parameters(), *model.buffers()]}
        self.stack: list[str] = []
        self.saved: list[_Saved] = []
        self.recording = True
        self.handles: list[Any] = []
        for name, m in model.named_modules():
            # bookkeepers: a unit still runs as its fused op, as in a training step (what it saves counts to it)
            self.handles.append(m.register_forward_pre_hook(module_bookkeeper(functools.partial(self._enter, name))))
            self.handles.append(m.register_forward_hook(self._exit, always_call=True))

    def _enter(self, name: str, module: nn.Module, args: Any) -> None:
        self.stack.append(name)

    @module_bookkeeper
    def _exit(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.stack:
            self.stack.pop()

    def observe(self, t: torch.Tensor, kept: Any) -> None:
        """`kept` is what autograd keeps for the saved tensor `t`."""
        if not self.recording:
            return
        packed = isinstance(kept, PackedSaved)
        # a recomputed BatchNorm output holds only its input, which that BatchNorm keeps anyway
        data = kept.data if packed or isinstance(kept, RecomputedNorm) else kept if isinstance(kept, torch.Tensor) else t
        key, nbytes = _storage(data)
        if not packed and key in self.skip:
            return
        try:
            ref: Callable[[], Any] = weakref.ref(kept)
        except TypeError:  # not weak-referenceable: count it as kept
            ref = functools.partial(lambda x: x, kept)
        self.saved.append(_Saved(ref, key, nbytes, self.stack[-1] if self.stack else LOSS, packed))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.observe(t, t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def kept(self) -> list[_Saved]:
        """The saves still held, one per storage (the first save of it)."""
        seen: dict[tuple[Any, ...], _Saved] = {}
        for s in self.saved:
            if s.key not in seen and s.ref() is not None:
                seen[s.key] = s
        return list(seen.values())

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.saved.clear()


# ---------------------------------------------------------------------------------------------
# measuring


def applied_level(model: nn.Module) -> str:
    """The memory level `optimize` left on `model` ("none" when none is)."""
    return _applied_plan(model).level


def _applied_plan(model: nn.Module) -> MemoryPlan:
    state = getattr(eager_module(model), "_efficient_memory", None)
    return MemoryPlan("none") if state is None else state.plan


def eager_module(model: nn.Module) -> nn.Module:
    """The eager module behind a `torch.compile`d model or a DistributedDataParallel wrapper."""
    for _ in range(4):
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        if inner is None:
            return model
        model = inner
    return model


def default_loss(out: Any) -> torch.Tensor:
    """Sum of every floating-point output that requires grad. Its backward keeps no tensor, so
    what the step keeps is the model's alone."""
    ts = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
    if not ts:
        return torch.zeros(())
    return functools.reduce(torch.add, (t.sum() for t in ts))


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _describe(args: tuple, kwargs: dict) -> str:
    parts = [str(list(a.shape)) for a in args if isinstance(a, torch.Tensor)]
    parts += [f"{k}={list(v.shape)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return ", ".join(parts)


def _sync(model: nn.Module) -> None:
    for p in model.parameters():
        if p.device.type == "cuda":
            torch.cuda.synchronize(p.device)
        return


def _reset_peer_state(model: nn.Module) -> None:
    """spikingjelly neurons keep their membrane between calls; start (and leave them) at rest."""
    for m in model.modules():
        if type(m).__module__.startswith("spikingjelly") and callable(getattr(m, "reset", None)):
            m.reset()


def _block_of(name: str, containers: set[str]) -> str:
    if name in (MODEL, LOSS):
        return name
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in containers and len(parts) > 1 else parts[0]


def activation_memory(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                      level: str | None = None, *, backward: bool = True) -> ActivationMemory:
    """Run one training step of `model` on `inputs` and count what autograd keeps for backward.

    inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs (on the model's device).
    loss_fn: output -> scalar (default `default_loss`, which keeps nothing itself; a loss such as
      cross-entropy adds what it keeps under `LOSS`).
    level: measure at this memory level ("none", "bits", "recompute"). When it differs from the level
      the model has, `optimize(model, level)` is applied for the step and the previous plan is
      applied again afterwards (`restore`: the same units rerun whole; a `MemoryPlan` held from
      before no longer
      counts packs; apply levels before compiling). None measures the model as it is.
    backward: also run the backward (recomputed regions rerun there), with `torch.autograd.grad`:
      no `.grad` is written and no gradient hook of a DDP wrapper fires.

    The model is left as it was: its training mode, buffers (BatchNorm statistics), gradients,
    memory level, and the RNG state (forked for the step).
    """
    module = eager_module(model)
    plan = _applied_plan(module)
    previous = plan.level
    switch = level is not None and check_level(level) != previous
    if switch:
        apply(module, level)
    try:
        return _measure(module, inputs, loss_fn, level or previous, backward)
    finally:
        if switch:
            restore(module, plan)


def _measure(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None, level: str,
             backward: bool) -> ActivationMemory:
    args, kwargs = _split_inputs(inputs)
    state = getattr(model, "_efficient_memory", None)
    hooks = getattr(state, "hooks", None)
    rec = _Recorder(model)
    was_training = model.training
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            model.train()
            _reset_peer_state(model)
            if hooks is not None:
                hooks.observer = rec.observe
            _sync(model)
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
                out = model(*args, **kwargs)
                loss = (loss_fn or default_loss)(out)
            rec.recording = False
            _sync(model)
            elapsed = time.perf_counter() - start
            kept = rec.kept()  # before backward frees the graph
            wrt = [p for p in model.parameters() if p.requires_grad]
            wrt += [t for t in _tensors((args, kwargs)) if t.requires_grad and not any(t is p for p in wrt)]
            ran_backward = backward and isinstance(loss, torch.Tensor) and loss.requires_grad and bool(wrt)
            if ran_backward:
                start = time.perf_counter()
                torch.autograd.grad(loss, wrt, allow_unused=True)
                _sync(model)
                elapsed += time.perf_counter() - start
            del out, loss
    finally:
        if hooks is not None:
            hooks.observer = None
        rec.close()
        model.train(was_training)
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        _reset_peer_state(model)

    containers = {n for n, c in model.named_children() if isinstance(c, (nn.ModuleList, nn.ModuleDict))}
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    order[LOSS] = len(order)
    by_module: dict[str, int] = {}
    for s in sorted(kept, key=lambda s: order.get(s.module, len(order))):
        by_module[s.module] = by_module.get(s.module, 0) + s.nbytes
    by_block: dict[str, int] = {}
    for name, n in by_module.items():
        b = _block_of(name, containers)
        by_block[b] = by_block.get(b, 0) + n
    packed = [s for s in kept if s.packed]
    return ActivationMemory(
        total_bytes=sum(s.nbytes for s in kept), by_module=by_module, by_block=by_block,
        packed_bytes=sum(s.nbytes for s in packed), dense_bytes=sum(s.nbytes for s in kept if not s.packed),
        tensors=len(kept), level=level, packed_tensors=len(packed), step_time_s=elapsed, backward=ran_backward,
        input=_describe(args, kwargs), model=str(getattr(model, "zoo_name", None) or type(model).__name__),
        conventions=dict(CONVENTIONS),
    )


def measure_levels(model: nn.Module, inputs: Any, levels: Any = LEVELS, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                   backward: bool = True, warmup: bool = True) -> dict[str, ActivationMemory]:
    """`activation_memory` at each of `levels`, in that order; the model keeps the level it had.
    `warmup` runs one unmeasured step at each level before its measured one, so that one-time costs
    (a kernel's compile, lazy initialisation: a level's own paths pay theirs on their first step)
    do not land in its `step_time_s`."""
    levels = [check_level(lv) for lv in levels]
    out = {}
    for lv in levels:
        if warmup:
            activation_memory(model, inputs, loss_fn, lv, backward=backward)
        out[lv] = activation_memory(model, inputs, loss_fn, lv, backward=backward)
    return out


# ---------------------------------------------------------------------------------------------
# a run's record


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def run_memory(model: nn.Module, batch: Any, level: str, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> dict[str, Any]:
    """The record `write_run_memory` writes: `level` and `none` measured on the input of `batch`."""
    check_level(level)
    module = eager_module(model)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    x = _to(first_input(batch), device)
    levels = measure_levels(module, x, dict.fromkeys((level, "none")), loss_fn)
    lead = next(iter(_tensors(x)), None)
    return {
        "level": level,
        "batch_size": int(lead.shape[0]) if isinstance(lead, torch.Tensor) and lead.dim() else None,
        "input": levels[level].input,
        "total_bytes": levels[level].total_bytes,
        "none_bytes": levels["none"].total_bytes,
        "ratio_to_none": levels[level].ratio(levels["none"]),
        "levels": {k: v.to_dict() for k, v in levels.items()},
    }


def write_run_memory(run_dir: str | Path, model: nn.Module, batch: Any, level: str,
                     loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Path:
    """Measure `level` and `none` for one training step on `batch` (a data batch: its inputs are
    used) and write them to RUN_DIR/memory.json in one rename; return its path. The model keeps its
    level, buffers, gradients and mode (see `activation_memory`); call it on the eager model or its
    compiled / DDP wrapper, on one rank."""
    from efficient.io import write_json

    path = Path(run_dir) / MEMORY_FILE
    write_json(path, run_memory(model, batch, level, loss_fn))
    return path


def from_run_record(d: dict[str, Any]) -> dict[str, ActivationMemory]:
    """The measurements of a memory.json, by level."""
    return {k: ActivationMemory.from_dict(v) for k, v in d.get("levels", {}).items()}


MARK = "efficient.mark:"  # `mark(name)`: a point in a step that `step_timeline` places among its allocations


def mark(name: str) -> None:
    """Note this point of the step under `step_timeline` (a zero-length `record_function` range)."""
    with torch.profiler.record_function(MARK + name):
        pass


@dataclass
class StepTimeline:
    """Live tensor bytes over one step: `live[k]` after its k-th allocation record (a free is one
    too), above what was alive before it; `marks[name]`: for each time `mark(name)` ran inside the
    step, the index of the first record after it (so the records from there on happened later)."""

    live: list[int]
    marks: dict[str, list[int]]

    @property
    def peak(self) -> int:
        return max(0, max(self.live, default=0))


def step_timeline(step: Callable[[], Any], without: Callable[[], Iterable[Any]] | None = None) -> StepTimeline:
    """The live tensor bytes while `step()` runs, record by record, read from the allocator's records
    in `torch.profiler` (see `step_peak_bytes`), and where the step's `mark` calls fell among them."""
    import bisect
    import gc

    from torch.profiler import ProfilerActivity, profile

    # earlier work's garbage, collected while the step runs, would count as the step freeing bytes: collect
    # it first, and let no collection run inside the step
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        if enabled:
            gc.enable()
    events = list(_tree_events(prof.profiler.kineto_results.experimental_event_tree()))
    # the allocation records (sizes signed: a free is negative) with their addresses, in time order; a
    # left-out storage is the last allocation at its address
    records = sorted(((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size) for e in events
                      if type(e.extra_fields).__name__ == "_ExtraFields_Allocation"), key=lambda r: r[0])
    left_out = {t.untyped_storage().data_ptr() for t in (without() if without else ()) if t is not None}
    drop = set({ptr: i for i, (_, ptr, size) in enumerate(records) if size > 0 and ptr in left_out}.values())
    kept = [(t, size) for i, (t, _, size) in enumerate(records) if i not in drop]
    live, total = [], 0
    for _, size in kept:
        total += size
        live.append(total)
    times = [t for t, _ in kept]
    marks: dict[str, list[int]] = {}
    for e in sorted((e for e in events if e.name.startswith(MARK)), key=lambda e: e.start_time_ns):
        marks.setdefault(e.name[len(MARK):], []).append(bisect.bisect_left(times, e.start_time_ns))
    return StepTimeline(live, marks)


def step_peak_bytes(step: Callable[[], Any], without: Callable[[], Iterable[Any]] | None = None) -> int:
    """Peak of live CPU tensor bytes while `step()` runs, above those alive before it: what a GPU's
    `torch.cuda.max_memory_allocated` counts for the same step, read on a CPU from the allocator's
    records in `torch.profiler` (a resident-set peak would add the host allocator's retention).

    `without`: called after the step, the tensors (None entries skipped) whose storages, made during
    the step and alive at its end, are left out of the count from the moment they were allocated. With
    the parameters' gradients, the peak is that of what the step holds besides them (activations,
    their gradients and the ops' temporaries), a quantity no placement of the update changes."""
    return step_timeline(step, without).peak


def _tree_events(events: Iterable[Any]) -> Iterator[Any]:
    """Every event of a profiler's event tree, children after their parent."""
    for e in events:
        yield e
        yield from _tree_events(e.children)


__all__ = ["ActivationMemory", "LOSS", "MEMORY_FILE", "MODEL", "activation_memory", "applied_level", "default_loss", "eager_module",
           "first_input", "fmt_bytes", "mark", "measure_levels", "run_memory", "step_peak_bytes", "step_timeline", "StepTimeline",
           "write_run_memory"]
