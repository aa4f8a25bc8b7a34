"""Early-exit kernels vs the plain torch path: time and peak memory, side by side.

    python bench/ee_kernels.py                 # both ops, default shapes
    python bench/ee_kernels.py --repeats 5 --json out.json

exit_confidence: p_max/argmax of softmax(h @ W.T) -- plain (full logits + softmax) vs the
chunked online-softmax path (vocab chunks of 4096), and Triton on CUDA when present.
linear_ce: K exits' summed CE + backward -- plain (K full logit tensors alive until backward) vs
the chunked fused path (256-row chunks, gradients formed in the forward).

Peak memory is the rise of peak RSS over the level before the first call (CPU; peak reset via
/proc/self/clear_refs, malloc returning large blocks at free) or of max_memory_allocated (CUDA),
in a fresh subprocess per case, so earlier cases do not mask later ones.
"""

from __future__ import annotations

import argparse
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
}
IMPLS = {"exit_confidence": ["plain", "chunked"], "linear_ce": ["plain", "fused"]}


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
            loss = sum(linear_ce(h, w, t, chunk_size=256, backend=backend) for h in hs)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child[0], args.child[1], args.repeats, args.device)))
        return
    rows = []
    for name in args.cases:
        for impl in IMPLS[CASES[name][0]]:
            # glibc returns every tensor-sized block to the OS on free, so RSS follows live memory
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            r = subprocess.run([sys.executable, __file__, "--child", name, impl, "--repeats", str(args.repeats), "--device", args.device],
                               capture_output=True, text=True, check=True, env=env)
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"{name:18s} {impl:8s} {rows[-1]['median_ms']:10.2f} ms  {rows[-1]['peak_mib']:9.1f} MiB", flush=True)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, device {args.device}, threads {os.environ.get('BENCH_THREADS', '1')}")
    print("| case | op | N x D x V, K | plain ms | kernel ms | time ratio (plain/kernel) | plain MiB | kernel MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        a, b = [r for r in rows if r["case"] == name]
        assert abs(a["result"] - b["result"]) <= 1e-3 * max(1.0, abs(a["result"])), (a, b)  # same answer
        print(f"| {name} | {a['op']} | {a['N']}x{a['D']}x{a['V']}, {a['K']} | {a['median_ms']:.1f} | {b['median_ms']:.1f} | "
              f"{a['median_ms'] / b['median_ms']:.2f} | {a['peak_mib']:.1f} | {b['peak_mib']:.1f} | {a['peak_mib'] / max(b['peak_mib'], 0.1):.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
