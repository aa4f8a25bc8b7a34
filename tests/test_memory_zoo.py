"""Activation-memory levels on every zoo model with spiking neurons, in every mode of the zoo
reference (train before / during / after STATA's warm-up, eval): `bits` keeps the spikes autograd
saves as bits and must give bitwise the outputs, gradients, buffers and STATA statistics of `none`;
`recompute` reruns units in backward and must agree with `none` within the zoo reference's tolerance
(in float64 it is exact on this CPU; the tolerance covers reordered sums elsewhere)."""

from __future__ import annotations

import pytest

import zoo_reference as zr
from conftest import needs_budget
from efficient import memory

# every model with neurons, but not the ImageNet-size variants (8 or 10 blocks): their units are
# the CIFAR-size variants' units, at several times the run time
SPIKING_CASES = [c for c in zr.CASES if not c.name.startswith(("bilipnet", "ee-gpt", "mlp"))
                 and "-8-" not in c.id and "-10-" not in c.id]
SPIKING_CASES = [zr.narrow(c) for c in SPIKING_CASES]  # the same units and modes at 64 channels


def _optimized(level: str):
    return lambda model: memory.optimize(model, level)


@pytest.mark.parametrize("case", SPIKING_CASES, ids=[c.id for c in SPIKING_CASES])
def test_levels_keep_what_a_step_computes(case: zr.Case) -> None:
    none = zr.compute_case(case)
    bits = zr.compute_case(case, perturb=_optimized("bits"))
    assert bits == none, "bits changed a value: spikes are not restored bit for bit"
    recompute = zr.compute_case(case, perturb=_optimized("recompute"))
    diffs = zr.compare(none, recompute, rtol=case.rtol)
    assert not diffs, f"recompute differs from none in {len(diffs)} places, first: {diffs[:3]}"


@pytest.mark.parametrize("level", ["bits", "recompute"])
def test_levels_run_the_units_as_the_same_fused_ops(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the one-op BatchNorm + LIF rounds its statistics unlike cuDNN's BatchNorm, so a level
    that split the units would flip spikes there (on this CPU the two agree bit for bit, so only the
    count of fused calls can show it): bits makes the same calls as none, recompute each twice."""
    import torch

    from efficient.models import neurons
    from efficient.zoo import create

    calls = []
    real = neurons.bn_lif
    monkeypatch.setattr(neurons, "bn_lif", lambda *a, **k: calls.append(1) or real(*a, **k))

    def fused_calls(lvl: str) -> int:
        torch.manual_seed(0)
        model = create("spikformer-4-384", embed_dim=32, depth=1, num_heads=2, img_size=16).train()
        if lvl != "none":
            memory.optimize(model, lvl)
        calls.clear()
        model(torch.rand(2, 3, 16, 16)).sum().backward()
        return len(calls)

    none = fused_calls("none")
    assert none > 0, "the reference model ran no fused unit"
    assert fused_calls(level) == (none if level == "bits" else 2 * none)


# tiny zoo models whose units run as the fused BatchNorm + LIF op (with and without STATA)
REBUILDING = ["spikformer-tiny", "spikformer-tiny-stata", "qkformer-tiny-stata", "spikingformer-tiny-stata",
              "sdt-v2-tiny-stata"]


@pytest.mark.parametrize("name", REBUILDING)
def test_bits_rebuilds_membranes_and_keeps_nones_gradients(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At level bits a fused BatchNorm + LIF unit keeps z but not its membrane trace, and its backward
    rebuilds the trace in one piece (`bn_lif(rebuild_whole=True)`): two SGD steps give level none's
    losses, gradients, running statistics and STATA statistics bit for bit, every fused unit of the
    step rebuilds, and at level none none does."""
    import copy

    import torch
    import torch.nn.functional as F

    from efficient.kernels import bn_lif
    from efficient.zoo import create

    rebuilt: list[bool] = []
    real = bn_lif._chunked_recompute
    monkeypatch.setattr(bn_lif, "_chunked_recompute",
                        lambda *a, **k: rebuilt.append(bool(k.get("whole"))) or real(*a, **k))
    torch.manual_seed(0)
    base = create(name).train()
    x = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([3, 7])

    def steps(level: str) -> tuple[list, dict]:
        model = copy.deepcopy(base)
        memory.optimize(model, level)
        seen = []
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            seen.append((loss.detach(), [p.grad for p in model.parameters()]))
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(0.05 * p.grad)
        return seen, model.state_dict()

    none = steps("none")
    assert rebuilt == [], "level none rebuilt a membrane trace"
    bits = steps("bits")
    assert rebuilt and all(rebuilt), f"level bits rebuilt {len(rebuilt)} traces, whole: {set(rebuilt)}"
    for (loss_n, grads_n), (loss_b, grads_b) in zip(none[0], bits[0]):
        assert torch.equal(loss_n, loss_b)
        for gn, gb in zip(grads_n, grads_b):
            assert (gn is None) == (gb is None) and (gn is None or torch.equal(gn, gb))
    assert none[1].keys() == bits[1].keys()
    for k in none[1]:
        assert torch.equal(none[1][k], bits[1][k]), k
    keeping = copy.deepcopy(base)  # the level as it was, for comparison (bench/memory.py bits-keep-membrane)
    memory.optimize(keeping, "bits")
    keeping._efficient_memory.rebuild = False
    rebuilt.clear()
    F.cross_entropy(keeping(x), y).backward()
    assert rebuilt == []


# stages 0 and 1 rerun together: their reruns hold less than stage 2's alone (`group_stages`)
STEM_PARTS = {"spikformer-4-384": ["stage0-1", "stage2", "stage3", "rpe"],
              "sdt-2-512": ["stage0-1", "stage2", "tail"]}
# where the stem's rerun, not a block's, sets the step's peak at these shapes. Spikformer's stem rerun whole
# writes its widest stage's gradient into that stage's z (`bn_lif_max_pool(donate=True)`), and its block's
# rerun now sets the peak staged or whole (as at CIFAR size: BENCHMARKS.md `## memory`)
STEM_SETS_PEAK = {"sdt-2-512"}


def _recorded_step(model, x, y) -> tuple[dict, dict, int]:
    """One cross-entropy training step of `model`: its parameters' gradients by name, its state dict after
    the step, and the step's peak of live tensor bytes."""
    import copy

    import torch
    import torch.nn.functional as F

    from efficient.memory.measure import step_peak_bytes

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        out = model(x)
        F.cross_entropy(out if torch.is_tensor(out) else out[0], y).backward()

    peak = step_peak_bytes(step)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, copy.deepcopy(model.state_dict()), peak


@pytest.mark.parametrize("name", sorted(STEM_PARTS))
def test_the_stem_is_recomputed_stage_by_stage(name: str, monkeypatch) -> None:
    """At level recompute the SPS stem (Spikformer's; the Spike-driven Transformer's MS-SPS) is a
    unit per stage, not one: the same gradients and running statistics as the stem rerun whole and
    as `none`, the same state dict, and a lower peak of live tensor bytes in the step than the
    stem rerun whole where the stem sets the peak (backward holds one stage's rerun at a time), and
    lower than reruns that keep their membrane traces and pool inputs."""
    import copy

    import torch

    from efficient.zoo import create

    from efficient.kernels import bn_lif

    # chunks of channels as small as these units (2^19 elements in the largest stage) make those of a full-size model
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 1 << 15)
    torch.manual_seed(0)
    # mlp_ratio 1: blocks as small as they go, so the stem's reruns can set the peak (`STEM_SETS_PEAK`)
    base = create(name, embed_dim=64, depth=1, num_heads=2, img_size=32, mlp_ratio=1).train()
    x, y = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])

    none = _recorded_step(copy.deepcopy(base), x, y)
    staged_model = copy.deepcopy(base)
    plan = memory.optimize(staged_model, "recompute")
    assert [u for u in plan.units if u.startswith("patch_embed")] == [f"patch_embed.{p}" for p in STEM_PARTS[name]]
    # a pooled stage computes its spikes in forward only: its rerun, which serves its backward, leaves them
    calls = {"forward": 0, "backward": 0}

    def counted(key, fn):
        def run(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(bn_lif, "_pooled_forward", counted("forward", bn_lif._pooled_forward))
    monkeypatch.setattr(bn_lif, "_pooled_rerun_backward", counted("backward", bn_lif._pooled_rerun_backward))
    staged = _recorded_step(staged_model, x, y)
    monkeypatch.undo()
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 1 << 15)
    assert calls["forward"] == calls["backward"] > 0, calls
    whole_model = copy.deepcopy(base)
    whole_model.patch_embed.recompute_parts = list  # the stem as one unit
    assert "patch_embed" in memory.optimize(whole_model, "recompute").units
    whole = _recorded_step(whole_model, x, y)
    # reruns that keep their membrane traces and pool inputs, as outside a region (wrap(lean=False))
    from efficient.memory import recompute as rc

    kept_model = copy.deepcopy(base)
    units = dict(rc.units(kept_model))
    for unit in memory.optimize(kept_model, "recompute").units:
        rc.wrap(units[unit], lean=False)
    kept = _recorded_step(kept_model, x, y)
    assert staged_model.state_dict().keys() == base.state_dict().keys()
    for other in (whole, kept, none):
        assert staged[0].keys() == other[0].keys()
        for k in staged[0]:
            torch.testing.assert_close(staged[0][k], other[0][k], rtol=1e-4, atol=1e-6)
        for k in base.state_dict():
            torch.testing.assert_close(staged[1][k], other[1][k], rtol=1e-5, atol=1e-6)
    peaks = f"peaks staged {staged[2]}, staged keeping H {kept[2]}, whole stem {whole[2]}, none {none[2]}"
    assert staged[2] < kept[2] and max(kept[2], whole[2]) < none[2], peaks
    if name in STEM_SETS_PEAK:
        assert staged[2] < whole[2], peaks


@pytest.mark.parametrize("name, kw", [("sdt-2-512", {}), ("spikformer-4-384", {"stem_pool": "before_neuron"})],
                         ids=["sdt-tail", "spikformer-pool-before-neuron"])
def test_stem_stages_pooling_batchnorm_output_rerun_it_by_chunks(name: str, kw: dict, monkeypatch) -> None:
    """A stem stage that max-pools its BatchNorm output (the Spike-driven Transformer's tail; every pooled
    stage of spikingjelly's Spikformer) runs BatchNorm and the pool as one op by chunks of channels inside
    its region at level recompute (`bn_max_pool`), forward and rerun: the gradients and running statistics
    of the separate calls bit for bit (per channel), `none`'s within tolerance, and a lower peak of live bytes
    while the SDT's tail reruns (its BatchNorm output, int64 indices and two gradients as large as its z were
    that rerun's peak; at full size, the step's)."""
    import copy

    import torch

    from efficient.kernels import bn_lif, bn_max_pool as bmp
    from efficient.models import neurons
    from efficient.zoo import create

    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 1 << 14)  # chunks as small as these units make a full size's
    torch.manual_seed(0)
    base = create(name, embed_dim=64, depth=1, num_heads=2, img_size=32, mlp_ratio=1, **kw).train()
    x, y = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    none = _recorded_step(copy.deepcopy(base), x, y)

    def tail_rerun_peak() -> int:  # the most live bytes while the tail's rerun and backward run
        import numpy as np
        import torch.nn.functional as F

        from efficient.memory.measure import step_timeline
        from efficient.memory.plan import _marking, _rerun_at

        model = copy.deepcopy(base)
        memory.optimize(model, "recompute")
        with _marking(model):
            line = step_timeline(lambda: F.cross_entropy(model(x), y).backward())
        live = np.asarray(line.live)
        return max(live[k] for k in range(len(live)) if _rerun_at(line.marks, k) == "patch_embed.tail")

    calls = {"forward": 0, "backward": 0}
    forward, backward = bmp._BNMaxPool.forward, bmp._BNMaxPool.backward

    def counted_forward(ctx, *args):
        calls["forward"] += 1
        return forward(ctx, *args)

    def counted_backward(ctx, *args):
        calls["backward"] += 1
        return backward(ctx, *args)

    monkeypatch.setattr(bmp._BNMaxPool, "forward", staticmethod(counted_forward))
    monkeypatch.setattr(bmp._BNMaxPool, "backward", staticmethod(counted_backward))
    model = copy.deepcopy(base)
    memory.optimize(model, "recompute")
    chunked = _recorded_step(model, x, y)
    pooled_stages = 1 if name == "sdt-2-512" else 2
    # each pooled stage: its region's forward and its rerun, then the rerun's backward
    assert calls == {"forward": 2 * pooled_stages, "backward": pooled_stages}, calls
    monkeypatch.setattr(neurons, "bn_max_pool", lambda *args, **kwargs: None)  # the separate calls
    model = copy.deepcopy(base)
    memory.optimize(model, "recompute")
    separate = _recorded_step(model, x, y)
    assert calls["backward"] == pooled_stages
    for k in none[0]:
        assert torch.equal(chunked[0][k], separate[0][k]), k
        torch.testing.assert_close(chunked[0][k], none[0][k], rtol=1e-4, atol=1e-6)
    for k in none[1]:
        assert torch.equal(chunked[1][k], separate[1][k]), k
        torch.testing.assert_close(chunked[1][k], none[1][k], rtol=1e-5, atol=1e-6)
    if name == "sdt-2-512":
        separate_peak = tail_rerun_peak()
        monkeypatch.setattr(neurons, "bn_max_pool", bmp.bn_max_pool)
        chunked_peak = tail_rerun_peak()
        assert chunked_peak < 0.7 * separate_peak, (chunked_peak, separate_peak)


@pytest.mark.parametrize("name, kw, shape", [
    ("spikformer-4-384", {"img_size": 32, "mlp_ratio": 8}, (4, 3, 32, 32)),
    ("spikformer-tiny-stata", {"img_size": 8, "prune_blocks": [1, 2], "keep_ratio": 0.5}, (16, 1, 8, 8)),
], ids=["dense", "stata"])
def test_spikformer_blocks_rerun_by_halves_with_nones_gradients(name: str, kw: dict, shape: tuple) -> None:
    """At level recompute a Spikformer block is two units, x + attention and the MLP: the gradients and
    running statistics of `none` bit for bit (at this width x feeds q, k and v separately, and the first half
    sums their gradients with the stream's as `none` does), the same module tree and state dict, and a lower
    step peak than the block rerun whole where a wide MLP's rerun sets it (ratio 8: backward holds one half's
    rerun at a time)."""
    import copy

    import torch

    from efficient.zoo import create

    torch.manual_seed(0)
    base = create(name, embed_dim=64, depth=2, num_heads=2, **kw).train()
    x, y = torch.rand(*shape), torch.arange(shape[0]) % 10

    none = _recorded_step(copy.deepcopy(base), x, y)
    halves_model = copy.deepcopy(base)
    units = memory.optimize(halves_model, "recompute").units
    assert [u for u in units if u.startswith("blocks")] == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
    halves = _recorded_step(halves_model, x, y)
    assert [n for n, _ in halves_model.named_modules()] == [n for n, _ in base.named_modules()]
    assert halves[0].keys() == none[0].keys() and all(torch.equal(halves[0][n], none[0][n]) for n in none[0])
    assert halves[1].keys() == none[1].keys() and all(torch.equal(halves[1][k], none[1][k]) for k in none[1])
    if name == "spikformer-4-384":
        whole_model = copy.deepcopy(base)
        for blk in whole_model.blocks:
            blk.recompute_parts = list  # the block as one unit
        assert "blocks.0" in memory.optimize(whole_model, "recompute").units
        whole = _recorded_step(whole_model, x, y)
        assert halves[2] < whole[2] < none[2], (halves[2], whole[2], none[2])


def test_a_folded_stem_stays_folded_in_its_stages() -> None:
    """The stages call the stem's modules as they are when called: folding BatchNorm for inference
    (which replaces the stem's BatchNorms) changes what the stages compute, and matches the unfolded
    model's evaluation output."""
    import torch

    from efficient import fold_batchnorm
    from efficient.zoo import create

    torch.manual_seed(0)
    model = create("spikformer-4-384", embed_dim=64, depth=1, num_heads=2, img_size=32)
    x = torch.rand(2, 3, 32, 32)
    model.train()
    model(torch.rand(8, 3, 32, 32))  # running statistics away from their defaults
    model.eval()
    with torch.no_grad():
        ref = model(x)
        folded = fold_batchnorm(model, x)
        assert any(n.startswith("patch_embed.bns") for n in folded)
        assert all(not isinstance(m, torch.nn.BatchNorm2d) for m in model.patch_embed.modules())
        torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-4)


def test_stem_stages_group_while_their_reruns_fit_the_largest() -> None:
    """`group_stages` joins consecutive stages while their rerun sizes sum to at most the largest unit's,
    so a grouped rerun never holds more than the stem's largest stage does alone; at 128 px (event
    frames, every stage pooled) the first stage is the largest and the later ones group instead."""
    from efficient.models.spikformer import StemStages, group_stages
    from efficient.zoo import create

    def groups(sizes: list[int], peak: int) -> list[list[int]]:
        parts = group_stages(list(range(len(sizes))), sizes, peak)  # type: ignore[arg-type]
        return [p._members if isinstance(p, StemStages) else [p] for p in parts]

    assert groups([1, 2, 4, 2], 4) == [[0, 1], [2], [3]]
    assert groups([4, 2, 1, 1], 4) == [[0], [1, 2, 3]]
    assert groups([3, 3, 3], 3) == [[0], [1], [2]]
    assert groups([1, 1, 1], 8) == [[0, 1, 2]]
    for sizes, peak in [([5, 1, 4, 2, 2], 6), ([2, 3, 1, 6], 6)]:
        for g in groups(sizes, peak):
            assert sum(sizes[i] for i in g) <= peak
    plan = memory.optimize(create("spikformer-2-256-dvs", embed_dim=64, num_heads=4), "recompute")
    assert [u for u in plan.units if "patch_embed" in u] == ["patch_embed.stage0", "patch_embed.stage1-3", "patch_embed.rpe"]


@pytest.mark.parametrize("name,kw", [
    ("spikformer-4-384", {"embed_dim": 64, "depth": 1, "num_heads": 2, "img_size": 32, "mlp_ratio": 1}),
    ("sdt-2-512", {"embed_dim": 64, "depth": 1, "num_heads": 2, "img_size": 32, "mlp_ratio": 1}),
    ("stable-snn-vgg11", {"width": 0.125, "fc_dim": 64, "timesteps": 2}),
], ids=["spikformer", "sdt", "vgg"])
@pytest.mark.parametrize("budget", [None, pytest.param(0.2, marks=needs_budget)], ids=["rerun-whole", "budget"])
def test_a_retained_graph_backpropagates_twice_at_recompute(name: str, kw: dict, budget: float | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A second backward through a retained graph (`retain_graph=True`) reruns every unit again and adds
    the same gradients, as at level `none`: the reruns' contexts are entered afresh, and a unit whose
    backward writes z's gradient into z (a stem stage, a VGG unit) writes into the rerun's own z. With a
    budget the units that keep outputs are torch's selective checkpoints, which refuse a second
    backward by name."""
    import copy

    import torch
    import torch.nn.functional as F

    from efficient.kernels import bn_lif
    from efficient.zoo import create

    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 1 << 15)  # the chunked, donating paths of a full-size model
    torch.manual_seed(0)
    base = create(name, **kw).train()
    x, y = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])

    def twice(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        loss = F.cross_entropy(model(x), y)
        loss.backward(retain_graph=True)
        once = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        loss.backward()
        return once, [p.grad for p in model.parameters() if p.grad is not None]

    none_once, none_twice = twice(copy.deepcopy(base))
    model = copy.deepcopy(base)
    memory.optimize(model, "recompute", **({} if budget is None else {"budget": budget, "example": x}))
    if budget is not None:
        with pytest.raises(RuntimeError, match="only allowed to backward once"):
            twice(model)
        return
    once, both = twice(model)
    assert len(once) == len(none_once)
    for a, b, c in zip(once, both, none_twice):
        torch.testing.assert_close(b, 2 * a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-6)
