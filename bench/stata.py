"""STATA training-step speed: dense vs STATA Spikformer (and spikingjelly 2.0's own Spikformer) on CPU.

For each pair the same batch goes through a full training step (forward + backward + AdamW) and,
separately, through the encoder only (the transformer blocks + head on fixed stem tokens, forward +
backward), alternating the models step by step so machine noise hits both alike; medians are
reported. Beside each measured speedup: the ideal one, dense MACs / STATA MACs (whole model and
blocks only), counted by `efficient.profile` at the same keep ratio (rho*, no warm-up).

    python bench/stata.py                       # CIFAR (4-384, batch 4) + ImageNet-sized (8-512 @224, batch 1)
    python bench/stata.py --only cifar --steps 5 --batch 8
    python bench/stata.py --only families       # QKFormer, Spikingformer, Meta-SpikeFormer at CIFAR size

The encoder columns need the Spikformer layout (one flat token stem, then blocks); for the other
families only the whole step is timed, and the ideal is their whole-model MAC ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import efficient
from efficient.zoo import create


def _autocast(amp: str):
    """bf16/fp16 autocast on the bench device, or a no-op for fp32."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    return torch.autocast(DEVICE.type, dtype=dtype, enabled=dtype is not None)


def step_fn(model, x, y, opt, reset=None, amp="fp32"):
    def step():
        opt.zero_grad(set_to_none=True)
        with _autocast(amp):
            out = model(x)
        if out.dim() == 3:  # spikingjelly's Spikformer returns per-step logits [T, B, classes]
            out = out.mean(0)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        if reset is not None:
            reset(model)

    return step


def encoder_fn(model, x, y, amp="fp32"):
    """Blocks + head on the stem's tokens (computed once, no grad): the part STATA prunes."""
    with torch.no_grad(), _autocast(amp):
        tokens = model.embed(x)

    def step():
        model.zero_grad(set_to_none=True)
        t = tokens
        with _autocast(amp):
            if model.n_prefix:  # re-attach the anchor parameter so its gradient is part of the step
                t = torch.cat([model.anchor[:, None, None, :].expand(t.shape[0], t.shape[1], 1, t.shape[3]).to(t.dtype), t[:, :, 1:]], 2)
            out = model.forward_head(model.forward_blocks(t))
        F.cross_entropy(out.float(), y).backward()

    return step


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":  # kernels run asynchronously: time them to completion
        torch.cuda.synchronize(DEVICE)


def timed(fns: dict, steps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median seconds per call on each clock ({clock: {name: s}}); the callables are interleaved
    step by step, in rotating order. "cpu" is this process's CPU time: with one thread it is the
    step's compute time, and unlike wall time it excludes the slices other jobs on a shared machine take."""
    times = {c: {k: [] for k in fns} for c in CLOCKS}
    keys = list(fns)
    for i in range(warmup + steps):
        for k in keys[i % len(keys):] + keys[: i % len(keys)]:  # rotate the order: no model always runs first
            fn = fns[k]
            _sync()
            t0 = {c: f() for c, f in CLOCKS.items()}
            fn()
            _sync()
            t1 = {c: f() for c, f in CLOCKS.items()}
            if i >= warmup:
                for c in CLOCKS:
                    times[c][k].append(t1[c] - t0[c])
    return {c: {k: statistics.median(v) for k, v in tk.items()} for c, tk in times.items()}


def macs(model, x) -> tuple[float, float]:
    """(whole-model, blocks-only) dense MACs of one forward as training runs it, from the profiler:
    every row computed (the lean inference path, which skips rows only inference can skip, is off)."""
    lean = getattr(model, "lean_inference", False)
    model.lean_inference = False
    try:
        rep = efficient.profile(model, inputs=x)
    finally:
        model.lean_inference = lean
    blocks = sum(l.dense_macs for l in rep.layers if l.name.startswith("blocks.") and not l.is_neuron)
    blocks = blocks or float("nan")  # a family without a flat `blocks` stack: no encoder-level ideal
    return float(rep.totals["dense_macs"]), float(blocks)


def build(name: str, **kw):
    # train at the final keep ratio, as in steady-state training after the warm-up: the pruner
    # applies its warm-up only once told the training progress, which this bench never does
    return create(name, **kw).train()


def spikingjelly_cifar():
    try:
        from spikingjelly.activation_based import functional
        from spikingjelly.activation_based.model.spikformer import spikformer_cifar10
    except ImportError:
        return None, None
    return spikformer_cifar10(T=4).train(), functional.reset_net


def bench_pair(label, dense_name, stata_variants, img, batch, classes, steps, warmup, with_sj=False, amps=("fp32",), **model_kw):
    torch.manual_seed(0)
    x = torch.randn(batch, 3, img, img)
    y = torch.randint(0, classes, (batch,))
    models = {dense_name: build(dense_name, **model_kw)}
    for vname, (zname, kw) in stata_variants.items():
        models[vname] = build(zname, **kw, **model_kw)
    counts = {k: macs(m, x[:1]) for k, m in models.items()}  # counted on the CPU, before any move
    x, y = x.to(DEVICE), y.to(DEVICE)
    models = {k: m.to(DEVICE) for k, m in models.items()}
    sj = reset = None
    if with_sj:
        sj, reset = spikingjelly_cifar()
        if sj is None:
            print("spikingjelly not installed: its Spikformer row is skipped")
        else:
            sj = sj.to(DEVICE)
    rows = []
    d_macs, d_bmacs = counts[dense_name]
    for amp in amps:
        steps_fns = {k: step_fn(m, x, y, torch.optim.AdamW(m.parameters(), lr=1e-4), amp=amp) for k, m in models.items()}
        if sj is not None:
            steps_fns["spikingjelly-2.0 spikformer_cifar10"] = step_fn(sj, x, y, torch.optim.AdamW(sj.parameters(), lr=1e-4), reset, amp=amp)
        full = timed(steps_fns, steps, warmup)
        has_encoder = all(hasattr(m, "embed") and hasattr(m, "forward_blocks") for m in models.values())
        enc = timed({k: encoder_fn(m, x, y, amp) for k, m in models.items()}, steps, warmup) if has_encoder else None
        for clock in CLOCKS:
            if DEVICE.type == "cuda" and clock == "cpu":
                continue  # host CPU time says nothing about a GPU step
            f = full[clock]
            e = enc[clock] if enc is not None else {k: float("nan") for k in f}
            for k in f:
                r = {"config": label, "amp": amp, "clock": clock, "model": k, "step_s": f[k], "speedup": f[dense_name] / f[k]}
                if k in models:
                    mm, bm = counts[k]
                    r.update(
                        encoder_s=e[k], encoder_speedup=e[dense_name] / e[k], ideal=d_macs / mm, ideal_encoder=d_bmacs / bm,
                        tokens=models[k].stata_stats.get("tokens_in"), gmacs=mm / 1e9,
                    )
                    r["realized_of_ideal"] = r["speedup"] / r["ideal"]
                    r["encoder_realized_of_ideal"] = r["encoder_speedup"] / r["ideal_encoder"]
                rows.append(r)
        if DEVICE.type == "cuda":
            r0 = [r for r in rows if r["amp"] == amp]
            print(f"{label} {amp}: " + ", ".join(f"{r['model']} {r['step_s'] * 1e3:.1f} ms" for r in r0), flush=True)
    return rows


# the newer spiking transformers at their CIFAR sizes, dense vs the zoo's STATA variant (its own
# pruning schedule, at rho*)
FAMILIES = [
    ("qkformer-4-384", "qkformer-4-384-stata", "SSA blocks 1,2, rho 0.7"),
    ("spikingformer-4-384", "spikingformer-stata", "blocks 2,3, rho 0.7"),
    ("sdt-v2-cifar", "sdt-v2-stata", "blocks 4,6,8, rho 0.7"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["cifar", "imagenet", "families"], default=None,
                    help="one part (default: cifar and imagenet; `families` runs only when named)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="CIFAR batch (ImageNet-sized uses --imagenet-batch)")
    ap.add_argument("--imagenet-batch", type=int, default=1)
    ap.add_argument("--imagenet-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--compile-min-numel", type=int, default=None,
                    help="override the LIF size from which `auto` compiles the loop on CPU (default 2^20 elements)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA the wall clock is the one to read)")
    ap.add_argument("--amp", default="fp32", help="comma list of fp32, bf16, fp16: autocast for every model (e.g. fp32,bf16)")
    ap.add_argument("--img", type=int, default=32, help="CIFAR-side image size (smaller only for dry runs)")
    ap.add_argument("--imagenet-img", type=int, default=224)
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile_min_numel is not None:
        from efficient.kernels import lif_common

        lif_common.COMPILE_MIN_NUMEL = args.compile_min_numel  # where resolve_backend reads it
    amps = tuple(a.strip() for a in args.amp.split(","))
    bad = [a for a in amps if a not in ("fp32", "bf16", "fp16")]
    if bad:
        ap.error(f"--amp: unknown {bad}; use fp32, bf16 or fp16")
    rows = []
    if args.only in (None, "cifar"):
        rows += bench_pair(
            "CIFAR %dpx T=4 b%d" % (args.img, args.batch), "spikformer-4-384",
            {
                "spikformer-stata (blocks 2,3 rho 0.7)": ("spikformer-stata", {}),
                "spikformer-stata blocks 1,2 rho 0.5": ("spikformer-stata", {"prune_blocks": [1, 2], "keep_ratio": 0.5}),
            },
            args.img, args.batch, 10, args.steps, args.warmup, with_sj=True, amps=amps,
        )
    if args.only in (None, "imagenet"):
        rows += bench_pair(
            "ImageNet %dpx T=4 b%d" % (args.imagenet_img, args.imagenet_batch), "spikformer-8-512",
            {
                "spikformer-8-512-stata (blocks 4,6,8 rho 0.7)": ("spikformer-8-512-stata", {}),
            },
            args.imagenet_img, args.imagenet_batch, 1000, args.imagenet_steps, args.warmup, amps=amps,
            **({} if args.imagenet_img == 224 else {"img_size": args.imagenet_img}),
        )
    if args.only == "families":
        for dense, stata, note in FAMILIES:
            rows += bench_pair(
                "CIFAR %dpx T=4 b%d" % (args.img, args.batch), dense, {f"{stata} ({note})": (stata, {})},
                args.img, args.batch, 10, args.steps, args.warmup, amps=amps,
                **({} if args.img == 32 else {"img_size": args.img}),
            )
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| config | amp | clock | model | step s | speedup | ideal (MACs) | realized/ideal | encoder s | encoder speedup "
          "| ideal encoder | tokens in per block |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ideal" in r:
            print(f"| {r['config']} | {r['amp']} | {r['clock']} | {r['model']} | {r['step_s']:.3f} | {r['speedup']:.2f}x | {r['ideal']:.2f}x "
                  f"| {r['realized_of_ideal']:.1%} | {r['encoder_s']:.3f} | {r['encoder_speedup']:.2f}x | {r['ideal_encoder']:.2f}x "
                  f"| {r['tokens']} |")
        else:
            print(f"| {r['config']} | {r['amp']} | {r['clock']} | {r['model']} | {r['step_s']:.3f} | dense is {1 / r['speedup']:.2f}x faster "
                  "| | | | | | |")
    targets(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


def targets(rows: list[dict]) -> None:
    """The GPU targets of the STATA benchmark, as PASS/FAIL lines (wall clock rows)."""
    wall = [r for r in rows if r["clock"] == "wall"]
    for r in wall:
        if "ideal" in r and r["ideal"] > 1.001:
            ok = r["realized_of_ideal"] >= 0.9
            print(f"target realized >= 90% of ideal: {r['config']} {r['amp']} {r['model']}: step {r['realized_of_ideal']:.0%}, "
                  f"encoder {r['encoder_realized_of_ideal']:.0%} {'PASS' if ok else 'FAIL'}")
        if r["config"].startswith("ImageNet") and "ideal" in r and r["ideal"] > 1.001:
            print(f"target STATA encoder >= 1.5x dense (ImageNet): {r['amp']} {r['encoder_speedup']:.2f}x "
                  f"{'PASS' if r['encoder_speedup'] >= 1.5 else 'FAIL'}")
        if r["model"].startswith("spikingjelly"):
            dense = next(d for d in wall if d["config"] == r["config"] and d["amp"] == r["amp"] and d["model"] == "spikformer-4-384")
            ratio = r["step_s"] / dense["step_s"]
            print(f"target dense >= 1.3x spikingjelly: {r['config']} {r['amp']} {ratio:.2f}x {'PASS' if ratio >= 1.3 else 'FAIL'}")


if __name__ == "__main__":
    main()
