"""Early-exit decoding of a trained EE-GPT run: quality against speed over exit thresholds.

    python bench/early_exit.py RUN_DIR --sweep recompute=0.95,0.9,0.85,0.8 copy=0.95,0.9 speculative=0.9,0.8,0.5 \
        --targets --plot bench/figures/early_exit_tradeoff.png --json early_exit.json

One run, paired, on one torch thread (`BENCH_THREADS`):

1. Teacher-forced on the validation split (cheap, all tokens): per-exit loss, the exit distribution
   under the rule per threshold, the held-out loss of the predictions the rule picks and its
   increase over full depth (recompute's loss exactly: its deep layers always read the full
   model's KV; for copy an approximation; speculative is lossless), the MAC-ratio speed-up the
   exits allow (full-depth MACs / MACs to each token's exit, exit heads included), and each exit's
   calibration (reliability bins of its max-prob against agreement with the final head).
2. Full depth before vs after the decode rework: the module-by-module path (`impl="modules"`),
   the decode engine eager and compiled (`torch.compile(dynamic=False)` one-token steps), timed on
   the same prompts in rotating order; tokens/s on wall-clock and thread CPU time
   (`time.thread_time`), the after/before ratio of each pair, and whether their tokens agree. The
   compiled engine's warm-up (compilation) is done first, timed and reported on its own.
3. Free-running greedy decoding from validation prompts (batch 1), per strategy and threshold on
   `--engine` (default: compiled), each run next to a full-depth run of the same engine on the same
   prompt (order alternating): tokens/s (wall and CPU), the realized speed-up (median of paired
   ratios on `--clock`), the MAC-ratio speed-up, the realized share of it (realized / MAC-ratio),
   the MACs actually spent (recomputed, copied and verified ones included), agreement with
   full-depth greedy; and for recompute and copy the decoded held-out loss: `--loss-windows`
   validation windows fed token by token through the strategy (forced decoding), scored by the
   head that decided each token (copy's approximate KV included; recompute's equals the
   teacher-forced value), against full depth decoded the same way.

`--targets`: realized speed-up >= 80 % of the MAC-ratio speed-up at every threshold; recompute
>= 1.3x tokens/s at <= 1 % higher held-out loss (`--recompute-speedup`); speculative exactly
lossless (greedy tokens identical to full depth on every prompt), and as fast as
`--speculative-speedup` where it is given. Each PASS/FAIL; when one fails, the per-exit calibration
table is printed (`--calibration` prints it always). `--plot`: held-out loss against tokens/s over
thresholds for recompute, copy and speculative, full depth as a point, beside the reliability
diagram of each exit (PNG).

`STRATEGY=auto` takes its thresholds from the teacher-forced sweep: the lowest tau whose held-out
loss increase is within 1 % and its neighbours (3 for recompute, 2 for copy). Past `--budget-s`
the remaining configurations are skipped (and listed). On CUDA timing is synchronized wall-clock
and `--unpaired` times the full-depth baseline once per prompt and reuses it.

Smoke run on a tiny model (seconds; nothing to conclude from its numbers):

    efficient train recipes/ee_gpt_text.yaml train.max_steps=30 profile.enabled=false --out runs/ee_tiny
    python bench/early_exit.py runs/ee_tiny --prompts 2 --new-tokens 16 --repeats 1 --val-batches 2 \
        --sweep recompute=0.5,0.2 copy=0.5 speculative=0.5 --targets --plot ee_smoke.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

RECOMPUTE_SPEEDUP, LOSS_BOUND, REALIZED_SHARE = 1.3, 0.01, 0.8
CALIBRATION_BINS = 10
CLOCKS = ("cpu_seconds", "seconds")  # thread CPU time, wall-clock


def teacher_forced(model, batches, thresholds):
    """Per threshold: exit distribution, CE and agreement of the chosen exits' predictions, and the
    MAC ratio; per exit: CE and reliability bins of its max-prob against agreement with the final head."""
    from efficient.profiler.exits import layer_macs

    L = model.num_layers
    cost = layer_macs(model)
    full = L * cost["layer"] + cost[f"head{L}"]
    per_exit_ce = {k: 0.0 for k in model.exit_layers}
    bins = {k: [[0, 0.0, 0, 0] for _ in range(CALIBRATION_BINS)] for k in model.exit_layers[:-1]}  # count, sum conf, agree final, correct
    rows = {t: {"ce": 0.0, "agree": 0.0, "macs": 0.0, "dist": dict.fromkeys(model.exit_layers, 0)} for t in thresholds}
    n = 0
    with torch.no_grad():
        for x, y in batches:
            logp = {s.layer: F.log_softmax((s.hidden @ s.weight.T).float(), -1) for s in model.exit_states(x)}
            final_arg = logp[L].argmax(-1)
            for k, lp in logp.items():
                per_exit_ce[k] += float(-lp.gather(-1, y[..., None]).sum())
            for k in bins:
                conf, arg = logp[k].max(-1)
                conf = conf.exp()
                b = (conf * CALIBRATION_BINS).long().clamp(max=CALIBRATION_BINS - 1)
                for i in range(CALIBRATION_BINS):
                    m = b == i
                    bins[k][i][0] += int(m.sum())
                    bins[k][i][1] += float(conf[m].sum())
                    bins[k][i][2] += int((arg == final_arg)[m].sum())
                    bins[k][i][3] += int((arg == y)[m].sum())
            for t in thresholds:
                chosen = torch.full(y.shape, L, device=y.device)
                for k in model.exit_layers[:-1]:
                    hit = (chosen == L) & (logp[k].amax(-1).exp() >= t) if t < 1 else torch.zeros_like(y, dtype=torch.bool)
                    chosen[hit] = k
                r = rows[t]
                for k in model.exit_layers:
                    m = chosen == k
                    r["dist"][k] += int(m.sum())
                    if m.any():
                        r["ce"] += float(-logp[k].gather(-1, y[..., None])[..., 0][m].sum())
                        r["agree"] += int((logp[k].argmax(-1) == final_arg)[m].sum())
                        # layers to the exit + every exit head evaluated on the way (tau < 1)
                        heads = sum(cost[f"head{j}"] for j in model.exit_layers if j <= k and (t < 1 or j == L))
                        r["macs"] += int(m.sum()) * (k * cost["layer"] + heads)
            n += y.numel()
    out = []
    for t, r in rows.items():
        out.append({"threshold": t, "val_ce": r["ce"] / n, "agree_final_top1": r["agree"] / n, "expected_mac_saving": 1 - r["macs"] / n / full,
                    "mac_speedup": n * full / r["macs"], "exit_dist": {k: v / n for k, v in r["dist"].items()},
                    "mean_exit_depth": sum(k * v for k, v in r["dist"].items()) / n / L})
    calibration = {}
    for k, bs in bins.items():
        rel = [{"bin": [i / CALIBRATION_BINS, (i + 1) / CALIBRATION_BINS], "share": c / n, "confidence": sc / c, "agree_final": a / c, "accuracy": ok / c}
               for i, (c, sc, a, ok) in enumerate(bs) if c]
        # expected calibration error of max-prob as a predictor of agreeing with the final head
        ece = sum(r["share"] * abs(r["confidence"] - r["agree_final"]) for r in rel)
        calibration[k] = {"ece_vs_final": ece, "ece_vs_target": sum(r["share"] * abs(r["confidence"] - r["accuracy"]) for r in rel), "bins": rel}
    return {k: v / n for k, v in per_exit_ce.items()}, out, calibration


class Decoder:
    """`generate` on one implementation: "modules" (the module-by-module path), "eager" or
    "compiled" (the decode engine). Returns the generation and its time on both clocks."""

    def __init__(self, model, impl: str) -> None:
        from efficient.decoding import DecodeEngine

        self.model, self.impl = model, impl
        self.engine = None if impl == "modules" else DecodeEngine(model, compile=impl == "compiled")

    def warm_up(self, total: int, strategies) -> float:
        return 0.0 if self.engine is None else self.engine.warm_up(total, tuple(strategies))

    def __call__(self, prompt, new_tokens, threshold, strategy, **kw):
        from efficient.decoding import generate

        if self.engine is None:
            g = generate(self.model, prompt, new_tokens, threshold, strategy, impl="modules", **kw)
        else:
            g = generate(self.model, prompt, new_tokens, threshold, strategy, engine=self.engine, **kw)
        return g, {"seconds": g.seconds, "cpu_seconds": g.cpu_seconds}


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def full_margin(model, prompt: list[int], ref: list[int], pos: int) -> dict:
    """The full model's (no cache, one forward) top-2 at position `pos` of the reference continuation."""
    with torch.no_grad():
        ids = torch.tensor([prompt + ref[:pos]], device=model.tok_emb.weight.device)
        s = model.exit_states(ids, [model.num_layers])[-1]
        z = (s.hidden[0, -1] @ s.weight.T).float()
        v, i = z.topk(2)
    return {"pos": pos, "top2": i.tolist(), "logit_margin": float(v[0] - v[1])}


def iqr(xs: list[float]) -> list[float]:
    return statistics.quantiles(xs, n=4)[::2] if len(xs) > 1 else [xs[0], xs[0]]


def before_after(decoders: dict, prompts, new_tokens, repeats, clock) -> dict:
    """Full depth (tau = 1) on every implementation, the same prompts, rotating order per pair so
    load drifts cancel: tokens/s on both clocks and each engine's speed-up over the module path
    (median of per-prompt ratios on `clock`)."""
    names = list(decoders)
    times = {k: {c: [] for c in CLOCKS} for k in names}
    ratios = {k: [] for k in names[1:]}
    tokens = {}
    for r in range(repeats):
        for i, p in enumerate(prompts):
            shift = (r + i) % len(names)
            took = {}
            for k in names[shift:] + names[:shift]:
                g, took[k] = decoders[k](p, new_tokens, 1.0, "recompute")
                tokens.setdefault(k, {})[i] = g.tokens
                for c in CLOCKS:
                    times[k][c].append(took[k][c])
            for k in names[1:]:
                ratios[k].append(took[names[0]][clock] / took[k][clock])
    per_prompt = len(prompts)
    out = {}
    for k in names:
        out[k] = {f"tokens_per_s_{'cpu' if c == 'cpu_seconds' else 'wall'}": per_prompt * new_tokens / statistics.median(
            [sum(times[k][c][j : j + per_prompt]) for j in range(0, len(times[k][c]), per_prompt)]) for c in CLOCKS}
        if k != names[0]:
            out[k]["speedup_over_" + names[0]] = statistics.median(ratios[k])
            out[k]["speedup_iqr"] = iqr(ratios[k])
            out[k]["same_tokens"] = all(tokens[k][i] == tokens[names[0]][i] for i in range(per_prompt))
    return out


def free_running(model, prompts, new_tokens, sweep, decode, clock, max_pending=None, repeats=3, unpaired=False, budget_s=None):
    """Each configuration is timed on every prompt `repeats` times. Paired (default): each time
    next to a full-depth run on the same prompt (tau = 1, same implementation, order alternating);
    the speed-up is the median of those paired ratios (interquartile range beside it), so machine
    load drifts cancel. Unpaired: the full-depth run is timed `repeats` times per prompt before the
    sweep and its per-prompt median is every configuration's baseline."""
    t_start = time.perf_counter()
    base_of = None
    if unpaired:  # the timed full-depth runs are also the greedy references
        runs = [[decode(p, new_tokens, 1.0, "recompute") for _ in range(repeats)] for p in prompts]
        refs = [r[0][0] for r in runs]
        base_of = [{c: statistics.median(t[c] for _, t in r) for c in CLOCKS} for r in runs]
    else:
        refs = [decode(p, new_tokens, 1.0, "recompute")[0] for p in prompts]  # full-depth greedy
    rows, skipped = [], []
    for strategy, thresholds in sweep:
        for t in thresholds:
            if budget_s is not None and time.perf_counter() - t_start > budget_s:
                skipped.append((strategy, t))
                continue
            t0 = time.perf_counter()
            kw = {"max_pending": max_pending} if strategy == "recompute" else {}
            ratios = {c: [] for c in CLOCKS}
            times, bases = {c: [] for c in CLOCKS}, {c: [] for c in CLOCKS}
            gens = [None] * len(prompts)
            for r in range(repeats):
                for i, p in enumerate(prompts):  # one (full, early-exit) pair per prompt, order alternating
                    first_full = (r + i) % 2 == 0
                    if unpaired:
                        base = base_of[i]
                    elif first_full:
                        base = decode(p, new_tokens, 1.0, "recompute")[1]
                    gens[i], took = decode(p, new_tokens, t, strategy, **kw)
                    if not unpaired and not first_full:
                        base = decode(p, new_tokens, 1.0, "recompute")[1]
                    for c in CLOCKS:
                        ratios[c].append(base[c] / took[c])
                        times[c].append(took[c])
                        bases[c].append(base[c])
            k = len(prompts)
            total = {c: statistics.median([sum(times[c][j : j + k]) for j in range(0, len(times[c]), k)]) for c in CLOCKS}
            base_total = {c: statistics.median([sum(bases[c][j : j + k]) for j in range(0, len(bases[c]), k)]) for c in CLOCKS}
            toks = sum(len(g.tokens) for g in gens)
            agree = sum(sum(a == b for a, b in zip(g.tokens, r.tokens)) for g, r in zip(gens, refs)) / toks
            diffs = [first_diff(g.tokens, r.tokens) for g, r in zip(gens, refs)]
            exits = [e for g in gens for e in g.exit_layers]
            full = sum(g.full_macs for g in gens)
            mac_speedup = full / sum(g.expected_macs for g in gens)
            speedup = statistics.median(ratios[clock])
            row = {"strategy": strategy, "threshold": t,
                   "tokens_per_s_cpu": toks / total["cpu_seconds"], "tokens_per_s_wall": toks / total["seconds"],
                   "full_tokens_per_s_cpu": toks / base_total["cpu_seconds"], "full_tokens_per_s_wall": toks / base_total["seconds"],
                   "speedup": speedup, "speedup_iqr": iqr(ratios[clock]), "speedup_other_clock": statistics.median(ratios[CLOCKS[1 - CLOCKS.index(clock)]]),
                   "mac_speedup": mac_speedup, "realized_share": speedup / mac_speedup, "spent_mac_speedup": full / sum(g.macs for g in gens),
                   "agree_full_greedy": agree, "identical_prompts": sum(d is None for d in diffs), "prompts": len(prompts),
                   "mean_exit_layer": statistics.mean(exits), "exit_dist": {e: exits.count(e) / len(exits) for e in model.exit_layers}}
            if strategy == "speculative":
                row["draft_acceptance"] = statistics.mean(g.stats["draft_acceptance"] for g in gens)
                row["first_differences"] = [{"prompt": i, **full_margin(model, prompts[i], refs[i].tokens, d)} for i, d in enumerate(diffs) if d is not None]
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows, skipped


def decoded_loss(model, windows: list[list[int]], prompt_len: int, strategy: str, threshold: float) -> float:
    """Held-out loss of a strategy as it decodes: each window's tokens after the first `prompt_len`
    fed one by one (forced decoding on the eager engine) under the exit rule, scored by the head
    that decided each; mean nats per token. Copy's approximate KV is in it; recompute's equals the
    teacher-forced value."""
    from efficient.decoding import DecodeEngine
    from efficient.decoding import generate

    engine = DecodeEngine(model)
    lp = []
    for w in windows:
        lp += generate(model, w[:prompt_len], len(w) - prompt_len, threshold, strategy, engine=engine, forced=w[prompt_len:]).logprobs
    return -sum(lp) / len(lp)


def parse_sweep(items: list[str] | None, strategies: list[str], thresholds: list[float]) -> list[tuple[str, list[float] | str]]:
    """`recompute=0.9,0.8 copy=auto` -> [(strategy, thresholds or "auto")]; default: every strategy x thresholds."""
    if not items:
        return [(s, list(thresholds)) for s in strategies]
    out = []
    for it in items:
        s, _, ts = it.partition("=")
        if s not in ("recompute", "copy", "speculative") or not ts or (ts == "auto" and s == "speculative"):
            raise SystemExit(f"--sweep: expected STRATEGY=T1,T2,... (or recompute=auto / copy=auto) with STRATEGY recompute, copy or speculative, got {it!r}")
        try:
            out.append((s, "auto" if ts == "auto" else [float(t) for t in ts.split(",")]))
        except ValueError:
            raise SystemExit(f"--sweep: thresholds must be numbers, got {it!r}") from None
    return out


def auto_thresholds(tf: list[dict], n: int) -> list[float]:
    """From the teacher-forced sweep: the lowest tau < 1 (most exits) whose loss increase is within
    the bound, then its higher neighbour and (for n >= 3) its lower one, just past the bound."""
    taus = sorted((r["threshold"] for r in tf if 0 < r["threshold"] < 1), reverse=True)  # generate takes tau in (0, 1]
    inc = {r["threshold"]: r["val_ce_increase"] for r in tf}
    ok = [t for t in taus if inc[t] <= LOSS_BOUND]
    if not ok:
        return taus[:n]
    i = taus.index(ok[-1])
    pick = [taus[i]] + taus[max(i - 1, 0) : i][::-1] + taus[i + 1 : i + 2]
    return sorted(dict.fromkeys(pick[:n]), reverse=True)


def print_targets(gen, ce_at, recompute_speedup: float = RECOMPUTE_SPEEDUP, speculative_speedup: float | None = None) -> dict:
    """PASS/FAIL: realized share at every threshold, recompute's speed-up within the loss bound,
    speculative's exactness (and its speed-up, where a target is given)."""
    print("\ntargets (tokens/s against full-depth decoding on the same engine):")
    verdict = {}
    low = [r for r in gen if r["realized_share"] < REALIZED_SHARE]
    verdict["realized_share"] = {"pass": bool(gen) and not low, "min": min((r["realized_share"] for r in gen), default=float("nan"))}
    print(f"- realized speed-up >= {100 * REALIZED_SHARE:.0f} % of the MAC-ratio speed-up at every threshold: "
          + ("PASS" if verdict["realized_share"]["pass"] else "FAIL (" + ", ".join(f"{r['strategy']} tau {r['threshold']}: {100 * r['realized_share']:.0f} %" for r in low) + ")"))
    rs = [r for r in gen if r["strategy"] == "recompute"]
    if rs:
        ok = [r for r in rs if ce_at.get(r["threshold"], float("inf")) <= LOSS_BOUND]
        target = f">= {recompute_speedup:.1f}x tokens/s at <= +{100 * LOSS_BOUND:.0f} % held-out loss"
        if ok:
            best = max(ok, key=lambda r: r["speedup"])
            passed = best["speedup"] >= recompute_speedup
            print(f"- recompute: {target}: best tau {best['threshold']}: {best['speedup']:.2f}x (MAC ratio {best['mac_speedup']:.2f}x) at "
                  f"{100 * ce_at[best['threshold']]:+.2f} % loss, mean exit layer {best['mean_exit_layer']:.2f} -> {'PASS' if passed else 'FAIL'}")
            verdict["recompute"] = {"threshold": best["threshold"], "speedup": best["speedup"], "loss_increase": ce_at[best["threshold"]], "pass": passed}
        else:
            lo = min(rs, key=lambda r: ce_at.get(r["threshold"], float("inf")))
            print(f"- recompute: {target}: no threshold within the bound (smallest increase: tau {lo['threshold']}, "
                  f"{100 * ce_at.get(lo['threshold'], float('nan')):+.2f} %) -> FAIL")
            verdict["recompute"] = {"threshold": None, "pass": False}
    rs = [r for r in gen if r["strategy"] == "speculative"]
    if rs:
        for r in rs:
            print(f"  speculative tau {r['threshold']}: tokens identical to full-depth greedy on {r['identical_prompts']}/{r['prompts']} prompts, "
                  f"{r['speedup']:.2f}x, draft acceptance {r['draft_acceptance']:.2f}")
            for d in r["first_differences"]:
                print(f"    prompt {d['prompt']}: first difference at token {d['pos']}, full model's top-2 {d['top2']} logit margin {d['logit_margin']:.2e}")
        exact = all(r["identical_prompts"] == r["prompts"] for r in rs)
        print(f"- speculative: exactly lossless (greedy) at every threshold -> {'PASS' if exact else 'FAIL'}")
        verdict["speculative"] = {"exact": exact, "pass": exact}
        if speculative_speedup is not None:
            best = max(rs, key=lambda r: r["speedup"])
            fast = best["speedup"] >= speculative_speedup
            print(f"- speculative: >= {speculative_speedup:.1f}x tokens/s: best tau {best['threshold']}: {best['speedup']:.2f}x "
                  f"-> {'PASS' if fast else 'FAIL'}")
            verdict["speculative"].update(speedup=best["speedup"], pass_speedup=fast)
            verdict["speculative"]["pass"] = exact and fast
    return verdict


def print_calibration(calibration: dict) -> None:
    """Reliability of each early exit's max-prob: what the exit rule thresholds."""
    print("\nexit-confidence calibration (teacher-forced; ECE against agreeing with the final head, and against the next byte):")
    for k, c in calibration.items():
        print(f"exit {k}: ECE vs final head {c['ece_vs_final']:.3f}, vs target {c['ece_vs_target']:.3f}")
        print("| max-prob bin | share of tokens | mean max-prob | agrees with final head | correct |")
        print("|---|---|---|---|---|")
        for b in c["bins"]:
            print(f"| {b['bin'][0]:.1f}-{b['bin'][1]:.1f} | {b['share']:.3f} | {b['confidence']:.3f} | {b['agree_final']:.3f} | {b['accuracy']:.3f} |")


def plot(path: str, gen: list[dict], full_ce: float, full_tps: float, tf_ce: dict, calibration: dict, clock: str, title: str) -> None:
    """Held-out loss against tokens/s over thresholds per strategy, full depth as a point; and the
    reliability diagram of every early exit. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "tokens_per_s_cpu" if clock == "cpu_seconds" else "tokens_per_s_wall"
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(11, 4.5))
    for strategy, marker in (("recompute", "o"), ("copy", "s"), ("speculative", "^")):
        rs = sorted((r for r in gen if r["strategy"] == strategy), key=lambda r: r["threshold"])
        if not rs:
            continue
        # copy's loss as it decodes (its KV is approximate) where measured, scaled to the
        # teacher-forced full-depth loss; recompute's teacher-forced loss is its decoded loss exactly
        decoded = strategy == "copy" and all("decoded_ce_increase" in r for r in rs)
        ys = [full_ce if strategy == "speculative" else full_ce * (1 + r["decoded_ce_increase"]) if decoded else tf_ce[r["threshold"]] for r in rs]
        label = {"copy": "copy (decoded loss)" if decoded else "copy (loss teacher-forced, approx.)", "speculative": "speculative (lossless)"}.get(strategy, strategy)
        ax.plot([r[key] for r in rs], ys, marker=marker, label=label)
        for r, y in zip(rs, ys):
            ax.annotate(f"{r['threshold']:g}", (r[key], y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.scatter([full_tps], [full_ce], marker="*", s=160, color="black", zorder=5, label="full depth")
    ax.set_xlabel(f"tokens/s ({'thread CPU time' if clock == 'cpu_seconds' else 'wall-clock'}, batch 1)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("loss vs speed over exit thresholds (labels: tau)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    rel.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    for k, c in calibration.items():
        rel.plot([b["confidence"] for b in c["bins"]], [b["agree_final"] for b in c["bins"]], marker="o", label=f"exit {k} (ECE {c['ece_vs_final']:.3f})")
    rel.set_xlabel("exit max-prob (bin mean)")
    rel.set_ylabel("share agreeing with the final head")
    rel.set_title("exit-confidence reliability")
    rel.grid(alpha=0.3)
    rel.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="run dir (or zoo name) of an early-exit model")
    # the paper's sweep: tau from 1.0 to 0.0 in steps of 0.05 (21 points), teacher-forced
    ap.add_argument("--thresholds", type=float, nargs="+", default=[round(1 - 0.05 * i, 2) for i in range(21)])
    ap.add_argument("--gen-thresholds", type=float, nargs="+", default=[0.95, 0.9, 0.85, 0.8, 0.7])
    ap.add_argument("--strategies", nargs="+", default=["recompute", "copy", "speculative"])
    ap.add_argument("--sweep", nargs="+", default=None, metavar="STRATEGY=T1,T2",
                    help="per-strategy thresholds (e.g. recompute=0.9,0.8,0.6 copy=0.9,0.8 speculative=0.8,0.5); replaces --strategies x --gen-thresholds")
    ap.add_argument("--engine", choices=["compiled", "eager", "modules"], default="compiled",
                    help="implementation of the strategy sweep: the decode engine compiled or eager, or the module-by-module path")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="model weights and KV cache")
    ap.add_argument("--clock", choices=list(CLOCKS), default=None,
                    help="clock of the speed-ups: thread CPU time (CPU default) or wall-clock; CUDA: always synchronized wall-clock")
    ap.add_argument("--repeats", type=int, default=5, help="timings per (configuration, prompt); the median ratio is reported")
    ap.add_argument("--unpaired", action="store_true", help="time the full-depth baseline once per prompt (x repeats) and reuse it for every configuration")
    ap.add_argument("--val-batches", type=int, default=8, help="teacher-forced batches of 16 x 128 tokens (capped at the validation split)")
    ap.add_argument("--loss-windows", type=int, default=4,
                    help="validation windows (128 tokens, first 16 as prompt) decoded token by token for each recompute/copy threshold's decoded held-out loss (0: skip)")
    ap.add_argument("--max-pending", type=int, default=None, help="recompute: force full depth after this many exited tokens")
    ap.add_argument("--targets", action="store_true", help="print the targets as PASS/FAIL (and the calibration when one fails)")
    ap.add_argument("--recompute-speedup", type=float, default=RECOMPUTE_SPEEDUP,
                    help="--targets: recompute's tokens/s speed-up within the loss bound")
    ap.add_argument("--speculative-speedup", type=float, default=None,
                    help="--targets: speculative's tokens/s speed-up (default: exactness only)")
    ap.add_argument("--calibration", action="store_true", help="print the per-exit calibration tables")
    ap.add_argument("--no-before-after", action="store_true", help="skip the full-depth comparison of the module path and the engine")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the remaining generation configurations after this many seconds of the sweep")
    ap.add_argument("--plot", default=None, metavar="PNG", help="write the loss-vs-tokens/s and reliability plot here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible")
        if args.clock == "cpu_seconds":
            raise SystemExit("--clock cpu_seconds means nothing on CUDA (the CPU waits on the device); CUDA timing is synchronized wall-clock")
        clock = "seconds"
    else:
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
        clock = args.clock or "cpu_seconds"
    torch.set_float32_matmul_precision("highest")  # fp32 without TF32: full-depth and early-exit paths see the same numerics
    import efficient
    from efficient.data.text import text

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = efficient.load(args.run).to(device=device, dtype=dtype).eval()
    sweep = parse_sweep(args.sweep, args.strategies, args.gen_thresholds)
    gen_thresholds = sorted({t for _, ts in sweep if ts != "auto" for t in ts}, reverse=True)
    seq_len = 128
    val = text(seq_len=seq_len).val
    batches = []
    for b in range(args.val_batches):
        items = [val[i] for i in range(b * 16, min((b + 1) * 16, len(val)))]
        if not items:  # the whole split is used
            break
        batches.append((torch.stack([x for x, _ in items]).to(device), torch.stack([y for _, y in items]).to(device)))
    t0 = time.perf_counter()
    per_exit, tf, calibration = teacher_forced(model, batches, sorted(set(args.thresholds) | set(gen_thresholds), reverse=True))
    print(f"model {args.run}: {model.num_layers} layers x {model.n_embd}, exits {model.exit_layers}, {args.dtype} on {args.device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f" ({torch.get_num_threads()} thread(s))")
          + f"; torch {torch.__version__}; speed-ups on {clock}")
    print(f"per-exit val CE ({sum(y.numel() for _, y in batches)} tokens, {time.perf_counter() - t0:.1f} s):", {k: round(v, 4) for k, v in per_exit.items()})
    full_ce = per_exit[model.num_layers]
    for r in tf:
        r["val_ce_increase"] = r["val_ce"] / full_ce - 1
    print("| tau | exit dist (layer: share) | mean exit layer | val CE of chosen exits | increase vs full | top-1 agreement with final | MAC-ratio speed-up |")
    print("|---|---|---|---|---|---|---|")
    for r in tf:
        dist = ", ".join(f"{k}: {v:.2f}" for k, v in r["exit_dist"].items())
        print(f"| {r['threshold']} | {dist} | {r['mean_exit_depth'] * model.num_layers:.2f} | {r['val_ce']:.4f} | {100 * r['val_ce_increase']:+.2f} % | {r['agree_final_top1']:.3f} | {r['mac_speedup']:.2f}x |")
    sweep = [(s, auto_thresholds(tf, 3 if s == "recompute" else 2) if ts == "auto" else ts) for s, ts in sweep]
    print("generation sweep:", ", ".join(f"{s} {ts}" for s, ts in sweep), f"on the {args.engine} path")
    stride = len(val) // args.prompts
    prompts = [val[i * stride][0][: args.prompt_len].tolist() for i in range(args.prompts)]
    total = args.prompt_len + args.new_tokens

    # implementations, each warmed up (compilation, first-call allocations) before any timing
    impls = ["modules", "eager", "compiled"] if not args.no_before_after else [args.engine]
    if args.engine not in impls:
        impls.append(args.engine)
    decoders, warmup = {}, {}
    strategies = [s for s, _ in sweep]
    for impl in impls:
        t0 = time.perf_counter()
        decoders[impl] = Decoder(model, impl)
        decoders[impl].warm_up(total, strategies)
        for s, ts in sweep:  # and once through every strategy's Python path
            decoders[impl](prompts[0], args.new_tokens, min(ts), s)
        decoders[impl](prompts[0], args.new_tokens, 1.0, "recompute")
        warmup[impl] = time.perf_counter() - t0
    print("warm-up (excluded from timing; compilation for 'compiled'), s: " + ", ".join(f"{k} {v:.1f}" for k, v in warmup.items()))

    ba = None
    if not args.no_before_after:
        ba = before_after({k: decoders[k] for k in ("modules", "eager", "compiled")}, prompts, args.new_tokens, args.repeats, clock)
        print(f"\nfull depth before (module path) vs after (decode engine), {len(prompts)} prompts x {args.new_tokens} tokens, {args.repeats} repeats, rotating order:")
        print("| path | tokens/s (thread CPU) | tokens/s (wall) | speed-up over the module path (median of pairs, IQR) | same tokens |")
        print("|---|---|---|---|---|")
        for k, r in ba.items():
            sp = f"{r['speedup_over_modules']:.2f}x ({r['speedup_iqr'][0]:.2f}-{r['speedup_iqr'][1]:.2f})" if k != "modules" else "-"
            print(f"| {k} | {r['tokens_per_s_cpu']:.1f} | {r['tokens_per_s_wall']:.1f} | {sp} | {r.get('same_tokens', '-')} |")

    t0 = time.perf_counter()
    gen, skipped = free_running(model, prompts, args.new_tokens, sweep, decoders[args.engine], clock, args.max_pending, args.repeats, args.unpaired, args.budget_s)
    print(f"\ngeneration sweep {time.perf_counter() - t0:.1f} s")
    ce_at = {r["threshold"]: r["val_ce_increase"] for r in tf}
    tf_ce = {r["threshold"]: r["val_ce"] for r in tf}
    decoded_full = None
    if args.loss_windows > 0 and any(r["strategy"] != "speculative" for r in gen):
        t0 = time.perf_counter()
        step = max(len(val) // args.loss_windows, 1)
        windows = [val[i * step][0].tolist() + [int(val[i * step][1][-1])] for i in range(min(args.loss_windows, len(val)))]
        decoded_full = decoded_loss(model, windows, 16, "recompute", 1.0)
        for r in gen:
            if r["strategy"] != "speculative":
                r["decoded_ce"] = decoded_loss(model, windows, 16, r["strategy"], r["threshold"])
                r["decoded_ce_increase"] = r["decoded_ce"] / decoded_full - 1
        print(f"decoded held-out loss ({len(windows)} windows x {len(windows[0]) - 16} tokens, forced decoding): full depth {decoded_full:.4f}, "
              f"{time.perf_counter() - t0:.1f} s")
    print(f"| strategy | tau | exit dist | mean exit layer | tokens/s CPU | tokens/s wall | full-depth tokens/s CPU / wall | speed-up on {clock} (median of pairs, IQR) | "
          "MAC-ratio speed-up | realized share | spent-MAC speed-up | held-out loss increase (teacher-forced) | decoded held-out loss increase | agreement with full greedy | identical prompts |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in gen:
        dist = ", ".join(f"{k}: {v:.2f}" for k, v in r["exit_dist"].items())
        extra = f" (draft acceptance {r['draft_acceptance']:.2f})" if "draft_acceptance" in r else ""
        inc = f"{100 * ce_at[r['threshold']]:+.2f} %" if r["threshold"] in ce_at else "-"
        if r["strategy"] == "speculative":  # the full model's own predictions: nothing to lose
            inc = "0 (lossless)"
        elif r["strategy"] == "copy":
            inc += " (approx.)"
        lo, hi = r["speedup_iqr"]
        dec = f"{100 * r['decoded_ce_increase']:+.2f} %" if "decoded_ce_increase" in r else ("0 (lossless)" if r["strategy"] == "speculative" else "-")
        print(f"| {r['strategy']}{extra} | {r['threshold']} | {dist} | {r['mean_exit_layer']:.2f} | {r['tokens_per_s_cpu']:.1f} | {r['tokens_per_s_wall']:.1f} | "
              f"{r['full_tokens_per_s_cpu']:.1f} / {r['full_tokens_per_s_wall']:.1f} | {r['speedup']:.2f}x ({lo:.2f}-{hi:.2f}) | {r['mac_speedup']:.2f}x | "
              f"{100 * r['realized_share']:.0f} % | {r['spent_mac_speedup']:.2f}x | {inc} | {dec} | {r['agree_full_greedy']:.3f} | {r['identical_prompts']}/{r['prompts']} |")
    if skipped:
        print(f"time budget {args.budget_s:.0f} s reached: skipped " + ", ".join(f"{s} tau {t}" for s, t in skipped))
    verdict = print_targets(gen, ce_at, args.recompute_speedup, args.speculative_speedup) if args.targets else None
    if args.calibration or (verdict and not all(v["pass"] for v in verdict.values())):
        print_calibration(calibration)
    if args.plot and gen:
        key = "full_tokens_per_s_cpu" if clock == "cpu_seconds" else "full_tokens_per_s_wall"
        full_tps = statistics.median(r[key] for r in gen)
        plot(args.plot, gen, full_ce, full_tps, tf_ce, calibration, clock,
             f"{args.run}: {model.num_layers} x {model.n_embd}, exits {model.exit_layers[:-1]}, {args.engine} engine, {len(prompts)} prompts x {args.new_tokens} tokens")
        print(f"plot: {args.plot}")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"run": str(args.run), "device": args.device, "dtype": args.dtype, "clock": clock, "engine": args.engine, "unpaired": args.unpaired,
                       "repeats": args.repeats, "prompts": len(prompts), "new_tokens": args.new_tokens, "per_exit_val_ce": per_exit, "teacher_forced": tf,
                       "calibration": calibration, "decoded_full_ce": decoded_full, "warmup_s": warmup, "before_after": ba, "generation": gen, "skipped": skipped, "targets": verdict}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
