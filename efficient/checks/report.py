"""What `check` returns: one `CheckResult` per check (status, number, threshold, detail, layers)
in a `CheckReport`, which prints as console tables and serialises to JSON."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

Status = Literal["PASS", "FAIL", "SKIP"]

# id -> the name reports show, in the order they show them
CHECKS: dict[str, str] = {
    "batch": "batch independence",
    "state": "state reset between calls",
    "causality": "time causality",
    "rates": "silent / saturated layers",
    "surrogate": "dead surrogate gradients",
    "binary": "binary spikes",
}
LAYERS_NAMED = 4  # layers named in a result's detail before "and N more"


@dataclass
class LayerFinding:
    """One spiking layer's number within a check (a rate, a gradient fraction, a difference)."""

    layer: str
    value: float
    note: str = ""


@dataclass
class CheckResult:
    """One check: its status, its number (`value`, shown as `shown`) against `threshold`, a sentence
    saying what was measured or found, and the layers behind a FAIL (or per-layer numbers)."""

    id: str
    name: str
    status: Status
    value: float | None
    shown: str
    threshold: str
    detail: str
    layers: list[LayerFinding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; an infinite value (a shape or call count that changed) becomes None."""
        d = dataclasses.asdict(self)
        d["value"] = _json_number(self.value)
        for layer in d["layers"]:
            layer["value"] = _json_number(layer["value"])
        return d


@dataclass
class CheckReport:
    """All checks of one model: `passed` (no FAIL), `failed`, `report[id]`, `to_dict()`, `tables()`."""

    model: str
    input: str
    spiking_layers: list[tuple[str, str]]  # (name, kind) in module order
    results: list[CheckResult]

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "FAIL"]

    def __getitem__(self, check_id: str) -> CheckResult:
        for r in self.results:
            if r.id == check_id:
                return r
        raise KeyError(f"no check {check_id!r} in this report; it has {', '.join(r.id for r in self.results)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "input": self.input,
            "passed": self.passed,
            "spiking_layers": [{"name": n, "kind": k} for n, k in self.spiking_layers],
            "checks": [r.to_dict() for r in self.results],
        }

    def tables(self) -> list[Any]:
        """The results as console tables (`FitTable`s that fit the width they are printed at): one
        row per check, then the layers behind each FAIL."""
        from efficient.profiler.console import Column, FitTable, number

        rs = self.results
        caption = f"{len(self.spiking_layers)} spiking layers; input: {self.input}"
        out: list[Any] = [FitTable([
            Column("check", [r.name for r in rs], name=True),
            Column("result", [_styled(r.status) for r in rs]),
            number("value", [r.shown for r in rs]),
            Column("pass when", [r.threshold for r in rs], drop=2),
            Column("detail", [r.detail for r in rs], wrap=True, min_width=24, drop=1),
        ], title=f"efficient check: {self.model}", caption=caption)]
        for r in self.failed:
            if r.layers:
                out.append(FitTable([
                    Column("layer", [f.layer for f in r.layers], name=True),
                    number("value", [_fmt(f.value) for f in r.layers]),
                    Column("note", [f.note for f in r.layers], wrap=True, min_width=16),
                ], title=f"{r.name}: layers"))
        return out

    def __str__(self) -> str:
        lines = [f"efficient check: {self.model} ({'passed' if self.passed else 'FAILED'}; input: {self.input})"]
        for r in self.results:
            lines.append(f"  {r.status:4}  {r.name}: {r.shown} ({r.threshold}). {r.detail}")
        return "\n".join(lines)


def _styled(status: Status) -> Any:
    from rich.text import Text

    return Text(status, style={"PASS": "green", "FAIL": "bold red", "SKIP": "yellow"}[status])


def _json_number(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return "inf"
    return "0" if v == 0 else f"{v:.3g}"


def _name_some(names: Sequence[str]) -> str:
    shown = ", ".join(names[:LAYERS_NAMED])
    return shown + (f" and {len(names) - LAYERS_NAMED} more" if len(names) > LAYERS_NAMED else "")
