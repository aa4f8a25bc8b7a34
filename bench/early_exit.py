"""Early-exit quality/speed trade-off of a trained EE-GPT run, over exit thresholds.

    python bench/early_exit.py runs/ee_gpt_text --gen-thresholds 0.9 0.8 0.6 0.4 0.2

CUDA (synchronized wall-clock timing, the full-depth baseline timed once per prompt; the issue's
protocol: 20 held-out prompts x 256 tokens at batch 1; about 2 minutes for a 12-layer model):

    python bench/early_exit.py RUN_DIR --device cuda --prompts 20 --new-tokens 256 --unpaired --repeats 1 \
        --val-batches 23 --sweep recompute=auto speculative=0.8,0.5 copy=auto --targets --budget-s 120 --json early_exit.json

`STRATEGY=auto` takes its thresholds from the teacher-forced sweep (run first): the lowest tau
whose held-out loss increase is within 1 % and its neighbours (3 for recompute, 2 for copy).
Configurations run in `--sweep` order; past `--budget-s` the rest are skipped (and listed).

CPU rehearsal of the same code path on a tiny run:

    efficient train recipes/ee_gpt_text.yaml train.max_steps=30 profile.enabled=false --out runs/ee_tiny
    python bench/early_exit.py runs/ee_tiny --device cpu --prompts 2 --new-tokens 16 --unpaired --repeats 1 \
        --val-batches 2 --sweep recompute=auto speculative=0.5,0.2 copy=auto --targets

Teacher-forced on the validation split (cheap, all tokens): per-exit loss, the exit distribution
under the rule, the loss and top-1 agreement with the final head of the exit-chosen predictions,
and the expected MAC saving. The loss of the exit-chosen predictions is recompute's held-out
loss exactly (its deep layers always see the full model's KV); for copy it is an approximation.
Free-running greedy generation from validation prompts (batch 1): tokens/s and its ratio to
full-depth decoding (tau = 1, same code path and KV cache), mean exit layer, expected and actual
MAC saving, and token agreement with full-depth greedy, per strategy and threshold.

Timing: on CPU the decoding thread's CPU time (default; `--clock seconds` for wall-clock), each
configuration paired with a full-depth run per prompt and repeat (order alternating), so machine
load drifts cancel. On CUDA wall-clock `seconds`, which `generate` measures with the device synchronized
after the prompt's prefill and at the end of decoding (the prefill is not timed, queued kernels are). `--unpaired`
times the full-depth run `--repeats` times per prompt once, before the sweep, and reuses it
(a GPU has no load noise to pair away). Every strategy is warmed up (Triton compilation, cuBLAS
handles) before any timing. `EFFICIENT_BACKEND=torch` runs exit_confidence on the torch path
instead of the Triton kernel (CUDA's default).

`--targets`: recompute >= 1.5x tokens/s at <= 1 % higher held-out loss (best threshold within the
bound), speculative exactly lossless (greedy tokens identical to full-depth greedy on every
prompt) and >= 1.2x, each PASS/FAIL. Where speculative tokens differ, the full model's top-2
logit margin at the first difference tells a numerical near-tie (chunked verification vs
one-token steps) from a real divergence.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

RECOMPUTE_SPEEDUP, LOSS_BOUND, SPECULATIVE_SPEEDUP = 1.5, 0.01, 1.2


def teacher_forced(model, batches, thresholds):
    """Per threshold: exit distribution, CE and agreement of the chosen exits' predictions."""
    from efficient.profiler.exits import layer_macs

    L = model.num_layers
    cost = layer_macs(model)
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
                    "exit_dist": {k: v / n for k, v in r["dist"].items()}, "mean_exit_depth": sum(k * v for k, v in r["dist"].items()) / n / L})
    return {k: v / n for k, v in per_exit_ce.items()}, out


class Decoder:
    """`generate` plus the time it took on the chosen clock (on CUDA, `generate` synchronizes the
    device around its timed decode, so `seconds` excludes the prefill and includes queued kernels)."""

    def __init__(self, model, clock: str) -> None:
        self.model, self.clock = model, clock

    def __call__(self, prompt, new_tokens, threshold, strategy, **kw):
        from efficient.decoding import generate

        g = generate(self.model, prompt, new_tokens, threshold, strategy, **kw)
        return g, getattr(g, self.clock)


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


def free_running(model, prompts, new_tokens, sweep, decode, max_pending=None, repeats=3, unpaired=False, budget_s=None):
    """Each configuration is timed on every prompt `repeats` times. Paired (default): each time
    next to a full-depth run on the same prompt (tau = 1, same code path, order alternating); the
    speedup is the median of those paired ratios (interquartile range beside it), so machine load
    drifts cancel. Unpaired: the full-depth run is timed `repeats` times per prompt before the
    sweep and its per-prompt median is every configuration's baseline."""
    t_start = time.perf_counter()
    for strategy, thresholds in sweep:  # warm-up of every code path, excluded from timing
        decode(prompts[0], min(16, new_tokens), min(thresholds), strategy, **({"max_pending": max_pending} if strategy == "recompute" else {}))
    decode(prompts[0], min(16, new_tokens), 1.0, "recompute")
    base_of = None
    if unpaired:  # the timed full-depth runs are also the greedy references
        runs = [[decode(p, new_tokens, 1.0, "recompute") for _ in range(repeats)] for p in prompts]
        refs = [r[0][0] for r in runs]
        base_of = [statistics.median(t for _, t in r) for r in runs]
    else:
        refs = [decode(p, new_tokens, 1.0, "recompute")[0] for p in prompts]  # full-depth greedy
    rows, base_times, skipped = [], [], []
    for strategy, thresholds in sweep:
        for t in thresholds:
            if budget_s is not None and time.perf_counter() - t_start > budget_s:
                skipped.append((strategy, t))
                continue
            t0 = time.perf_counter()
            kw = {"max_pending": max_pending} if strategy == "recompute" else {}
            ratios, times, bases, gens = [], [], [], [None] * len(prompts)
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
                    ratios.append(base / took)
                    times.append(took)
                    bases.append(base)
            times = [sum(times[k : k + len(prompts)]) for k in range(0, len(times), len(prompts))]
            bases = [sum(bases[k : k + len(prompts)]) for k in range(0, len(bases), len(prompts))]
            base_times += bases
            toks = sum(len(g.tokens) for g in gens)
            agree = sum(sum(a == b for a, b in zip(g.tokens, r.tokens)) for g, r in zip(gens, refs)) / toks
            diffs = [first_diff(g.tokens, r.tokens) for g, r in zip(gens, refs)]
            same_prefix = statistics.mean(len(g.tokens) if d is None else d for g, d in zip(gens, diffs))
            exits = [e for g in gens for e in g.exit_layers]
            full = sum(g.full_macs for g in gens)
            iqr = statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else [ratios[0], ratios[0]]
            row = {"strategy": strategy, "threshold": t, "tokens_per_s": toks / statistics.median(times), "full_tokens_per_s": toks / statistics.median(bases),
                   "speedup": statistics.median(ratios), "speedup_iqr": iqr, "speedup_of_totals": statistics.median(bases) / statistics.median(times),
                   "agree_full_greedy": agree, "agree_prefix_len": same_prefix, "identical_prompts": sum(d is None for d in diffs), "prompts": len(prompts),
                   "mean_exit_layer": statistics.mean(exits), "mean_exit_depth": statistics.mean(exits) / model.num_layers,
                   "expected_mac_saving": 1 - sum(g.expected_macs for g in gens) / full, "mac_saving": 1 - sum(g.macs for g in gens) / full,
                   "exit_dist": {k: exits.count(k) / len(exits) for k in model.exit_layers}, "wall_s": 0.0}
            if strategy == "speculative":
                row["draft_acceptance"] = statistics.mean(g.stats["draft_acceptance"] for g in gens)
                row["first_differences"] = [{"prompt": i, **full_margin(model, prompts[i], refs[i].tokens, d)} for i, d in enumerate(diffs) if d is not None]
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
    if unpaired:
        base_times = [sum(base_of)]
    base_tps = len(prompts) * new_tokens / statistics.median(base_times) if base_times else float("nan")
    return base_tps, rows, skipped


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


def print_targets(gen, ce_at) -> dict:
    """Per strategy: the fastest threshold within the loss bound, and PASS/FAIL against the targets."""
    print("\ntargets (tokens/s against full-depth decoding with the same KV cache):")
    verdict = {}
    for strategy in ("recompute", "copy"):
        rs = [r for r in gen if r["strategy"] == strategy]
        if not rs:
            continue
        ok = [r for r in rs if ce_at.get(r["threshold"], float("inf")) <= LOSS_BOUND]
        target = f">= {RECOMPUTE_SPEEDUP:.1f}x tokens/s at <= +{100 * LOSS_BOUND:.0f} % held-out loss"
        note = "" if strategy == "recompute" else " (no target for copy; the same bound, loss teacher-forced, approximate for copy)"
        if ok:
            best = max(ok, key=lambda r: r["speedup"])
            passed = best["speedup"] >= RECOMPUTE_SPEEDUP
            print(f"- {strategy}: {target}{note}: best tau {best['threshold']}: {best['speedup']:.2f}x (ratio of totals {best['speedup_of_totals']:.2f}x) at {100 * ce_at[best['threshold']]:+.2f} % loss, "
                  f"mean exit layer {best['mean_exit_layer']:.2f} -> {'PASS' if passed else 'FAIL'}")
            verdict[strategy] = {"threshold": best["threshold"], "speedup": best["speedup"], "loss_increase": ce_at[best["threshold"]], "pass": passed}
        else:
            low = min(rs, key=lambda r: ce_at.get(r["threshold"], float("inf")))
            print(f"- {strategy}: {target}{note}: no threshold within the bound (smallest increase: tau {low['threshold']}, "
                  f"{100 * ce_at.get(low['threshold'], float('nan')):+.2f} %) -> FAIL")
            verdict[strategy] = {"threshold": None, "pass": False}
    rs = [r for r in gen if r["strategy"] == "speculative"]
    if rs:
        for r in rs:
            exact = r["identical_prompts"] == r["prompts"]
            print(f"  speculative tau {r['threshold']}: tokens identical to full-depth greedy on {r['identical_prompts']}/{r['prompts']} prompts "
                  f"({'EXACT' if exact else 'NOT EXACT'}), {r['speedup']:.2f}x, draft acceptance {r['draft_acceptance']:.2f}")
            for d in r["first_differences"]:
                print(f"    prompt {d['prompt']}: first difference at token {d['pos']}, full model's top-2 {d['top2']} logit margin {d['logit_margin']:.2e}")
        exact = [r for r in rs if r["identical_prompts"] == r["prompts"]]
        target = f"exactly lossless (greedy) and >= {SPECULATIVE_SPEEDUP:.1f}x tokens/s"
        if exact:
            best = max(exact, key=lambda r: r["speedup"])
            passed = best["speedup"] >= SPECULATIVE_SPEEDUP
            print(f"- speculative: {target}: best exact tau {best['threshold']}: {best['speedup']:.2f}x (ratio of totals {best['speedup_of_totals']:.2f}x) -> {'PASS' if passed else 'FAIL'}")
            verdict["speculative"] = {"threshold": best["threshold"], "speedup": best["speedup"], "exact": True, "pass": passed}
        else:
            print(f"- speculative: {target}: no threshold gave identical tokens on every prompt -> FAIL")
            verdict["speculative"] = {"threshold": None, "exact": False, "pass": False}
    return verdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="run dir (or zoo name) of an early-exit model")
    # the paper's sweep: tau from 1.0 to 0.0 in steps of 0.05 (21 points), teacher-forced
    ap.add_argument("--thresholds", type=float, nargs="+", default=[round(1 - 0.05 * i, 2) for i in range(21)])
    ap.add_argument("--gen-thresholds", type=float, nargs="+", default=[0.9, 0.8, 0.7, 0.6, 0.5])
    ap.add_argument("--strategies", nargs="+", default=["recompute", "copy", "speculative"])
    ap.add_argument("--sweep", nargs="+", default=None, metavar="STRATEGY=T1,T2",
                    help="per-strategy thresholds (e.g. recompute=0.9,0.8,0.6 copy=0.9,0.8 speculative=0.8,0.5); replaces --strategies x --gen-thresholds")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="model weights and KV cache")
    ap.add_argument("--clock", choices=["cpu_seconds", "seconds"], default=None,
                    help="CPU: thread CPU time (default) or wall-clock; CUDA: always synchronized wall-clock")
    ap.add_argument("--repeats", type=int, default=5, help="timings per (configuration, prompt); the median ratio is reported")
    ap.add_argument("--unpaired", action="store_true", help="time the full-depth baseline once per prompt (x repeats) and reuse it for every configuration")
    ap.add_argument("--val-batches", type=int, default=8, help="teacher-forced batches of 16 x 128 tokens (capped at the validation split)")
    ap.add_argument("--max-pending", type=int, default=None, help="recompute: force full depth after this many exited tokens")
    ap.add_argument("--targets", action="store_true", help="print the targets (recompute >= 1.5x at <= 1 %% loss; speculative exact and >= 1.2x) as PASS/FAIL")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the remaining generation configurations after this many seconds of the sweep")
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
    per_exit, tf = teacher_forced(model, batches, sorted(set(args.thresholds) | set(gen_thresholds), reverse=True))
    print(f"model {args.run}: {model.num_layers} layers, exits {model.exit_layers}, {args.dtype} on {args.device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "") + f"; torch {torch.__version__}; timing clock: {clock}")
    print(f"per-exit val CE ({sum(y.numel() for _, y in batches)} tokens, {time.perf_counter() - t0:.1f} s):", {k: round(v, 4) for k, v in per_exit.items()})
    full_ce = per_exit[model.num_layers]
    for r in tf:
        r["val_ce_increase"] = r["val_ce"] / full_ce - 1
    print("| tau | exit dist (layer: share) | mean exit layer | val CE of chosen exits | increase vs full | top-1 agreement with final | expected MAC saving |")
    print("|---|---|---|---|---|---|---|")
    for r in tf:
        dist = ", ".join(f"{k}: {v:.2f}" for k, v in r["exit_dist"].items())
        print(f"| {r['threshold']} | {dist} | {r['mean_exit_depth'] * model.num_layers:.2f} | {r['val_ce']:.4f} | {100 * r['val_ce_increase']:+.2f} % | {r['agree_final_top1']:.3f} | {r['expected_mac_saving']:.3f} |")
    sweep = [(s, auto_thresholds(tf, 3 if s == "recompute" else 2) if ts == "auto" else ts) for s, ts in sweep]
    print("generation sweep:", ", ".join(f"{s} {ts}" for s, ts in sweep))
    stride = len(val) // args.prompts
    prompts = [val[i * stride][0][: args.prompt_len].tolist() for i in range(args.prompts)]
    decode = Decoder(model, clock)
    t0 = time.perf_counter()
    base_tps, gen, skipped = free_running(model, prompts, args.new_tokens, sweep, decode, args.max_pending, args.repeats, args.unpaired, args.budget_s)
    print(f"\nfull-depth decoding (tau = 1, recompute path), {len(prompts)} prompts x {args.new_tokens} tokens, median: {base_tps:.1f} tokens/s; "
          f"generation {time.perf_counter() - t0:.1f} s in all")
    ce_at = {r["threshold"]: r["val_ce_increase"] for r in tf}
    base_note = "unpaired, per-prompt median" if args.unpaired else "paired"
    print(f"| strategy | tau | exit dist | mean exit layer | tokens/s | full-depth tokens/s ({base_note}) | speedup (median of per-prompt ratios, IQR) | held-out loss increase (teacher-forced) | agreement with full greedy | identical prompts | expected MAC saving | actual MAC saving |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in gen:
        dist = ", ".join(f"{k}: {v:.2f}" for k, v in r["exit_dist"].items())
        extra = f" (draft acceptance {r['draft_acceptance']:.2f})" if "draft_acceptance" in r else ""
        inc = f"{100 * ce_at[r['threshold']]:+.2f} %" if r["threshold"] in ce_at else "-"
        if r["strategy"] == "speculative":  # the full model's own predictions: nothing to lose
            inc = "0 (lossless)"
        elif r["strategy"] == "copy":
            inc += " (approx.)"
        lo, hi = r["speedup_iqr"]
        print(f"| {r['strategy']}{extra} | {r['threshold']} | {dist} | {r['mean_exit_layer']:.2f} | {r['tokens_per_s']:.1f} | {r['full_tokens_per_s']:.1f} | {r['speedup']:.2f}x ({lo:.2f}-{hi:.2f}) | {inc} | "
              f"{r['agree_full_greedy']:.3f} | {r['identical_prompts']}/{r['prompts']} | {r['expected_mac_saving']:.3f} | {r['mac_saving']:.3f} |")
    if skipped:
        print(f"time budget {args.budget_s:.0f} s reached: skipped " + ", ".join(f"{s} tau {t}" for s, t in skipped))
    verdict = print_targets(gen, ce_at) if args.targets else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": str(args.run), "device": args.device, "dtype": args.dtype, "clock": clock, "unpaired": args.unpaired, "repeats": args.repeats,
                       "prompts": len(prompts), "new_tokens": args.new_tokens, "per_exit_val_ce": per_exit, "teacher_forced": tf,
                       "full_tokens_per_s": base_tps, "generation": gen, "skipped": skipped, "targets": verdict}, f, indent=1)


if __name__ == "__main__":
    main()
