"""`report.html`: one self-contained page per run (or two runs side by side) with its curves, activation
memory, costs, firing rates, token and exit statistics, robust accuracy, recipe and environment.

Charts are inline SVG from matplotlib and there is no script or remote resource, so the file opens
offline anywhere. Every number a chart shows is also in a table cell whose `data-value` holds it
unrounded, for reading back.
"""

from __future__ import annotations

import datetime
import html
from pathlib import Path
from typing import Any, Callable, Sequence

from efficient.io import write_text
from efficient.report import plots
from efficient.report.rundata import ATTACKS_FILE, MEMORY_FILE, PROFILE_FILE, RunData, load_run, report_from_dict

REPORT_FILE = "report.html"
# (id, heading) of every section, in page order; each is always present and says when it does not apply
SECTIONS: tuple[tuple[str, str], ...] = (
    ("overview", "Overview"),
    ("curves", "Training and validation curves"),
    ("lr", "Learning rate and throughput"),
    ("memory", "Activation memory"),
    ("energy", "Energy per layer"),
    ("sops", "Synaptic operations per layer"),
    ("firing", "Firing rates per layer"),
    ("tokens", "Tokens kept per block (STATA)"),
    ("exits", "Early exits"),
    ("robust", "Robust accuracy"),
    ("recipe", "Resolved recipe"),
    ("environment", "Environment"),
)
_SCHEDULE_KEYS = ("lr", "samples_per_s")


def write_run_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of one run (default `RUN_DIR/report.html`); return its path."""
    run = load_run(run_dir)
    path = Path(out) if out is not None else run.path / REPORT_FILE
    write_text(path, render([run]))
    return path


def write_comparison(run_a: str | Path, run_b: str | Path, out: str | Path) -> Path:
    """Write one page with two runs side by side (curves overlaid, costs compared); return its path."""
    runs = [load_run(run_a), load_run(run_b)]
    if runs[0].name == runs[1].name:  # same folder name in two places: tell them apart
        runs[0].name, runs[1].name = str(runs[0].path), str(runs[1].path)
    path = Path(out)
    write_text(path, render(runs))
    return path


def render(runs: Sequence[RunData]) -> str:
    """The whole page for one run or two."""
    title = " vs ".join(r.name for r in runs)
    builders: dict[str, Callable[[Sequence[RunData]], str]] = {
        "overview": _overview, "curves": _curves, "lr": _lr, "memory": _memory, "energy": _energy, "sops": _sops, "firing": _firing,
        "tokens": _tokens, "exits": _exits, "robust": _robust, "recipe": _recipe, "environment": _environment,
    }
    nav = " · ".join(f'<a href="#{sid}">{html.escape(head)}</a>' for sid, head in SECTIONS)
    body = "\n".join(f'<section id="{sid}"><h2>{html.escape(head)}</h2>\n{builders[sid](runs)}\n</section>'
                     for sid, head in SECTIONS)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = "Run report" if len(runs) == 1 else "Run comparison"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(what)}: {html.escape(title)}</title>
<style>{_CSS}</style></head>
<body>
<header><h1>{html.escape(what)}: {html.escape(title)}</h1>
<p class="meta">{" · ".join(html.escape(str(r.path)) for r in runs)} · written {stamp} by <code>efficient report</code></p>
<nav>{nav}</nav></header>
{body}
</body></html>
"""


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1400px;padding:0 1.5em 3em;color:#222}
header{border-bottom:1px solid #ddd;margin-bottom:1em}h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #eee;padding-top:.5em}
nav a{margin-right:.2em}.meta{color:#666;font-size:.85em}.na{color:#666;font-style:italic}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}th,td{border:1px solid #ddd;padding:.2em .6em}
td.num{text-align:right;font-variant-numeric:tabular-nums}th{background:#f5f5f5}
.warn{background:#fff5d6;border-left:4px solid #e0a800;padding:.5em 1em;margin:.5em 0}
.row{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}pre{background:#f7f7f7;padding:1em;overflow:auto;font-size:.85em}
figure{margin:.5em 0}svg{max-width:100%;height:auto}details{margin:.5em 0}
"""


# ----------------------------------------------------------------------------- table helpers


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return html.escape("-" if v is None else str(v))
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 1000:
        return f"{int(v):,}"
    return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"


def _cell(v: Any) -> str:
    """A table cell; numbers right-aligned, their full value in `data-value`."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f'<td class="num" data-value="{float(v)!r}">{_fmt(v)}</td>'
    return f"<td>{_fmt(v)}</td>"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _na(text: str) -> str:
    return f'<p class="na">{html.escape(text)}</p>'


def _fig(svg: str, caption: str = "") -> str:
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f"<figure>{svg}{cap}</figure>"


def _names(runs: Sequence[RunData]) -> list[str]:
    return [r.name for r in runs]


# ----------------------------------------------------------------------------------- sections


def _overview(runs: Sequence[RunData]) -> str:
    rows: list[list[Any]] = []
    sums = [r.summary or {} for r in runs]
    for label, get in (
        ("model", lambda s, r: r.recipe.get("model", {}).get("name")),
        ("dataset", lambda s, r: r.recipe.get("data", {}).get("name")),
        ("objective", lambda s, r: r.recipe.get("objective", {}).get("name")),
        ("steps", lambda s, r: s.get("steps", r.train[-1]["step"] if r.train else None)),
        ("epochs", lambda s, r: s.get("epochs")),
        ("train time (s)", lambda s, r: s.get("train_time_s")),
        ("params", lambda s, r: s.get("params")),
    ):
        rows.append([label, *(get(s, r) for s, r in zip(sums, runs))])
    metrics = list(dict.fromkeys(k for s in sums for k in (s.get("val") or {})))
    rows += [[f"final val {k}", *((s.get("val") or {}).get(k) for s in sums)] for k in metrics]
    for s in sums:
        for k in (s.get("best") or {}):
            if not any(row[0] == f"best val {k}" for row in rows):
                rows.append([f"best val {k}", *((t.get("best") or {}).get(k) for t in sums)])
    out = _table(["", *_names(runs)], rows, "overview")
    for r in runs:
        if r.summary is None:
            out += _na(f"{r.name}: no summary.json (the run has not finished); values above come from metrics.jsonl.")
        if r.skipped_lines:
            out += f'<p class="warn">{html.escape(r.name)}: metrics.jsonl lines {r.skipped_lines} are not JSON records and were skipped.</p>'
    return out


def _curve_keys(runs: Sequence[RunData]) -> list[str]:
    skip = lambda k: k in _SCHEDULE_KEYS or k.startswith(("stata/", "loss_exit", "w_exit")) or k == "loss_final"  # noqa: E731
    val = [k for r in runs for k in r.keys("val") if not skip(k)]
    train = [k for r in runs for k in r.keys("train") if not skip(k)]
    return list(dict.fromkeys(val + train))


def _last_values(runs: Sequence[RunData], keys: Sequence[str], splits: Sequence[str] = ("train", "val")) -> str:
    rows = []
    for key in keys:
        for split in splits:
            vals = [r.series(split, key) for r in runs]
            if any(v[0] for v in vals):
                rows.append([key, split, *((v[1][-1] if v[1] else None) for v in vals),
                             *((v[0][-1] if v[0] else None) for v in vals)])
    names = _names(runs)
    header = ["metric", "split", *(f"last: {n}" for n in names), *(f"at step: {n}" for n in names)]
    return _table(header, rows, "last-values")


def _curves(runs: Sequence[RunData]) -> str:
    keys = _curve_keys(runs)
    if not keys:
        return _na("No metrics logged yet (metrics.jsonl has no train or validation lines).")
    cap = "Train lines are the mean over each logging window; validation at epoch ends and after the last step."
    return _fig(plots.curves(runs, keys), cap) + _last_values(runs, keys)


def _lr(runs: Sequence[RunData]) -> str:
    keys = [k for k in _SCHEDULE_KEYS if any(r.series("train", k)[0] for r in runs)]
    if not keys:
        return _na("No train lines logged yet.")
    labels = {"lr": "learning rate", "samples_per_s": "samples / s"}
    return _fig(plots.curves(runs, keys, splits=("train",), ylabel=labels)) + _last_values(runs, keys, ("train",))


MEMORY_TOP_BLOCKS = 8  # blocks listed per run, largest first


def _memory(runs: Sequence[RunData]) -> str:
    from efficient.memory.measure import fmt_bytes as _bytes

    have, out = _applies(runs, lambda r: r.memory is not None,
                         lambda r: f"{r.name}: activation memory not measured ({MEMORY_FILE} is missing: the recipe does not set "
                                   f"train.memory, or the run predates this record). `efficient profile {r.path} --memory` "
                                   "measures it at every level.")
    if not have:
        return out
    rows = [[r.name, m.get("level"), m.get("batch_size"), m.get("total_bytes"), m.get("none_bytes"), m.get("ratio_to_none")]
            for r in have for m in [r.memory]]
    out += _table(["run", "level", "batch", "bytes kept / step", "bytes kept at none", "ratio to none"], rows, "memory-totals")
    for r in have:
        m = r.memory
        levels = m.get("levels") or {}
        used, none = levels.get(m.get("level")) or {}, levels.get("none") or {}
        ratio = m.get("ratio_to_none")
        out += (f'<p class="meta">{html.escape(r.name)}: level {html.escape(str(m.get("level")))} keeps '
                f'{_bytes(m.get("total_bytes"))} for backward per training step on {html.escape(str(m.get("input")))} '
                f'({_bytes(used.get("packed_bytes"))} of it spikes as bits); level none keeps {_bytes(m.get("none_bytes"))}'
                + (f", {ratio:.3f}x of it" if isinstance(ratio, (int, float)) else "")
                + ". Bytes of every storage autograd keeps after forward + loss, each once; parameters not counted.</p>")
        by_block = used.get("by_block") or {}
        total = used.get("total_bytes") or 0
        top = sorted(by_block.items(), key=lambda kv: -kv[1])[:MEMORY_TOP_BLOCKS]
        if top:
            rows = [[b or "(model)", n, (none.get("by_block") or {}).get(b), 100 * n / total if total else None] for b, n in top]
            out += (f"<details open><summary>{html.escape(r.name)}: blocks keeping the most (level "
                    f"{html.escape(str(m.get('level')))})</summary>"
                    + _table(["block", f"bytes at {m.get('level')}", "bytes at none", "share %"], rows, "memory-blocks")
                    + "</details>")
    return out


def _applies(runs: Sequence[RunData], applies: Callable[[RunData], Any], why: Callable[[RunData], str]) -> tuple[list[RunData], str]:
    """The runs a section applies to, and a note saying `why` not for each of the others."""
    return [r for r in runs if applies(r)], "".join(_na(why(r)) for r in runs if not applies(r))


def _profiles(runs: Sequence[RunData]) -> tuple[list[RunData], str]:
    return _applies(runs, lambda r: r.profile is not None,
                    lambda r: f"{r.name}: no cost profile ({PROFILE_FILE} is missing: profile.enabled was false, or the run "
                              f"has not finished). `efficient profile {r.path} --format json -o {r.path / PROFILE_FILE}` writes it.")


def _per_sample(prof: dict[str, Any], v: float) -> float:
    return v / (prof["totals"].get("batch_size") or 1)


def _energy(runs: Sequence[RunData]) -> str:
    have, notes = _profiles(runs)
    if not have:
        return notes
    out = notes
    if len(have) == 2:
        cmp = report_from_dict(have[0].profile).compare(report_from_dict(have[1].profile))
        out += _table(["metric (per sample)", have[0].name, have[1].name, f"ratio {have[1].name} / {have[0].name}", "change %"],
                      [[r["metric"], r["a"], r["b"], r["ratio"], r["change_pct"]] for r in cmp.rows], "cost-compare")
    else:
        prof = have[0].profile
        keys = ("params", "dense_macs", "macs", "sops", "flops", "energy_pj", "mean_firing_rate")
        rows = [[k + (" / sample" if k in ("dense_macs", "macs", "sops", "flops", "energy_pj") else ""),
                 _per_sample(prof, prof["totals"][k]) if k in ("dense_macs", "macs", "sops", "flops", "energy_pj") else prof["totals"][k]]
                for k in keys if k in prof["totals"]]
        out += _table(["total", have[0].name], rows, "cost-totals")
    for r in have:
        m = r.profile["meta"]
        e = m["energy"]
        out += (f'<p class="meta">{html.escape(r.name)}: profiled on {html.escape(str(m.get("input")))}; energy = '
                f'{e["e_mac_pj"]:g} pJ x MACs + {e["e_ac_pj"]:g} pJ x SOPs ({html.escape(str(e.get("name")))}), '
                f'compute only; FLOPs = {m.get("flops_per_mac"):g} x dense MACs.</p>')
    out += _fig(plots.layer_bars([r.profile for r in have], _names(have), "energy"), "Energy per compute layer, per sample.")
    for r in have:
        p = r.profile
        e = p["meta"]["energy"]
        rows = [[x["name"], x["type"], _per_sample(p, x["dense_macs"]), _per_sample(p, x["macs"]), _per_sample(p, x["sops"]),
                 _per_sample(p, x["energy_pj"])] for x in p["layers"] if x["dense_macs"] > 0]
        out += (f"<details><summary>{html.escape(r.name)}: energy per layer (table)</summary>"
                + _table(["layer", "type", "dense MACs / sample", "MACs / sample", "SOPs / sample", "energy pJ / sample"], rows, "layer-energy")
                + "</details>")
    return out


def _sops(runs: Sequence[RunData]) -> str:
    have, notes = _profiles(runs)
    if not have:
        return notes
    out = notes + _fig(plots.layer_bars([r.profile for r in have], _names(have), "sops"),
                       "Synaptic operations (ops with a binary spike operand: nonzeros x fan-out) per compute layer, per sample.")
    for r in have:
        p = r.profile
        rows = [[x["name"], x["type"], _per_sample(p, x["sops"]), x["input_firing_rate"]] for x in p["layers"] if x["dense_macs"] > 0]
        out += (f"<details open><summary>{html.escape(r.name)}: SOPs per layer</summary>"
                + _table(["layer", "type", "SOPs / sample", "input spike rate"], rows, "layer-sops") + "</details>")
    return out


def _firing(runs: Sequence[RunData]) -> str:
    have, notes = _profiles(runs)
    spiking, none = _applies(have, lambda r: any(x["neuron"] for x in r.profile["layers"]),
                             lambda r: f"{r.name}: no spiking neurons in this model, so no firing rates.")
    out = notes + none
    for r in have:
        for w in r.profile.get("warnings", []):
            out += f'<p class="warn"><b>{html.escape(r.name)}:</b> {html.escape(w)}</p>'
    if not spiking:
        return out
    out += _fig(plots.layer_bars([r.profile for r in spiking], _names(spiking), "firing"),
                "Output firing rate of each spiking layer (spikes per neuron per time step) on the profiled samples.")
    for r in spiking:
        rows = [[x["name"], x["neuron"], x["output_firing_rate"]] for x in r.profile["layers"] if x["neuron"]]
        out += (f"<details open><summary>{html.escape(r.name)}: firing rate per spiking layer</summary>"
                + _table(["layer", "neuron", "firing rate"], rows, "layer-firing") + "</details>")
    return out


def _tokens(runs: Sequence[RunData]) -> str:
    stata, out = _applies(runs, lambda r: r.is_stata,
                          lambda r: f"{r.name}: not a STATA run (no token selection), so every block sees every token.")
    if not stata:
        return out
    with_blocks = [r for r in stata if r.profile and r.profile.get("blocks")]
    if with_blocks:
        groups = [(r.name, [b["block"] for b in r.profile["blocks"]], [b["tokens_in"] for b in r.profile["blocks"]]) for r in with_blocks]
        out += _fig(plots.bars(groups, "tokens per sample and time step", "tokens entering each block"),
                    "Tokens entering each block on the profiled samples: a pruning block keeps fewer for the blocks after it.")
        for r in with_blocks:
            out += _table(["block", f"tokens in: {r.name}"], [[b["block"], b["tokens_in"]] for b in r.profile["blocks"]], "tokens")
    keys = [k for k in ("stata/tokens_out", "stata/keep_ratio") if any(r.series("train", k)[0] for r in stata)]
    if keys:
        out += _fig(plots.curves(stata, keys, splits=("train",)), "Token selection during training (means per logging window).")
        out += _last_values(stata, keys, ("train",))
    return out


def _exits(runs: Sequence[RunData]) -> str:
    ee, out = _applies(runs, lambda r: r.exit_keys or (r.profile and r.profile.get("exits")),
                       lambda r: f"{r.name}: no early exits in this model.")
    if not ee:
        return out
    dist_runs = [r for r in ee if r.profile and (r.profile.get("exits") or {}).get("distribution")]
    if dist_runs:
        groups = [(r.name, [f"layer {k}" for k in r.profile["exits"]["distribution"]], list(r.profile["exits"]["distribution"].values()))
                  for r in dist_runs]
        thr = ", ".join(f"{r.name}: {r.profile['exits']['threshold']:g}" for r in dist_runs)
        out += _fig(plots.bars(groups, "fraction of tokens", "exit distribution"),
                    f"Share of tokens leaving at each exit (max-probability rule, threshold {thr}) on the profiled samples.")
    for r in ee:
        ex = (r.profile or {}).get("exits")
        if ex:
            dist = ex.get("distribution") or {}
            rows = [[int(k), v["macs_per_token"], v["energy_pj_per_token"], dist.get(k, dist.get(str(k)))] for k, v in ex["per_exit"].items()]
            out += _table(["exit layer", "MACs / token", "energy pJ / token", f"fraction exiting: {r.name}"], rows, "exits")
            if ex.get("expected_macs_per_token") is not None:
                out += (f'<p class="meta">{html.escape(r.name)}: expected {ex["expected_macs_per_token"]:.4g} MACs / token, '
                        f'speedup bound {ex["speedup_bound"]:.3f}x (compute only).</p>')
    keys = list(dict.fromkeys(k for r in ee for k in r.exit_keys + (["loss_final"] if r.series("train", "loss_final")[0] else [])))
    if keys:
        out += _fig(plots.curves(ee, keys), "Loss of each exit: train (weighted into the objective) and validation.")
        out += _last_values(ee, keys)
    return out


def _robust(runs: Sequence[RunData]) -> str:
    have, out = _applies(runs, lambda r: r.attacks,
                         lambda r: f"{r.name}: no attack results ({ATTACKS_FILE} is missing); `efficient attack {r.path}` adds them.")
    if not have:
        return out
    out += _fig(plots.robust_accuracy(have), "Accuracy under each L-inf attack against its radius; eps 0 is clean accuracy.")
    rows = []
    for r in have:
        for res in r.attacks:
            rows.append([r.name, res.get("checkpoint"), res.get("data"), res["n"], "clean", None, None, 100 * res["clean"]])
            rows += [[r.name, res.get("checkpoint"), res.get("data"), res["n"], a["attack"], 255 * a["eps"], a["steps"], 100 * a["acc"]]
                     for a in res["attacks"]]
    return out + _table(["run", "checkpoint", "data", "samples", "attack", "eps x 255", "steps", "accuracy %"], rows, "robust")


def _recipe(runs: Sequence[RunData]) -> str:
    if len(runs) == 1:
        return f"<pre>{html.escape(runs[0].recipe_text)}</pre>"
    a, b = (_flatten(r.recipe) for r in runs)
    diff = [[k, _show(a.get(k)), _show(b.get(k))] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    out = _table(["key", *_names(runs)], diff, "recipe-diff") if diff else _na("The two recipes are identical.")
    return out + "".join(f"<details><summary>{html.escape(r.name)}: config.yaml</summary><pre>{html.escape(r.recipe_text)}</pre></details>"
                         for r in runs)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(v: Any) -> str:
    return "(unset)" if v is None else str(v)


def _environment(runs: Sequence[RunData]) -> str:
    envs = [(r.summary or {}).get("environment") for r in runs]
    _, out = _applies(runs, lambda r: (r.summary or {}).get("environment"),
                      lambda r: f"{r.name}: environment not recorded (the run has not finished, or predates this record).")
    if not any(envs):
        return out
    keys = list(dict.fromkeys(k for e in envs if e for k in e))
    return out + _table(["", *_names(runs)], [[k, *((e or {}).get(k) for e in envs)] for k in keys], "environment")
