"""Training-time measures: functions `(model, batch, **options) -> dict[str, float]` that a recipe
can ask the engine to log (`train.measures: [names]`). Each is costly (extra forwards or
per-sample Jacobians): log them every few steps on a small batch.

    local_complexity    density of ReLU region boundaries near the inputs (grokking progress)
    agop_alignment      average gradient outer product statistics, cosine to a target AGOP
    ntk_top_eigenvalue  top tangent-kernel eigenvalue and the critical step 2/lambda (catapults)
"""

from __future__ import annotations

from typing import Any, Callable

from efficient.errors import ConfigError, did_you_mean
from efficient.metrics.catapult import agop_alignment, ntk_top_eigenvalue
from efficient.metrics.local_complexity import local_complexity

MEASURES: dict[str, Callable[..., dict[str, float]]] = {
    "local_complexity": local_complexity,
    "agop_alignment": agop_alignment,
    "ntk_top_eigenvalue": ntk_top_eigenvalue,
}


def get_measure(name: str) -> Callable[..., dict[str, float]]:
    if name not in MEASURES:
        raise ConfigError(f"unknown measure {name!r}.{did_you_mean(name, MEASURES)} Available: {', '.join(sorted(MEASURES))}.")
    return MEASURES[name]


def measure(names: list[str], model: Any, batch: Any) -> dict[str, float]:
    """All requested measures on one batch, merged into one dict."""
    out: dict[str, float] = {}
    for n in names:
        out.update(get_measure(n)(model, batch))
    return out
