"""Pipeline-parallel EE-GPT training steps on this machine: step time and bubble fraction (idle
time / step time, per stage) for 1 vs 2 stages, GPipe vs 1F1B, at 4 and 8 micro-batches.

    python bench/pipeline.py --steps 20 --n-layer 8 --n-embd 256 --seq-len 128 --batch 16

Each configuration runs under torchrun (one process per stage, `--threads` each) with the
`exits` objective (two early exits) and AdamW; the table holds medians over the steps after
`--warmup`. The ideal bubble of a fill-drain schedule is (p - 1) / (m + p - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from efficient import zoo
    from efficient.config import OptimConfig
    from efficient.objectives.exits import ExitLoss
    from efficient.train.optim import build_optimizer
    from efficient.train.pipeline import PipelineRunner, make_layout

    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    L = args.n_layer
    model = zoo.create("ee-gpt-tiny", n_layer=L, n_embd=args.n_embd, n_head=args.n_embd // 64 or 1, seq_len=args.seq_len,
                       exit_layers=[L // 4, L // 2], tie_embeddings=True)
    obj = ExitLoss(weights=[0.25, 0.5])
    obj.setup(model)
    pp = dist.get_world_size()
    lay = make_layout(pp, 1, model)
    runner = PipelineRunner(model, obj, lay, args.schedule, args.microbatches, args.batch // args.microbatches, torch.device("cpu"))
    opt = build_optimizer(runner.shard, OptimConfig(lr=1e-4))
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (args.batch, args.seq_len), generator=g)
        y = torch.randint(0, 256, (args.batch, args.seq_len), generator=g)
        obj.set_progress(0.0, step)
        logs = runner.step(x, y)
        opt.step()
        if step >= args.warmup:
            rows.append((logs["step_s"], 1.0 - logs["busy_s"] / logs["step_s"]))
    out: list = [None] * pp if dist.get_rank() == 0 else None
    dist.gather_object(rows, out, dst=0)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def run(args: argparse.Namespace, stages: int, schedule: str, microbatches: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}", __file__, "--worker",
           "--schedule", schedule, "--microbatches", str(microbatches), "--out", str(out), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
           "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--threads", str(args.threads)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    per_rank = json.loads(out.read_text())
    step = statistics.median(max(r[i][0] for r in per_rank) for i in range(len(per_rank[0])))
    bubbles = [statistics.median(b for _, b in r) for r in per_rank]
    return {"step_ms": 1e3 * step, "bubble": bubbles, "ideal": (stages - 1) / (microbatches + stages - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    ap.add_argument("--microbatches", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="batch per step (divisible by 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    ap.add_argument("--microbatch-counts", type=int, nargs="+", default=[4, 8])
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    print("| stages | schedule | micro-batches | step time (ms, median) | bubble per stage (median) | ideal bubble |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for stages in args.stages:
            for schedule in args.schedules:
                for m in args.microbatch_counts:
                    r = run(args, stages, schedule, m, Path(d) / f"{stages}-{schedule}-{m}.json")
                    bub = " / ".join(f"{b:.2f}" for b in r["bubble"])
                    print(f"| {stages} | {schedule} | {m} | {r['step_ms']:.1f} | {bub} | {r['ideal']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
