"""The report's charts: matplotlib figures rendered to SVG text for inline embedding (no files,
no network). Each function takes one run or two (drawn over each other or side by side)."""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from efficient.report.rundata import RunData

# one colour per run (a comparison draws two); train solid, validation dashed with markers
RUN_COLORS = ("#1f77b4", "#d62728")
_E_MAC, _E_AC, _RATE = "#c0504d", "#4f81bd", "#9bbb59"


def svg(fig: Any) -> str:
    """The figure as an `<svg>` element (fonts left to the browser, no date stamp)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _figure(n_panels: int, width: float = 4.2, height: float = 2.8, cols: int = 3) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    cols = max(1, min(cols, n_panels))
    rows = -(-n_panels // cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten().tolist()
    for ax in axes[n_panels:]:
        ax.set_axis_off()
    return fig, axes[:n_panels]


def curves(runs: Sequence[RunData], keys: Sequence[str], splits: Sequence[str] = ("train", "val"),
           ylabel: dict[str, str] | None = None) -> str:
    """One panel per metric key: each run's train (solid) and validation (dashed, dots) series over steps."""
    fig, axes = _figure(len(keys))
    for ax, key in zip(axes, keys):
        for run, color in zip(runs, RUN_COLORS):
            for split in splits:
                steps, vals = run.series(split, key)
                if not steps:
                    continue
                label = f"{run.name} {split}" if len(runs) > 1 else split
                style = {"linestyle": "-"} if split == "train" else {"linestyle": "--", "marker": "o", "markersize": 3}
                ax.plot(steps, vals, color=color, label=label, **style)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if ylabel and key in ylabel:
            ax.set_ylabel(ylabel[key], fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return svg(fig)


def _short(names: Sequence[str]) -> list[str]:
    return [n if len(n) <= 28 else "…" + n[-27:] for n in names]


def layer_bars(profiles: Sequence[dict[str, Any]], titles: Sequence[str], kind: str) -> str:
    """Per-layer bars of each profile side by side: kind "energy" (MAC and AC energy stacked, per
    sample), "sops" (synaptic operations per sample) or "firing" (output rate per spiking layer)."""
    fig, axes = _figure(len(profiles), width=max(5.0, min(14.0, 0.22 * _most_layers(profiles, kind))), height=3.6, cols=2)
    top = 0.0
    energy_unit = _energy_unit(max((x["energy_pj"] / (p["totals"].get("batch_size") or 1) for p in profiles for x in p["layers"]), default=0.0))
    for ax, prof, title in zip(axes, profiles, titles):
        n = prof["totals"].get("batch_size") or 1
        e = prof["meta"]["energy"]
        if kind == "firing":
            layers = [x for x in prof["layers"] if x["neuron"]]
            ax.bar(range(len(layers)), [x["output_firing_rate"] or 0.0 for x in layers], color=_RATE)
            ax.set_ylabel("spikes per neuron per step", fontsize=8)
            mean = prof["totals"].get("mean_firing_rate")
            ax.set_title(f"{title}: mean firing rate {mean:.3g}" if mean is not None else title, fontsize=9)
            heights = [x["output_firing_rate"] or 0.0 for x in layers]
        else:
            layers = [x for x in prof["layers"] if x["dense_macs"] > 0]
            if kind == "energy":
                unit, scale = energy_unit
                mac = [e["e_mac_pj"] * x["macs"] / n / scale for x in layers]
                ac = [e["e_ac_pj"] * x["sops"] / n / scale for x in layers]
                ax.bar(range(len(layers)), mac, color=_E_MAC, label="MAC energy")
                ax.bar(range(len(layers)), ac, bottom=mac, color=_E_AC, label="AC (SOP) energy")
                ax.set_ylabel(f"{unit} / sample", fontsize=8)
                ax.legend(fontsize=7)
                heights = [a + b for a, b in zip(mac, ac)]
            else:
                heights = [x["sops"] / n for x in layers]
                ax.bar(range(len(layers)), heights, color=_E_AC)
                ax.set_ylabel("SOPs / sample", fontsize=8)
            ax.set_title(title, fontsize=9)
        top = max([top, *heights])
        ax.set_xticks(range(len(layers)), _short([x["name"] for x in layers]), rotation=90, fontsize=6)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes:  # one scale across runs
        ax.set_ylim(0, 1.08 * top or 1.0)
    return svg(fig)


def _energy_unit(peak_pj: float) -> tuple[str, float]:
    """The unit (and pJ per unit) that keeps the tallest energy bar between 1 and 1000."""
    for unit, scale in (("mJ", 1e9), ("uJ", 1e6), ("nJ", 1e3)):
        if peak_pj >= scale:
            return unit, scale
    return "pJ", 1.0


def _most_layers(profiles: Sequence[dict[str, Any]], kind: str) -> int:
    pick = (lambda x: x["neuron"]) if kind == "firing" else (lambda x: x["dense_macs"] > 0)
    return max((sum(1 for x in p["layers"] if pick(x)) for p in profiles), default=1)


def bars(groups: Sequence[tuple[str, Sequence[str], Sequence[float]]], ylabel: str, title: str) -> str:
    """Grouped bars: one (run name, categories, values) per run, sharing the categories' axis."""
    fig, (ax,) = _figure(1, width=max(4.5, 0.5 * max(len(g[1]) for g in groups) * len(groups)), height=3.0)
    cats = list(dict.fromkeys(c for _, cs, _ in groups for c in cs))
    w = 0.8 / len(groups)
    for i, ((name, cs, vs), color) in enumerate(zip(groups, RUN_COLORS)):
        pos = [cats.index(c) + (i - (len(groups) - 1) / 2) * w for c in cs]
        ax.bar(pos, vs, width=w, color=color, label=name if len(groups) > 1 else None)
    ax.set_xticks(range(len(cats)), cats, fontsize=7)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", alpha=0.3)
    if len(groups) > 1:
        ax.legend(fontsize=7)
    return svg(fig)


def robust_accuracy(runs: Sequence[RunData]) -> str:
    """Accuracy against the attack radius, one line per (run, attack); clean accuracy at eps 0."""
    fig, (ax,) = _figure(1, width=5.0, height=3.2)
    for run, color in zip(runs, RUN_COLORS):
        by_attack: dict[str, list[tuple[float, float]]] = {}
        for res in run.attacks:
            for a in res["attacks"]:
                by_attack.setdefault(re.sub(r"\s+", " ", a["attack"]), []).append((255 * a["eps"], 100 * a["acc"]))
        clean = run.attacks[-1]["clean"] if run.attacks else None
        for (attack, pts), marker in zip(sorted(by_attack.items()), "osD^v<>"):
            pts = sorted(set(pts))
            if clean is not None:
                pts = [(0.0, 100 * clean)] + pts
            label = f"{run.name} {attack}" if len(runs) > 1 else attack
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=label)
    ax.set_xlabel("eps (x / 255)", fontsize=8)
    ax.set_ylabel("accuracy %", fontsize=8)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return svg(fig)
