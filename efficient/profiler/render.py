"""Renderers for `Report` and `Comparison`: markdown, rich tables and a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from efficient.profiler.report import fmt_count, fmt_energy, fmt_rate

if TYPE_CHECKING:
    from efficient.profiler.report import Comparison, Report

_TOTAL_ROWS = (
    ("params", "params", fmt_count),
    ("dense_macs", "dense MACs", fmt_count),
    ("macs", "MACs (real operands)", fmt_count),
    ("sops", "SOPs (spike operands)", fmt_count),
    ("flops", "FLOPs", fmt_count),
    ("energy_pj", "energy", fmt_energy),
    ("energy_pj_per_sample", "energy / sample", fmt_energy),
    ("mean_firing_rate", "mean firing rate", fmt_rate),
)


def _fmt_total(key: str, v: Any) -> str:
    for k, _, f in _TOTAL_ROWS:
        if k == key:
            return f(v)
    return str(v)


def convention_line(report: "Report") -> str:
    e = report.meta["energy"]
    return (f"energy = {e['e_mac_pj']:g} pJ x MACs + {e['e_ac_pj']:g} pJ x SOPs ({e['name']}); "
            f"FLOPs = {report.meta['flops_per_mac']:g} x dense MACs")


def _layer_rows(report: "Report", max_layers: int) -> list[list[str]]:
    rows = []
    for layer in report.layers[:max_layers]:
        rows.append([
            layer.name, layer.type, fmt_count(layer.dense_macs), fmt_count(layer.macs), fmt_count(layer.sops),
            fmt_rate(layer.input_firing_rate), fmt_rate(layer.output_firing_rate), fmt_energy(layer.energy_pj),
        ])
    return rows


_LAYER_COLS = ["layer", "type", "dense MACs", "MACs", "SOPs", "in rate", "out rate", "energy"]


def markdown(report: "Report", max_layers: int = 60, depth: int = 1) -> str:
    m = report.meta
    lines = [f"## Cost profile: {m.get('model')}", "",
             f"Input: {m.get('input')}" + (f", T = {m['timesteps']}" if m.get("timesteps") else ""),
             f"Convention: {convention_line(report)}.", "",
             "| metric | value |", "|---|---|"]
    for k, label, f in _TOTAL_ROWS:
        if k in report.totals:
            lines.append(f"| {label} | {f(report.totals[k])} |")
    if report.exits:
        lines += ["", _exits_md(report.exits)]
    if report.blocks:
        lines += ["", "Tokens entering each block: " + ", ".join(f"{b['block']}: {b['tokens_in']}" for b in report.blocks)]
    top = report.top_modules(depth)
    if top:
        total_e = report.totals["energy_pj"] or 1.0
        lines += ["", "### Top modules", "", "| module | type | params | dense MACs | SOPs | energy | share |", "|---|---|---|---|---|---|---|"]
        for r in top:
            lines.append(f"| {r['name']} | {r['type']} | {fmt_count(r['params'])} | {fmt_count(r['dense_macs'])} | "
                         f"{fmt_count(r['sops'])} | {fmt_energy(r['energy_pj'])} | {100 * r['energy_pj'] / total_e:.1f}% |")
    lines += ["", "### Layers", "", "| " + " | ".join(_LAYER_COLS) + " |", "|" + "---|" * len(_LAYER_COLS)]
    for row in _layer_rows(report, max_layers):
        lines.append("| " + " | ".join(row) + " |")
    if len(report.layers) > max_layers:
        lines.append(f"\n({len(report.layers) - max_layers} more layers in to_csv() / to_json())")
    if report.warnings:
        lines += ["", "### Warnings", ""] + [f"- {w}" for w in report.warnings]
    return "\n".join(lines) + "\n"


def _exits_md(ex: dict[str, Any]) -> str:
    lines = ["### Early exits", "", "| exit layer | MACs / token | energy / token | fraction exiting |", "|---|---|---|---|"]
    dist = ex.get("distribution") or {}
    for k, v in ex["per_exit"].items():
        frac = dist.get(k)
        lines.append(f"| {k} | {fmt_count(v['macs_per_token'])} | {fmt_energy(v['energy_pj_per_token'])} | "
                     f"{'-' if frac is None else f'{frac:.3f}'} |")
    if "expected_macs_per_token" in ex:
        lines += ["", f"Threshold {ex['threshold']:g}: expected {fmt_count(ex['expected_macs_per_token'])} MACs / token, "
                      f"{fmt_energy(ex['expected_energy_pj_per_token'])} / token; speedup bound "
                      f"{ex['speedup_bound']:.3f}x (compute only)."]
    return "\n".join(lines)


def rich_tables(report: "Report", max_layers: int = 40, depth: int = 1) -> list[Any]:
    from rich.table import Table

    m = report.meta
    t = Table(title=f"{m.get('model')}  ({m.get('input')}" + (f", T={m['timesteps']}" if m.get("timesteps") else "") + ")",
              caption=convention_line(report))
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, label, f in _TOTAL_ROWS:
        if k in report.totals:
            t.add_row(label, f(report.totals[k]))
    out: list[Any] = [t]
    top = report.top_modules(depth)
    if top:
        total_e = report.totals["energy_pj"] or 1.0
        tm = Table(title=f"top modules at depth {depth} (by energy)")
        for c in ("module", "type", "params", "dense MACs", "SOPs", "energy", "share"):
            tm.add_column(c, justify="left" if c in ("module", "type") else "right")
        for r in top:
            tm.add_row(r["name"], r["type"], fmt_count(r["params"]), fmt_count(r["dense_macs"]), fmt_count(r["sops"]),
                       fmt_energy(r["energy_pj"]), f"{100 * r['energy_pj'] / total_e:.1f}%")
        out.append(tm)
    tl = Table(title="layers")
    for c in _LAYER_COLS:
        tl.add_column(c, justify="left" if c in ("layer", "type") else "right")
    for row in _layer_rows(report, max_layers):
        tl.add_row(*row)
    out.append(tl)
    if report.blocks:
        tb = Table(title="tokens entering each block")
        tb.add_column("block")
        tb.add_column("tokens", justify="right")
        for b in report.blocks:
            tb.add_row(b["block"], str(b["tokens_in"]))
        out.append(tb)
    if report.exits:
        from rich.markdown import Markdown

        out.append(Markdown(_exits_md(report.exits)))
    return out


def comparison_markdown(c: "Comparison") -> str:
    a, b = c.a.meta.get("model"), c.b.meta.get("model")
    lines = [f"| metric | {a} | {b} | change |", "|---|---|---|---|"]
    for r in c.rows:
        ch = "-" if r["change_pct"] is None else f"{r['change_pct']:+.1f}%"
        lines.append(f"| {r['metric']} | {_fmt_total(r['metric'], r['a'])} | {_fmt_total(r['metric'], r['b'])} | {ch} |")
    return "\n".join(lines) + "\n"


def comparison_table(c: "Comparison") -> Any:
    from rich.table import Table

    t = Table(title=f"{c.a.meta.get('model')} vs {c.b.meta.get('model')}", caption=convention_line(c.a))
    for col in ("metric", str(c.a.meta.get("model")), str(c.b.meta.get("model")), "change"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for r in c.rows:
        ch = "-" if r["change_pct"] is None else f"{r['change_pct']:+.1f}%"
        t.add_row(r["metric"], _fmt_total(r["metric"], r["a"]), _fmt_total(r["metric"], r["b"]), ch)
    return t


def plot(report: "Report", path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compute = report.compute_layers
    neurons = report.neurons
    n_panels = 2 if neurons else 1
    width = max(6.0, 0.25 * max(len(compute), len(neurons), 1))
    fig, axes = plt.subplots(n_panels, 1, figsize=(min(width, 40), 3.2 * n_panels + 1), squeeze=False)
    ax = axes[0][0]
    xs = range(len(compute))
    e_mac = [report.meta["energy"]["e_mac_pj"] * layer.macs for layer in compute]
    e_ac = [report.meta["energy"]["e_ac_pj"] * layer.sops for layer in compute]
    ax.bar(xs, e_mac, label="MAC energy", color="#c0504d")
    ax.bar(xs, e_ac, bottom=e_mac, label="AC (SOP) energy", color="#4f81bd")
    ax.set_ylabel("energy (pJ)")
    ax.set_title(f"{report.meta.get('model')}: energy per layer ({convention_line(report)})", fontsize=8)
    ax.set_xticks(list(xs), [layer.name for layer in compute], rotation=90, fontsize=6)
    ax.legend(fontsize=7)
    if neurons:
        ax2 = axes[1][0]
        ax2.bar(range(len(neurons)), [n.output_firing_rate or 0.0 for n in neurons], color="#9bbb59")
        ax2.set_ylabel("firing rate")
        ax2.set_title("firing rate per spiking neuron (spikes / neuron / step)", fontsize=8)
        ax2.set_xticks(list(range(len(neurons))), [n.name for n in neurons], rotation=90, fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
