"""Early-exit kernels vs the plain torch path: correctness, time and peak memory, side by side.

CUDA (in one process; Triton kernels checked against the references, then timed):

    python bench/ee_kernels.py --device cuda --repeats 20 --json ee_kernels.json   # under a minute expected (--budget-s 70)
    python bench/ee_kernels.py --device cuda --dry-run          # the tiny grid, seconds

The CUDA grid: exit_confidence at N=1 (a decode step at batch 1) and N=1024 (a batch) and
linear_ce with K=3 exits at N=2048 (V=256) / N=1024 (V=32000), each for D in 512, 4096, 1024,
2048 (that order: `--budget-s` skips what is left when time runs out, so the ends come first),
V in 256 / 32000, fp32 and bf16. Per case:
- correctness of backend="triton" against the fp32-math references of the kernel modules
  (exit_confidence_reference, linear_ce_reference + autograd): exit_confidence p_max relative
  error and argmax equality (a differing argmax counts as a tie, not an error, where the two
  candidates' reference probabilities agree within the tolerance); linear_ce summed loss and the
  gradients w.r.t. every exit's hidden states and the shared weight (max error / max |reference|).
  Tolerance: 1e-4 (fp32), 2e-2 (bf16). The exit status is 1 on any mismatch.
- time: median of `--repeats` CUDA-event-timed calls after `--warmup` calls, plain vs Triton.
  plain = softmax(h @ W.T).max(-1) / the K exits' F.cross_entropy(h @ W.T) + backward (K full
  logit tensors alive until backward); Triton = exit_confidence / linear_ce(backend="triton").
  fp32 matmuls run at full fp32 precision (no TF32) on both sides, as the kernel's tl.dot does.
- peak memory: max_memory_allocated over one call above the level before it (inputs excluded);
  linear_ce's Triton/plain ratio is held to the target "at most 60% of the naive multi-exit
  memory" (PASS/FAIL; a target, not a correctness failure).

CPU rehearsal of the same in-process code path (Triton interpreter, tiny shapes, fp32 only):

    TRITON_INTERPRET=1 python bench/ee_kernels.py --device cpu --dry-run --json ee_kernels_dry.json

CPU timing of the torch paths (a fresh subprocess per case, so earlier cases do not mask later
ones' peak RSS):

    python bench/ee_kernels.py                 # both ops, default shapes
    python bench/ee_kernels.py --repeats 5 --json out.json

exit_confidence: p_max/argmax of softmax(h @ W.T) -- plain (full logits + softmax) vs the
chunked online-softmax path (vocab chunks of 4096).
linear_ce: K exits' summed CE + backward -- plain (K full logit tensors alive until backward) vs
the chunked fused path (256-row chunks, gradients formed in the forward).
Peak memory there is the rise of peak RSS over the level before the first call (peak reset via
/proc/self/clear_refs, malloc returning large blocks at free).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CASES = {
    # name: (op, N tokens, D hidden, V vocab, K exits)
    "conf-decode-32k": ("exit_confidence", 16, 2048, 32000, 1),
    "conf-batch-32k": ("exit_confidence", 256, 256, 32000, 1),
    "ce-3exits-32k": ("linear_ce", 512, 128, 32000, 3),
    "ce-3exits-bytes": ("linear_ce", 2048, 128, 256, 3),
    # a hidden size near the row count: gradients made in forward would hold a [V, D] weight gradient per exit
    "ce-3exits-32k-wide": ("linear_ce", 256, 1024, 32000, 3),
}
# linear_ce "fused": grads="auto" (in forward where 4 D <= N, else in backward); "fused-forward": always in forward
IMPLS = {"exit_confidence": ["plain", "chunked"], "linear_ce": ["plain", "fused", "fused-forward"]}

# in-process grid (CUDA, or --dry-run): D order puts 512 and 4096 first (see --budget-s)
GRID_DIMS = [512, 4096, 1024, 2048]
GRID_VOCABS = [256, 32000]
CONF_TOKENS = {"decode": 1, "batch": 1024}  # decode: one token per exit and step at batch 1, as decoding calls it
CE_TOKENS = {256: 2048, 32000: 1024}  # by vocab
CE_EXITS = 3
DRY = {"dims": [32], "vocabs": [256, 300], "conf_tokens": {"decode": 1, "batch": 8}, "ce_tokens": 8, "dtypes": ["fp32"]}
TOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}
MEM_TARGET = 0.60  # linear_ce: Triton peak at most 60% of the plain multi-exit peak


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak(device) -> int:
    """Reset the peak counter; return the current level it is measured from."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM, the peak RSS (Linux >= 4.0)
        f.write("5")
    return _proc_status("VmRSS")


def _peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status("VmHWM")


def run_case(name: str, impl: str, repeats: int, device_name: str) -> dict:
    """One (case, implementation) in this process: warm-up, one call for peak memory, timed repeats."""
    import torch
    import torch.nn.functional as F

    from efficient.kernels.exit_confidence import exit_confidence
    from efficient.kernels.linear_ce import linear_ce

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    device = torch.device(device_name)
    op, N, D, V, K = CASES[name]
    g = torch.Generator(device=device).manual_seed(0)
    hs = [(torch.randn(N, D, device=device, generator=g) / D**0.5).requires_grad_(op == "linear_ce") for _ in range(K)]
    w = (torch.randn(V, D, device=device, generator=g) * 0.5).requires_grad_(op == "linear_ce")
    t = torch.randint(0, V, (N,), device=device, generator=g)
    backend = "auto"

    def step():
        if op == "exit_confidence":
            with torch.no_grad():
                if impl == "plain":
                    return torch.softmax(hs[0] @ w.T, -1).max(-1)
                return exit_confidence(hs[0], w, backend=backend)
        if impl == "plain":  # K logit tensors stay alive until backward
            loss = sum(F.cross_entropy(h @ w.T, t) for h in hs)
        else:
            grads = "forward" if impl == "fused-forward" else "auto"
            loss = sum(linear_ce(h, w, t, chunk_size=256, backend=backend, grads=grads) for h in hs)
        loss.backward()
        for p in (*hs, w):
            p.grad = None
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: lazy initialisation (op registration, dispatch caches) is not the kernel's memory
    sync()
    base = _reset_peak(device)
    out = step()
    sync()
    peak = _peak_bytes(device) - base
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return {"case": name, "impl": impl, "op": op, "N": N, "D": D, "V": V, "K": K, "median_ms": 1e3 * statistics.median(times),
            "peak_mib": max(peak, 0) / 2**20, "result": float(out[0].float().mean()) if isinstance(out, tuple) else float(out)}


# ---------------------------------------------------------------------------------------------
# in-process grid: Triton vs reference, then plain vs Triton time and peak memory


def grid_cases(dry: bool, dims, vocabs, dtypes, ops) -> list[dict]:
    """The (op, N, D, V, K, dtype) cases, in run order."""
    if dry:
        # the interpreter has no bf16: a dry run keeps the requested fp32/fp16 (fp32 if neither)
        dims, vocabs, dtypes = DRY["dims"], DRY["vocabs"], [d for d in dtypes if d != "bf16"] or DRY["dtypes"]
        conf_tokens, ce_tokens = DRY["conf_tokens"], dict.fromkeys(vocabs, DRY["ce_tokens"])
    else:
        conf_tokens, ce_tokens = CONF_TOKENS, {v: CE_TOKENS.get(v, 1024) for v in vocabs}
    out = []
    for D in dims:
        for V in vocabs:
            for dt in dtypes:
                if "exit_confidence" in ops:
                    for mode, N in conf_tokens.items():
                        out.append({"op": "exit_confidence", "mode": mode, "N": N, "D": D, "V": V, "K": 1, "dtype": dt})
                if "linear_ce" in ops:
                    out.append({"op": "linear_ce", "mode": f"{CE_EXITS} exits", "N": ce_tokens[V], "D": D, "V": V, "K": CE_EXITS, "dtype": dt})
    return out


class _Timer:
    """Median milliseconds of `fn` over `repeats` calls after `warmup` calls: CUDA events on CUDA
    (the device's time from the first launch to the last kernel's end), perf_counter on CPU."""

    def __init__(self, device) -> None:
        self.device = device

    def __call__(self, fn, repeats: int, warmup: int) -> float:
        import torch

        for _ in range(warmup):
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
            for a, b in ev:
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            return statistics.median(a.elapsed_time(b) for a, b in ev)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)


def _peak_mib(fn, device) -> float:
    """Peak memory of one call of `fn` above the level before it (MiB)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
    base = _reset_peak(device)
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return max(_peak_bytes(device) - base, 0) / 2**20


def _rel_err(a, b) -> float:
    """max |a - b| / max |b| (fp32 math)."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check_exit_confidence(h, w, tol: float) -> dict:
    """Triton p_max/argmax vs the reference; a differing argmax is a tie when the reference
    probabilities of both candidates agree within `tol` (relative)."""
    import torch

    from efficient.kernels.exit_confidence import exit_confidence, exit_confidence_reference

    p, a = exit_confidence(h, w, backend="triton")
    pr, ar = exit_confidence_reference(h, w)
    p_err = float(((p.double() - pr.double()).abs() / pr.double()).max())
    diff = (a != ar).nonzero()[:, 0]
    ties = 0
    if len(diff):
        acc = torch.promote_types(h.dtype, torch.float32)
        probs = torch.softmax(h[diff].to(acc) @ w.to(acc).T, dim=-1)
        rows = torch.arange(len(diff), device=h.device)
        ties = int(((probs[rows, ar[diff]] - probs[rows, a[diff]]).abs() <= tol * probs[rows, ar[diff]]).sum())
    mism = len(diff) - ties
    return {"p_err": p_err, "argmax_diff": int(len(diff)), "argmax_ties": ties, "argmax_mismatch": mism,
            "p_range": [float(pr.min()), float(pr.max())], "ok": bool(p_err <= tol and mism == 0 and p.dtype == torch.float32 and a.dtype == torch.long)}


def check_linear_ce(hs, w, t, tol: float, chunk_size: int) -> dict:
    """Triton summed K-exit loss and its gradients (every exit's hidden states, the weight) vs
    the reference through autograd."""
    import torch

    from efficient.kernels.linear_ce import linear_ce, linear_ce_reference

    loss = sum(linear_ce(h, w, t, chunk_size=chunk_size, backend="triton") for h in hs)
    g = torch.autograd.grad(loss, (*hs, w))
    ref = sum(linear_ce_reference(h, w, t) for h in hs)
    r = torch.autograd.grad(ref, (*hs, w))
    loss, ref = float(loss.detach()), float(ref.detach())
    loss_err = abs(loss - ref) / max(abs(ref), 1e-30)
    dh_err = max(_rel_err(a, b) for a, b in zip(g[:-1], r[:-1]))
    dw_err = _rel_err(g[-1], r[-1])
    ok = loss_err <= tol and dh_err <= tol and dw_err <= tol and all(x.dtype == y.dtype for x, y in zip(g, (*hs, w)))
    return {"loss": loss, "loss_ref": ref, "loss_err": loss_err, "dh_err": dh_err, "dw_err": dw_err, "ok": bool(ok)}


def run_grid_case(c: dict, device, repeats: int, warmup: int, chunk_size: int) -> dict:
    import torch
    import torch.nn.functional as F

    from efficient.kernels.exit_confidence import exit_confidence
    from efficient.kernels.linear_ce import linear_ce

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[c["dtype"]]
    tol = TOL[c["dtype"]]
    N, D, V, K = c["N"], c["D"], c["V"], c["K"]
    g = torch.Generator(device=device).manual_seed(N * 7 + D * 13 + V)
    timer = _Timer(device)
    row = dict(c)
    if c["op"] == "exit_confidence":
        # logit spread ~3: a range of confidences (as in the tests), not all saturated
        h = (torch.randn(N, D, device=device, generator=g) / D**0.5).to(dtype)
        w = (torch.randn(V, D, device=device, generator=g) * 3).to(dtype)
        row["check"] = check_exit_confidence(h, w, tol)

        def plain():
            with torch.no_grad():
                return torch.softmax(h @ w.T, -1).max(-1)

        def kern():
            return exit_confidence(h, w, backend="triton")

    else:
        hs = [(torch.randn(N, D, device=device, generator=g) / D**0.5).to(dtype).requires_grad_() for _ in range(K)]
        w = (torch.randn(V, D, device=device, generator=g) * 0.5).to(dtype).requires_grad_()
        t = torch.randint(0, V, (N,), device=device, generator=g)
        row["check"] = check_linear_ce(hs, w, t, tol, chunk_size)
        row["chunk_size"] = chunk_size

        def _step(loss):
            loss.backward()
            for p in (*hs, w):
                p.grad = None

        def plain():  # K logit tensors (and their softmax) alive until backward
            _step(sum(F.cross_entropy(h @ w.T, t) for h in hs))

        def kern():
            _step(sum(linear_ce(h, w, t, chunk_size=chunk_size, backend="triton") for h in hs))

    for name, fn in (("plain", plain), ("triton", kern)):
        fn()  # first call (compilation, lazy initialisation) is neither timed nor in the peak
        row[f"{name}_peak_mib"] = _peak_mib(fn, device)
        row[f"{name}_ms"] = timer(fn, repeats, warmup)
    row["speedup"] = row["plain_ms"] / row["triton_ms"]
    # below 1 MiB (tiny dry-run shapes, page-granular RSS on CPU) a ratio says nothing
    row["mem_ratio"] = row["triton_peak_mib"] / row["plain_peak_mib"] if row["plain_peak_mib"] >= 1 else None
    if c["op"] == "linear_ce" and row["mem_ratio"] is not None:
        row["mem_target"] = bool(row["mem_ratio"] <= MEM_TARGET)
    return row


def _fmt_check(r: dict) -> str:
    k = r["check"]
    if "error" in k:
        return "ERROR: " + k["error"][:200]
    if r["op"] == "exit_confidence":
        s = f"p {k['p_err']:.1e}, argmax " + ("equal" if not k["argmax_diff"] else f"{k['argmax_mismatch']} differ + {k['argmax_ties']} ties")
    else:
        s = f"loss {k['loss_err']:.1e}, dh {k['dh_err']:.1e}, dW {k['dw_err']:.1e}"
    return ("ok: " if k["ok"] else "MISMATCH: ") + s


def _num(r: dict, key: str, width: int, prec: int) -> str:
    v = r.get(key)
    return f"{v:{width}.{prec}f}" if v is not None else f"{'-':>{width}s}"


def grid_main(args, device_name: str) -> int:
    import torch

    device = torch.device(device_name)
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("on CPU the in-process grid runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    elif not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device visible")
    torch.set_float32_matmul_precision("highest")  # fp32 plain/reference matmuls without TF32, as the kernels' ieee dot
    import triton

    repeats = args.repeats or (3 if args.dry_run and device.type == "cpu" else 20)
    warmup = args.warmup if args.warmup is not None else (1 if device.type == "cpu" else 3)
    cases = grid_cases(args.dry_run, args.dims, args.vocabs, args.dtypes, args.ops)
    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(), "device": device_name,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "cuda": torch.version.cuda,
           "repeats": repeats, "warmup": warmup, "dry_run": args.dry_run, "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    print(json.dumps(env), flush=True)
    t_start, rows, skipped = time.perf_counter(), [], []
    for c in cases:
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(c)
            continue
        t0 = time.perf_counter()
        try:
            r = run_grid_case(c, device, repeats, warmup, args.chunk_size)
        except Exception as e:  # one failing case (compile error, OOM) must not cost the rest of the grid
            r = {**c, "check": {"ok": False, "error": f"{type(e).__name__}: {e}".replace("\n", " ")}}
        r["case_s"] = time.perf_counter() - t0
        rows.append(r)
        print(f"{r['op']:15s} {r['mode']:7s} {r['dtype']} N={r['N']:<5d} D={r['D']:<5d} V={r['V']:<6d} "
              f"plain {_num(r, 'plain_ms', 9, 3)} ms  triton {_num(r, 'triton_ms', 9, 3)} ms  {_fmt_check(r)}  ({r['case_s']:.1f} s)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    total = time.perf_counter() - t_start
    where = env["gpu"] or f"{platform.machine()} CPU, Triton interpreter"
    print(f"\n{where}; torch {env['torch']}, triton {env['triton']}; median of {repeats} after {warmup} warm-up; {total:.1f} s in all")
    print("| op | dtype | N | D | V | K | Triton vs reference | plain ms | Triton ms | speedup (plain/Triton) | plain peak MiB | Triton peak MiB | peak ratio (Triton/plain) | memory target (<= 60%) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tgt = ("PASS" if r["mem_target"] else "FAIL") if "mem_target" in r else "-"
        print(f"| {r['op']} ({r['mode']}) | {r['dtype']} | {r['N']} | {r['D']} | {r['V']} | {r['K']} | {_fmt_check(r)} | {_num(r, 'plain_ms', 0, 3)} | "
              f"{_num(r, 'triton_ms', 0, 3)} | {_num(r, 'speedup', 0, 2)}x | {_num(r, 'plain_peak_mib', 0, 1)} | {_num(r, 'triton_peak_mib', 0, 1)} | "
              f"{_num(r, 'mem_ratio', 0, 2)} | {tgt} |")
    bad = [r for r in rows if not r["check"]["ok"]]
    ce = [r for r in rows if "mem_target" in r]
    print(f"\ncorrectness: {len(rows) - len(bad)}/{len(rows)} cases match the reference" + (f"; MISMATCH in {len(bad)}" if bad else ""))
    if ce:
        print(f"linear_ce memory target (Triton peak <= {MEM_TARGET:.0%} of plain): {sum(r['mem_target'] for r in ce)}/{len(ce)} PASS"
              + "".join(f"; FAIL at {r['dtype']} N={r['N']} D={r['D']} V={r['V']} ({r['mem_ratio']:.2f})" for r in ce if not r["mem_target"]))
    if skipped:
        print(f"time budget {args.budget_s:.0f} s reached: {len(skipped)} cases skipped: " + ", ".join(f"{c['op']} {c['dtype']} D={c['D']} V={c['V']}" for c in skipped))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "total_s": total, "rows": rows, "skipped": skipped}, f, indent=1)
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (torch paths, subprocess per case; with --dry-run the in-process grid) or cuda (in-process grid)")
    ap.add_argument("--dry-run", action="store_true", help="the in-process grid at tiny shapes (D=32, V=256/300, N=8, fp32): on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per implementation (default 5 CPU, 20 CUDA, 3 dry run on CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (in-process grid; default 3 CUDA, 1 CPU)")
    ap.add_argument("--ops", nargs="+", default=["exit_confidence", "linear_ce"], choices=["exit_confidence", "linear_ce"])
    ap.add_argument("--dims", type=int, nargs="+", default=GRID_DIMS, help="hidden sizes D of the CUDA grid")
    ap.add_argument("--vocabs", type=int, nargs="+", default=GRID_VOCABS, help="vocab sizes V of the CUDA grid")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--chunk-size", type=int, default=1024, help="linear_ce row chunk of the Triton path (the API default)")
    ap.add_argument("--budget-s", type=float, default=70.0, help="in-process grid: skip the remaining cases after this many seconds")
    ap.add_argument("--cases", nargs="*", default=list(CASES), help="CPU subprocess mode: named cases")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child[0], args.child[1], args.repeats or 5, args.device)))
        return
    if args.device.startswith("cuda") or args.dry_run:
        sys.exit(grid_main(args, args.device))
    repeats = args.repeats or 5
    rows = []
    for name in args.cases:
        for impl in IMPLS[CASES[name][0]]:
            # glibc returns every tensor-sized block to the OS on free, so RSS follows live memory
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            r = subprocess.run([sys.executable, __file__, "--child", name, impl, "--repeats", str(repeats), "--device", args.device],
                               capture_output=True, text=True, check=True, env=env)
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"{name:18s} {impl:8s} {rows[-1]['median_ms']:10.2f} ms  {rows[-1]['peak_mib']:9.1f} MiB", flush=True)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, device {args.device}, threads {os.environ.get('BENCH_THREADS', '1')}")
    print("| case | op | N x D x V, K | plain ms | kernel ms | time ratio (plain/kernel) | plain MiB | kernel MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        a, *others = [r for r in rows if r["case"] == name]
        for b in others:
            assert abs(a["result"] - b["result"]) <= 1e-3 * max(1.0, abs(a["result"])), (a, b)  # same answer
            label = b["op"] if b["impl"] in ("fused", "chunked") else f"{b['op']} ({b['impl']})"
            print(f"| {name} | {label} | {a['N']}x{a['D']}x{a['V']}, {a['K']} | {a['median_ms']:.1f} | {b['median_ms']:.1f} | "
                  f"{a['median_ms'] / b['median_ms']:.2f} | {a['peak_mib']:.1f} | {b['peak_mib']:.1f} | "
                  f"{a['peak_mib'] / max(b['peak_mib'], 0.1):.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
