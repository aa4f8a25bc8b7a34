"""Activation-memory levels (`efficient.memory`) in training: 20 steps of the digits STATA recipe per
level, resume, bad levels, models without neurons, the peers' models, random draws and BatchNorm
statistics in recomputed units. Every zoo model: test_memory_zoo.py; every recipe and DDP:
test_memory_recipes.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT, needs_budget
from safetensors.torch import load_file
from test_engine import _interrupt_after
from torch import nn

from efficient import memory
from efficient.config import load_recipe
from efficient.errors import ConfigError
from efficient.train.engine import Trainer

# --------------------------------------------------------------------------- training runs

# the digits STATA recipe at 20 steps of 16 samples: the keep ratio warms up inside the run
STATA_DIGITS = ["train.max_steps=20", "train.epochs=1", "data.batch_size=16", "model.keep_warmup_epochs=0.3",
                "profile.enabled=false", "train.progress=false", "eval.batch_size=64", "eval.max_batches=1"]


def _train(tmp: Path, level: str, extra: list[str] = ()) -> tuple[dict, dict[str, torch.Tensor], list[dict]]:
    run = tmp / level
    summary = Trainer(load_recipe(ROOT / "recipes" / "stata_digits.yaml", [*STATA_DIGITS, f"train.memory={level}", *extra]), run).fit()
    logs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return summary, load_file(str(run / "checkpoint" / "last" / "model.safetensors")), logs


def test_twenty_steps_of_the_digits_stata_recipe_per_level(tmp_path: Path) -> None:
    """bits trains bit for bit as none (weights, BN statistics, logged STATA statistics); recompute
    ends within fp32 tolerance of it with the same BN statistics and kept-token counts."""
    s_none, w_none, log_none = _train(tmp_path, "none")
    s_bits, w_bits, log_bits = _train(tmp_path, "bits")
    s_rec, w_rec, log_rec = _train(tmp_path, "recompute")
    assert s_none["steps"] == s_bits["steps"] == s_rec["steps"] == 20
    assert s_bits["memory"]["level"] == "bits" and "kept as bits" in s_bits["memory"]["summary"]
    for level in ("bits", "recompute"):  # the run records what its level keeps per step, against none
        rec = json.loads((tmp_path / level / "memory.json").read_text())
        assert rec["level"] == level and 0 < rec["ratio_to_none"] < 1, rec
    assert not (tmp_path / "none" / "memory.json").exists()
    for k in w_none:
        assert torch.equal(w_bits[k], w_none[k]), k
        assert torch.allclose(w_rec[k].double(), w_none[k].double(), rtol=1e-4, atol=1e-5), k
    strip = lambda logs: [{k: v for k, v in r.items() if k not in ("samples_per_s", "time_s", "elapsed_s")} for r in logs]  # noqa: E731
    assert strip(log_bits) == strip(log_none)  # losses and STATA statistics, every logged step
    kept = lambda logs: [{k: v for k, v in r.items() if "kept" in k or "tokens" in k} for r in logs]  # noqa: E731
    assert kept(log_rec) == kept(log_none)
    bn = [k for k in w_none if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert bn and all(torch.equal(w_none[k], w_rec[k]) or torch.allclose(w_none[k].double(), w_rec[k].double(), rtol=1e-4, atol=1e-6) for k in bn)


@pytest.mark.parametrize("budget", [[], pytest.param(["train.memory_budget=0.5"], marks=needs_budget),
                                    ["train.memory_budget=0", "train.memory_budget_of=peak"]],
                         ids=["every-unit-whole", "budget", "peak-budget"])
def test_resume_of_a_recompute_run_equals_an_uninterrupted_one(tmp_path: Path, budget: list[str]) -> None:
    overrides = [*STATA_DIGITS, "train.max_steps=6", "train.memory=recompute", *budget]
    recipe = ROOT / "recipes" / "stata_digits.yaml"
    straight = tmp_path / "straight"
    Trainer(load_recipe(recipe, overrides), straight).fit()
    half = tmp_path / "half"
    with pytest.raises(KeyboardInterrupt, match="resume with --resume"):
        _interrupt_after(Trainer(load_recipe(recipe, overrides), half), 3).fit()
    resumed = Trainer(load_recipe(half / "config.yaml"), half, resume=True)
    assert resumed.recipe.train.memory == "recompute" and resumed.memory_plan.level == "recompute"
    if budget == ["train.memory_budget=0.5"]:  # the plan depends on shapes only: the resumed run reruns the same units whole
        assert resumed.memory_plan.budget == 0.5 and resumed.memory_plan.keep
        assert "within the budget of 50 %" in resumed.memory_plan.summary()
    elif budget:  # a peak budget: the plan of a fresh run on the same first batch
        fresh = Trainer(load_recipe(recipe, overrides), tmp_path / "fresh")
        fresh.setup()
        assert resumed.memory_plan.budget_of == "peak" and resumed.memory_plan.plain == fresh.memory_plan.plain
    resumed.fit()
    a = load_file(str(straight / "checkpoint" / "last" / "model.safetensors"))
    b = load_file(str(half / "checkpoint" / "last" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_bad_level_is_named_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.memory"):
        load_recipe(ROOT / "recipes" / "stata_digits.yaml", ["train.memory=bitz"])
    with pytest.raises(ConfigError, match="none, bits, recompute"):
        memory.optimize(nn.Linear(2, 2), "bitz")


def test_a_model_without_neurons_is_left_alone_and_says_so() -> None:
    plan = memory.optimize(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "recompute")
    assert plan.units == [] and "nothing to do" in plan.summary()


# --------------------------------------------------------------------------- the peers' models

def _grads_of(model: nn.Module, x: torch.Tensor, reset) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    reset(model)
    model.zero_grad(set_to_none=True)
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * w).sum().backward()
    return out.detach().clone(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _sj_net():
    from spikingjelly.activation_based import functional, layer, neuron

    net = nn.Sequential(
        layer.Conv2d(1, 8, 3, padding=1), layer.BatchNorm2d(8), neuron.LIFNode(), layer.MaxPool2d(2),
        layer.Conv2d(8, 8, 3, padding=1), layer.BatchNorm2d(8), neuron.LIFNode(), layer.Flatten(), layer.Linear(8 * 4 * 4, 10),
    )
    functional.set_step_mode(net, "m")
    return net, functional.reset_net


def _snn_net():
    import snntorch as snn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.lif1 = nn.Linear(64, 32), snn.Leaky(beta=0.9)
            self.fc2, self.lif2 = nn.Linear(32, 10), snn.Leaky(beta=0.8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, B, 64]
            m1, m2, out = self.lif1.init_leaky(), self.lif2.init_leaky(), []
            for t in range(x.shape[0]):
                s1, m1 = self.lif1(self.fc1(x[t]), m1)
                s2, m2 = self.lif2(self.fc2(s1), m2)
                out.append(s2)
            return torch.stack(out)

    return Net(), lambda m: None


@pytest.mark.parametrize("build,shape", [(_sj_net, (4, 2, 1, 8, 8)), (_snn_net, (4, 2, 64))], ids=["spikingjelly", "snntorch"])
@pytest.mark.parametrize("accelerated", [False, True])
def test_peer_models_keep_their_gradients_at_every_level(build, shape, accelerated: bool) -> None:
    import efficient

    torch.manual_seed(0)
    net, reset = build()
    if accelerated:
        net, _ = efficient.accelerate(net)
    x = (torch.rand(shape, generator=torch.Generator().manual_seed(1)) * 3).requires_grad_(False)
    out0, g0 = _grads_of(net, x, reset)
    for level in ("bits", "recompute"):
        plan = memory.optimize(net, level)
        assert plan.neurons and plan.units == []  # their neurons carry state between calls: bits, no rerun
        out, g = _grads_of(net, x, reset)
        assert torch.equal(out, out0) and all(torch.equal(g[k], g0[k]) for k in g0), level
        assert plan.hooks.packed > 0, "no spike tensor was kept as bits"
    memory.optimize(net, "none")


def test_a_recomputed_unit_replays_its_random_draws_and_counts_batch_statistics_once() -> None:
    """Dropout inside a unit draws the same mask in the rerun as in forward (RNG state replayed), and
    BatchNorm's running statistics and batch count move once per step, not twice."""
    from efficient.models.neurons import LIF

    class Unit(nn.Module):
        recompute_unit = True

        def __init__(self) -> None:
            super().__init__()
            self.fc, self.bn, self.drop, self.lif = nn.Linear(12, 12), nn.BatchNorm1d(12), nn.Dropout(0.3), LIF(backend="torch")

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, B, 12]
            T, B, _ = x.shape
            return self.lif(self.drop(self.bn(self.fc(x.flatten(0, 1)))).reshape(T, B, -1))

    def step(level: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        net = nn.Sequential(Unit(), Unit())
        memory.optimize(net, level)
        torch.manual_seed(1)
        x = torch.rand(4, 3, 12, generator=torch.Generator().manual_seed(2)) * 4
        (net(x) * torch.arange(12.0)).sum().backward()
        return ({k: p.grad for k, p in net.named_parameters()}, {k: b.clone() for k, b in net.named_buffers()})

    g0, b0 = step("none")
    g1, b1 = step("recompute")
    assert all(torch.equal(g1[k], g0[k]) for k in g0)
    assert all(torch.equal(b1[k], b0[k]) for k in b0) and int(b1["0.bn.num_batches_tracked"]) == 1


# --------------------------------------------------------------------------- a byte budget

class _ConvUnit(nn.Module):
    """Conv -> BatchNorm -> LIF on [T, B, C, H, W]: its conv costs c_in x 9 MACs per output element."""

    recompute_unit = True

    def __init__(self, c_in: int, c_out: int) -> None:
        from efficient.models.neurons import LIF

        super().__init__()
        self.conv, self.bn, self.lif = nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), LIF(backend="torch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B = x.shape[:2]
        y = self.bn(self.conv(x.flatten(0, 1)))
        return self.lif(y.reshape(T, B, *y.shape[1:]))


def _budget_net() -> nn.Module:
    # a wide, cheap first unit (2 input channels, 16x16) and two narrow, costly ones (32 in, 4x4 after a pool)
    torch.manual_seed(0)
    pool = nn.Module()
    pool.forward = lambda x: torch.nn.functional.max_pool2d(x.flatten(0, 1), 4).reshape(*x.shape[:3], 4, 4)
    return nn.Sequential(_ConvUnit(2, 32), pool, _ConvUnit(32, 32), _ConvUnit(32, 32))


def _deep_net() -> nn.Module:
    # two units at 16x16, a pool, two at 4x4: the last units' activations live only around the turn from
    # forward to backward
    torch.manual_seed(0)
    pool = nn.Module()
    pool.forward = lambda x: torch.nn.functional.max_pool2d(x.flatten(0, 1), 4).reshape(*x.shape[:3], 4, 4)
    return nn.Sequential(_ConvUnit(2, 32), _ConvUnit(32, 32), pool, _ConvUnit(32, 32), _ConvUnit(32, 32))


def _budget_step(net: nn.Module, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    net.zero_grad(set_to_none=True)
    (net(x) * torch.linspace(-1, 1, 32).reshape(32, 1, 1)).sum().backward()
    return {k: p.grad for k, p in net.named_parameters()}, {k: b.clone() for k, b in net.named_buffers()}


@needs_budget
def test_a_budget_keeps_the_outputs_that_save_most_rerun_flops_per_byte() -> None:
    """Under a budget the narrow convolutions of 32 channels (288 MACs per output value) keep their
    outputs before the wide one of 2 channels (18), as many as fit; the step keeps at most the
    budget of none's bytes (measured independently), trains as none does within fp32 rounding, and
    updates BatchNorm statistics once."""
    from efficient.memory.measure import activation_memory

    x = torch.rand(3, 2, 2, 16, 16, generator=torch.Generator().manual_seed(1)) * 3
    ref = _budget_net()
    g0, b0 = _budget_step(ref, x)
    none = activation_memory(ref, x, backward=False).total_bytes
    net = _budget_net()
    assert memory.optimize(net, "recompute").keep == {}
    floor = activation_memory(net, x, backward=False).total_bytes
    narrow = 3 * 2 * 32 * 4 * 4 * 4  # bytes of one narrow convolution's fp32 output
    budget = (floor + 2 * narrow + narrow // 2) / none  # room for both narrow outputs, not the wide one
    plan = memory.optimize(net, "recompute", budget=budget, example=x)
    assert plan.units == ["0", "2", "3"] and plan.keep == {"2": [0], "3": [0]}, plan
    kept = activation_memory(net, x, backward=False).total_bytes
    assert kept == floor + 2 * narrow and kept <= budget * none and plan.kept_fraction == pytest.approx(kept / none)
    # each convolution does the same MACs (2x9x32 per value at 16x16, 32x9x32 at 4x4): the wide one
    # still reruns, a third of them, for 16x fewer bytes kept
    assert plan.rerun_share == pytest.approx(1 / 3)
    assert f"within the budget of {100 * budget:g} %" in plan.summary()
    g1, b1 = _budget_step(net, x)
    for k in g0:
        assert torch.allclose(g1[k], g0[k], rtol=1e-4, atol=1e-5), k
    assert all(torch.equal(b1[k], b0[k]) for k in b0) and int(b1["0.bn.num_batches_tracked"]) == 1


@needs_budget
def test_budget_extremes_and_a_plan_kept_across_measurements() -> None:
    """Budget 0 keeps no output (every unit reruns whole, as with no budget), budget 1 every one;
    measuring another level (as a run's memory record does) puts the same plan back."""
    from efficient.memory.measure import activation_memory, applied_level

    x = torch.rand(3, 2, 2, 16, 16, generator=torch.Generator().manual_seed(1)) * 3
    net = _budget_net()
    zero = memory.optimize(net, "recompute", budget=0, example=x)
    assert zero.units == ["0", "2", "3"] and zero.keep == {} and zero.rerun_share == 1
    one = memory.optimize(net, "recompute", budget=1, example=x)
    assert one.keep == {"0": [0], "2": [0], "3": [0]} and one.rerun_share == 0 and one.kept_fraction < 1
    before = activation_memory(net, x, backward=False).total_bytes
    activation_memory(net, x, level="none", backward=False)
    assert applied_level(net) == "recompute" and net._efficient_memory.plan.keep == one.keep
    assert activation_memory(net, x, backward=False).total_bytes == before


def test_a_peak_budget_runs_plainly_the_units_that_cost_the_peak_nothing() -> None:
    """With budget_of="peak" and budget 0, the step's peak of live tensors (measured independently) stays
    within that of every unit rerun whole, and the last unit, whose activations live only from the end
    of forward to the start of backward, when the step holds least, runs plainly (no rerun): its
    gradients are level none's bit for bit, the others' within fp32 rounding, and BatchNorm updates
    once. A budget of all of none's peak runs at least those units plainly, within it."""
    from efficient.memory.measure import activation_memory, step_peak_bytes

    x = torch.rand(4, 8, 2, 16, 16, generator=torch.Generator().manual_seed(1)) * 3
    ref = _deep_net()
    g0, b0 = _budget_step(ref, x)

    def peak(model: nn.Module) -> int:  # of a step after the first (whose units measure their outputs)
        activation_memory(model, x, backward=True)
        return step_peak_bytes(lambda: activation_memory(model, x, backward=True))

    none = peak(ref)
    net = _deep_net()
    memory.optimize(net, "recompute")
    floor = peak(net)
    assert floor < none
    plan = memory.optimize(net, "recompute", budget=0, example=x, budget_of="peak")
    assert "4" in plan.plain and set(plan.units) == {"0", "1", "3", "4"} - set(plan.plain) and plan.keep == {}
    # these units call BatchNorm and the LIF apart: no fused unit leaves a trace to keep
    assert not set(plan.keeping) & set(plan.plain) and "run plainly keeping" not in plan.summary()
    assert peak(net) <= floor and plan.kept_fraction == pytest.approx(peak(net) / none)
    assert plan.budget_of == "peak" and plan.floor_fraction == pytest.approx(floor / none)
    assert "run plainly (as at level bits)" in plan.summary()
    assert f"; its step peaks at {100 * plan.kept_fraction:.1f} % of level none's" in plan.summary()
    assert "over the budget of 0 %: every unit rerun whole peaks at" in plan.summary()
    g1, b1 = _budget_step(net, x)
    for k in g0:
        assert torch.allclose(g1[k], g0[k], rtol=1e-4, atol=1e-5), k
    assert all(torch.equal(g1[k], g0[k]) for k in g0 if k.startswith("4."))
    assert all(torch.equal(b1[k], b0[k]) for k in b0) and int(b1["0.bn.num_batches_tracked"]) == 1
    wide = memory.optimize(net, "recompute", budget=1, example=x, budget_of="peak")
    assert set(wide.plain) >= set(plan.plain) and peak(net) <= none
    assert "within the budget of 100 %" in wide.summary()


@pytest.mark.parametrize("plain_flops,output_flops,chosen", [(100, 150, "plain"), (100, 250, "outputs"),
                                                              (100, 200, "plain")])
def test_the_peak_planner_keeps_the_order_that_saves_more_rerun_work(
        plain_flops: int, output_flops: int, chosen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner makes a plan admitting plain units first and one admitting outputs first, and keeps the
    one worth more: a plain unit's FLOPs count twice (it also skips its rerun's elementwise work), a kept
    output's once; at equal worth, the lower peak (here the plain-first plan's)."""
    from efficient.memory import plan as P

    def plan_in_order(*args: object) -> P._PeakPlan:
        if args[-1] == "plain":
            return P._PeakPlan(["4"], [], [], plain_flops, 0, 100)
        return P._PeakPlan([], [], ["3.conv"], 0, output_flops, 101)

    monkeypatch.setattr(P, "_plan_in_order", plan_in_order)
    x = torch.rand(4, 8, 2, 16, 16, generator=torch.Generator().manual_seed(1)) * 3
    c = P.choose_plain_for_peak(_deep_net(), x, 0.5)
    assert (c.plain, c.outputs) == ((["4"], []) if chosen == "plain" else ([], ["3.conv"]))
    assert c.rerun_flops == c.flops - (plain_flops if chosen == "plain" else output_flops)


def test_the_peak_planner_tries_again_the_units_a_wrongly_admitted_one_turned_away() -> None:
    """A unit predicted to fit whose measured step peak is over the target is dropped, and the units its
    predicted bytes had turned away are predicted again without it and, where they fit, measured and run
    plainly: the planner leaves no room that a measured unit fits in."""
    import numpy as np

    from efficient.memory.plan import _admit_by_span

    live = np.full(100, 10)
    # (unit, bytes kept more when plain, FLOPs saved, span): "a" saves the most per byte over the whole step
    candidates = [("a", 15, 1000, (0, 100)), ("b", 10, 100, (10, 50)), ("c", 10, 90, (60, 90))]
    measured: list[list[str]] = []

    def measure(names: list[str]) -> int:  # "a"'s own backward holds more than its kept bytes
        measured.append(list(names))
        return 40 if "a" in names else 10 + 10 * len(names)

    chosen, total = _admit_by_span(candidates, live, 30, 10, measure)
    assert [c[0] for c in chosen] == ["b", "c"] and total == 30, (chosen, measured)
    assert measured == [["a"], ["a"], ["b"], ["b", "c"]]
    # a correct prediction is measured once
    measured.clear()
    chosen, total = _admit_by_span(candidates[1:], live, 30, 10, measure)
    assert [c[0] for c in chosen] == ["b", "c"] and total == 30 and measured == [["b", "c"]]


def _wide_units() -> nn.Module:
    """Spikformer's fused Linear -> BatchNorm -> LIF units on [T, B, N, C], one wide (512 channels) among narrow ones."""
    from efficient.models.spikformer import LinearBNLIF

    torch.manual_seed(0)
    lif = {"tau": 2.0}
    return nn.Sequential(LinearBNLIF(8, 8, lif), LinearBNLIF(8, 512, lif), LinearBNLIF(512, 8, lif),
                         LinearBNLIF(8, 8, lif), LinearBNLIF(8, 8, lif))


def test_a_peak_budget_lets_the_reruns_off_the_peak_keep_their_membrane_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a peak budget the reruns that do not hold the step's peak keep their membrane traces as a
    plain call does (their backward rebuilds nothing); the rerun at the peak stays lean, so the step's
    peak (measured independently) stays within the target, where every rerun keeping its trace would
    exceed it; the units run plainly keep their traces from forward to backward. Gradients are level none's
    within fp32 rounding, BatchNorm updates once, and the choice survives `restore`."""
    from efficient.kernels import bn_lif
    from efficient.memory import levels
    from efficient.memory.measure import activation_memory, step_peak_bytes

    # chunks of 256 elements: these small units rebuild their traces by chunks as a wide model's do
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 256)
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK_MIN", 256)
    rebuilt: list[int] = []
    real = bn_lif._recompute_backward_impl

    def counted(gs: torch.Tensor, z: torch.Tensor, *a: object, **k: object) -> object:
        if not (a[14] if len(a) > 14 else k.get("whole", False)):  # by chunks (a plain unit's, as at level bits, is whole)
            rebuilt.append(z.shape[-1])
        return real(gs, z, *a, **k)

    monkeypatch.setattr(bn_lif, "_recompute_backward_impl", counted)
    x = torch.rand(4, 16, 8, 8, generator=torch.Generator().manual_seed(2)).round()

    def step(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        (model(x) * torch.linspace(-1, 1, 8)).sum().backward()
        return {k: p.grad for k, p in model.named_parameters()}, {k: b.clone() for k, b in model.named_buffers()}

    def peak(model: nn.Module) -> int:
        activation_memory(model, x, backward=True)
        return step_peak_bytes(lambda: activation_memory(model, x, backward=True))

    ref = _wide_units()
    g0, b0 = step(ref)
    net = _wide_units()
    memory.optimize(net, "recompute")
    floor = peak(net)
    plan = memory.optimize(net, "recompute", budget=0, example=x, budget_of="peak")
    reruns = set(plan.units)
    kept = set(plan.keeping) & reruns
    assert kept and kept < reruns and set(plan.keeping) <= reruns | set(plan.plain), (plan.plain, plan.keeping)
    # the narrow units run plainly keep their traces too: over their short spans they cost the peak nothing
    assert plan.plain and set(plan.plain) <= set(plan.keeping), (plan.plain, plan.keeping)
    assert f"{len(plan.plain)} run plainly keeping their membrane traces" in plan.summary()
    assert f"{len(kept)} rerun keeping their membrane traces" in plan.summary()
    assert all(net[int(n)].__dict__["_efficient_lean"] is (n not in plan.keeping) for n in reruns)
    assert peak(net) <= floor
    rebuilt.clear()
    g1, b1 = step(net)
    lean = reruns - set(plan.keeping)
    # only the lean reruns rebuild a trace by chunks: the others' backward reads it
    assert sorted(rebuilt) == sorted(net[int(n)].bn.num_features for n in lean), (rebuilt, lean)
    for k in g0:
        assert torch.allclose(g1[k], g0[k], rtol=1e-4, atol=1e-5), k
    assert all(torch.equal(b1[k], b0[k]) for k in b0)
    levels.apply(net, "recompute", plain=plan.plain, keeping=sorted(reruns | set(plan.keeping)))
    assert peak(net) > floor  # every rerun keeping its trace: what the planner avoided
    again = levels.restore(net, plan)
    assert again.keeping == plan.keeping and peak(net) <= floor


def test_kept_traces_name_rerun_units() -> None:
    from efficient.memory import levels

    net = _wide_units()
    with pytest.raises(ConfigError, match=r"'9' not a recompute unit of Sequential \(its units: 0, 1, 2, 3, 4\)"):
        levels.apply(net, "recompute", keeping=["9"])


def test_a_plain_unit_keeping_its_trace_rebuilds_nothing_in_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit run plainly and named in `keeping` keeps its membrane trace from forward to backward, as at
    level none: its backward rebuilds nothing, where a plain unit rebuilds its trace in one piece (level
    bits) and a rerun by chunks. Gradients stay none's within fp32 rounding; `restore` keeps the choice and
    level none drops it."""
    from efficient.kernels import bn_lif
    from efficient.memory import levels
    from efficient.models.replay import KEEP_TRACE_MARK

    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 256)  # these small units rebuild as a wide model's do
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK_MIN", 256)
    rebuilt: list[tuple[int, bool]] = []
    real = bn_lif._recompute_backward_impl

    def counted(gs: torch.Tensor, z: torch.Tensor, *a: object, **k: object) -> object:
        rebuilt.append((z.shape[-1], bool(a[14] if len(a) > 14 else k.get("whole", False))))
        return real(gs, z, *a, **k)

    monkeypatch.setattr(bn_lif, "_recompute_backward_impl", counted)
    x = torch.rand(4, 16, 8, 8, generator=torch.Generator().manual_seed(3)).round()

    def step(model: nn.Module) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (model(x) * torch.linspace(-1, 1, 8)).sum().backward()
        return {k: p.grad for k, p in model.named_parameters()}

    g0 = step(_wide_units())
    net = _wide_units()
    plan = levels.apply(net, "recompute", plain=["1", "2"], keeping=["1"])
    assert "2 run plainly (as at level bits)" in plan.summary()
    assert "1 run plainly keeping their membrane traces" in plan.summary() and "rerun keeping" not in plan.summary()
    rebuilt.clear()
    g1 = step(net)
    # unit 2 (plain) rebuilds its 8 channels whole, the three lean reruns theirs by chunks, unit 1 (512) nothing
    assert sorted(rebuilt) == [(8, False)] * 3 + [(8, True)], rebuilt
    for k in g0:
        # a Linear's bias before BatchNorm has a gradient of zero up to rounding: compare it at its weight's scale
        scale = g0[k.replace("linear.bias", "linear.weight")].abs().max() if k.endswith("linear.bias") else 1.0
        assert torch.allclose(g1[k], g0[k], rtol=1e-4, atol=1e-5 * float(scale)), k
    again = levels.restore(net, plan)
    assert again.keeping == ["1"] and net[1].lif.__dict__.get(KEEP_TRACE_MARK)
    levels.apply(net, "none")
    assert not any(KEEP_TRACE_MARK in m.__dict__ for m in net.modules())


def _linear_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the weights every `F.linear` call from now on multiplies by (the fused units call it too)."""
    import torch.nn.functional as F

    calls: list[int] = []
    real = F.linear

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(id(w))
        return real(x, w, b)

    monkeypatch.setattr(F, "linear", counted)
    return calls


def test_a_rerun_keeping_its_linear_outputs_skips_their_matmuls_with_the_same_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rerun units named in `outputs` keep their fused units' Linear outputs from forward: their reruns run
    no matmul for them, the step keeps exactly those outputs' bytes more, and gradients and running
    statistics are those of the same units rerun without them bit for bit, also through a retained graph's
    second backward (whose rerun reads the kept outputs again). `restore` keeps the choice; level none
    drops it."""
    from efficient.memory import levels
    from efficient.memory.measure import activation_memory
    from efficient.models.replay import KEEP_OUTPUT_MARK

    x = torch.rand(4, 16, 8, 8, generator=torch.Generator().manual_seed(5)).round()
    w = torch.linspace(-1, 1, 8)

    def step(model: nn.Module, twice: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = (model(x) * w).sum()
        loss.backward(retain_graph=twice)
        if twice:
            loss.backward()
        return ({k: p.grad.clone() for k, p in model.named_parameters()},
                {k: b.clone() for k, b in model.named_buffers()})

    ref = _wide_units()
    levels.apply(ref, "recompute")
    net = _wide_units()
    plan = levels.apply(net, "recompute", outputs=["1.lif", "2.lif"])
    assert plan.outputs == ["1.lif", "2.lif"] and "2 outputs kept for their reruns" in plan.summary()
    saved = {n: activation_memory(m, x, backward=False).total_bytes for n, m in (("ref", ref), ("net", net))}
    rows = 4 * 16 * 8
    assert saved["net"] - saved["ref"] == 4 * rows * (512 + 8)  # unit 1's output, 512 channels, and unit 2's, 8
    calls = _linear_calls(monkeypatch)
    for model in (ref, net):
        model.zero_grad(set_to_none=True)
        loss = (model(x) * w).sum()
        calls.clear()
        loss.backward()
        reran = [i for i, u in enumerate(model) if id(u.linear.weight) in calls]
        assert reran == ([0, 1, 2, 3, 4] if model is ref else [0, 3, 4]), reran
    for twice in (False, True):
        for model in (ref, net):  # both start from the same weights and statistics (the steps above ran on both)
            model.load_state_dict(_wide_units().state_dict())
        g0, b0 = step(ref, twice)
        g1, b1 = step(net, twice)
        assert all(torch.equal(g1[k], g0[k]) for k in g0) and all(torch.equal(b1[k], b0[k]) for k in b0), twice
    again = levels.restore(net, plan)
    assert again.outputs == ["1.lif", "2.lif"] and net[1].lif.__dict__.get(KEEP_OUTPUT_MARK)
    levels.apply(net, "none")
    assert not any(KEEP_OUTPUT_MARK in m.__dict__ for m in net.modules())


def test_kept_linear_outputs_are_in_the_attention_and_mlp_of_a_spikformer_with_the_same_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a Spikformer block, the fused Q/K/V unit (kept under Q's neuron), the projection and both MLP units
    keep their Linear outputs for their halves' reruns, with the gradients and statistics of the halves rerun
    without them, bit for bit."""
    from efficient.memory import levels
    from efficient.models import spikformer
    from efficient.models.replay import recording_outputs
    from efficient.zoo import create

    monkeypatch.setattr(spikformer, "COMPILE_MIN_NUMEL", 0)  # Q, K and V as one fused unit at this small size
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    y = torch.tensor([1, 4])

    def step(outputs: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = create("spikformer-4-384", embed_dim=64, depth=1, num_heads=2, img_size=32, timesteps=2).train()
        plan = levels.apply(model, "recompute", outputs=outputs)
        assert plan.outputs == sorted(outputs)
        with recording_outputs() as kept:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        names = {id(m): n for n, m in model.named_modules()}
        assert sorted(names[id(n)] for n, _, _ in kept) == sorted(outputs)  # each kept once
        size = {names[id(n)]: b for n, b, _ in kept}
        if outputs:  # Q's for Q, K and V: three projections' output
            assert size["blocks.0.attn.q.lif"] == 3 * size["blocks.0.attn.proj.lif"]
        return [p.grad for p in model.parameters() if p.grad is not None], list(model.buffers())

    g0, b0 = step([])
    neurons = ["blocks.0.attn.q.lif", "blocks.0.attn.proj.lif", "blocks.0.mlp.fc1.lif", "blocks.0.mlp.fc2.lif"]
    g1, b1 = step(neurons)
    assert len(g1) == len(g0) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert all(torch.equal(a, b) for a, b in zip(b0, b1))


@pytest.mark.parametrize("arch,keeping,amp,checkpointed", [
    ("sdt-2-512", False, False, False), ("sdt-2-512", True, False, False), ("sdt-2-512", False, True, False),
    ("sdt-2-512", False, False, True), ("stable-snn-vgg11", False, False, False)])
def test_kept_convolution_and_linear_outputs_skip_their_reruns_with_the_same_gradients(
        arch: str, keeping: bool, amp: bool, checkpointed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every convolution and Linear of the rerun units (SDT's stem stages, position embedding, projection and
    second MLP Linear; the VGG's units) and every fused Linear unit keep their outputs for the reruns, in lean
    reruns, in reruns keeping their membrane traces, under bf16 autocast (outputs kept in bf16) and with
    chunks so small that the stem stages rerun under torch's checkpoint unless they keep outputs (then as
    light regions): backward runs none of those convolutions or matmuls, and two steps give the gradients and
    statistics of the same units rerun without them, bit for bit."""
    import torch.nn.functional as F

    from efficient.kernels import bn_lif
    from efficient.memory import levels
    from efficient.memory.recompute import region_modules, units
    from efficient.memory.spikes import is_neuron
    from efficient.models.replay import recording_outputs
    from efficient.zoo import create

    small = dict(embed_dim=64, depth=1, num_heads=2, img_size=32) if arch.startswith("sdt") else {}
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    y = torch.tensor([1, 4, 2, 0])
    weights: list[int] = []
    real_linear, real_conv = F.linear, F.conv2d

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        weights.append(id(w))
        return real_linear(x, w, b)

    def conv(x: torch.Tensor, w: torch.Tensor, *a: object) -> torch.Tensor:
        weights.append(id(w))
        return real_conv(x, w, *a)

    monkeypatch.setattr(F, "linear", linear)
    monkeypatch.setattr(F, "conv2d", conv)
    if checkpointed:
        monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 256)
        monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK_MIN", 256)

    def steps(outputs: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], set[str], set[str]]:
        torch.manual_seed(0)
        model = create(arch, timesteps=2, **small).train()
        names = {id(m): n for n, m in model.named_modules()}
        every = sorted({names[id(m)] for u, unit in units(model) for m in region_modules(unit)
                        if id(m) in names and (is_neuron(m) or type(m) in (nn.Linear, nn.Conv2d))})
        levels.apply(model, "recompute", outputs=every if outputs else None,
                     keeping=[u for u, _ in units(model)] if keeping else None)
        rerun: set[str] = set()
        with recording_outputs() as kept:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = F.cross_entropy(model(x).float(), y)
                weights.clear()
                loss.backward()
                rerun |= {n for n, p in model.named_parameters() if id(p) in weights}
        grads = [p.grad for p in model.parameters()]
        return grads, [b.clone() for b in model.buffers()], {names[id(o)] for o, _, _ in kept}, rerun

    g0, b0, _, rerun0 = steps(False)
    g1, b1, kept, rerun1 = steps(True)
    # (under autocast a region's convolution multiplies by a bf16 copy of its weight: matmuls are counted there)
    convs = {n for n in kept if ("conv" in n and not amp) or n.endswith(".linear")}
    assert convs and all(f"{n}.weight" in rerun0 and f"{n}.weight" not in rerun1 for n in convs), (convs, rerun1)
    if arch.startswith("sdt"):
        assert {"blocks.0.attn.proj.linear", "blocks.0.mlp.fc2.linear", "patch_embed.rpe_conv"} <= kept
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g0, g1))
    assert all(torch.equal(a, b) for a, b in zip(b0, b1))


def test_kept_outputs_name_neurons_linears_or_convolutions_of_rerun_units() -> None:
    from efficient.memory import levels

    net = _wide_units()
    with pytest.raises(ConfigError, match=r"outputs: '1.bn' is not a spiking neuron, Linear or convolution of a rerun unit"):
        levels.apply(net, "recompute", outputs=["1.bn"])
    with pytest.raises(ConfigError, match=r"outputs: '1.lif' is not a spiking neuron, Linear or convolution of a rerun unit .*rerun units: 0, 2"):
        levels.apply(net, "recompute", plain=["1", "3", "4"], outputs=["1.lif"])
    with pytest.raises(ConfigError, match=r"unit '1' keeps costly-op outputs \(keep\) and an output"):
        levels.apply(net, "recompute", keep={"1": [0]}, outputs=["1.lif"])
    with pytest.raises(ConfigError, match=r"outputs: '1.lif' is not a spiking neuron, Linear or convolution of a rerun"):
        levels.apply(net, "bits", outputs=["1.lif"])


def test_the_peak_planner_keeps_the_outputs_whose_span_leaves_the_peak_within_the_target() -> None:
    """The planner's last step keeps a rerun unit's output where, over its life (its unit's forward to its
    rerun), the step's peak stays within the target. With no room at all, unit 0's output (alive through the
    wide unit 1's rerun, which holds the peak) is not kept, and those of units 1-4 are, unit 1's 1 MiB
    included (it is handed to its own rerun, before which backward holds little): each checked against the
    peak measured with it alone; the peak returned is the plan's, measured again independently."""
    from efficient.memory import levels
    from efficient.memory.measure import activation_memory, step_peak_bytes
    from efficient.memory.plan import _reruns_keeping_outputs

    x = torch.rand(4, 16, 8, 8, generator=torch.Generator().manual_seed(7)).round()

    def peak(model: nn.Module, outputs: list[str]) -> int:
        levels.apply(model, "recompute", outputs=outputs)
        activation_memory(model, x, backward=True)
        return step_peak_bytes(lambda: activation_memory(model, x, backward=True))

    net = _wide_units()
    start = peak(net, [])
    alone = {f"{i}.lif": peak(net, [f"{i}.lif"]) for i in range(5)}
    assert alone["0.lif"] == start + 4 * 16 * 8 * 8 * 4  # all of its bytes at the peak
    levels.apply(net, "recompute")
    outputs, saved, measured, owners = _reruns_keeping_outputs(net, x, None, [], [], start, start)
    assert outputs == ["1.lif", "2.lif", "3.lif", "4.lif"] and owners == {"1", "2", "3", "4"}, outputs
    assert all(alone[n] <= start for n in outputs)
    rows = 4 * 16 * 8
    assert saved == sum(2 * rows * net[int(n[0])].linear.in_features * net[int(n[0])].linear.out_features for n in outputs)
    assert measured is not None and measured <= start and peak(net, outputs) == measured
    plan = levels.apply(net, "recompute", outputs=outputs)
    assert f"{len(outputs)} outputs kept for their reruns" in plan.summary()
    assert _reruns_keeping_outputs(net, x, None, ["0", "1", "2", "3", "4"], [], start, start) == ([], 0, None, set())


class _FiresFirst(nn.Module):
    """A residual half that fires on its input first, as a spike-driven transformer's attention and MLP do."""

    recompute_unit = True
    recompute_residual = True

    def __init__(self, channels: int) -> None:
        super().__init__()
        from efficient.models.neurons import LIF

        self.lif, self.linear = LIF(backend="compile"), nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.lif(x))


def test_a_rerun_holds_no_input_gradient_past_its_step() -> None:
    """A recomputed region hands its input's gradient back and keeps nothing of it: after each training step no
    tensor of the input's size is left alive. (Its input gradient once stayed alive from step to step where the
    LIF's backward wrote it over the rerun's membrane trace: a tensor per region and step, 128 MiB a step on
    SDT-2-512 at b64.)"""
    import gc

    from efficient.kernels._backend import have_cxx_compiler
    from efficient.memory import levels

    if not have_cxx_compiler():
        pytest.skip("no C++ compiler: inductor cannot compile on CPU")
    torch.manual_seed(0)
    T, B, C = 4, 8, 64
    net = nn.Sequential(_FiresFirst(C), _FiresFirst(C))
    levels.apply(net, "recompute")
    x = torch.randn(T, B, C, generator=torch.Generator().manual_seed(1)) + 0.5
    own = {id(t) for t in [*net.parameters(), *net.buffers(), x]}

    def alive() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and id(o) not in own and o.numel() == x.numel())

    before = alive()  # (earlier tests in this process may have left some of this size)
    for _ in range(3):
        net.zero_grad(set_to_none=True)
        h = x.clone().requires_grad_()
        out = h
        for half in net:  # residual halves, as a block runs them
            out = out + half(out)
        out.sum().backward()
        del out, h
        assert alive() == before


def test_a_step_timeline_places_marks_among_its_allocations() -> None:
    """`step_timeline`: live bytes after each allocation record, exactly, and where each `mark` fell."""
    from efficient.memory.measure import mark, step_timeline

    def step() -> None:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        mark("between")
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        del a
        mark("end")
        del b

    tl = step_timeline(step)
    assert tl.live == [4000, 8000, 4000, 0] and tl.peak == 8000
    assert tl.marks == {"between": [1], "end": [3]}


def test_budget_errors_name_what_is_wrong(tmp_path: Path) -> None:
    net, x = _budget_net(), torch.rand(3, 2, 2, 16, 16)
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        memory.optimize(net, "recompute", budget=1.5, example=x)
    with pytest.raises(ConfigError, match="example inputs"):
        memory.optimize(net, "recompute", budget=0.2)
    with pytest.raises(ConfigError, match="level recompute only"):
        memory.optimize(net, "bits", budget=0.2, example=x)
    with pytest.raises(ConfigError, match=r"'9' not a recompute unit.*its units: 0, 2, 3"):
        memory.optimize(net, "recompute", keep={"9": [0]})
    with pytest.raises(ConfigError, match="train.memory_budget applies to train.memory: recompute"):
        Trainer(load_recipe(ROOT / "recipes" / "stata_digits.yaml", ["train.memory=bits", "train.memory_budget=0.2"]),
                tmp_path).setup()
    with pytest.raises(ConfigError, match="memory_budget"):
        load_recipe(ROOT / "recipes" / "stata_digits.yaml", ["train.memory_budget=2"])
    with pytest.raises(ConfigError, match=r"budget_of: 'bytes' is not one of saved, peak"):
        memory.optimize(net, "recompute", budget=0.2, example=x, budget_of="bytes")
    with pytest.raises(ConfigError, match="applies with a budget"):
        memory.optimize(net, "recompute", budget_of="peak")
    with pytest.raises(ConfigError, match="train.memory_budget_of applies with train.memory_budget"):
        Trainer(load_recipe(ROOT / "recipes" / "stata_digits.yaml", ["train.memory=recompute", "train.memory_budget_of=peak"]),
                tmp_path / "p").setup()
    with pytest.raises(ConfigError, match="does not work with train.compile"):
        Trainer(load_recipe(ROOT / "recipes" / "stata_digits.yaml",
                            ["train.memory=recompute", "train.memory_budget=0.2", "train.compile=true"]), tmp_path / "c").setup()


def test_a_torch_without_hooked_checkpoints_refuses_a_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch's checkpoint cannot hand kept outputs to the saved-tensor hooks (they would be neither
    counted nor packed), a budget or a plan's kept outputs stop with what to do; rerunning every unit whole
    still works. The user's own mistakes are named first."""
    import efficient.memory.recompute as rc

    monkeypatch.setattr(rc, "budget_supported", lambda: False)
    net, x = _budget_net(), torch.rand(3, 2, 2, 16, 16)
    for kw in ({"budget": 0.2, "example": x}, {"keep": {"0": [0]}}):
        with pytest.raises(ConfigError, match=rf"torch {re.escape(torch.__version__)} cannot count or pack.*drop the budget"):
            memory.optimize(net, "recompute", **kw)
    with pytest.raises(ConfigError, match="example inputs"):
        memory.optimize(net, "recompute", budget=0.2)
    with pytest.raises(ConfigError, match=r"'9' not a recompute unit"):
        memory.optimize(net, "recompute", keep={"9": [0]})
    assert memory.optimize(net, "recompute").units == ["0", "2", "3"]
