"""What recomputing a spiking stem stage by stage buys: the peak of live tensor bytes in one training
step (forward + cross-entropy + backward) at memory level `recompute` with the SPS stem rerun as one
unit (as before its stages were units), stage by stage with every rerun keeping its units' membrane
traces H, and stage by stage with the fused BatchNorm + LIF units rebuilding H in backward (the
default, `bn_lif(keep_membrane=False)`), beside levels `none` and `bits` and spikingjelly 2.0 plain and
with memopt level 1 (`sj`, `sj-memopt`), counted the same way. The peak counts what the CPU allocator hands out and takes back during the step, from
`torch.profiler`'s memory records, above what was allocated before it: the quantity a GPU's
`max_memory_allocated` reports, without the host allocator's retention that a resident-set peak
includes. Each implementation runs in a fresh process; the step time is the median of `--steps`
unprofiled steps. With `--compile` the model runs under `torch.compile` (what `train.compile:
default` does; a level is applied before compiling, and its recomputed regions become the
compiler's checkpoint regions): the same peak, of the compiled step. `--optimizer` ends the step with an
SGD update after backward, or inside it (`train.optimizer_in_backward`), which frees each parameter
gradient as soon as it is used. Each peak is also given without the parameters' gradients (the same
step again, their storages left out from their allocation on: `step_peak_bytes(without=...)`), the part
of the peak the memory levels act on.

    python bench/stem_stages.py --archs spikformer-4-384 --batch 64 --steps 2
    python bench/stem_stages.py --archs spikformer-4-384 --impls none recompute --compile
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory as M  # noqa: E402

IMPLS = ("none", "bits", "bits-keep-membrane", "recompute-whole-stem", "recompute-keep-membrane", "recompute", "recompute-budget", "recompute-peak",
         "sj", "sj-memopt")


def child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    x, y = M._inputs(spec["arch"], spec["batch"])
    model, plan, _ = M.build(spec["arch"], spec["impl"], spec["T"], None, example=x,
                             budget=spec.get("budget", M.RECOMPUTE_BUDGET))
    compile_s = None
    if spec.get("compile"):
        model = torch.compile(model)
        t0 = time.perf_counter()
        M.train_step(model, x, y)  # compiles forward and backward
        compile_s = time.perf_counter() - t0
    step = _step(model, x, y, spec.get("optimizer", "none"))
    step()  # warm-up (and the optimizer's moments)
    for p in model.parameters():
        p.grad = None
    from efficient.memory.measure import step_peak_bytes

    peak = step_peak_bytes(step)
    # the same step again, its parameters' gradients left out: what the level changes (activations, their
    # gradients, the ops' temporaries), where the update's placement changes the gradients' part
    for p in model.parameters():
        p.grad = None
    bare = step_peak_bytes(step, without=lambda: [p.grad for p in model.parameters()])
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak_bytes": peak, "peak_without_grads_bytes": bare, "step_s": statistics.median(times), "times_s": times, "compile_s": compile_s,
            "units": list(plan.units) if plan is not None else []}


def _step(model, x, y, optimizer: str):
    """The measured step: forward + loss + backward (`none`), then an SGD update after backward (`sgd`)
    or inside it, each parameter's as its gradient is accumulated (`sgd-in-backward`,
    `train.optimizer_in_backward`)."""
    if optimizer == "none":
        return lambda: M.train_step(model, x, y)
    from contextlib import nullcontext

    import torch

    from efficient.train.optim import InBackwardOptimizer

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4, momentum=0.9)
    if optimizer == "sgd-in-backward":
        opt = InBackwardOptimizer(opt)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with opt.stepping() if isinstance(opt, InBackwardOptimizer) else nullcontext():
            M._loss(model, x, y).backward()
        opt.step()

    return step


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":  # memory.py's child protocol: --child KIND SPEC
        print(M.RESULT + json.dumps(child(json.loads(sys.argv[3]))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=["spikformer-4-384"], choices=sorted(M.ARCHS))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--compile", action="store_true", help="the step under torch.compile (default mode)")
    ap.add_argument("--optimizer", default="none", choices=["none", "sgd", "sgd-in-backward"],
                    help="what the step ends with: nothing (forward + loss + backward), an SGD update after backward, "
                         "or the update inside backward (train.optimizer_in_backward)")
    ap.add_argument("--recompute-budget", type=float, default=M.RECOMPUTE_BUDGET,
                    help="the budget of recompute-budget (a fraction of none's saved bytes) and recompute-peak (of none's "
                         "step peak of live tensors), planned on the step's batch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.compile and {"sj", "sj-memopt"} & set(args.impls):
        ap.error("--compile measures our levels: leave out sj and sj-memopt")
    print(f"# bench/stem_stages.py -- {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
          f"batch {args.batch}, T {args.T}{', compiled' if args.compile else ''}, optimizer {args.optimizer}, load {os.getloadavg()[0]:.2f} before")
    print("\n| architecture | impl | step peak of live tensors MiB | vs none | without parameter gradients MiB | vs none "
          "| step s | time vs none |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for arch in args.archs:
        rows: dict[str, dict] = {}
        for impl in args.impls:
            spec = {"arch": arch, "impl": impl, "T": args.T, "batch": args.batch, "steps": args.steps, "threads": args.threads,
                    "compile": args.compile, "optimizer": args.optimizer, "budget": args.recompute_budget}
            res = M._child("stem", spec, timeout=3600, script=__file__)
            rows[impl] = res
            out.append({**spec, **res})
            if "error" in res:
                print(f"| {arch} | {M.label(impl, args.recompute_budget)} | {res['error']} | | | | | |", flush=True)
                continue
            base = rows.get("none", {})
            def rel(k: str) -> str:
                return f"{res[k] / base[k]:.3f}" if k in base else ""
            print(f"| {arch} | {M.label(impl, args.recompute_budget)} | {res['peak_bytes'] / M.MiB:,.1f} | {rel('peak_bytes')} | "
                  f"{res['peak_without_grads_bytes'] / M.MiB:,.1f} | {rel('peak_without_grads_bytes')} | {res['step_s']:.2f} "
                  f"| {rel('step_s')} |", flush=True)
    print(f"\n# load {os.getloadavg()[0]:.2f} after")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
