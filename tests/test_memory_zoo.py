"""Activation-memory levels on every zoo model with spiking neurons, in every mode of the zoo
reference (train before / during / after STATA's warm-up, eval): `bits` keeps the spikes autograd
saves as bits and must give bitwise the outputs, gradients, buffers and STATA statistics of `none`;
`recompute` reruns units in backward and must agree with `none` within the zoo reference's tolerance
(in float64 it is exact on this CPU; the tolerance covers reordered sums elsewhere)."""

from __future__ import annotations

import pytest

import zoo_reference as zr
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
