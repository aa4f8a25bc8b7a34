"""Every zoo model computes bitwise what the committed reference says: outputs, losses, parameter
gradients, BatchNorm statistics and STATA scores / statistics, in train and eval mode and across
the keep-ratio warm-up (see `zoo_reference.py`). A refactor that keeps numerics passes unchanged;
state-dict keys and parameter order are checked too, so published checkpoints and optimizer
states still load."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import zoo_reference as ref  # noqa: E402

import efficient  # noqa: E402

REFERENCE = json.loads(ref.REFERENCE.read_text())


def test_every_zoo_model_has_a_reference_case():
    assert set(efficient.list_models()) <= {c.name for c in ref.CASES}
    assert [c.id for c in ref.CASES] == list(REFERENCE)


def _diff(want, got, path: str = "") -> list[str]:
    """Paths where two fingerprint records differ (first few), for a readable failure."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: missing" for k in want if k not in got] + [f"{path}.{k}: unexpected" for k in got if k not in want]
        for k in want:
            if k in got:
                out += _diff(want[k], got[k], f"{path}.{k}")
        return out
    return [] if want == got else [f"{path}: want {want!r}, got {got!r}"]


@pytest.mark.parametrize("case", ref.CASES, ids=[c.id for c in ref.CASES])
def test_bitwise_equal_to_the_reference(case: ref.Case):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference was computed single-threaded
    try:
        got = json.loads(json.dumps(ref.compute_case(case)))  # the same float / list round trip as the file
    finally:
        torch.set_num_threads(threads)
    problems = _diff(REFERENCE[case.id], got)
    assert not problems, f"{case.id}: {len(problems)} differences, first:\n" + "\n".join(problems[:15])
