"""`Report`: what a model costs (totals, per layer, per neuron, per block, per exit) and its renderers."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from efficient.errors import closest
from efficient.profiler.layers import LayerStat
from efficient.profiler.units import fmt_count, fmt_energy, fmt_rate

__all__ = ["Report", "Comparison", "LayerStat", "TOTAL_KEYS", "PER_SAMPLE_KEYS", "COMPARE_KEYS", "ratio", "pct_change",
           "fmt_count", "fmt_energy", "fmt_rate"]

# Columns compared side by side and shown in tables, in order.
TOTAL_KEYS = ("params", "dense_macs", "macs", "sops", "flops", "energy_pj", "energy_pj_per_sample", "mean_firing_rate")
# Totals that grow with the profiled batch; a comparison divides them by each report's batch size.
PER_SAMPLE_KEYS = ("dense_macs", "macs", "sops", "flops", "energy_pj")
COMPARE_KEYS = ("params", *PER_SAMPLE_KEYS, "mean_firing_rate")


@dataclass
class Report:
    """A profile of one forward pass. `totals` is a plain dict of numbers (stored in summary.json)."""

    totals: dict[str, float]
    layers: list[LayerStat]
    meta: dict[str, Any] = field(default_factory=dict)
    blocks: list[dict[str, Any]] = field(default_factory=list)  # tokens entering each block
    exits: dict[str, Any] | None = None  # early-exit models: per-exit cost, distribution, bound
    modules: dict[str, dict[str, float]] = field(default_factory=dict)  # aggregated by module prefix
    warnings: list[str] = field(default_factory=list)

    # ---- views -------------------------------------------------------------------------------
    @property
    def neurons(self) -> list[LayerStat]:
        return [layer for layer in self.layers if layer.is_neuron]

    @property
    def compute_layers(self) -> list[LayerStat]:
        return [layer for layer in self.layers if layer.dense_macs > 0]

    def layer(self, name: str) -> LayerStat:
        for layer in self.layers:
            if layer.name == name:
                return layer
        hint = closest(name, [layer.name for layer in self.layers])
        raise KeyError(f"no layer {name!r} in this report" + (f"; did you mean {hint[0]!r}?" if hint else ""))

    def top_modules(self, depth: int = 1, k: int = 10) -> list[dict[str, Any]]:
        """DeepSpeed-style summary: modules at `depth` ranked by energy (then MACs)."""
        rows = [dict(name=n, **v) for n, v in self.modules.items()
                if n and (n.count(".") == depth - 1 or n.startswith("("))]
        rows.sort(key=lambda r: (r["energy_pj"], r["dense_macs"]), reverse=True)
        return rows[:k]

    # ---- renderers ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "totals": self.totals,
            "layers": [asdict(layer) for layer in self.layers],
            "blocks": self.blocks,
            "exits": self.exits,
            "modules": self.modules,
            "warnings": self.warnings,
        }

    def to_json(self, path: str | Path | None = None, indent: int = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent, default=_json_default)
        if path is not None:
            _write(path, text)
        return text

    def to_csv(self, path: str | Path | None = None) -> str:
        buf = io.StringIO()
        cols = ["name", "type", "dense_macs", "macs", "sops", "energy_pj", "input_firing_rate",
                "output_firing_rate", "neuron", "ops", "params"]
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        for layer in self.layers:
            d = asdict(layer)
            w.writerow(["" if d[c] is None else d[c] for c in cols])
        text = buf.getvalue()
        if path is not None:
            _write(path, text)
        return text

    def to_markdown(self, max_layers: int = 60, depth: int = 1) -> str:
        from efficient.profiler.render import markdown

        return markdown(self, max_layers=max_layers, depth=depth)

    def to_table(self, max_layers: int = 40, depth: int = 1) -> Any:
        """rich renderables (totals, top modules at `depth`, layers) for the console."""
        from efficient.profiler.render import rich_tables

        return rich_tables(self, max_layers=max_layers, depth=depth)

    def plot(self, path: str | Path) -> Path:
        """PNG: energy per compute layer and firing rate per neuron layer."""
        from efficient.profiler.render import plot

        return plot(self, Path(path))

    def compare(self, other: "Report") -> "Comparison":
        """This report and `other` side by side, per sample (each may have run on its own batch)."""
        return Comparison(self, other)

    def per_sample(self, key: str) -> float | None:
        """A total divided by the profiled batch size for batch-extensive keys (MACs, SOPs, energy)."""
        v = self.totals.get(key)
        if v is None or key not in PER_SAMPLE_KEYS:
            return v
        return v / (self.totals.get("batch_size") or 1)

    def __repr__(self) -> str:
        t = self.totals
        return (f"Report({self.meta.get('model', '?')}: dense_macs={fmt_count(t['dense_macs'])}, "
                f"macs={fmt_count(t['macs'])}, sops={fmt_count(t['sops'])}, energy={fmt_energy(t['energy_pj'])})")


@dataclass
class Comparison:
    """Two reports side by side. `rows` give each metric per sample (MACs, SOPs, FLOPs, energy are
    divided by each report's batch size, so reports on different inputs compare), the ratio b / a
    and the percentage change of b vs a."""

    a: Report
    b: Report

    @property
    def rows(self) -> list[dict[str, Any]]:
        out = []
        for k in COMPARE_KEYS:
            va, vb = self.a.per_sample(k), self.b.per_sample(k)
            if va is None and vb is None:
                continue
            out.append({"metric": k, "per_sample": k in PER_SAMPLE_KEYS, "a": va, "b": vb,
                        "ratio": ratio(va, vb), "change_pct": pct_change(va, vb)})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a.meta.get("model"), "b": self.b.meta.get("model"), "ratio": "b / a", "rows": self.rows}

    def plot(self, path: str | Path) -> Path:
        """PNG: both models side by side, energy per layer (per sample) and firing rate per neuron layer."""
        from efficient.profiler.render import plot_comparison

        return plot_comparison(self, Path(path))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    def to_markdown(self) -> str:
        from efficient.profiler.render import comparison_markdown

        return comparison_markdown(self)

    def to_table(self) -> Any:
        from efficient.profiler.render import comparison_table

        return comparison_table(self)


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a; None when undefined (a missing value, or a == 0 with b != 0); 1 when both are 0."""
    if a is None or b is None:
        return None
    if a == 0:
        return 1.0 if b == 0 else None
    return b / a


def pct_change(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if a == 0:
        return 0.0 if b == 0 else None
    return 100.0 * (b - a) / abs(a)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _write(path: str | Path, text: str) -> None:
    from efficient.io import write_text

    write_text(path, text)
