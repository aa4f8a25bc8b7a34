"""Every zoo model computes what the committed reference says: outputs, losses, parameter
gradients, BatchNorm statistics and STATA scores / statistics, in train and eval mode and across
the keep-ratio warm-up (see `zoo_reference.py`). A refactor that keeps numerics passes on any CPU;
one that changes behaviour fails. State-dict keys and parameter order are checked exactly, so
published checkpoints and optimizer states still load."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import zoo_reference as ref  # noqa: E402

import efficient  # noqa: E402
from efficient.models.neurons import SpikingNeuron  # noqa: E402

REFERENCE = json.loads(ref.REFERENCE.read_text(encoding="utf-8"))
CASE = {c.id: c for c in ref.CASES}


def test_every_zoo_model_has_a_reference_case():
    assert set(efficient.list_models()) <= {c.name for c in ref.CASES}
    assert [c.id for c in ref.CASES] == list(REFERENCE)


@pytest.mark.parametrize("case", ref.CASES, ids=[c.id for c in ref.CASES])
def test_matches_the_reference(case: ref.Case):
    problems = ref.compare(REFERENCE[case.id], ref.compute_case(case), rtol=case.rtol)
    assert not problems, f"{case.id}: {len(problems)} differences, first:\n" + "\n".join(problems[:15])


def _nudge_one_ulp(model: nn.Module) -> None:
    """Every float parameter and buffer moved by one float64 ulp up or down at random: the size of
    what another CPU's summation order does to a float64 result."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                up = torch.rand(t.shape, generator=g) < 0.5
                t.copy_(torch.nextafter(t, torch.where(up, torch.inf, -torch.inf).to(t.dtype)))


def test_rounding_noise_passes():
    """A one-ulp change of every weight of a STATA model (spikes, pruning, alignment losses) is
    within the tolerance: the comparison does not depend on the last bits."""
    case = CASE["spikformer-tiny-stata"]
    got = ref.compute_case(case, perturb=_nudge_one_ulp)
    assert got["init"] != REFERENCE[case.id]["init"], "the nudge changed nothing"
    worst = [0.0]
    assert ref.compare(REFERENCE[case.id], got, worst=worst) == []
    assert worst[0] > 0


def _soft_reset(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, SpikingNeuron) and getattr(m, "v_reset", None) is not None:
            m.v_reset = None  # subtract the threshold instead of resetting to 0


def _double_attention_scale(model: nn.Module) -> None:
    for m in model.modules():
        if hasattr(m, "scale") and hasattr(m, "heads"):
            m.scale = 2 * m.scale


def _bn_momentum(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = 0.2  # PyTorch's default is 0.1


@pytest.mark.parametrize(
    ("change", "where"),
    [(_soft_reset, "output"), (_double_attention_scale, "output"), (_bn_momentum, "buffers")],
    ids=["soft-reset", "attention-scale", "bn-momentum"],
)
def test_a_behaviour_change_fails(change: Callable[[nn.Module], None], where: str):
    """Planted changes a refactor could make by mistake, none of which touches the weights, are
    caught, and in the part of the record they should show in."""
    case = CASE["spikformer-tiny"]
    problems = ref.compare(REFERENCE[case.id], ref.compute_case(case, perturb=change))
    assert problems, f"{change.__name__} went unnoticed"
    assert not any(".init." in p for p in problems)
    assert any(f".{where}" in p for p in problems), problems[:5]
