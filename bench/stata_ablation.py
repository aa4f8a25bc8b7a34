"""STATA ablation on cluttered digits: every part of the method, paired by seed, and the
accuracy-energy frontier of STATA against random selection.

Arms (each a recipe plus overrides; every arm runs `train.seed = s` for each seed s, on the same
data, so arm and STATA differ in one switch and are paired by seed):

    dense          recipes/spikformer_cluttered.yaml (no anchor, no pruning)
    stata          recipes/stata_cluttered.yaml as shipped
    raw            scores not standardized                        (model.score=raw)
    no_anchor      ranked by mean received attention (EViT, no CLS) (model.anchor=off)
    shared_anchor  one anchor for all timesteps                   (model.anchor=shared)
    no_align       neither alignment loss                         (lambda_intra = lambda_inter = 0)
    intra_only     intra-timestep alignment only                  (lambda_inter = 0)
    inter_only     inter-timestep alignment only                  (lambda_intra = 0)
    random         uniformly random kept set, same keep ratio     (model.score=random)
    sweep          stata and random at keep ratios 0.3, 0.7, 0.9 (0.5 is the recipe's: the arms above)
    stata_early    the variant where selection has more to do: prune in blocks 1 and 2, after one
    random_early   attention instead of two (same rho), so kept tokens have been mixed once less
                   and the MLPs and later blocks see only them; random_early is its floor

Each run is `efficient train` in its own process, in OUT/<arm>/s<seed>; a run with a summary is
skipped, an interrupted one is resumed, so the study can be run in pieces (--arms, --seeds) and
restarted. After training each pruned run is evaluated on every validation canvas to find which
tokens survive the last pruning block and how many of the digit's tokens they hold. Then, from
whatever runs are finished: OUT/ablation.json, OUT/ablation.md (accuracy mean +- std, the paired
difference to STATA with a 95 % t-interval and a verdict, SOPs and energy per sample from the
profiler, training step time), OUT/frontier.png (accuracy vs energy, with the dense point),
OUT/kept_tokens.png (kept tokens on a few validation canvases: STATA, no anchor, no alignment, random).

    python bench/stata_ablation.py --seeds 0-4                    # everything, 5 seeds
    python bench/stata_ablation.py --arms stata,random --seeds 0-4 --jobs 2
    python bench/stata_ablation.py --report                       # tables and plots only
    python bench/stata_ablation.py --seeds 0 --arms all --set train.max_steps=3 --out runs/abl_smoke   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DENSE, STATA = "recipes/spikformer_cluttered.yaml", "recipes/stata_cluttered.yaml"
SWEEP = (0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class Arm:
    name: str
    recipe: str
    overrides: tuple[str, ...]
    removes: str  # what the arm takes away from STATA, for the verdict
    family: str = ""  # "stata" / "random" for the keep-ratio sweep
    rho: float | None = None
    variant: bool = False  # a changed method (not an ablation): its verdict is plain "vs STATA"


def arms(recipe_rho: float = 0.5) -> dict[str, Arm]:
    """Every arm by name; the sweep's point at the recipe's own rho is the `stata` / `random` arm."""
    out = [
        Arm("dense", DENSE, (), "token pruning as a whole (dense model)"),
        Arm("stata", STATA, (), "", "stata", recipe_rho),
        Arm("raw", STATA, ("model.score=raw",), "standardization of the scores"),
        Arm("no_anchor", STATA, ("model.anchor=off",), "the anchor (tokens ranked by mean received attention)"),
        Arm("shared_anchor", STATA, ("model.anchor=shared",), "one anchor per timestep (one shared anchor)"),
        Arm("no_align", STATA, ("objective.lambda_intra=0", "objective.lambda_inter=0"), "both alignment losses"),
        Arm("intra_only", STATA, ("objective.lambda_inter=0",), "the inter-timestep alignment"),
        Arm("inter_only", STATA, ("objective.lambda_intra=0",), "the intra-timestep alignment"),
        Arm("random", STATA, ("model.score=random",), "the criterion (random kept set, same keep ratio)", "random", recipe_rho),
    ]
    for rho in SWEEP:
        if rho == recipe_rho:
            continue
        out.append(Arm(f"stata_rho{rho}", STATA, (f"model.keep_ratio={rho}",), "", "stata", rho))
        out.append(Arm(f"random_rho{rho}", STATA, ("model.score=random", f"model.keep_ratio={rho}"), "", "random", rho))
    early = ("model.prune_blocks=[1,2]",)
    out.append(Arm("stata_early", STATA, early, "", variant=True))
    out.append(Arm("random_early", STATA, (*early, "model.score=random"), "", variant=True))
    return {a.name: a for a in out}


def criterion_pairs(recipe_rho: float = 0.5) -> list[tuple[str, str, str]]:
    """(STATA arm, random arm with the same keep schedule, label): where the criterion is tested."""
    pairs = [(f"stata_rho{r}", f"random_rho{r}", f"rho {r:g}, blocks 2-3") for r in SWEEP if r != recipe_rho]
    pairs.insert(sum(r < recipe_rho for r in SWEEP), ("stata", "random", f"rho {recipe_rho:g}, blocks 2-3 (recipe)"))
    return [*pairs, ("stata_early", "random_early", f"rho {recipe_rho:g}, blocks 1-2 (early)")]


MAIN = ("dense", "stata", "raw", "no_anchor", "shared_anchor", "no_align", "intra_only", "inter_only", "random")


def parse_seeds(text: str) -> list[int]:
    """'0-4' or '0,2,5' -> seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return sorted(set(seeds))


def parse_arms(text: str, known: dict[str, Arm]) -> list[str]:
    names: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            names += list(known)
        elif part == "main":
            names += list(MAIN)
        elif part == "sweep":
            names += [n for n, a in known.items() if a.family]
        elif part in known:
            names.append(part)
        else:
            raise SystemExit(f"unknown arm {part!r}; arms: {', '.join(known)} (or all, main, sweep)")
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------------- running


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"s{seed}"


def train(out: Path, arm: Arm, seed: int, extra: list[str]) -> str:
    """Train one (arm, seed) unless finished; resume it if interrupted. Returns what happened."""
    d = run_dir(out, arm.name, seed)
    if (d / "summary.json").exists():
        return "done before"
    d.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if (d / "checkpoint").exists():
        cmd = [sys.executable, "-m", "efficient", "train", "--resume", str(d)]
    else:
        cmd = [sys.executable, "-m", "efficient", "train", arm.recipe, *arm.overrides, *extra,
               f"train.seed={seed}", "train.progress=false", "--out", str(d)]
    t0 = time.perf_counter()
    with open(d.parent / f"s{seed}.log", "a") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        return f"FAILED (exit {rc}; see {d.parent / f's{seed}.log'})"
    return f"trained in {time.perf_counter() - t0:.0f} s"


# ---------------------------------------------------------------------------------- analysis


def analyse(d: Path) -> dict[str, Any]:
    """Accuracy on every validation canvas and, for a pruned model, the tokens kept after the last
    pruning block: their share of the digit's tokens (recall) and of digit tokens among them
    (precision). Written to <run>/kept.json once."""
    cached = d / "kept.json"
    if cached.exists():
        return json.loads(cached.read_text())
    import torch

    import efficient
    from efficient.config import load_recipe
    from efficient.data import build_data
    from efficient.io import write_json
    from efficient.models.stata import surviving_patches

    torch.set_num_threads(1)
    recipe = load_recipe(d / "config.yaml")
    data = build_data(recipe.data)
    model = efficient.load(str(d)).eval()
    grid = model.patch_embed.grid
    patch = data.val.canvas_size // grid
    digit = data.val.digit_tokens(patch)  # [N, grid*grid]
    xs = torch.stack([data.val[i][0] for i in range(len(data.val))])
    ys = data.val.y
    correct, kept_all = 0, []
    with torch.no_grad():
        for i in range(0, len(xs), 256):
            logits = model(xs[i:i + 256])
            correct += int((logits.argmax(-1) == ys[i:i + 256]).sum())
            kept = surviving_patches(model.stata_stats)
            if kept is not None:
                kept_all += [[int(i) for i in row if i >= 0] for row in kept]
    out: dict[str, Any] = {"acc": correct / len(xs), "tokens": grid * grid, "patch": patch,
                           "digit_token_share": float(digit.float().mean())}
    if kept_all:
        rec, prec = [], []
        for row, mask in zip(kept_all, digit):
            hit = int(mask[row].sum())
            rec.append(hit / max(1, int(mask.sum())))
            prec.append(hit / max(1, len(row)))
        out.update({"kept": len(kept_all[0]), "digit_recall": statistics.fmean(rec), "digit_precision": statistics.fmean(prec),
                    "random_recall": len(kept_all[0]) / (grid * grid), "kept_idx_first": kept_all[:16]})
    write_json(cached, out)
    return out


def paired_diffs(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """a minus b for every seed both have, in seed order."""
    return [a[s] - b[s] for s in sorted(a) if s in b]


def t_interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean and 95 % t-interval of paired differences (nan-wide with fewer than 2 pairs)."""
    from scipy import stats

    m = statistics.fmean(diffs)
    if len(diffs) < 2:
        return m, math.nan, math.nan
    h = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return m, m - h, m + h


def by_interval(lo: float, hi: float, below: str, above: str, neither: str) -> str:
    """The words for a paired difference's 95 % interval: below 0, above 0, or across it."""
    if math.isnan(lo):
        return "too few seeds for an interval"
    return below if hi < 0 else (above if lo > 0 else neither)


def verdict(arm: Arm, lo: float, hi: float) -> str:
    def three(below: str, above: str, neither: str) -> str:  # arm minus STATA
        return by_interval(lo, hi, below, above, neither)

    if arm.name == "dense":
        return three("STATA more accurate", "dense more accurate: pruning costs accuracy", "no detectable accuracy difference")
    if arm.name == "random":
        return three("STATA's criterion beats random selection", "random selection is better",
                     "no detectable difference from random selection")
    if arm.variant:
        return three("less accurate than STATA", "more accurate than STATA", "no detectable difference from STATA")
    if not arm.removes:  # a point of the keep-ratio sweep
        return three("less accurate than rho 0.5", "more accurate than rho 0.5", "no detectable difference from rho 0.5")
    return three(f"helps: without {arm.removes}, accuracy drops", f"hurts: without {arm.removes}, accuracy rises",
                 "no detectable effect at this scale")


def collect(out: Path, known: dict[str, Arm]) -> dict[str, Any]:
    """Per arm and seed: accuracy, costs, step time, kept-token coverage, from the finished runs."""
    res: dict[str, Any] = {}
    for name in known:
        for d in sorted((out / name).glob("s*/summary.json")):
            s = json.loads(d.read_text())
            run = d.parent
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            train_rows = [r for r in rows if "samples_per_s" in r]
            batch = _recipe_batch(run)
            kept = analyse(run)
            cost = s.get("cost", {})
            res.setdefault(name, {})[run.name] = {
                "acc": 100 * s["val"].get("acc", kept["acc"]),
                "sops": cost.get("sops", math.nan) / max(1, cost.get("batch_size", 1)),
                "energy_uj": cost.get("energy_pj_per_sample", math.nan) / 1e6,
                # wall clock per step in the last logged window: the final epoch, past the keep-ratio warm-up
                "step_ms": 1000 * batch / train_rows[-1]["samples_per_s"] if train_rows else math.nan,
                "train_time_s": s["train_time_s"],
                **{k: v for k, v in kept.items() if k in ("digit_recall", "digit_precision", "random_recall", "kept", "digit_token_share")},
            }
    return res


def _recipe_batch(run: Path) -> int:
    from efficient.config import load_recipe

    return load_recipe(run / "config.yaml").data["batch_size"]


def summarise(res: dict[str, Any], known: dict[str, Arm]) -> dict[str, Any]:
    table = {}
    base = res.get("stata", {})
    for name, runs in res.items():
        arm = known[name]
        accs = [r["acc"] for r in runs.values()]
        row = {"seeds": sorted(int(k[1:]) for k in runs), "n": len(accs), "acc_mean": statistics.fmean(accs),
               "acc_std": statistics.stdev(accs) if len(accs) > 1 else math.nan}
        for k in ("sops", "energy_uj", "step_ms", "digit_recall", "random_recall"):
            vals = [r[k] for r in runs.values() if k in r and not math.isnan(r[k])]
            row[k] = statistics.fmean(vals) if vals else math.nan
        pairs = [runs[s]["acc"] - base[s]["acc"] for s in runs if s in base]
        if name != "stata" and pairs:
            m, lo, hi = t_interval(pairs)
            row.update({"paired_n": len(pairs), "diff": m, "diff_lo": lo, "diff_hi": hi, "verdict": verdict(arm, lo, hi)})
        row.update({"family": arm.family, "rho": arm.rho, "removes": arm.removes})
        table[name] = row
    return table


# STATA minus random: interval below 0, above 0, across it
CRITERION_WORDS = ("random selection is better", "STATA's criterion beats random selection", "no detectable difference")


def criterion(res: dict[str, Any]) -> list[dict[str, Any]]:
    """STATA minus random selection at the same keep schedule, paired by seed: does the criterion
    matter, and where (the sweep's rho, early pruning)?"""
    rows = []
    for a, b, label in criterion_pairs():
        if a not in res or b not in res:
            continue
        seeds = sorted(set(res[a]) & set(res[b]), key=lambda k: int(k[1:]))
        if not seeds:
            continue
        d = [res[a][s]["acc"] - res[b][s]["acc"] for s in seeds]
        m, lo, hi = t_interval(d)
        rec = [res[x][s].get("digit_recall", math.nan) for x in (a, b) for s in seeds]
        v = by_interval(lo, hi, *CRITERION_WORDS)
        rows.append({"stata": a, "random": b, "label": label, "seeds": [int(s[1:]) for s in seeds], "diffs": d, "diff": m,
                     "diff_lo": lo, "diff_hi": hi, "verdict": v,
                     "stata_recall": statistics.fmean(rec[:len(seeds)]), "random_recall": statistics.fmean(rec[len(seeds):])})
    if len(rows) > 1:
        rows.append(pooled(rows))
    return rows


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The criterion over every schedule at once: per seed, the mean of STATA - random over the
    schedules (so each seed counts once), then the t-interval over seeds. Only the seeds every
    schedule has are used; the schedules are different models, so this asks whether the criterion
    helps on average over the sweep, not at any one keep ratio."""
    seeds = sorted(set.intersection(*(set(r["seeds"]) for r in rows)))
    d = [statistics.fmean(r["diffs"][r["seeds"].index(s)] for r in rows) for s in seeds]
    m, lo, hi = t_interval(d) if seeds else (math.nan, math.nan, math.nan)
    v = by_interval(lo, hi, *CRITERION_WORDS)
    return {"stata": "all", "random": "all", "label": f"mean over the {len(rows)} schedules above", "seeds": seeds, "diffs": d,
            "diff": m, "diff_lo": lo, "diff_hi": hi, "verdict": v,
            "stata_recall": statistics.fmean(r["stata_recall"] for r in rows),
            "random_recall": statistics.fmean(r["random_recall"] for r in rows)}


def criterion_markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["| keep schedule | seeds | STATA - random, points [95 % CI] | per seed | verdict | digit tokens kept: STATA / random |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {len(r['seeds'])} | {r['diff']:+.2f} [{fmt(r['diff_lo'])}, {fmt(r['diff_hi'])}] | "
                     f"{', '.join(f'{x:+.1f}' for x in r['diffs'])} | {r['verdict']} | "
                     f"{100 * r['stata_recall']:.1f} % / {100 * r['random_recall']:.1f} % |")
    return "\n".join(lines) + "\n"


def fmt(v: float, nd: int = 2) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def markdown(table: dict[str, Any], known: dict[str, Arm]) -> str:
    head = ["arm", "seeds", "val acc % (mean +- std)", "paired diff to STATA, points [95 % CI]", "verdict", "SOPs / sample (M)",
            "energy / sample (uJ)", "step (ms)", "digit tokens kept (random: k/N)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in known:
        if name not in table:
            continue
        r = table[name]
        if "diff" in r:
            diff = f"{r['diff']:+.2f} [{fmt(r['diff_lo'])}, {fmt(r['diff_hi'])}]"
        else:
            diff = "(reference)" if name == "stata" else "n/a"
        cover = "all" if math.isnan(r["digit_recall"]) else f"{100 * r['digit_recall']:.1f} % ({100 * r['random_recall']:.1f} %)"
        lines.append(f"| {name} | {r['n']} | {fmt(r['acc_mean'])} +- {fmt(r['acc_std'])} | {diff} | {r.get('verdict', '')} | "
                     f"{fmt(r['sops'] / 1e6, 3)} | {fmt(r['energy_uj'], 3)} | {fmt(r['step_ms'], 1)} | {cover} |")
    for fam in ("stata", "random"):
        r = table.get(fam)
        if r and not math.isnan(r["digit_recall"]):
            who = "STATA" if fam == "stata" else "random selection"
            lines.append(f"\n{who} keeps {100 * r['digit_recall']:.1f} % of the digit's tokens after the last pruning block "
                         f"(a random set of that size keeps {100 * r['random_recall']:.1f} % on average).")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- plots


def plot_frontier(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, style in (("stata_early", "^"), ("random_early", "v")):
        if name in table:
            r = table[name]
            ax.errorbar([r["energy_uj"]], [r["acc_mean"]], yerr=[0 if math.isnan(r["acc_std"]) else r["acc_std"]], fmt=style,
                        capsize=3, label=f"{name.replace('_', ' ')} (blocks 1-2, rho 0.5)")
    for fam, style in (("stata", "o-"), ("random", "s--")):
        pts = sorted((r["rho"], r["energy_uj"], r["acc_mean"], r["acc_std"]) for r in table.values() if r["family"] == fam)
        if not pts:
            continue
        ax.errorbar([p[1] for p in pts], [p[2] for p in pts], yerr=[0 if math.isnan(p[3]) else p[3] for p in pts],
                    fmt=style, capsize=3, label=f"{'STATA' if fam == 'stata' else 'random selection'}")
        # STATA's labels above its points, random's below: the two families share each rho's energy.
        for rho, e, a, _ in pts:
            ax.annotate(f"rho {rho:g}", (e, a), textcoords="offset points", xytext=(4, 5 if fam == "stata" else -11),
                        fontsize=7)
    if "dense" in table:
        d = table["dense"]
        ax.errorbar([d["energy_uj"]], [d["acc_mean"]], yerr=[0 if math.isnan(d["acc_std"]) else d["acc_std"]], fmt="k*",
                    markersize=12, capsize=3, label="dense")
    ax.set_xlabel("energy per sample (uJ, 45 nm: 4.6 pJ/MAC, 0.9 pJ/SOP)")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title("cluttered digits: accuracy vs energy (mean +- std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_kept(out: Path, path: Path, n: int = 6) -> bool:
    """Kept tokens after the last pruning block on the first `n` validation canvases: the lowest
    seed of STATA and of each selection arm that ran (no anchor, no alignment, random). Digit box in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from efficient.config import load_recipe
    from efficient.data import build_data

    rows = []
    for name in ("stata", "no_anchor", "no_align", "random", "stata_rho0.3", "random_rho0.3", "stata_early", "random_early"):
        runs = sorted((out / name).glob("s*/kept.json"), key=lambda p: int(p.parent.name[1:]))
        if runs:
            rows.append((name, runs[0].parent, json.loads(runs[0].read_text())))
    if not rows:
        return False
    data = build_data({**load_recipe(rows[0][1] / "config.yaml").data, "normalize": False})
    fig, axes = plt.subplots(len(rows), n, figsize=(1.9 * n, 2.1 * len(rows)), squeeze=False)
    for r, (name, run, kept) in enumerate(rows):
        g, p = int(math.isqrt(kept["tokens"])), kept["patch"]
        for c in range(n):
            ax = axes[r][c]
            ax.imshow(data.val.x[c, 0].numpy(), cmap="gray", vmin=0, vmax=1)
            for t in kept["kept_idx_first"][c]:
                ax.add_patch(Rectangle(((t % g) * p - 0.5, (t // g) * p - 0.5), p, p, color="deepskyblue", alpha=0.35, lw=0))
            top, left, size = data.val.boxes[c].tolist()
            ax.add_patch(Rectangle((left - 0.5, top - 0.5), size, size, fill=False, ec="red", lw=1))
            ax.set_xticks([]), ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(f"{name} ({run.name})", fontsize=8)
        axes[r][0].set_title(f"kept {kept['kept']}/{kept['tokens']}, digit tokens kept {100 * kept['digit_recall']:.0f} %",
                             fontsize=7, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------- main


def check_manifest(out: Path, extra: list[str]) -> None:
    """Runs in one OUT share their extra overrides: refuse to mix a smoke with a full study."""
    from efficient.io import write_json

    f = out / "manifest.json"
    if f.exists():
        before = json.loads(f.read_text()).get("extra", [])
        if before != extra:
            raise SystemExit(f"{out} holds runs made with --set {before or '(none)'}; this call has {extra or '(none)'}. "
                             f"Use another --out or the same --set.")
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_json(f, {"extra": extra})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/stata_ablation", help="study directory (runs, tables, plots)")
    ap.add_argument("--arms", default="all", help="comma list of arms, or all / main / sweep (default all)")
    ap.add_argument("--seeds", default="0-4", help="seeds, e.g. 0-4 or 0,3 (default 0-4)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for every run (e.g. train.max_steps=3 for a smoke); fixed per --out")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    ap.add_argument("--report", action="store_true", help="only write the tables and plots from finished runs")
    ap.add_argument("--figures", default=None, help="also copy the PNGs into this directory (e.g. bench/figures)")
    args = ap.parse_args()

    out = Path(args.out)
    known = arms()
    if args.report:  # reading only: the runs' overrides are the manifest's
        manifest = out / "manifest.json"
        args.extra = json.loads(manifest.read_text()).get("extra", []) if manifest.exists() else []
    else:
        check_manifest(out, args.extra)
        jobs = [(known[a], s) for s in parse_seeds(args.seeds) for a in parse_arms(args.arms, known)]  # seed-major: pairs finish together
        t0 = time.perf_counter()

        def one(job: tuple[Arm, int]) -> None:
            arm, seed = job
            print(f"{arm.name} s{seed}: {train(out, arm, seed, args.extra)}", flush=True)

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            list(pool.map(one, jobs))
        print(f"{len(jobs)} runs in {time.perf_counter() - t0:.0f} s", flush=True)

    from efficient.io import write_json, write_text

    res = collect(out, known)
    table = summarise(res, known)
    crit = criterion(res)
    write_json(out / "ablation.json", {"runs": res, "arms": table, "criterion": crit, "extra": args.extra})
    md = markdown(table, known)
    if crit:
        md += "\nThe criterion at each keep schedule (paired by seed):\n\n" + criterion_markdown(crit)
    write_text(out / "ablation.md", md)
    print(md)
    pngs = []
    if table:
        plot_frontier(table, out / "frontier.png")
        pngs.append(out / "frontier.png")
    if plot_kept(out, out / "kept_tokens.png"):
        pngs.append(out / "kept_tokens.png")
    if args.figures:
        import shutil

        Path(args.figures).mkdir(parents=True, exist_ok=True)
        for p in pngs:
            shutil.copyfile(p, Path(args.figures) / f"stata_ablation_{p.name}")
    print("wrote", ", ".join(str(p) for p in [out / "ablation.json", out / "ablation.md", *pngs]))


if __name__ == "__main__":
    main()
