"""Which matmul and convolution outputs a `recompute` step keeps, under a byte budget.

A unit rerun whole keeps only its input, at the price of its forward again, and its matmuls and
convolutions are most of that price. Keeping the output of one of them saves rerunning it, for its
output's bytes. Starting from every unit rerun whole (the least memory), outputs are kept in the
order of FLOPs saved per byte (a 512-channel convolution of a 4x4 map before a 3-channel one of a
32x32 image), while the step stays within the budget: a fraction of what level `none` keeps. What
reruns is then the cheap elementwise work (BatchNorm, neurons, pools) and the costly ops whose
outputs are large for their cost.

Bytes are counted by `efficient.memory.measure` on example inputs and FLOPs by torch's formulas:
both depend on shapes, not values, so every process and a resumed run choose the same ops. Planning
takes three forwards of the example (none, every unit whole while listing its costly ops, the
chosen plan) and one more per correction, once, before training.

A budget of the step's peak (`choose_plain_for_peak`) counts what a GPU's `max_memory_allocated` does
instead: the live tensors at the step's busiest moment, which with every unit rerun whole comes late in
backward (the first units' reruns, with most parameter gradients already made). A unit that is not
rerun (run plainly, as at level `bits`: its BatchNorm inputs kept, its spikes as bits) adds what it
keeps over its span only, from its forward to its backward, so units that run late in forward and
reach backward early often cost the peak nothing, and skip their rerun. The planner reads the step's
live bytes over time once (every unit whole, each unit's forward and backward marked), runs units
plainly in the order of FLOPs saved per byte while the predicted peak stays within the target, and
measures the result (where a unit's own backward held more than predicted, the units are measured one
at a time, and those its predicted bytes had turned away are tried again).

A rerun that does not hold the step's peak need not be lean either: the units that keep least rebuild
their membrane traces in backward a chunk of channels at a time (on a CPU 1.7x the BatchNorm + LIF
backward of a unit that kept its trace, at a spiking transformer's MLP width), which is what lets the
largest rerun fit. The planner then lets every rerun keep what a plain call keeps during its own rerun
and backward (`keeping`), measures the step, and while its peak is over the target makes lean again
the unit whose rerun holds that peak, one at a time. Last, a unit run plainly may keep its membrane traces
from forward to backward, as at level `none`, instead of rebuilding them in backward as level `bits` does:
each one, the last in forward first, keeps them if the measured peak stays within the target.

A rerun unit may also keep single outputs from forward for its rerun, which then skips those matmuls and
convolutions: a fused Linear -> BatchNorm -> LIF unit's Linear output, a Linear's, a convolution's (a
spiking transformer's second MLP Linear: a quarter of the first's output bytes for the same FLOPs; SDT's
position-embedding convolution: 77 GFLOP for 32 MiB at b64). An output lives from its unit's forward to
its rerun, and is admitted as a plain unit is: the most FLOPs per byte first, predicted over that span,
then measured. Plain units and kept outputs compete for the same room, so the planner makes two plans,
one admitting plain units first and one admitting outputs first, and keeps the one that saves more rerun
work: the FLOPs of its kept outputs, and those of its plain units twice (`PLAIN_WORTH`: a plain unit also
skips its rerun's elementwise work); ties go to the lower peak.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from efficient.errors import ConfigError
from efficient.memory.levels import apply
from efficient.memory.measure import activation_memory, mark, step_timeline
from efficient.memory.recompute import KeptOps, require_budget_support, units

BUDGETS_OF = ("saved", "peak")  # what a budget is a fraction of: none's saved bytes, or none's step peak


@dataclass
class BudgetChoice:
    """What the planner measured and chose: per unit, the positions of the costly ops whose outputs
    are kept; the bytes of `none` and of the chosen plan on the example; the FLOPs of the units'
    costly ops in all and of those still rerun."""

    budget: float
    keep: dict[str, list[int]]
    none_bytes: int
    kept_bytes: int
    flops: int = 0
    rerun_flops: int = 0
    ops: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    of: str = "saved"  # "peak": none_bytes and kept_bytes are the step's peaks of live tensors
    floor_bytes: int = 0  # with every unit rerun whole (saved bytes, or the peak)
    plain: list[str] = field(default_factory=list)  # units run plainly (a peak budget's choice)
    keeping: list[str] = field(default_factory=list)  # units whose reruns or plain calls keep their traces (the same)
    outputs: list[str] = field(default_factory=list)  # modules whose outputs reruns take from forward (the same)

    @property
    def fraction(self) -> float:
        return self.kept_bytes / self.none_bytes if self.none_bytes else 0.0


def check_budget(budget: Any) -> float:
    """The budget as a float, or a ConfigError saying what a budget is."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ConfigError(f"memory budget: {budget!r} is not a fraction in [0, 1] of level none's activation bytes "
                          "(0: every unit reruns whole; 1: every matmul and convolution output is kept)")
    return float(budget)


def choose_kept(model: nn.Module, example: Any, budget: float,
                loss_fn: Callable[[Any], torch.Tensor] | None = None) -> BudgetChoice:
    """The costly-op outputs to keep so that a step keeps at most `budget` x level none's bytes on
    `example` (none when even every unit rerun whole does not fit). Leaves `model` at level none."""
    budget = check_budget(budget)
    require_budget_support()

    def measure(level: str = "recompute", keep: dict[str, list[int]] | None = None) -> int:
        apply(model, level, keep=keep)
        return activation_memory(model, example, loss_fn, backward=False).total_bytes

    try:
        none = measure("none")
        ops, floor = _costly_ops(model, example, loss_fn)
    finally:
        apply(model, "none")
    target = budget * none
    chosen: list[tuple[str, int, int, int]] = []
    estimate = floor
    for op in _ranked(ops):
        if estimate + op[2] > target:
            continue  # a smaller one further down may still fit
        chosen.append(op)
        estimate += op[2]

    try:
        # outputs that share storage with something already kept count once, or more than once
        # when a view keeps its base: check, and drop the last kept outputs while over the budget
        total = measure(keep=_keep_of(chosen)) if chosen else floor
        while total > target and chosen:
            chosen.pop()
            total = measure(keep=_keep_of(chosen)) if chosen else floor
    finally:
        apply(model, "none")
    flops = sum(fl for found in ops.values() for _, _, fl in found)
    return BudgetChoice(budget, _keep_of(chosen), none, total, flops, flops - sum(o[3] for o in chosen), ops,
                        floor_bytes=floor)


def _costly_ops(model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor] | None
                ) -> tuple[dict[str, list[tuple[int, int, int]]], int]:
    """Per unit, its costly ops as (position, output bytes, FLOPs), listed by one forward at level
    recompute with every unit whole (which keeps nothing more while it lists them), and the bytes
    that forward keeps: the floor of every plan. Leaves `model` at level recompute."""
    apply(model, "recompute")
    ops: dict[str, list[tuple[int, int, int]]] = {}
    for name, m in units(model):
        ops[name] = []
        m.__dict__["_efficient_kept"] = KeptOps(record=ops[name])
    return ops, activation_memory(model, example, loss_fn, backward=False).total_bytes


def _ranked(ops: dict[str, list[tuple[int, int, int]]]) -> list[tuple[str, int, int, int]]:
    """Every costly op with an output as (unit, position, bytes, FLOPs): most FLOPs saved per byte kept
    first, ties in model order."""
    return sorted(((name, i, size, fl) for name, found in ops.items() for i, size, fl in found if size),
                  key=lambda o: -o[3] / o[2])


def _keep_of(chosen: list[tuple[str, int, int, int]]) -> dict[str, list[int]]:
    keep: dict[str, list[int]] = {}
    for name, i, _, _ in chosen:
        keep.setdefault(name, []).append(i)
    return {name: sorted(set(v)) for name, v in keep.items()}


def _step(model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> Callable[[], Any]:
    """One training step (forward, loss, backward) on `example`, leaving the model as it was."""
    return lambda: activation_memory(model, example, loss_fn, backward=True)


def choose_plain_for_peak(model: nn.Module, example: Any, budget: float,
                          loss_fn: Callable[[Any], torch.Tensor] | None = None) -> BudgetChoice:
    """The units to run plainly (as at level bits: no rerun, their activations kept) so that a training
    step's peak of live tensors on `example` stays within the larger of `budget` x level none's peak
    and the peak with every unit rerun whole (budget 0: what costs that peak nothing). Leaves `model`
    at level none.

    A plain unit keeps, from its forward to its backward, what it keeps at level bits less the input
    its rerun would keep (measured: one forward per unit). The planner adds that over the unit's span
    to the live bytes of the every-unit-whole step, in the order of matmul/convolution FLOPs saved per
    byte, keeps a unit plain when the sum stays within the target, then measures the plan; when it is
    over (a plain unit's own backward may hold more than its rerun by chunks did), it adds the chosen
    units one at a time, each kept plain only if the measured peak stays within the target, and then
    the units the prediction turned away while a unit that did not fit held their room: each predicted
    again beside those kept and, where it fits, measured. Outputs kept for reruns compete for the same room:
    a second plan admits them first (see the module's docstring), and the one worth more is returned."""
    import numpy as np

    from efficient.memory.measure import step_peak_bytes

    budget = check_budget(budget)
    try:
        apply(model, "none")
        none = step_peak_bytes(_step(model, example, loss_fn))
        ops, floor_kept = _costly_ops(model, example, loss_fn)
        apply(model, "recompute")
        with _marking(model):
            timeline = step_timeline(_step(model, example, loss_fn))
        # what each unit keeps more when it runs plainly: one forward each (a stem's stages save inside
        # the stem's own call, so a unit's share cannot be read from one forward's modules)
        extra: dict[str, int] = {}
        for name, found in ops.items():
            if sum(fl for _, _, fl in found):
                apply(model, "recompute", plain=[name])
                kept = activation_memory(model, example, loss_fn, backward=False).total_bytes
                extra[name] = max(0, kept - floor_kept)
    finally:
        apply(model, "none")
    floor = timeline.peak
    if not timeline.live or not none:
        raise RuntimeError("memory peak budget: the profiler recorded no allocation of the step on "
                           f"{_device_of(model)}, so its peak cannot be planned there; use a budget of saved "
                           "bytes (budget_of='saved') or no budget")
    target = max(budget * none, floor)
    live = np.asarray(timeline.live, dtype=np.int64)
    candidates = []
    for name, more in extra.items():
        span = _span(timeline.marks, name, len(live))
        if span is not None:
            candidates.append((name, more, sum(fl for _, _, fl in ops[name]), span))
    # FLOPs saved per byte first; among equals (a transformer's blocks), the shortest span holds its bytes least
    candidates.sort(key=lambda c: (-c[2] / max(c[1], 1), c[3][1] - c[3][0]))

    try:
        # two orders: units run plainly first, then outputs in what room is left; or outputs first (one output
        # often saves as many FLOPs as a plain unit for a fraction of its bytes), then plain units
        plans = [_plan_in_order(model, example, loss_fn, candidates, timeline, target, floor, first)
                 for first in ("plain", "outputs")]
    finally:
        apply(model, "none")
    best = max(plans, key=lambda q: (q.worth, -q.total))
    flops = sum(fl for found in ops.values() for _, _, fl in found)
    return BudgetChoice(budget, {}, none, best.total, flops, flops - best.saved, ops, of="peak", floor_bytes=floor,
                        plain=best.plain, keeping=best.keeping, outputs=best.outputs)


# A unit run plainly skips its whole rerun: its matmuls and convolutions, and about as much again in elementwise
# work (BatchNorm, neurons, pools, the membrane trace rebuilt in backward), where a kept output skips one op. So
# when two plans are compared, a plain unit's FLOPs count this many times. (On a CPU, SDT-2-512's rerun spent
# 1.3 s in matmuls and convolutions and 0.7 s in the rest; Spikformer-4-384's plan with plain units first saved
# 53 % of the FLOPs against 64 % for outputs first and was the faster, SDT's 5 % against 24 % the slower:
# BENCHMARKS.md `## memory`. Any weight from 1.3 to 4.4 orders those two pairs as their times did.)
PLAIN_WORTH = 2


@dataclass
class _PeakPlan:
    plain: list[str]
    keeping: list[str]
    outputs: list[str]
    plain_flops: int  # matmul/convolution FLOPs of the units run plainly
    output_flops: int  # those of the outputs kept
    total: int  # the step's measured peak

    @property
    def saved(self) -> int:  # matmul/convolution FLOPs not rerun
        return self.plain_flops + self.output_flops

    @property
    def worth(self) -> int:
        return PLAIN_WORTH * self.plain_flops + self.output_flops


def _plan_in_order(model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                   candidates: list[Candidate], timeline: Any, target: float, floor: int, first: str) -> _PeakPlan:
    """A peak plan from every unit rerun whole (its marked `timeline`, its peak `floor`): the units run plainly
    and the outputs kept for reruns, `first` ("plain" or "outputs") admitted first into the room under
    `target`, then the reruns and plain units that may keep their membrane traces."""
    import numpy as np

    from efficient.memory.measure import step_peak_bytes

    def admit_plain(outputs: list[str], owners: set[str], live: Any, peak: int) -> tuple[list[tuple[str, int, int]], int]:
        def measure(names: list[str]) -> int:
            apply(model, "recompute", plain=names, outputs=outputs)
            return step_peak_bytes(_step(model, example, loss_fn))
        # a unit whose outputs are kept for its rerun stays a rerun
        return _admit_by_span([c for c in candidates if c[0] not in owners], live, target, peak, measure)

    live = np.asarray(timeline.live, dtype=np.int64)
    if first == "plain":
        chosen, total = admit_plain([], set(), live, floor)
        plain = sorted(c[0] for c in chosen)
        outputs, out_saved = [], 0
    else:
        outputs, out_saved, peak, owners = _reruns_keeping_outputs(model, example, loss_fn, [], [], target, floor,
                                                                   timeline)
        total = floor if peak is None else peak
        if outputs:  # the step's live bytes over time with them kept, for the plain units' spans
            apply(model, "recompute", outputs=outputs)
            with _marking(model):
                timeline = step_timeline(_step(model, example, loss_fn))
            live = np.asarray(timeline.live, dtype=np.int64)
        chosen, total = admit_plain(outputs, owners, live, total)
        plain = sorted(c[0] for c in chosen)
    keeping, peak = _reruns_keeping(model, example, loss_fn, plain, target, outputs)
    total = total if peak is None else peak
    keeping, peak = _plains_keeping(model, example, loss_fn, plain, keeping, target, outputs)
    total = total if peak is None else peak
    if first == "plain":
        outputs, out_saved, peak, _ = _reruns_keeping_outputs(model, example, loss_fn, plain, keeping, target, total)
        total = total if peak is None else peak
    return _PeakPlan(plain, keeping, outputs, sum(c[2] for c in chosen), out_saved, total)


# a unit run plainly or an output kept: its name, the bytes it keeps more, the FLOPs it saves, its span
Candidate = tuple[str, int, int, tuple[int, int]]


def _admit_by_span(candidates: list[Candidate], live: Any, target: float, floor: int,
                   measure: Callable[[list[str]], int]) -> tuple[list[tuple[str, int, int]], int]:
    """The candidates admitted (units to run plainly, or outputs to keep), (name, bytes, FLOPs) in the order of
    `candidates`, and the step peak that `measure(names)` gave them (`floor` for none). A candidate is
    predicted to fit when the live bytes over its span (`live`: the step without any), with those of the
    candidates already admitted that overlap it and its own, stay within `target`. The predicted set is
    measured; when it is over, its candidates are measured one at a time, and then those it turned away are
    predicted again beside those kept and measured where they fit (one that did not fit had held their room)."""
    import numpy as np

    def predicted_fit(c: Candidate, admitted: list[Candidate]) -> bool:
        _, more, _, (a, b) = c
        if b <= a:
            return False
        added = np.zeros(b - a, dtype=np.int64)
        for _, bytes_, _, (lo, hi) in admitted:
            lo, hi = max(lo, a), min(hi, b)
            if hi > lo:
                added[lo - a:hi - a] += bytes_
        return int((live[a:b] + added).max()) + more <= target

    chosen: list[Candidate] = []
    for c in candidates:
        if predicted_fit(c, chosen):
            chosen.append(c)
    total = measure([c[0] for c in chosen]) if chosen else floor
    if total > target:  # one unit's own backward held more than predicted
        fits: list[Candidate] = []
        total = floor
        for c in chosen + [c for c in candidates if c not in chosen]:
            if c in chosen or predicted_fit(c, fits):
                peak = measure([f[0] for f in fits] + [c[0]])
                if peak <= target:
                    fits.append(c)
                    total = peak
        chosen = fits
    return [c[:3] for c in chosen], total


def _reruns_keeping(model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                    plain: list[str], target: float, outputs: list[str] | None = None) -> tuple[list[str], int | None]:
    """The rerun units (all but `plain`) whose reruns may keep their membrane traces with the step's peak of
    live tensors within `target`, and that peak: all of them, less the unit whose rerun holds the measured
    peak, one at a time, while the peak is over. ([], None) when the peak lies elsewhere (in forward, or in a
    unit already lean): then every rerun stays lean."""
    import numpy as np

    names = [name for name, _ in units(model) if name not in plain]
    while names:
        apply(model, "recompute", plain=plain, keeping=names, outputs=outputs)
        with _marking(model):
            timeline = step_timeline(_step(model, example, loss_fn))
        if timeline.peak <= target:
            return names, timeline.peak
        at = _rerun_at(timeline.marks, int(np.argmax(timeline.live)))
        if at not in names:
            break
        names.remove(at)
    return [], None


def _plains_keeping(model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                    plain: list[str], keeping: list[str], target: float,
                    outputs: list[str] | None = None) -> tuple[list[str], int | None]:
    """`keeping` and the plain units that may keep their membrane traces from forward to backward with the
    step's peak of live tensors within `target` (tried one at a time, the last in forward first: its traces
    live the shortest), and the last peak measured of the plan returned (None when none is added)."""
    from efficient.memory.measure import step_peak_bytes
    from efficient.memory.recompute import region_modules
    from efficient.models.replay import recording_rebuilds

    # only a unit whose fused BatchNorm + LIF leaves its trace to its backward has a trace to keep: one forward
    apply(model, "recompute", plain=plain, keeping=keeping, outputs=outputs)
    with recording_rebuilds() as rebuilt:
        activation_memory(model, example, loss_fn, backward=False)
    fused = [n for n, m in units(model) if n in plain and any(id(x) in rebuilt for x in region_modules(m))]
    chosen, peak = list(keeping), None
    for name in reversed(fused):
        apply(model, "recompute", plain=plain, keeping=chosen + [name], outputs=outputs)
        measured = step_peak_bytes(_step(model, example, loss_fn))
        if measured <= target:
            chosen.append(name)
            peak = measured
    return sorted(chosen), peak


def _reruns_keeping_outputs(model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                            plain: list[str], keeping: list[str], target: float, peak: int,
                            timeline: Any = None) -> tuple[list[str], int, int | None, set[str]]:
    """The modules of rerun units whose outputs their regions may keep for the rerun (which then skips those
    matmuls and convolutions) with the step's peak of live tensors within `target`, the FLOPs that saves, and
    the last peak measured of the plan returned (None when none is kept). The owners are the neurons of fused
    Linear -> BatchNorm -> LIF units (for their Linear's output), Linears and convolutions. One forward lists
    them with their bytes and FLOPs, one step marks each unit's span on the step's live bytes; an output lives
    from its unit's forward to its rerun, so, the most FLOPs per byte first, each is admitted as plain units are
    (`_admit_by_span`: predicted over its unit's span beside those admitted, then measured, one at a time where
    the prediction missed). `peak`: the plan's measured peak without any, `timeline` its marked step where
    already measured. Last, the units whose outputs are kept."""
    import numpy as np

    from efficient.memory.measure import step_peak_bytes
    from efficient.memory.recompute import region_modules
    from efficient.memory.spikes import is_neuron
    from efficient.models.replay import recording_outputs

    named = {id(m): n for n, m in model.named_modules()}
    unit_of = {id(x): name for name, m in units(model) if name not in plain for x in region_modules(m)
               if id(x) in named and (is_neuron(x) or type(x) in (nn.Linear, nn.Conv2d))}
    every = sorted({named[i] for i in unit_of})
    if not every:
        return [], 0, None, set()
    apply(model, "recompute", plain=plain, keeping=keeping, outputs=every)
    with recording_outputs(keep=False) as seen:
        activation_memory(model, example, loss_fn, backward=False)
    found: dict[str, list[int]] = {}
    owners: dict[str, str] = {}
    for owner, size, fl in seen:  # a module called more than once keeps an output per call
        name = named[id(owner)]
        acc = found.setdefault(name, [0, 0])
        acc[0], acc[1] = acc[0] + size, acc[1] + fl
        owners[name] = unit_of[id(owner)]
    if not found:
        return [], 0, None, set()
    if timeline is None:
        apply(model, "recompute", plain=plain, keeping=keeping)
        with _marking(model):
            timeline = step_timeline(_step(model, example, loss_fn))
    live = np.asarray(timeline.live, dtype=np.int64)
    candidates = []
    for name, (size, fl) in found.items():
        span = _span(timeline.marks, owners[name], len(live))
        if span is not None and size:
            candidates.append((name, size, fl, span))
    candidates.sort(key=lambda c: (-c[2] / c[1], c[3][1] - c[3][0], c[0]))

    def measure(names: list[str]) -> int:
        apply(model, "recompute", plain=plain, keeping=keeping, outputs=names)
        return step_peak_bytes(_step(model, example, loss_fn))

    chosen, total = _admit_by_span(candidates, live, target, peak, measure)
    if not chosen:
        return [], 0, None, set()
    return sorted(c[0] for c in chosen), sum(c[2] for c in chosen), total, {owners[c[0]] for c in chosen}


def _rerun_at(marks: dict[str, list[int]], k: int) -> str | None:
    """The unit whose rerun and backward were under way at record `k`: the one whose outputs' last gradient
    arrived last before it (None in forward)."""
    started = [(max(i for i in at if i <= k), name[4:]) for name, at in marks.items()
               if name.startswith("bwd:") and any(i <= k for i in at)]
    return max(started)[1] if started else None


@contextlib.contextmanager
def _marking(model: nn.Module) -> Iterator[None]:
    """Each unit's forward marks `fwd:<unit>` as it starts, and the gradient reaching each of its outputs
    marks `bwd:<unit>` (its rerun follows the last of them), for `step_timeline`."""
    handles = []

    def starts(name: str) -> Callable[..., None]:
        return lambda module, args: mark("fwd:" + name)

    def ends(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad: mark("bwd:" + name))
        return hook

    try:
        for name, m in units(model):
            handles.append(m.register_forward_pre_hook(starts(name)))
            handles.append(m.register_forward_hook(ends(name)))
        yield
    finally:
        for h in handles:
            h.remove()


def peak_phases(model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> dict[str, int]:
    """Where one training step's peak of live tensors sits, at the level `model` is at: the most live bytes
    (above those alive before the step) in its forward (`"forward"`) and in backward from the moment the
    gradient reaches each recompute unit's outputs (at level recompute: its rerun and backward) until it
    reaches the next unit's, by unit name (before the first: `"backward"`), largest first. Read from the
    allocator's records with each unit's forward and backward marked, as the peak planner reads them
    (`step_timeline`), on the second of two steps (a unit's first call sizes its region:
    `recompute._OUT_NUMEL`); CPU tensors."""
    import numpy as np

    _step(model, example, loss_fn)()
    with _marking(model):
        line = step_timeline(_step(model, example, loss_fn))
    live = np.asarray(line.live, dtype=np.int64)
    if not len(live):
        raise RuntimeError(f"peak phases: the profiler recorded no allocation of the step on {_device_of(model)}")
    first = min((i for name, at in line.marks.items() if name.startswith("bwd:") for i in at), default=len(live))
    found = {"forward": int(live[:first].max())} if first else {}
    for k in range(first, len(live)):
        phase = _rerun_at(line.marks, k) or "backward"
        found[phase] = max(found.get(phase, 0), int(live[k]))
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def _device_of(model: nn.Module) -> str:
    return str(next((p.device for p in model.parameters()), torch.device("cpu")))


def _span(marks: dict[str, list[int]], unit: str, n: int) -> tuple[int, int] | None:
    """The records over which an output of `unit` kept from its forward lives until its rerun: from the
    unit's first forward to the last gradient reaching its outputs (a unit called more than once spans
    all its calls)."""
    fwd, bwd = marks.get("fwd:" + unit), marks.get("bwd:" + unit)
    if not fwd or not bwd:
        return None
    return min(fwd), min(max(bwd), n)


__all__ = ["BUDGETS_OF", "BudgetChoice", "check_budget", "choose_kept", "choose_plain_for_peak", "peak_phases"]
