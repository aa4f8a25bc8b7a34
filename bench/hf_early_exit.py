"""Early exits on a transformers causal LM: our decoding against transformers', same weights, same prompts.

    python bench/hf_early_exit.py --model CHECKPOINT_DIR --prompts 20 --new-tokens 128 --batch 1 --out hf_ee.json
    python bench/hf_early_exit.py --random --prompts 2 --new-tokens 16 --batch 2 --out smoke.json   # smoke run, nothing to conclude

`--model DIR`: a transformers checkpoint directory; with `early_exit.json` beside it (written by
`efficient.early_exit(...).save_pretrained`) its exits and heads are used. `--random`: a random
Llama (`--family gpt2`: GPT-2) built here. Prompts are windows of the held-out split of the byte
corpus (`efficient.data.text`; `--data-files` for other text) when the vocabulary holds the 256
bytes, random ids otherwise; prompts of a batch are cut to different lengths and left-padded.

Rows, each timed over all prompts (whole `generate` calls, prefill included, on one torch thread
unless `BENCH_THREADS`), the median of `--repeats`:

- transformers greedy `generate(do_sample=False)` (the baseline of every ratio);
- transformers `generate(assistant_early_exit=k, num_assistant_tokens=d)` over the grid
  `--hf-exits` x `--hf-drafts`, batch 1 (all it runs), best row marked; Llama family only (GPT-2's
  forward does not stop at `num_hidden_layers`, so the setting would not truncate it);
- ours full depth; ours self-speculative over `--draft-layers` x `--num-drafts`; ours recompute and
  copy at `--thresholds` over `--exits`.

Columns: tokens/s, ratio to transformers greedy, lossless (greedy tokens identical to transformers
greedy on every prompt), the layer-count ratio (full-depth layer evaluations / those the run made)
and the realized share of it (speed-up over our full depth, timed beside the row prompt by prompt
so that drifts of the machine's speed cancel, / layer-count ratio), draft acceptance
or mean exit layer, and for recompute/copy the held-out loss and its increase over full depth:
teacher-forced on `--loss-windows` windows of `--loss-len` tokens with each position decided by
the exit rule (exact for recompute, whose deep layers read the full model's keys/values); copy's
is decoded (forced decoding through its approximate keys/values). Prints a markdown table and
the targets as PASS/FAIL: speculative >= 1.5x transformers greedy and >= 1.3x its best
assistant_early_exit, lossless; recompute >= 1.5x greedy at <= +1 % loss; realized speed-up
>= 80 % of the layer-count ratio. `--out` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# run as a script, this folder comes first on sys.path, and its accelerate.py would shadow the
# `accelerate` package that transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from efficient.decoding import HFDecodeModel, generate_hf  # noqa: E402

SPEC_VS_GREEDY, SPEC_VS_HF_SPEC, RECOMPUTE_VS_GREEDY, LOSS_BOUND, REALIZED_SHARE = 1.5, 1.3, 1.5, 0.01, 0.8


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def load_model(args):
    """(model or early-exit wrapper, transformers model) from --model or --random."""
    if args.random:
        import transformers

        torch.manual_seed(args.seed)
        if args.family == "gpt2":
            cfg = transformers.GPT2Config(vocab_size=256, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, n_positions=1024,
                                          bos_token_id=None, eos_token_id=None)
            hf = transformers.GPT2LMHeadModel(cfg)
        else:
            cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                           num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=1024,
                                           bos_token_id=None, eos_token_id=None, pad_token_id=0)
            hf = transformers.LlamaForCausalLM(cfg)
        return hf.eval(), hf
    d = Path(args.model)
    if (d / "early_exit.json").exists():
        from efficient.hf import EarlyExitLM

        ee = EarlyExitLM.from_pretrained(d).eval()
        return ee, ee.model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    return hf, hf


def corpus_ids(args, vocab: int, n: int, length: int) -> torch.Tensor:
    """`n` held-out windows [n, length]: the byte corpus's validation split, or random ids."""
    if vocab >= 256:
        from efficient.data.text import text

        val = text(args.data_files, seq_len=length).val
        step = max(1, len(val) // n)
        return torch.stack([val[i * step][0] for i in range(n)])
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab, (n, length), generator=g)


def prompt_batches(args, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Left-padded batches of `--batch` prompts of lengths from `--prompt-len` down to half of it."""
    windows = corpus_ids(args, vocab, args.prompts, args.prompt_len)
    out = []
    for s in range(0, args.prompts, args.batch):
        w = windows[s : s + args.batch]
        mask = torch.ones_like(w)
        for b in range(w.shape[0]):
            cut = (b * args.prompt_len // 2) // max(args.batch, 1)
            mask[b, :cut] = 0
        out.append((w * mask, mask))
    return out


def timed(fn, batches, repeats: int):
    """(median seconds over repeats of the whole pass over `batches`, the outputs of the last pass)."""
    fn(*batches[0])  # warm-up, untimed
    secs, outs = [], []
    for _ in range(repeats):
        outs, t, n = [], 0.0, 0
        for ids, mask in batches:
            t0 = time.perf_counter()
            o = fn(ids, mask)
            t += time.perf_counter() - t0
            outs.append(o)
            n += ids.shape[0]
        secs.append(t)
    return statistics.median(secs), outs


def timed_beside(fn, ref, batches, repeats: int):
    """(median seconds of `fn`'s pass, median of its speed-up over `ref`, the outputs of fn's last pass):
    `ref` runs beside `fn` on every batch, so the ratio holds while the machine's speed drifts."""
    fn(*batches[0])
    ref(*batches[0])
    secs, ups, outs = [], [], []
    for _ in range(repeats):
        outs, t, tr = [], 0.0, 0.0
        for ids, mask in batches:
            t0 = time.perf_counter()
            ref(ids, mask)
            t1 = time.perf_counter()
            outs.append(fn(ids, mask))
            t += time.perf_counter() - t1
            tr += t1 - t0
        secs.append(t)
        ups.append(tr / t)
    return statistics.median(secs), statistics.median(ups), outs


def hf_generate(hf, new: int, **kw):
    def run(ids, mask):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
    return run


def teacher_forced(dm: HFDecodeModel, hf, windows: torch.Tensor, exits: list[int], thresholds: list[float]) -> dict:
    """Held-out loss of full depth and of the exit rule at each threshold (each position decided by
    the first exit whose max-prob reaches it), and the mean exit layer."""
    N = dm.num_layers
    with torch.inference_mode():
        out = hf(windows[:, :-1], output_hidden_states=True)
        target = windows[:, 1:]
        logits = {e: dm.head(e)(out.hidden_states[e]) for e in exits if e < N}
        logits[N] = out.logits
        logp = {e: torch.log_softmax(z.float(), -1) for e, z in logits.items()}
        nll = {e: -lp.gather(-1, target[..., None])[..., 0] for e, lp in logp.items()}
        pmax = {e: lp.max(-1).values.exp() for e, lp in logp.items()}
        res = {"full": float(nll[N].mean()), "rule": {}}
        for tau in thresholds:
            loss, layer, done = torch.zeros_like(nll[N]), torch.full_like(nll[N], N), torch.zeros_like(nll[N], dtype=torch.bool)
            for e in sorted(logits):
                take = ~done & ((pmax[e] >= tau) if e < N else torch.ones_like(done))
                loss = torch.where(take, nll[e], loss)
                layer = torch.where(take, float(e), layer)
                done |= take
            res["rule"][tau] = {"loss": float(loss.mean()), "mean_exit": float(layer.mean())}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="transformers checkpoint directory (with early_exit.json: its exits and heads)")
    src.add_argument("--random", action="store_true", help="a random model built here (smoke run)")
    ap.add_argument("--family", choices=["llama", "gpt2"], default="llama", help="--random: the architecture")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-layers", type=_ints, default=None, help="ours speculative: k values (default: the model's early exits, else L/4, L/2)")
    ap.add_argument("--num-drafts", type=_ints, default=[2, 4, 6])
    ap.add_argument("--hf-exits", type=_ints, default=None, help="transformers assistant_early_exit k values (default: as --draft-layers)")
    ap.add_argument("--hf-drafts", type=_ints, default=[2, 4, 6], help="transformers num_assistant_tokens values")
    ap.add_argument("--exits", type=_ints, default=None, help="recompute/copy exits (default: the model's early exits, else every layer)")
    ap.add_argument("--thresholds", type=_floats, default=[0.9, 0.8, 0.6])
    ap.add_argument("--loss-windows", type=int, default=8)
    ap.add_argument("--loss-len", type=int, default=128)
    ap.add_argument("--data-files", nargs="*", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))

    model, hf = load_model(args)
    hf.generation_config.eos_token_id = None  # every configuration decodes exactly --new-tokens
    dm = HFDecodeModel(model)
    N, new = dm.num_layers, args.new_tokens
    own = [e for e in (dm.wrapped_exits or []) if e < N]
    draft_layers = args.draft_layers or own[:2] or sorted({max(1, N // 4), max(1, N // 2)})
    hf_exits = args.hf_exits or draft_layers
    exits = args.exits or own or list(range(1, N))
    batches = prompt_batches(args, dm.vocab_size)
    singles = [(ids[b : b + 1, mask[b].bool()], mask[b : b + 1, mask[b].bool()]) for ids, mask in batches for b in range(ids.shape[0])]
    total = args.prompts * new
    rows: list[dict] = []

    def add(name, secs, outs, ref=None, extra=None):
        row = {"config": name, "tokens_per_s": total / secs, "seconds": secs, **(extra or {})}
        if ref is not None:
            seqs = [o.sequences if hasattr(o, "sequences") else o for o in outs]
            row["lossless"] = all(torch.equal(a[:, -new:], b[:, -new:]) for a, b in zip(seqs, ref))
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    greedy_s, greedy = timed(hf_generate(hf, new), batches, args.repeats)
    add("transformers greedy", greedy_s, greedy)
    greedy1 = None
    if dm.family == "llama":
        _, greedy1 = timed(hf_generate(hf, new), singles, 1)  # the batch-1 reference of assisted decoding
        for k in hf_exits:
            for d in args.hf_drafts:
                s, outs = timed(hf_generate(hf, new, assistant_early_exit=k, num_assistant_tokens=d, num_assistant_tokens_schedule="constant"), singles, args.repeats)
                add(f"transformers assistant_early_exit k={k} d={d} (batch 1)", s, outs, greedy1, {"hf_spec": True})

    def ours(**kw):
        return lambda ids, mask: generate_hf(dm, ids, mask, new, **kw)

    full_s, full = timed(ours(), batches, args.repeats)
    add("ours full depth", full_s, full, greedy, {"layer_ratio": 1.0})
    full_tps = total / full_s

    def ours_row(name, kw, extra):
        s, up, outs = timed_beside(ours(**kw), ours(), batches, args.repeats)
        steps, full_steps = sum(o.layer_steps for o in outs), sum(o.full_layer_steps for o in outs)
        ratio = full_steps / max(steps, 1)
        extra = {"layer_ratio": ratio, "vs_full_beside": up, "realized_share": up / ratio, **extra(outs)}
        return add(name, s, outs, greedy, extra)

    for k in draft_layers:
        for d in args.num_drafts:
            ours_row(f"ours speculative k={k} d={d}", dict(strategy="speculative", draft_layer=k, num_draft=d),
                     lambda outs: {"draft_acceptance": sum(o.stats["accepted"] for o in outs) / max(sum(o.stats["drafted"] for o in outs), 1), "spec": True})

    windows = corpus_ids(args, dm.vocab_size, args.loss_windows, args.loss_len + 1)
    tf = teacher_forced(dm, hf, windows, exits, args.thresholds)
    copy_full = generate_hf(dm, windows[:, :1], None, args.loss_len, forced=windows[:, 1:])
    copy_base = float(-copy_full.logprobs.mean())
    for tau in args.thresholds:
        rule = tf["rule"][tau]
        ours_row(f"ours recompute tau={tau}", dict(strategy="recompute", threshold=tau, exits=exits),
                 lambda outs: {"mean_exit": float(torch.cat([o.exit_layers.flatten() for o in outs]).float().mean()),
                               "loss": rule["loss"], "loss_increase": rule["loss"] / tf["full"] - 1, "recompute": True})
        cp = generate_hf(dm, windows[:, :1], None, args.loss_len, strategy="copy", threshold=tau, exits=exits, forced=windows[:, 1:])
        closs = float(-cp.logprobs.mean())
        ours_row(f"ours copy tau={tau}", dict(strategy="copy", threshold=tau, exits=exits),
                 lambda outs: {"mean_exit": float(torch.cat([o.exit_layers.flatten() for o in outs]).float().mean()),
                               "loss": closs, "loss_increase": closs / copy_base - 1})

    base = total / greedy_s
    for r in rows:
        r["vs_greedy"] = r["tokens_per_s"] / base
        r["vs_ours_full"] = r.get("vs_full_beside", r["tokens_per_s"] / full_tps)  # what the exit mechanism itself buys on our engine
    hf_spec = [r for r in rows if r.get("hf_spec")]
    best_hf = max(hf_spec, key=lambda r: r["tokens_per_s"]) if hf_spec else None
    if best_hf:
        best_hf["best"] = True
    spec = [r for r in rows if r.get("spec")]
    best_spec = max(spec, key=lambda r: r["tokens_per_s"]) if spec else None
    if best_spec:
        best_spec["best"] = True

    print(f"\n{N}-layer {type(hf).__name__}, {args.prompts} prompts x {new} new tokens, batch {args.batch}, "
          f"{torch.get_num_threads()} thread(s); held-out loss at full depth {tf['full']:.4f}\n")
    print("| configuration | tokens/s | vs transformers greedy | vs ours full depth | lossless | layer ratio | realized share "
          "| acceptance / mean exit | loss (+%) |")
    print("|---|---:|---:|---:|:---:|---:|---:|---:|---:|")
    for r in rows:
        acc = f"{r['draft_acceptance']:.2f}" if "draft_acceptance" in r else f"{r['mean_exit']:.2f}" if "mean_exit" in r else ""
        loss = f"{r['loss']:.4f} ({100 * r['loss_increase']:+.2f})" if "loss" in r else ""
        ll = "" if "lossless" not in r else "yes" if r["lossless"] else "NO"
        lr = f"{r['layer_ratio']:.2f}" if "layer_ratio" in r else ""
        rs = f"{r['realized_share']:.2f}" if "realized_share" in r else ""
        name = r["config"] + (" **best**" if r.get("best") else "")
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['vs_greedy']:.2f}x | {r['vs_ours_full']:.2f}x | {ll} | {lr} | {rs} | {acc} | {loss} |")

    targets = {}
    if best_spec:
        targets[f"speculative >= {SPEC_VS_GREEDY}x transformers greedy"] = best_spec["vs_greedy"] >= SPEC_VS_GREEDY
        if best_hf:
            targets[f"speculative >= {SPEC_VS_HF_SPEC}x transformers assistant_early_exit"] = best_spec["tokens_per_s"] >= SPEC_VS_HF_SPEC * best_hf["tokens_per_s"]
        targets["speculative lossless on every prompt"] = all(r["lossless"] for r in spec)
    rec_ok = [r for r in rows if r.get("recompute") and r["loss_increase"] <= LOSS_BOUND]
    targets[f"recompute >= {RECOMPUTE_VS_GREEDY}x transformers greedy at <= +{100 * LOSS_BOUND:.0f}% loss"] = any(r["vs_greedy"] >= RECOMPUTE_VS_GREEDY for r in rec_ok)
    shares = [r for r in rows if "realized_share" in r and r["layer_ratio"] > 1]
    name = f"realized speed-up >= {100 * REALIZED_SHARE:.0f}% of the layer-count ratio (rows that skip layers)"
    targets[name] = all(r["realized_share"] >= REALIZED_SHARE for r in shares) if shares else None  # None: no row skipped layers
    print()
    for name, ok in targets.items():
        print(f"{'n/a ' if ok is None else 'PASS' if ok else 'FAIL'}  {name}")
    if args.out:
        res = {"args": vars(args), "model": type(hf).__name__, "num_layers": N, "threads": torch.get_num_threads(),
               "teacher_forced": tf, "rows": rows, "targets": targets, "date": time.strftime("%Y-%m-%d")}
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
