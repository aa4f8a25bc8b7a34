"""Training step time and peak memory of EE-GPT with and without exits (ee_llm.md section 5).

    python bench/ee_train_step.py --model ee-gpt-tiny --batch 16 --seq 128

Variants, each in a fresh subprocess (forward + backward + AdamW step, median of repeats):
  no-exits      the same backbone built with exit_layers=[] and the `lm` objective
  exits         exits at the recipe's layers, weights 0.25 / 0.5 (`exits` objective)
  exits-fused   the same with the chunked fused linear-CE (objective.fused=true)
  exits-w0      exit weights 0: exits are skipped, so this should cost what no-exits costs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "no-exits": ({"exit_layers": []}, {"name": "lm"}),
    "exits": ({}, {"name": "exits", "weights": [0.25, 0.5]}),
    "exits-fused": ({}, {"name": "exits", "weights": [0.25, 0.5], "fused": True, "chunk_size": 1024}),
    "exits-w0": ({}, {"name": "exits", "weights": [0.0, 0.0]}),
}


def _mem():
    spec = importlib.util.spec_from_file_location("ee_kernels", Path(__file__).with_name("ee_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_variant(variant: str, model_name: str, batch: int, seq: int, repeats: int, device_name: str) -> dict:
    import torch

    import efficient
    from efficient.objectives import build_objective

    mem = _mem()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    device = torch.device(device_name)
    model_kw, obj_cfg = VARIANTS[variant]
    torch.manual_seed(0)
    model = efficient.zoo.create(model_name, seq_len=max(seq, 128), **model_kw).to(device).train()
    obj = build_objective(obj_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, model.vocab_size, (batch, seq), device=device)
    y = torch.randint(0, model.vocab_size, (batch, seq), device=device)

    def step():
        loss, _ = obj.loss(model, (x, y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return float(loss)

    step()
    step()  # optimizer state exists from here on
    base = mem._reset_peak(device)
    step()
    peak = mem._peak_bytes(device) - base
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "median_ms": 1e3 * statistics.median(times), "peak_mib": max(peak, 0) / 2**20,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ee-gpt-tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args.model, args.batch, args.seq, args.repeats, args.device)))
        return
    rows = []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for v in VARIANTS:
        cmd = [sys.executable, __file__, "--child", v, "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
               "--repeats", str(args.repeats), "--device", args.device]
        rows.append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(f"\n{args.model}, batch {args.batch} x {args.seq} tokens, device {args.device}, threads {os.environ.get('BENCH_THREADS', '1')}")
    print("| variant | step ms (median) | vs no-exits | peak MiB | vs no-exits |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['median_ms']:.1f} | {r['median_ms'] / base['median_ms']:.2f} | {r['peak_mib']:.1f} | {r['peak_mib'] / max(base['peak_mib'], 0.1):.2f} |")


if __name__ == "__main__":
    main()
