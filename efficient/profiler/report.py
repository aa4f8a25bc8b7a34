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
    neurobench: dict[str, Any] | None = None  # NeuroBench's metrics, with its definitions

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
            "neurobench": self.neurobench,
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

    def to_html(self, max_layers: int = 60) -> str:
        """A self-contained HTML page: totals, the conventions block, NeuroBench's metrics, layers."""
        from efficient.profiler.render import html_page

        return html_page(self, max_layers=max_layers)

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


FIRING_RATE_DEFINITION = (
    "spikes per neuron per time step: a layer's spikes / (its neurons x time steps), pooled over the samples of "
    "the pass and over repeated calls; mean_firing_rate pools all spiking layers (total spikes / total neuron-steps), "
    "so a layer weighs by its neuron-steps; a compute layer's input rate is the nonzero fraction of its spike operand")


def conventions_block(conv: Any, emodel: Any, flops_per_mac: float, layers: list[LayerStat], stack: Any, mode: Any,
                      mmodel: Any = None) -> dict[str, Any]:
    """What a number in this report means: one block shown in every output (table, JSON, markdown, HTML)."""
    real_in = [layer.name for layer in layers if layer.real_operand_macs]
    int_layers = sorted({layer.name for layer in layers if layer.int_operand_macs or layer.int_operand_acs})
    mixed = sum(acc.mixed_ops for acc in stack.layers.values())
    integer = {
        "mac": "integer-valued operand units (spike counts, residual sums) are charged as MACs (conservative)",
        "accumulate": "integer-valued operand units are charged value x fan-out accumulates (an integer n is n spikes)",
        "nonzero": "integer-valued operand units are charged nonzeros x fan-out accumulates, as if binary",
    }[conv.integer]
    block: dict[str, Any] = {
        "preset": conv.name,
        "source": conv.source,
        "formula": conv.formula,
        "dense_macs": "every matmul/conv/linear multiply-accumulate, counted dense (what fvcore counts)",
        "macs": "multiply-accumulates of real-valued operand units (token rows of matmul operands, samples of conv inputs)",
        "sops": "binary {0,1} operand units: nonzeros x fan-out; conv fan-out exact at padded borders",
        "classification": ("per unit: a matmul operand's rows along its contiguous axis (tokens), a convolution's samples; "
                           "a tensor mixing spike, integer and real units is split, not rounded to its costliest class; "
                           f"{mixed} op(s) here had mixed operands"),
        "integer_operands": integer + (f"; layers with integer operands: {', '.join(int_layers)}" if int_layers else
                                       "; no layer saw integer operands"),
        "real_input_layers": real_in,
        "spike_matmul": {
            "operand": "spike x spike matmul: nnz(left operand) x fan-out",
            "coincidence": "spike x spike matmul: number of coinciding (1,1) products",
        }[conv.spike_matmul],
        "firing_rate": FIRING_RATE_DEFINITION,
        "timesteps": "T enters through the ops executed: counts cover every time step of the pass and are never multiplied by T again",
        "flops": f"flops = {flops_per_mac:g} x dense_macs",
        "energy": (f"energy_pj = {emodel.e_mac_pj:g} pJ x macs + {emodel.e_ac_pj:g} pJ x sops ({emodel.name}: {emodel.source}); "
                   + ("compute only" if mmodel is None else "compute; memory traffic reported beside it as energy_memory_pj")),
    }
    if conv.after_first == "nonzero":
        first = mode.ctx.first_layer
        block["first_layer"] = (f"{first}: charged as counted; every later op charges nonzeros of its activation operand x "
                                f"fan-out as accumulates" + (" (real-valued rows kept as MACs)" if conv.real_rows == "exact" else ""))
    if conv.modules_only:
        block["modules_only"] = ("macs and sops are NeuroBench's Effective MACs / ACs of nn.Linear / nn.Conv modules; "
                                 "ops outside them (attention matmuls, functional code) count 0")
    if mmodel is not None:
        block["memory_access"] = (f"{mmodel.name}: {mmodel.source}. Weights: one read per MAC or AC; inputs: one read per "
                                  "spike event, per MAC of a real conv input, per element of a real matmul input; membrane "
                                  "potentials: read + write per AC and per neuron per time step; spikes: one write each; "
                                  "outputs of MAC ops: one write each")
    return block


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
