"""Early-exit quality/speed trade-off of a trained EE-GPT run, over exit thresholds.

    python bench/early_exit.py runs/ee_gpt_text --gen-thresholds 0.9 0.8 0.6 0.4 0.2

Teacher-forced on the validation split (cheap, all tokens): per-exit loss, the exit distribution
under the rule, the loss and top-1 agreement with the final head of the exit-chosen predictions,
and the expected MAC saving. Free-running greedy generation from validation prompts (batch 1):
tokens/s and its ratio to the full model (tau = 1, same code path), mean exit depth, expected
and actual MAC saving, and token agreement with full-model greedy, per strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F


def teacher_forced(model, batches, thresholds):
    """Per threshold: exit distribution, CE and agreement of the chosen exits' predictions."""
    L = model.num_layers
    cost = model.layer_macs()
    full = L * cost["layer"] + cost[f"head{L}"]
    per_exit_ce = {k: 0.0 for k in model.exit_layers}
    rows = {t: {"ce": 0.0, "agree": 0.0, "macs": 0.0, "dist": dict.fromkeys(model.exit_layers, 0)} for t in thresholds}
    n = 0
    with torch.no_grad():
        for x, y in batches:
            logp = {s.layer: F.log_softmax((s.hidden @ s.weight.T).float(), -1) for s in model.exit_states(x)}
            final_arg = logp[L].argmax(-1)
            for k, lp in logp.items():
                per_exit_ce[k] += float(-lp.gather(-1, y[..., None]).sum())
            for t in thresholds:
                chosen = torch.full(y.shape, L)
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
                    "exit_dist": {k: v / n for k, v in r["dist"].items()}, "mean_exit_depth": sum(k * v for k, v in r["dist"].items()) / n / L})
    return {k: v / n for k, v in per_exit_ce.items()}, out


def free_running(model, prompts, new_tokens, thresholds, strategies, max_pending=None, repeats=3, clock="cpu_seconds"):
    """Each configuration is timed on every prompt `repeats` times, each time next to a full-model
    run on the same prompt (tau = 1, same code path, order alternating); the speedup is the median
    of those paired ratios (interquartile range beside it), so machine load drifts cancel. `clock`:
    the decoding thread's CPU time (default; decoding runs on one thread, and CPU time leaves out
    what a shared machine's other jobs take) or wall-clock `seconds`."""
    from efficient.decoding import generate

    generate(model, prompts[0], 8, 0.5, "recompute")  # warm-up
    refs = [generate(model, p, new_tokens, 1.0, "recompute") for p in prompts]
    rows, base_times = [], []
    for strategy in strategies:
        for t in thresholds:
            kw = {"max_pending": max_pending} if strategy == "recompute" else {}
            ratios, times, bases, gens = [], [], [], [None] * len(prompts)
            for r in range(repeats):
                for i, p in enumerate(prompts):  # one (full, early-exit) pair per prompt, order alternating
                    first_full = (r + i) % 2 == 0
                    if first_full:
                        base = getattr(generate(model, p, new_tokens, 1.0, "recompute"), clock)
                    gens[i] = generate(model, p, new_tokens, t, strategy, **kw)
                    if not first_full:
                        base = getattr(generate(model, p, new_tokens, 1.0, "recompute"), clock)
                    took = getattr(gens[i], clock)
                    ratios.append(base / took)
                    times.append(took)
                    bases.append(base)
            times = [sum(times[k : k + len(prompts)]) for k in range(0, len(times), len(prompts))]
            bases = [sum(bases[k : k + len(prompts)]) for k in range(0, len(bases), len(prompts))]
            base_times += bases
            toks = sum(len(g.tokens) for g in gens)
            agree = sum(sum(a == b for a, b in zip(g.tokens, r.tokens)) for g, r in zip(gens, refs)) / toks
            same_prefix = statistics.mean(next((i for i, (a, b) in enumerate(zip(g.tokens, r.tokens)) if a != b), len(g.tokens)) for g, r in zip(gens, refs))
            exits = [e for g in gens for e in g.exit_layers]
            full = sum(g.full_macs for g in gens)
            row = {"strategy": strategy, "threshold": t, "tokens_per_s": toks / statistics.median(times), "full_tokens_per_s": toks / statistics.median(bases),
                   "speedup": statistics.median(ratios), "speedup_iqr": statistics.quantiles(ratios, n=4)[::2],
                   "agree_full_greedy": agree, "agree_prefix_len": same_prefix, "mean_exit_layer": statistics.mean(exits), "mean_exit_depth": statistics.mean(exits) / model.num_layers,
                   "expected_mac_saving": 1 - sum(g.expected_macs for g in gens) / full, "mac_saving": 1 - sum(g.macs for g in gens) / full,
                   "exit_dist": {k: exits.count(k) / len(exits) for k in model.exit_layers}}
            if strategy == "speculative":
                row["draft_acceptance"] = statistics.mean(g.stats["draft_acceptance"] for g in gens)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base_tps = len(prompts) * new_tokens / statistics.median(base_times)
    return base_tps, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="run dir (or zoo name) of an early-exit model")
    # the paper's sweep: tau from 1.0 to 0.0 in steps of 0.05 (21 points), teacher-forced
    ap.add_argument("--thresholds", type=float, nargs="+", default=[round(1 - 0.05 * i, 2) for i in range(21)])
    ap.add_argument("--gen-thresholds", type=float, nargs="+", default=[0.9, 0.8, 0.7, 0.6, 0.5])
    ap.add_argument("--strategies", nargs="+", default=["recompute", "copy", "speculative"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--clock", choices=["cpu_seconds", "seconds"], default="cpu_seconds", help="thread CPU time (default) or wall-clock")
    ap.add_argument("--repeats", type=int, default=5, help="paired (full, early-exit) timings per configuration; the median ratio is reported")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--max-pending", type=int, default=None, help="recompute: force full depth after this many exited tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    import efficient
    from efficient.data.text import text

    model = efficient.load(args.run).float().eval()
    seq_len = 128
    val = text(seq_len=seq_len).val
    batches = []
    for b in range(args.val_batches):
        items = [val[i] for i in range(b * 16, min((b + 1) * 16, len(val)))]
        batches.append((torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))
    per_exit, tf = teacher_forced(model, batches, args.thresholds)
    print("per-exit val CE:", {k: round(v, 4) for k, v in per_exit.items()})
    full_ce = per_exit[model.num_layers]
    for r in tf:
        r["val_ce_increase"] = r["val_ce"] / full_ce - 1
    print("| tau | exit dist (layer: share) | mean exit layer | val CE of chosen exits | increase vs full | top-1 agreement with final | expected MAC saving |")
    print("|---|---|---|---|---|---|---|")
    for r in tf:
        dist = ", ".join(f"{k}: {v:.2f}" for k, v in r["exit_dist"].items())
        print(f"| {r['threshold']} | {dist} | {r['mean_exit_depth'] * model.num_layers:.2f} | {r['val_ce']:.4f} | {100 * r['val_ce_increase']:+.2f} % | {r['agree_final_top1']:.3f} | {r['expected_mac_saving']:.3f} |")
    stride = len(val) // args.prompts
    prompts = [val[i * stride][0][: args.prompt_len].tolist() for i in range(args.prompts)]
    base_tps, gen = free_running(model, prompts, args.new_tokens, args.gen_thresholds, args.strategies, args.max_pending, args.repeats, args.clock)
    print(f"\nfull model (tau = 1, recompute path), median: {base_tps:.1f} tokens/s")
    ce_at = {r["threshold"]: r["val_ce_increase"] for r in tf}
    print("| strategy | tau | exit dist | mean exit layer | tokens/s | full-model tokens/s (paired) | speedup (median of pairs, IQR) | held-out loss increase (teacher-forced) | agreement with full greedy | expected MAC saving | actual MAC saving |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in gen:
        dist = ", ".join(f"{k}: {v:.2f}" for k, v in r["exit_dist"].items())
        extra = f" (draft acceptance {r['draft_acceptance']:.2f})" if "draft_acceptance" in r else ""
        inc = f"{100 * ce_at[r['threshold']]:+.2f} %" if r["threshold"] in ce_at else "-"
        if r["strategy"] == "speculative":  # the full model's own predictions: nothing to lose
            inc = "0 (lossless)"
        lo, hi = r["speedup_iqr"]
        print(f"| {r['strategy']}{extra} | {r['threshold']} | {dist} | {r['mean_exit_layer']:.2f} | {r['tokens_per_s']:.1f} | {r['full_tokens_per_s']:.1f} | {r['speedup']:.2f}x ({lo:.2f}-{hi:.2f}) | {inc} | "
              f"{r['agree_full_greedy']:.3f} | {r['expected_mac_saving']:.3f} | {r['mac_saving']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"per_exit_val_ce": per_exit, "teacher_forced": tf, "full_tokens_per_s": base_tps, "generation": gen}, f, indent=1)


if __name__ == "__main__":
    main()
