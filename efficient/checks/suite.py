"""The six checks, each a function of the shared setup and the passes it runs (see the package
docstring for what each computes and when it fails)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from efficient.checks.passes import (Part, _Diff, _Pass, _Setup, _Tap, _batch_dim, _batch_part, _culprit, _current_like,
                                     _generator, _out_batch_dim, _random_like, _rel, _rest, _run, _scale, _seeded,
                                     _spikes_of, _tensors, _worst)
from efficient.checks.report import CHECKS, LAYERS_NAMED, CheckResult, LayerFinding, Status, _fmt, _name_some


def _check_batch(s: _Setup, base_eval: _Pass) -> CheckResult:
    """Kept samples against a pass in which the others were replaced (input and spiking layers), eval and train."""
    n = s.n
    keep = torch.tensor([0, n - 1], device=s.x.device)
    others = torch.arange(1, n - 1, device=s.x.device)
    g = _generator(s.seed + 1)
    x = s.x.clone()
    x.index_copy_(s.batch_dim, others, _random_like(s.x.index_select(s.batch_dim, others), g))

    def inject(name: str, k: int, t: Tensor) -> Tensor:
        d, view = _batch_dim(t, s, s.multi[name]), t
        if d is None and s.multi[name] and s.T and t.dim() >= 1 and t.shape[0] == s.T * n:
            d, view = 1, t.reshape(s.T, n, *t.shape[1:])  # [T*B, ...]: taken as time-major flattened
        if d is None:
            return t
        view = view.clone()
        view.index_copy_(d, others, _current_like(view.index_select(d, others), g))
        return view.reshape(t.shape)

    parts: dict[str, Part] = {"kept": lambda name, k, t: _batch_part(t, s, s.multi[name], keep),
                              "others": lambda name, k, t: _batch_part(t, s, s.multi[name], others)}
    threshold = f"<= {s.rtol:g} relative change"
    if not s.layers and all(_out_batch_dim(t, s) is None for t in base_eval.out):
        return _result("batch", "SKIP", None, threshold, f"no batch axis of size {n} in the model output")
    worst: dict[str, _Diff] = {}
    culprits: dict[str, str] = {}
    layers: dict[str, float] = {}
    reached = False
    for train in (False, True):
        mode = "train" if train else "eval"
        a = base_eval if not train else _run(s, s.x, True)
        b = _run(s, x, train, inject, clean=s.x, record="compare", against=a, parts=parts)
        diffs = [_Diff(None, "output", _out_rel(s, a.out, b.out, keep)), *b.diffs["kept"]]
        reached = reached or _out_rel(s, a.out, b.out, others) > s.rtol or any(
            d.rel > s.rtol for d in b.diffs["others"] if d.what == "spikes")
        w = _worst(diffs)
        if w is not None:
            worst[mode] = w
        if w is not None and w.rel > s.rtol:
            culprits[mode] = _culprit(diffs, s.rtol)
            for d in diffs:
                if d.layer is not None and d.rel > s.rtol:
                    layers[d.layer] = max(layers.get(d.layer, 0.0), d.rel)
    value = max((d.rel for d in worst.values()), default=0.0)
    if value > s.rtol:
        modes = "; ".join(f"{m}: {_fmt(worst[m].rel)} at {worst[m].where}, {culprits[m]}" for m in culprits)
        return _result("batch", "FAIL", value, threshold,
                       f"samples 0 and {n - 1} changed when only the other samples did ({modes})",
                       [LayerFinding(k, v, "its kept samples changed") for k, v in layers.items()])
    if not reached:
        return _result("batch", "SKIP", value, threshold,
                       "changing the other samples changed nothing, not even their own outputs: nothing to compare")
    return _result("batch", "PASS", value, threshold,
                   f"samples 0 and {n - 1} unchanged when {_samples(range(1, n - 1))} replaced (eval and train mode)")


def _samples(idx: range) -> str:
    """'sample 1 was' / 'samples 1 and 2 were' / 'samples 1 to 3 were'."""
    if len(idx) == 1:
        return f"sample {idx[0]} was"
    return f"samples {idx[0]} {'and' if len(idx) == 2 else 'to'} {idx[-1]} were"


def _out_rel(s: _Setup, a: list[Tensor], b: list[Tensor], idx: Tensor) -> float:
    """Relative change of the model output's entries of samples `idx` (outputs without a batch axis are left out)."""
    if len(a) != len(b):
        return math.inf
    worst = 0.0
    for ta, tb in zip(a, b):
        d = _out_batch_dim(ta, s)
        if d is not None:
            other = tb.index_select(d, idx) if tb.shape == ta.shape else None
            worst = max(worst, _rel(ta.index_select(d, idx), other, _scale(ta)))
    return worst


def _all_rel(a: list[Tensor], b: list[Tensor]) -> float:
    if len(a) != len(b):
        return math.inf
    return max((_rel(ta, tb, _scale(ta)) for ta, tb in zip(a, b)), default=0.0)


def _check_state(s: _Setup, first: _Pass) -> CheckResult:
    """`first` must be the pass just run (on s.x, eval mode): the calls here follow it without a rest."""
    g = _generator(s.seed + 2)
    everything: dict[str, Part] = {"all": lambda name, k, t: t}
    again = _run(s, s.x, False, rest=False, record="compare", against=first, parts=everything)
    _run(s, _random_like(s.x, g), False, lambda name, k, t: _current_like(t, g), rest=False, record="count")
    after_other = _run(s, s.x, False, rest=False, record="compare", against=first, parts=everything)
    diffs_again = [_Diff(None, "output", _all_rel(first.out, again.out)), *again.diffs["all"]]
    diffs_other = [_Diff(None, "output", _all_rel(first.out, after_other.out)), *after_other.diffs["all"]]
    w_again, w_other = _worst(diffs_again), _worst(diffs_other)
    value = max(w_again.rel if w_again else 0.0, w_other.rel if w_other else 0.0)
    threshold = f"<= {s.rtol:g} relative change"
    how = "with reset(model) between calls" if s.reset is not None else "with nothing run between calls"
    if value <= s.rtol:
        return _result("state", "PASS", value, threshold, f"repeated calls agree, also after a call on other inputs ({how})")
    diffs = diffs_again if w_again is not None and w_again.rel > s.rtol else diffs_other
    which = "two identical calls differ" if diffs is diffs_again else "a call differs after a call on other inputs"
    layers = [LayerFinding(d.layer, d.rel, f"its {d.what} changed") for d in diffs if d.layer is not None and d.rel > s.rtol]
    return _result("state", "FAIL", value, threshold, f"{which} ({how}); {_culprit(diffs, s.rtol)}. {_reset_hint(s)}", layers)


def _reset_hint(s: _Setup) -> str:
    from efficient.profiler.neurons import neuron_library

    libs = {neuron_library(m) for m in s.layers.values()}
    if s.reset is not None:
        return "The reset given does not clear all of it."
    if "spikingjelly" in libs:
        return ("spikingjelly neurons keep their membrane until functional.reset_net(model): call it after every "
                "forward, and pass reset=functional.reset_net to check that it suffices.")
    if "snntorch" in libs:
        return ("snntorch neurons keep their membrane (hidden state) across calls: call snntorch.utils.reset(model) "
                "(or pass mem=) before every forward, and pass that reset to check that it suffices.")
    return "Something in the model keeps state across calls; reset it at the start of forward."


def _check_causality(s: _Setup, base: _Pass) -> CheckResult:
    """Steps <= t0 against a pass in which every spiking layer's input (and a time-major model input) changed after t0."""
    threshold = f"<= {s.rtol:g} relative change"
    steps = {name: len(calls) for name, calls in base.calls.items() if not s.multi[name]}  # single-step: calls = steps
    T = s.T
    if (T is None or T < 2) and not any(c >= 2 for c in steps.values()):
        return _result("causality", "SKIP", None, threshold, "no time steps: T is unknown or 1 (pass timesteps=)")

    def t0_of(name: str) -> int | None:
        if s.multi[name]:
            return (T - 1) // 2 if T and T >= 2 else None
        return (steps[name] - 1) // 2 if steps.get(name, 0) >= 2 else None

    g = _generator(s.seed + 3)

    def inject(name: str, k: int, t: Tensor) -> Tensor:
        t0 = t0_of(name)
        if t0 is None:
            return t
        if not s.multi[name]:
            return _current_like(t, g) if k > t0 else t
        if t.dim() < 1 or t.shape[0] != T:
            return t
        t = t.clone()
        t[t0 + 1:] = _current_like(t[t0 + 1:], g)
        return t

    def part(before: bool) -> Part:
        def pick(name: str, k: int, t: Tensor) -> Tensor | None:
            t0 = t0_of(name)
            if t0 is None:
                return None
            if not s.multi[name]:
                return t if (k <= t0) == before else None
            if t.dim() < 1 or t.shape[0] != T:
                return None
            return t[: t0 + 1] if before else t[t0 + 1:]
        return pick

    x = s.x
    out_t0 = (T - 1) // 2 if T and T >= 2 else None
    if s.time_major and out_t0 is not None and x.shape[0] == T:
        x = x.clone()
        x[out_t0 + 1:] = _random_like(x[out_t0 + 1:], g)
    b = _run(s, x, False, inject, clean=s.x, record="compare", against=base, parts={"before": part(True), "after": part(False)},
             mixing=True)
    where = f"steps <= {out_t0}" if out_t0 is not None else "the first half of each layer's calls"
    out_before = _Diff(None, "output", _time_rel(s, base.out, b.out, out_t0, True))
    before = ([] if b.mixed else [out_before]) + b.diffs["before"]  # the output comes after any mixing
    after = [_Diff(None, "output", _time_rel(s, base.out, b.out, out_t0, False))]
    after += [d for d in b.diffs["after"] + b.diffs["after|mixed"] if d.what == "spikes"]
    worst = _worst(before)
    value = worst.rel if worst is not None else 0.0
    if value > s.rtol:
        layers = [LayerFinding(d.layer, d.rel, f"its {d.what} at {where} changed") for d in before
                  if d.layer is not None and d.rel > s.rtol]
        return _result("causality", "FAIL", value, threshold,
                       f"{where} changed when only later steps did; {_culprit(before, s.rtol)}", layers)
    if not any(d.rel > s.rtol for d in after):
        return _result("causality", "SKIP", value, threshold,
                       "changing the later steps changed no spikes or output there either: nothing reached")
    mixed = [out_before, *b.diffs["before|mixed"]] if b.mixed else []
    moved = _worst(mixed)
    if b.mixed and moved is not None and moved.rel > s.rtol:
        last, what = b.mixed
        return _result("causality", "SKIP", value, threshold,
                       f"{where} unchanged up to the first {what}" + (f", after {last}" if last else "") +
                       f"; from there the model mixes time steps by design (it cannot run step by step), so what "
                       f"follows is not judged (it moved by {_fmt(moved.rel)} at {moved.where})")
    return _result("causality", "PASS", value, threshold, f"{where} unchanged when the later steps were replaced")


def _time_rel(s: _Setup, a: list[Tensor], b: list[Tensor], t0: int | None, before: bool) -> float:
    """Relative change of the time-major model outputs `[T, B, ...]` at steps <= t0 (or after)."""
    if t0 is None or len(a) != len(b):
        return 0.0
    worst = 0.0
    for ta, tb in zip(a, b):
        if ta.dim() >= 2 and ta.shape[0] == s.T and ta.shape[1] == s.n and ta.shape == tb.shape:
            sl = slice(0, t0 + 1) if before else slice(t0 + 1, None)
            worst = max(worst, _rel(ta[sl], tb[sl], _scale(ta)))
    return worst


def _check_rates(s: _Setup, full: _Pass, real: bool, silent: float, saturated: float) -> CheckResult:
    """Each spiking layer's firing rate on the example (undriven), against the silent and saturated bounds."""
    threshold = f"no layer at rate <= {silent:g} or >= {saturated:g}"
    rates = {name: c.nonzero / c.numel for name, c in full.counts.items() if c.numel}
    if not rates:
        return _result("rates", "SKIP", None, threshold, "no spiking layer was called")
    span = f"rates {_fmt(min(rates.values()))} to {_fmt(max(rates.values()))} over {len(rates)} layers"
    if not real:
        return _result("rates", "SKIP", None, threshold,
                       f"no example data: rates on random inputs say nothing about real ones ({span}); give real data")
    silent_l = [k for k, r in rates.items() if r <= silent]
    sat_l = [k for k, r in rates.items() if r >= saturated]
    bad = silent_l + sat_l
    if not bad:
        return _result("rates", "PASS", 0, threshold, f"no silent or saturated layer; {span}", shown="0 layers")
    parts = ([f"silent ({len(silent_l)}): {_name_some(silent_l)}"] if silent_l else []) + \
            ([f"saturated ({len(sat_l)}): {_name_some(sat_l)}"] if sat_l else [])
    layers = [LayerFinding(k, rates[k], "silent" if k in silent_l else "saturated") for k in bad]
    return _result("rates", "FAIL", len(bad), threshold, "; ".join(parts) + f"; {span}", layers,
                   shown=f"{len(bad)} of {len(rates)} layers")


def _check_binary(s: _Setup, full: _Pass) -> CheckResult:
    """Each spiking layer's spikes on the example (undriven) are exactly 0 or 1."""
    threshold = "only 0 and 1"
    counted = {name: c for name, c in full.counts.items() if c.numel}
    bad = [LayerFinding(name, c.off / c.numel, f"{c.off} of {c.numel} entries are not 0 or 1 (e.g. "
                        f"{', '.join(f'{v:.3g}' for v in c.examples)})") for name, c in counted.items() if c.off]
    if not bad:
        return _result("binary", "PASS", 0.0, threshold, f"every spike of the {len(counted)} spiking layers is 0 or 1")
    worst = max(f.value for f in bad)
    return _result("binary", "FAIL", worst, threshold,
                   f"{len(bad)} of {len(counted)} spiking layers emit values other than 0 and 1, so the ops after them read "
                   f"non-binary input (not spike-driven): {_name_some([f.layer for f in bad])}", bad,
                   shown=f"{_fmt(worst)} of entries")


def _alone(module: nn.Module, like: Tensor, g: torch.Generator) -> float:
    """The fraction of nonzero entries of a spiking layer's own input gradient when it runs alone on
    a sweep of currents (uniform in [-2r, 4r], r = the spread of its real input, at least 1), with
    random upstream gradients: 0 when it has no surrogate or one that is zero everywhere."""
    xf = like.detach().float()
    std = float(xf.std()) if xf.numel() > 1 else 0.0
    r = max(std, 1.0) if math.isfinite(std) else 1.0
    x = ((torch.rand(like.shape, generator=g) * 6 - 2) * r).to(like.device, like.dtype).requires_grad_(True)
    try:
        spk = _spikes_of(module(x))
    except Exception:  # a layer that cannot run alone is judged in place only
        return math.nan
    if spk is None or not spk.is_floating_point() or not spk.requires_grad:
        return 0.0
    up = torch.randn(spk.shape, generator=g).to(spk.device, spk.dtype)
    (gi,) = torch.autograd.grad(spk, x, grad_outputs=up, allow_unused=True)
    return float(torch.count_nonzero(gi)) / gi.numel() if gi is not None and gi.numel() else 0.0


def _check_surrogate(s: _Setup, real: bool) -> CheckResult:
    """Each spiking layer's own gradient (in place and alone on a sweep) and the output's gradient at its input, train mode."""
    threshold = "no layer without gradient"
    _rest(s.model, s.reset)
    s.model.train(True)  # as in training, BatchNorm included
    x = s.x.detach().clone()
    if x.is_floating_point():
        x.requires_grad_(True)
    g = _generator(s.seed + 4)
    own: dict[str, list[float]] = {}  # layer -> [nonzero entries, entries] of its own input gradient
    reached: dict[str, list[float]] = {}  # the same for the output's gradient at its input
    unreachable: set[str] = set()  # no autograd path from the output to its input
    with _seeded(s.seed, x.device), torch.enable_grad(), _Tap(s.layers, record="graph") as tap:
        outs = [t for t in _tensors(s.model(x)) if t.is_floating_point() and t.requires_grad]
        if not outs:
            return _result("surrogate", "SKIP", None, threshold, "no model output carries a gradient")
        loss = sum((t * torch.randn(t.shape, generator=g).to(t.device, t.dtype)).sum() for t in outs)
        inputs = [(name, c[0]) for name in tap.order for c in tap.calls[name] if c[0] is not None]
        need = [(name, t) for name, t in inputs if t.requires_grad]
        unreachable |= {name for name, t in inputs if not t.requires_grad}
        grads = torch.autograd.grad(loss, [t for _, t in need], allow_unused=True, retain_graph=True) if need else ()
        for (name, t), gr in zip(need, grads):
            acc = reached.setdefault(name, [0.0, 0.0])
            if gr is None:
                unreachable.add(name)
            else:
                acc[0] += float(torch.count_nonzero(gr))
            acc[1] += t.numel()
        for name in tap.order:
            acc = own.setdefault(name, [0.0, 0.0])
            for inp, spk in tap.calls[name]:
                if inp is None or spk is None or not inp.requires_grad or not spk.requires_grad or not spk.is_floating_point():
                    continue
                up = torch.randn(spk.shape, generator=g).to(spk.device, spk.dtype)
                (gi,) = torch.autograd.grad(spk, inp, grad_outputs=up, allow_unused=True, retain_graph=True)
                acc[0] += float(torch.count_nonzero(gi)) if gi is not None else 0.0
                acc[1] += inp.numel()
        alone: dict[str, float] = {}
        for name in tap.order:
            first = next((c[0] for c in tap.calls[name] if c[0] is not None), None)
            if first is not None:
                _rest(s.model, s.reset)
                alone[name] = _alone(s.layers[name], first, g)
    _rest(s.model, s.reset)
    dead: list[LayerFinding] = []
    quiet: list[LayerFinding] = []  # zero on this data only
    values: list[LayerFinding] = []
    for name in tap.order:
        o, r, a = own[name], reached.get(name, [0.0, 0.0]), alone.get(name, math.nan)
        own_frac = o[0] / o[1] if o[1] else (a if math.isfinite(a) else 0.0)
        reach_frac = r[0] / r[1] if r[1] else 0.0
        values.append(LayerFinding(name, min(own_frac, reach_frac)))
        if a == 0.0 or (math.isnan(a) and own_frac == 0.0 and o[1] == 0):
            dead.append(LayerFinding(name, 0.0, "passes no gradient for any input current: no surrogate, or one that is zero"))
        elif name in unreachable:
            dead.append(LayerFinding(name, 0.0, "no gradient path from the output to its input (a detach, or an op "
                                                "without gradient)"))
        elif own_frac == 0.0:
            quiet.append(LayerFinding(name, 0.0, "its input never falls where its surrogate is nonzero"))
        elif reach_frac == 0.0:
            quiet.append(LayerFinding(name, 0.0, "the gradient reaching its input is zero (dead layers after it)"))
    if not values:
        return _result("surrogate", "SKIP", None, threshold, "no spiking layer was called")
    failing = dead + (quiet if real else [])
    if failing:
        parts = [f"{f.layer}: {f.note}" for f in failing[:LAYERS_NAMED]]
        more = f" and {len(failing) - LAYERS_NAMED} more" if len(failing) > LAYERS_NAMED else ""
        return _result("surrogate", "FAIL", len(failing), threshold,
                       f"{len(failing)} of {len(values)} spiking layers get no gradient: " + "; ".join(parts) + more,
                       failing, shown=f"{len(failing)} of {len(values)} layers")
    low = min(values, key=lambda f: f.value)
    note = ""
    if quiet:
        note = (f"; on this random input {len(quiet)} layers get no gradient ({_name_some([q.layer for q in quiet])}: "
                "their inputs stay outside the surrogate's window): check on real data")
    return _result("surrogate", "PASS", 0, threshold,
                   f"every spiking layer passes gradient and receives it from the output; the lowest fraction of "
                   f"nonzero input gradients is {_fmt(low.value)}, at {low.layer}{note}", shown="0 layers")


def _result(cid: str, status: Status, value: float | None, threshold: str, detail: str,
            layers: list[LayerFinding] | None = None, shown: str | None = None) -> CheckResult:
    return CheckResult(cid, CHECKS[cid], status, None if value is None else float(value),
                       shown if shown is not None else _fmt(value), threshold, detail, layers or [])


def _skip_all(cid: str, why: str) -> CheckResult:
    return _result(cid, "SKIP", None, "-", why)
