"""Renderers for `Report` and `Comparison`: markdown, rich tables and a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence

from efficient.profiler.layers import LayerStat
from efficient.profiler.units import fmt_count, fmt_energy, fmt_rate


class Report(Protocol):
    """What the renderers read of a profile (`efficient.profiler.Report`)."""

    @property
    def totals(self) -> dict[str, float]: ...

    @property
    def layers(self) -> list[LayerStat]: ...

    @property
    def meta(self) -> dict[str, Any]: ...

    @property
    def blocks(self) -> list[dict[str, Any]]: ...

    @property
    def exits(self) -> dict[str, Any] | None: ...

    @property
    def warnings(self) -> list[str]: ...

    @property
    def neurons(self) -> list[LayerStat]: ...

    @property
    def compute_layers(self) -> list[LayerStat]: ...

    def top_modules(self, depth: int = 1, k: int = 10) -> list[dict[str, Any]]: ...

    def per_sample(self, key: str) -> float | None: ...


class Comparison(Protocol):
    """What the renderers read of two profiles side by side (`efficient.profiler.Comparison`)."""

    @property
    def a(self) -> Report: ...

    @property
    def b(self) -> Report: ...

    @property
    def rows(self) -> list[dict[str, Any]]: ...

_TOTAL_ROWS = (
    ("params", "params", fmt_count),
    ("dense_macs", "dense MACs", fmt_count),
    ("macs", "MACs (real operands)", fmt_count),
    ("sops", "SOPs (spike operands)", fmt_count),
    ("flops", "FLOPs", fmt_count),
    ("energy_pj", "energy", fmt_energy),
    ("energy_pj_per_sample", "energy / sample", fmt_energy),
    ("energy_memory_pj", "memory-access energy", fmt_energy),
    ("energy_total_pj", "energy incl. memory", fmt_energy),
    ("energy_total_pj_per_sample", "energy incl. memory / sample", fmt_energy),
    ("mean_firing_rate", "mean firing rate", fmt_rate),
)

# Conventions block: (key in meta["conventions"], label), in the order shown.
_CONVENTION_ROWS = (
    ("preset", "convention"), ("formula", "formula"), ("source", "source"), ("classification", "operands"),
    ("integer_operands", "integer operands"), ("real_input_layers", "real-valued input"), ("spike_matmul", "spike x spike"),
    ("first_layer", "first layer"), ("modules_only", "counted ops"), ("firing_rate", "firing rate"), ("timesteps", "T"),
    ("energy", "op energies"), ("flops", "FLOPs per MAC"), ("memory_access", "memory access"),
)


def convention_rows(report: Report) -> list[tuple[str, str]]:
    """The conventions block as (label, text) rows."""
    conv = report.meta.get("conventions") or {}
    rows = []
    for key, label in _CONVENTION_ROWS:
        if key not in conv:
            continue
        v = conv[key]
        if isinstance(v, list):
            v = ", ".join(v) if v else "none"
        rows.append((label, str(v)))
    return rows


def neurobench_rows(report: Report) -> list[tuple[str, str]]:
    nb = getattr(report, "neurobench", None)
    if not nb:
        return []
    so = nb["synaptic_operations"]
    rate = nb["connection_sparsity"]
    return [("footprint", f"{nb['footprint']} bytes"),
            ("connection sparsity", "-" if rate is None else f"{rate:g}"),
            ("activation sparsity", f"{nb['activation_sparsity']:.6g}"),
            ("Effective MACs / sample", fmt_count(so["Effective_MACs"])),
            ("Effective ACs / sample", fmt_count(so["Effective_ACs"])),
            ("Dense / sample", fmt_count(so["Dense"])),
            ("membrane updates / sample", "-" if nb["membrane_updates"] is None else fmt_count(nb["membrane_updates"]))]


def _fmt_total(key: str, v: Any) -> str:
    for k, _, f in _TOTAL_ROWS:
        if k == key:
            return f(v)
    return str(v)


def convention_line(report: Report) -> str:
    e = report.meta["energy"]
    return (f"energy = {e['e_mac_pj']:g} pJ x MACs + {e['e_ac_pj']:g} pJ x SOPs ({e['name']}); "
            f"FLOPs = {report.meta['flops_per_mac']:g} x dense MACs")


def _layer_rows(report: Report, max_layers: int) -> list[list[str]]:
    rows = []
    for layer in report.layers[:max_layers]:
        rows.append([
            layer.name, layer.type, fmt_count(layer.dense_macs), fmt_count(layer.macs), fmt_count(layer.sops),
            fmt_rate(layer.input_firing_rate), fmt_rate(layer.output_firing_rate), fmt_energy(layer.energy_pj),
        ])
    return rows


_LAYER_COLS = ["layer", "type", "dense MACs", "MACs", "SOPs", "in rate", "out rate", "energy"]


def markdown(report: Report, max_layers: int = 60, depth: int = 1) -> str:
    m = report.meta
    lines = [f"## Cost profile: {m.get('model')}", "",
             f"Input: {m.get('input')}" + (f", T = {m['timesteps']}" if m.get("timesteps") else ""),
             f"Convention: {convention_line(report)}.", "",
             "| metric | value |", "|---|---|"]
    for k, label, f in _TOTAL_ROWS:
        if k in report.totals:
            lines.append(f"| {label} | {f(report.totals[k])} |")
    conv = convention_rows(report)
    if conv:
        lines += ["", "### Conventions", "", "| | |", "|---|---|"] + [f"| {k} | {v.replace('|', '/')} |" for k, v in conv]
    nb = neurobench_rows(report)
    if nb:
        lines += ["", "### NeuroBench metrics", "", "| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in nb]
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


def _layers_wide(report: Report, max_layers: int) -> Any:
    from rich.table import Table

    tl = Table(title="layers")
    for c in _LAYER_COLS:
        tl.add_column(c, justify="left" if c in ("layer", "type") else "right", no_wrap=True)
    for row in _layer_rows(report, max_layers):
        tl.add_row(*row)
    return tl


def _layers_narrow(report: Report, max_layers: int) -> Any:
    """One `rate` column (a compute layer's input spike rate, a neuron's output rate); the layer
    name stays whole, and where there is no room the type and then number columns are left out."""
    from rich import box

    from efficient.profiler.console import Column, FitTable, number

    rows = list(zip(report.layers, _layer_rows(report, max_layers)))
    rates = [row[6] if layer.is_neuron else row[5] for layer, row in rows]
    cols = [Column("layer", [row[0] for _, row in rows], name=True),
            Column("type", [row[1] for _, row in rows], drop=5),
            number("dense MACs", [row[2] for _, row in rows], drop=3),
            number("MACs", [row[3] for _, row in rows], drop=2),
            number("SOPs", [row[4] for _, row in rows], drop=1),
            number("rate", rates, drop=4,
                   note="rate: spike rate of a compute layer's input (its SOP operand), or of a neuron's output"),
            number("energy", [row[7] for _, row in rows])]
    return FitTable(cols, title="layers", table=dict(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0)))


def rich_tables(report: Report, max_layers: int = 40, depth: int = 1) -> list[Any]:
    """rich renderables that fit the console they are printed on: names stay whole, and where
    there is no room the less important columns are left out (the caption says which)."""
    from efficient.profiler.console import Column, FirstThatFits, FitTable, number

    m = report.meta
    title = f"{m.get('model')}  ({m.get('input')}" + (f", T={m['timesteps']}" if m.get("timesteps") else "") + ")"
    totals = [(label, f(report.totals[k])) for k, label, f in _TOTAL_ROWS if k in report.totals]
    out: list[Any] = [FitTable([Column("metric", [r[0] for r in totals], name=True), number("value", [r[1] for r in totals])],
                               title=title, caption=convention_line(report))]
    top = report.top_modules(depth)
    if top:
        total_e = report.totals["energy_pj"] or 1.0
        out.append(FitTable([
            Column("module", [r["name"] for r in top], name=True),
            Column("type", [r["type"] for r in top], drop=3),
            number("params", [fmt_count(r["params"]) for r in top], drop=4),
            number("dense MACs", [fmt_count(r["dense_macs"]) for r in top], drop=2),
            number("SOPs", [fmt_count(r["sops"]) for r in top], drop=1),
            number("energy", [fmt_energy(r["energy_pj"]) for r in top]),
            number("share", [f"{100 * r['energy_pj'] / total_e:.1f}%" for r in top]),
        ], title=f"top modules at depth {depth} (by energy)"))
    out.append(FirstThatFits(_layers_wide(report, max_layers), _layers_narrow(report, max_layers)))
    conv = convention_rows(report)
    if conv:
        from rich.table import Table

        t = Table(title="conventions", show_header=False, expand=False)
        t.add_column("what", no_wrap=True, style="bold")
        t.add_column("meaning", overflow="fold")
        for k, v in conv:
            t.add_row(k, v)
        out.append(t)
    nb = neurobench_rows(report)
    if nb:
        out.append(FitTable([Column("metric", [r[0] for r in nb], name=True), number("value", [r[1] for r in nb])],
                            title="NeuroBench metrics"))
    if report.blocks:
        out.append(FitTable([Column("block", [b["block"] for b in report.blocks], name=True),
                             number("tokens", [str(b["tokens_in"]) for b in report.blocks])],
                            title="tokens entering each block"))
    if report.exits:
        from rich.markdown import Markdown

        out.append(Markdown(_exits_md(report.exits)))
    return out


def html_page(report: Report, max_layers: int = 60) -> str:
    """One self-contained HTML page of a report: totals, conventions, NeuroBench metrics, layers, warnings."""
    import html

    def table(head: list[str], rows: list[list[str]], cls: str) -> str:
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'

    m = report.meta
    title = html.escape(f"Cost profile: {m.get('model')}")
    parts = [f"<h1>{title}</h1>",
             f"<p>Input: {html.escape(str(m.get('input')))}" + (f", T = {m['timesteps']}" if m.get("timesteps") else "") + "</p>",
             table(["metric", "value"], [[label, f(report.totals[k])] for k, label, f in _TOTAL_ROWS if k in report.totals], "totals"),
             '<h2 id="conventions">Conventions</h2>', table(["", ""], [list(r) for r in convention_rows(report)], "conventions")]
    nb = neurobench_rows(report)
    if nb:
        parts += ['<h2 id="neurobench">NeuroBench metrics</h2>', table(["metric", "value"], [list(r) for r in nb], "neurobench")]
    parts += ["<h2>Layers</h2>", table(_LAYER_COLS, _layer_rows(report, max_layers), "layers")]
    if report.warnings:
        parts += ["<h2>Warnings</h2><ul>" + "".join(f"<li>{html.escape(w)}</li>" for w in report.warnings) + "</ul>"]
    style = "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{style}</style></head>'
            f"<body>{''.join(parts)}</body></html>\n")


_COMPARE_LABELS = {
    "params": "params",
    "dense_macs": "dense MACs / sample",
    "macs": "MACs / sample",
    "sops": "SOPs / sample",
    "flops": "FLOPs / sample",
    "energy_pj": "energy / sample",
    "mean_firing_rate": "mean firing rate",
}


def _compare_cells(r: dict[str, Any]) -> list[str]:
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}x"
    change = "-" if r["change_pct"] is None else f"{r['change_pct']:+.1f}%"
    return [_COMPARE_LABELS.get(r["metric"], r["metric"]), _fmt_total(r["metric"], r["a"]),
            _fmt_total(r["metric"], r["b"]), ratio, change]


def _compare_caption(c: Comparison) -> str:
    a, b = c.a.meta.get("model"), c.b.meta.get("model")
    inputs = f"{a}: {c.a.meta.get('input')}; {b}: {c.b.meta.get('input')}"
    conv = convention_line(c.a)
    if convention_line(c.b) != conv:
        conv = f"{a}: {conv}; {b}: {convention_line(c.b)}"
    return f"ratio = {b} / {a}, change = {b} vs {a}, per sample. Inputs: {inputs}. {conv}"


def comparison_markdown(c: Comparison) -> str:
    a, b = c.a.meta.get("model"), c.b.meta.get("model")
    lines = [f"| metric | {a} | {b} | ratio | change |", "|---|---|---|---|---|"]
    for r in c.rows:
        lines.append("| " + " | ".join(_compare_cells(r)) + " |")
    return "\n".join(lines) + "\n\n" + _compare_caption(c) + "\n"


def comparison_table(c: Comparison) -> Any:
    """The comparison as a rich table with its caption (ratio direction, inputs, convention) below
    it; where the model names do not fit as column headers they become A and B."""
    from rich.console import Group
    from rich.text import Text

    from efficient.profiler.console import Column, FitTable, number

    a, b = str(c.a.meta.get("model")), str(c.b.meta.get("model"))
    cells = [_compare_cells(r) for r in c.rows]
    col = [[row[i] for row in cells] for i in range(5)]
    t = FitTable([
        Column("metric", col[0], name=True),
        number(a, col[1], drop=2, shorter=number("A", col[1], note=f"A: {a}")),
        number(b, col[2], drop=2, shorter=number("B", col[2], note=f"B: {b}")),
        number("ratio", col[3]),
        number("change", col[4], drop=3),
    ], title=f"{a} vs {b}")
    return Group(t, Text(_compare_caption(c)))


# ---------------------------------------------------------------------------------------------
# PNG

_E_MAC_COLOR, _E_AC_COLOR, _RATE_COLOR = "#c0504d", "#4f81bd", "#9bbb59"


def _wrap(text: str, width_in: float, fontsize: float, margin_in: float = 0.7) -> str:
    """Wrap a title to the characters that fit `width_in` inches less `margin_in` (the axis labels) at `fontsize` points."""
    import textwrap

    return textwrap.fill(text, width=max(20, int((width_in - margin_in) * 72 / (0.55 * fontsize))))


def _layer_energy(report: Report) -> tuple[list[float], list[float]]:
    """(MAC energy, AC energy) per compute layer, per sample, in pJ."""
    n = report.totals.get("batch_size") or 1
    e = report.meta["energy"]
    compute = report.compute_layers
    return [e["e_mac_pj"] * layer.macs / n for layer in compute], [e["e_ac_pj"] * layer.sops / n for layer in compute]


def _energy_unit(peak_pj: float) -> tuple[str, float]:
    for unit, scale in (("mJ", 1e9), ("uJ", 1e6), ("nJ", 1e3)):
        if peak_pj >= scale:
            return unit, scale
    return "pJ", 1.0


def _title(report: Report) -> str:
    label, zoo = report.meta.get("model"), report.meta.get("zoo_model")
    return f"{label} ({zoo})" if zoo and zoo != label else str(label)


def _draw_energy(ax: Any, report: Report, width_in: float, unit: tuple[str, float], legend: bool = True) -> None:
    compute = report.compute_layers
    e_mac, e_ac = _layer_energy(report)
    name, scale = unit
    xs = list(range(len(compute)))
    ax.bar(xs, [v / scale for v in e_mac], label="MAC energy", color=_E_MAC_COLOR)
    ax.bar(xs, [v / scale for v in e_ac], bottom=[v / scale for v in e_mac], label="AC (SOP) energy", color=_E_AC_COLOR)
    ax.set_ylabel(f"energy / sample ({name})")
    title = f"{_title(report)}: energy per layer, {fmt_energy(report.per_sample('energy_pj'))} / sample"
    ax.set_title(_wrap(title, width_in, 9), fontsize=9)
    ax.set_xticks(xs, [layer.name for layer in compute], rotation=90, fontsize=6)
    if legend:
        ax.legend(fontsize=7)


def _peak_energy(report: Report) -> float:
    e_mac, e_ac = _layer_energy(report)
    return max((m + a for m, a in zip(e_mac, e_ac)), default=0.0)


def _draw_rates(ax: Any, report: Report, width_in: float) -> None:
    neurons = report.neurons
    if not neurons:
        ax.text(0.5, 0.5, "no spiking neurons", ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_axis_off()
        return
    xs = list(range(len(neurons)))
    ax.bar(xs, [nrn.output_firing_rate or 0.0 for nrn in neurons], color=_RATE_COLOR)
    ax.set_ylabel("firing rate")
    title = f"{_title(report)}: firing rate per neuron layer, mean {fmt_rate(report.totals.get('mean_firing_rate'))}"
    ax.set_title(_wrap(title, width_in, 9), fontsize=9)
    ax.set_xticks(xs, [nrn.name for nrn in neurons], rotation=90, fontsize=6)


def _fit_ylim(column: Any, reports: Sequence[Report], unit: tuple[str, float]) -> None:
    """Energy (and firing-rate) axes from 0 to just above the tallest bar of any report: one scale, nothing cut off."""
    peak = max(_peak_energy(r) for r in reports) / unit[1]
    column[0].set_ylim(0, 1.08 * peak or 1.0)
    if len(column) > 1:
        top = max((nrn.output_firing_rate or 0.0 for r in reports for nrn in r.neurons), default=0.0)
        column[1].set_ylim(0, 1.08 * top or 1.0)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _column_width(report: Report) -> float:
    return min(20.0, max(5.0, 0.22 * max(len(report.compute_layers), len(report.neurons), 1)))


def plot(report: Report, path: Path) -> Path:
    """PNG: energy per compute layer (per sample) over firing rate per neuron layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rows = 2 if report.neurons else 1
    width = _column_width(report)
    fig, axes = plt.subplots(n_rows, 1, figsize=(width, 3.6 * n_rows + 1.6), squeeze=False, layout="constrained")
    unit = _energy_unit(_peak_energy(report))
    _draw_energy(axes[0][0], report, width, unit)
    if report.neurons:
        _draw_rates(axes[1][0], report, width)
    _fit_ylim(axes[:, 0], [report], unit)
    fig.supxlabel(_wrap(convention_line(report), width, 7, margin_in=0.3), fontsize=7)
    return _save(fig, path)


def plot_comparison(c: Comparison, path: Path) -> Path:
    """Both reports in two columns: energy per layer (per sample, same scale) over firing rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = (c.a, c.b)
    widths = [_column_width(r) for r in reports]
    n_rows = 2 if any(r.neurons for r in reports) else 1
    fig, axes = plt.subplots(n_rows, 2, figsize=(sum(widths), 3.6 * n_rows + 2.0), squeeze=False, sharey="row",
                             width_ratios=widths, layout="constrained")
    peak = max(_peak_energy(r) for r in reports)
    unit = _energy_unit(peak)
    for col, (r, w) in enumerate(zip(reports, widths)):
        _draw_energy(axes[0][col], r, w, unit, legend=col == 0)
        if n_rows == 2:
            _draw_rates(axes[1][col], r, w)
    _fit_ylim(axes[:, 0], reports, unit)
    for ax in axes[:, 1]:  # shared scale: the right column repeats the left one's tick labels
        ax.tick_params(labelleft=True)
    energy = next(r for r in c.rows if r["metric"] == "energy_pj")
    head = _wrap(f"{_title(c.a)} vs {_title(c.b)}", sum(widths), 11, margin_in=0.3)
    if energy["ratio"] is not None:
        head += f"\nenergy per sample, right / left: {energy['ratio']:.3f}x"
    fig.suptitle(head, fontsize=11)
    fig.supxlabel(_wrap(_compare_caption(c), sum(widths), 7, margin_in=0.3), fontsize=7)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# activation memory (efficient.memory.measure)

MEMORY_CAPTION = ("one training step; kept = bytes autograd keeps for backward after forward + loss, each storage once (a view counts "
                  "its storage); parameters not counted; as bits = spikes packed 8 per byte; step = forward + "
                  "backward wall time, measuring hooks included")


def _memory_block_label(name: str) -> str:
    return {"": "(model)"}.get(name, name)


def memory_tables(results: dict[str, Any], base: Any | None, title: str) -> list[Any]:
    """rich renderables for `ActivationMemory` results by level: the totals with the ratio to `base`
    (level none), and bytes per top-level block, one column per level (block names stay whole)."""
    from efficient.memory.measure import fmt_bytes
    from efficient.profiler.console import Column, FitTable, number

    levels = list(results)
    mems = list(results.values())
    ratio = [("-" if base is None or not base.total_bytes else f"{m.total_bytes / base.total_bytes:.3f}x") for m in mems]
    totals = FitTable([
        Column("level", levels, name=True),
        number("kept", [fmt_bytes(m.total_bytes) for m in mems]),
        number("vs none", ratio),
        number("as bits", [fmt_bytes(m.packed_bytes) for m in mems], drop=2),
        number("dense", [fmt_bytes(m.dense_bytes) for m in mems], drop=2),
        number("tensors", [str(m.tensors) for m in mems], drop=3),
        number("step", ["-" if m.step_time_s is None else f"{m.step_time_s:.2f} s" for m in mems], drop=1),
    ], title=title, caption=MEMORY_CAPTION)
    blocks = list(dict.fromkeys(b for m in ([base] if base is not None else []) + mems for b in m.by_block))
    cols = [Column("block", [_memory_block_label(b) for b in blocks], name=True)]
    cols += [number(lv, [fmt_bytes(m.by_block.get(b, 0)) for b in blocks]) for lv, m in results.items()]
    per_block = FitTable(cols, title="kept for backward per block")
    return [totals, per_block]
