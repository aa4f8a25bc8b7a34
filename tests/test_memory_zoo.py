"""Activation-memory levels on every zoo model with spiking neurons, in every mode of the zoo
reference (train before / during / after STATA's warm-up, eval): `bits` keeps the spikes autograd
saves as bits and must give bitwise the outputs, gradients, buffers and STATA statistics of `none`;
`recompute` reruns units in backward and must agree with `none` within the zoo reference's tolerance
(in float64 it is exact on this CPU; the tolerance covers reordered sums elsewhere)."""

from __future__ import annotations

import pytest

import zoo_reference as zr
from efficient import memory

SPIKING_CASES = [c for c in zr.CASES if c.name.startswith(("spikformer", "sdt", "stable-snn"))]


def _optimized(level: str):
    return lambda model: memory.optimize(model, level)


@pytest.mark.parametrize("case", SPIKING_CASES, ids=[c.id for c in SPIKING_CASES])
def test_levels_keep_what_a_step_computes(case: zr.Case) -> None:
    none = zr.compute_case(case)
    bits = zr.compute_case(case, perturb=_optimized("bits"))
    assert bits == none, "bits changed a value: spikes are not restored bit for bit"
    recompute = zr.compute_case(case, perturb=_optimized("recompute"))
    zr.compare(none, recompute, rtol=case.rtol)
