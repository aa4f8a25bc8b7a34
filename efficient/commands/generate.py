"""Generate text with an early-exit language model (exit threshold, KV strategy, sampling).

    efficient generate ee-gpt-tiny --prompt "def " --max-new-tokens 64 --exit-threshold 0.8
    efficient generate runs/ee_gpt_text --prompt "The " --strategy speculative

Prints the text, the exit layer of every generated token and a summary (tokens/s, mean exit
depth, expected MAC saving). Decoding runs on the decode engine (`efficient.decoding.engine`);
`--compile` compiles its steps first. Byte-level models (vocab 256) only, since the zoo ships no tokenizer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from efficient.errors import ConfigError


def _threshold(text: str) -> float | None:
    """'none' (never exit) or a max-probability in (0, 1]."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] or 'none', got {text!r}") from None
    from efficient.decoding import check_threshold

    try:
        return check_threshold(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name, run dir, or .safetensors file of an early-exit model")
    parser.add_argument("--pretrained", metavar="SOURCE", nargs="?", const=True,
                        help="zoo names: the shipped weights (no value), a tag of them, a run dir, .safetensors file or URL")
    parser.add_argument("--prompt", required=True, help="prompt text (UTF-8, encoded as bytes)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--exit-threshold", type=_threshold, default=None, help="exit when max-prob >= this, in (0, 1]; 'none' (default) or 1 never exits")
    parser.add_argument("--strategy", choices=["recompute", "copy", "speculative"], default="recompute")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-draft", type=int, default=8, help="speculative: at most this many drafts per round (a draft below the threshold also ends it)")
    parser.add_argument("--max-pending", type=int, default=None, help="recompute: force a full-depth step after this many exited tokens")
    parser.add_argument("--compile", action="store_true",
                        help="compile the decode engine's one-token steps (torch.compile; compilation runs before decoding and is reported apart)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    import torch

    from efficient.data.text import decode, encode
    from efficient.decoding import generate
    from efficient.zoo import get_entry, load

    if not Path(args.model).exists():  # a zoo name: check the vocabulary before building (1.3B+ configs)
        vocab = get_entry(args.model).resolved_cfg().get("vocab_size")
        if vocab != 256:
            raise ConfigError(f"generate: {args.model} has a {vocab}-token vocabulary; only byte-level (256) models have a tokenizer here")
    model = load(args.model, pretrained=args.pretrained)
    if not hasattr(model, "exit_layers"):
        raise ConfigError(f"generate: {args.model} is not an early-exit language model (try ee-gpt-tiny)")
    if model.vocab_size != 256:
        raise ConfigError(f"generate: {args.model} has a {model.vocab_size}-token vocabulary; only byte-level (256) models have a tokenizer here")
    model.to(torch.device(args.device))
    ids = encode(args.prompt).long()
    engine, warmup_s = None, None
    if args.compile:
        from efficient.decoding import DecodeEngine

        engine = DecodeEngine(model.eval(), compile=True)
        from efficient.decoding import check_threshold, exits_enabled

        exits = exits_enabled(check_threshold(args.exit_threshold))  # never exiting needs only the full-depth step
        warmup_s = engine.warm_up(len(ids) + args.max_new_tokens, (args.strategy,), exits=exits)
    out = generate(
        model, ids, args.max_new_tokens, args.exit_threshold, args.strategy,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        num_draft=args.num_draft, max_pending=args.max_pending, engine=engine,
    )
    text = decode(out.tokens)
    summary = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.summary().items()}
    if warmup_s is not None:
        summary["compile_warmup_s"] = round(warmup_s, 2)
    hist = {str(k): round(v, 4) for k, v in out.exit_histogram().items()}
    if args.json:
        print(json.dumps({"prompt": args.prompt, "text": text, "exit_layers": out.exit_layers, "exit_distribution": hist, "summary": summary}))
        return 0
    from rich.console import Console

    from efficient.profiler.console import echo

    print(args.prompt + text)  # the generated text as it is, never re-wrapped
    console = Console()
    echo(f"\nexit layer per token (exits at {model.exit_layers}):", console)
    echo(" ".join(str(e) for e in out.exit_layers), console)
    echo("exit distribution: " + ", ".join(f"layer {k}: {v:.0%}" for k, v in hist.items()), console, indent="  ")
    echo("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()), console, indent="  ")
    return 0
