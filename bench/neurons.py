"""LIF forward+backward time and saved-activation memory: ours vs spikingjelly, snntorch, torch.compile.

    python bench/neurons.py                      # both shapes, Spikformer's LIF (tau=2, hard reset, detached)
    python bench/neurons.py --shapes 4x32x24576 --repeats 7 --no-detach-reset

Every implementation runs the same multi-step LIF (tau=2, v_th=1, sigmoid surrogate alpha=4) on
the same fp32 input, forward then backward with a fixed random output gradient, in one process; the table
reports medians over `--repeats` round-robin timed runs (after one warm-up run that also
triggers compilation) and ratios to spikingjelly's eager LIFNode. Saved activations are the unique storage
bytes of every tensor autograd saves during the forward (torch.autograd.graph.saved_tensors_hooks).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import torch

from efficient.kernels import lif as K

TAU, VTH, ALPHA = 2.0, 1.0, 4.0


def saved_bytes(fn, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run fn(x) recording unique storages autograd saves; returns (output, bytes)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, sum(storages.values())


def make_impls(detach_reset: bool):
    """name -> callable(x) returning spikes; each callable is stateless across calls."""
    impls = {}
    def ours(x, stepwise: bool = True, stepwise_forward: bool = True):
        K.STEPWISE_BACKWARD, K.STEPWISE_FORWARD = True, stepwise_forward
        try:
            s = K.lif(x, TAU, VTH, 0.0, detach_reset, True, "sigmoid", ALPHA, backend="auto")
        finally:
            K.STEPWISE_FORWARD = True
        if not stepwise and s.requires_grad:  # the all-T backward loop, set once the output's gradient arrives
            s.register_hook(lambda g: setattr(K, "STEPWISE_BACKWARD", False))
        return s

    impls["ours auto"] = ours
    impls["ours auto, all-T backward"] = lambda x: ours(x, stepwise=False)
    impls["ours auto, all-T forward and backward"] = lambda x: ours(x, stepwise=False, stepwise_forward=False)
    impls["ours reference"] = lambda x: K.lif(x, TAU, VTH, 0.0, detach_reset, True, "sigmoid", ALPHA, backend="torch")
    try:
        from spikingjelly.activation_based import functional, neuron, surrogate

        sj = neuron.LIFNode(tau=TAU, decay_input=True, v_threshold=VTH, v_reset=0.0,
                            surrogate_function=surrogate.Sigmoid(alpha=ALPHA),
                            detach_reset=detach_reset, step_mode="m")

        def run_sj(x):
            functional.reset_net(sj)
            return sj(x)

        impls["spikingjelly LIFNode"] = run_sj
    except ImportError:
        print("spikingjelly not installed: skipped")
    try:
        import snntorch
        from snntorch import surrogate as snn_surrogate

        # same cost class: beta=1-1/tau, reset to zero, sigmoid surrogate with the same slope
        leaky = snntorch.Leaky(beta=1 - 1 / TAU, threshold=VTH, reset_mechanism="zero",
                               spike_grad=snn_surrogate.sigmoid(slope=ALPHA))

        def run_snn(x):
            mem = leaky.init_leaky()
            out = []
            for t in range(x.shape[0]):
                spk, mem = leaky(x[t] / TAU, mem)
                out.append(spk)
            return torch.stack(out)

        impls["snntorch Leaky loop"] = run_snn
    except ImportError:
        print("snntorch not installed: skipped")

    def plain_loop(x):
        v = torch.zeros_like(x[0])
        out = []
        for t in range(x.shape[0]):
            h = v + (x[t] - v) / TAU
            s = K._Heaviside.apply(h - VTH, 0, ALPHA)
            sr = s.detach() if detach_reset else s
            v = h * (1.0 - sr)
            out.append(s)
        return torch.stack(out)

    impls["torch.compile plain loop"] = torch.compile(plain_loop, dynamic=False)
    return impls


def bench_shape(shape, impls, repeats: int, base: str) -> list[dict]:
    """Warm up every implementation (compiles, measures memory, checks spikes), then time them
    round-robin so that load from other processes hits all of them alike."""
    torch.manual_seed(0)
    x0 = torch.randn(*shape) * 1.5 + 0.5
    g = torch.randn(*shape)
    xs, rows, ref_spikes = {}, {}, None
    for name, fn in impls.items():
        x = xs[name] = x0.clone().requires_grad_()
        y, mem = saved_bytes(fn, x)
        y.backward(g)
        if ref_spikes is None:
            ref_spikes = y.detach()
        agree = torch.equal(y.detach(), ref_spikes) if "snntorch" not in name else None
        rows[name] = {"name": name, "times": [], "bytes": mem, "agree": agree}
        del y
    for _ in range(repeats):
        for name, fn in impls.items():
            x = xs[name]
            x.grad = None
            t0 = time.perf_counter()
            fn(x).backward(g)
            rows[name]["times"].append(time.perf_counter() - t0)
    for r in rows.values():
        r["ms"] = 1e3 * statistics.median(r["times"])
        print(f"  {r['name']:28s} {r['ms']:9.1f} ms  saved {r['bytes'] / 2**20:8.1f} MiB", flush=True)
    ref = rows.get(base, next(iter(rows.values())))
    for r in rows.values():
        r["speedup"] = ref["ms"] / r["ms"]
        r["mem_ratio"] = r["bytes"] / ref["bytes"] if ref["bytes"] else float("nan")
    return list(rows.values())


# ---- GPU mode (bench/gpu.sh): Triton correctness on CUDA, speed vs spikingjelly, bandwidth ----------


def _noncontiguous(shape, dev) -> torch.Tensor:
    """A [T, B, ...] tensor whose memory is laid out [T, ..., B]: strided, not contiguous."""
    x = torch.randn(shape[0], *shape[2:], shape[1], device=dev).movedim(-1, 1)
    assert not x.is_contiguous()
    return x


GPU_SHAPES = ((1, 7), (4, 3, 1001), (16, 5, 333), (4, 32, 24576))
DRY_SHAPES = ((1, 7), (4, 3, 101), (16, 2, 33))


def gpu_correctness(device: str = "cuda", shapes=GPU_SHAPES) -> bool:
    """Triton op vs the torch reference over every reset/detach/decay/surrogate combination, PLIF,
    the DLIF leak charge, fp32/bf16/fp16, T in {1, 4, 16}, odd sizes and a non-contiguous input;
    spikes must be identical and fp32 gradients within 1e-5. Prints one line per failure."""
    import itertools

    dev, ok, n = torch.device(device), True, 0
    # tau=2: torch on CUDA divides by a Python scalar via its reciprocal (exact only for powers of
    # two), while the kernels divide with IEEE rounding like torch on CPU
    full = [dict(v_reset=vr, detach_reset=d, decay_input=di, surrogate=sg, alpha=2.0, tau=2.0, v_threshold=0.8)
            for vr, d, di, sg in itertools.product([0.0, None], [True, False], [True, False],
                                                  ["sigmoid", "atan", "triangle"])]
    full += [dict(rate=True, v_reset=vr, detach_reset=False, decay_input=di)
             for vr, di in itertools.product([0.0, None], [True, False])]
    full += [dict(leak=0.9, v_reset=0.0, detach_reset=False, surrogate="triangle", alpha=1.0)]
    few = [full[0], full[13], full[-2], full[-1]]  # hard/detached/sigmoid, soft/atan, PLIF, DLIF leak
    plan = []  # (shape, dtype, configs, contiguous): every option in fp32 on the small shapes, a subset elsewhere
    for i, shape in enumerate(shapes):
        plan.append((shape, torch.float32, full if i < len(shapes) - 1 else few, True))
        plan.append((shape, torch.float32, few, False))
        for dtype in (torch.bfloat16, torch.float16):
            if dtype == torch.bfloat16 and dev.type == "cpu":
                continue  # dry runs under TRITON_INTERPRET=1: the interpreter has no bf16
            plan.append((shape, dtype, few, True))
    worst = 0.0
    for shape, dtype, cfgs, contiguous in plan:
        if not contiguous and len(shape) < 3:
            continue
        for cfg in cfgs:
            torch.manual_seed(n)
            n += 1
            base = torch.randn(shape, device=dev) if contiguous else _noncontiguous(shape, dev)
            x = (base * 1.5 + 0.5).to(dtype)
            g = torch.randn(shape, device=dev)
            outs = []
            for impl in ("reference", "triton"):
                kw = dict(cfg)
                w = torch.tensor(0.3, device=dev, requires_grad=True)
                if kw.pop("rate", False):
                    kw["rate"] = w.sigmoid()
                xs = x.detach().requires_grad_()  # same strides as x: the op sees the strided input
                if impl == "reference":
                    s, h = K.lif_reference(xs, **kw)
                else:
                    s, h = K.lif(xs, impl="triton", return_membrane=True, **kw)
                ((s.float() * g).sum() + (h.float() * g).sum()).backward()
                outs.append((s, h, xs.grad.float(), w.grad))
            (s0, h0, gx0, gw0), (s1, h1, gx1, gw1) = outs
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            bad = []
            if not torch.equal(s0, s1):
                bad.append(f"spikes differ at {(s0 != s1).sum().item()} places")
            if not torch.allclose(h0.float(), h1.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=tol):
                bad.append(f"H diff {(h0.float() - h1.float()).abs().max().item():.2e}")
            if dtype == torch.float32:
                worst = max(worst, (gx0 - gx1).abs().max().item())
            if not torch.allclose(gx1, gx0, rtol=tol, atol=tol):
                bad.append(f"grad x diff {(gx0 - gx1).abs().max().item():.2e}")
            if gw0 is not None and not torch.allclose(gw1, gw0, rtol=1e-4, atol=1e-4):
                bad.append(f"grad rate {gw0.item():.6g} vs {gw1.item():.6g}")
            if bad:
                ok = False
                print(f"FAIL shape={shape} dtype={dtype} contiguous={contiguous} cfg={cfg}: {'; '.join(bad)}")
    print(f"correctness: {n} cases, {'all match' if ok else 'FAILURES above'}; largest fp32 grad x difference {worst:.2e}")
    return ok


def _cuda_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _sj_torch_path_ms(shape, dtype, repeats: int) -> float | None:
    """spikingjelly's LIF fwd+bwd with its torch implementation, timed in a child process:
    SJ_LIF_CUDA_IMPLEMENTATION is read once when spikingjelly is imported, and switching its
    cached selection inside one process does not take."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "SJ_LIF_CUDA_IMPLEMENTATION": "torch"}
    cmd = [sys.executable, __file__, "--sj-child", "x".join(map(str, shape)), str(dtype).replace("torch.", ""), str(repeats)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if r.returncode != 0:
        print(f"  spikingjelly LIFNode torch path: failed ({r.stderr.strip().splitlines()[-1][:160] if r.stderr.strip() else r.returncode})")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["ms"]


def _sj_child(spec: str, dtype_name: str, repeats: int) -> None:
    import json

    impl = make_impls(True)["spikingjelly LIFNode"]
    x = (torch.randn(tuple(int(v) for v in spec.split("x")), device="cuda") * 1.5 + 0.5).to(getattr(torch, dtype_name)).requires_grad_()
    g = torch.randn_like(x)
    impl(x).backward(g)

    def step():
        x.grad = None
        impl(x).backward(g)

    print(json.dumps({"ms": _cuda_ms(step, repeats)}))


GPU_ROWS: list[dict] = []  # every GPU timing, for --json


def gpu_speed(shapes, repeats: int) -> bool:
    """fwd+bwd medians (CUDA events) vs spikingjelly's LIFNode (set SJ_LIF_CUDA_IMPLEMENTATION=triton
    to pin its Triton kernels) and the fraction of copy bandwidth our kernels reach."""
    dev = torch.device("cuda")
    impls = make_impls(True)
    impls.pop("ours auto")
    impls.pop("ours auto, all-T backward")  # CPU loops' choices: on CUDA all are the Triton kernels
    impls.pop("ours auto, all-T forward and backward")
    impls = {"ours triton": lambda x: K.lif(x, TAU, VTH, 0.0, True, True, "sigmoid", ALPHA, backend="triton"), **impls}
    impls.pop("snntorch Leaky loop", None)
    compiled = impls.pop("torch.compile plain loop")
    big = torch.empty(2**28, device=dev)  # 1 GiB: device copy bandwidth as the practical peak
    copy_ms = _cuda_ms(lambda: big.clone(), 10)
    peak = 2 * big.numel() * 4 / (copy_ms * 1e-3)
    del big
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {peak / 1e9:.0f} GB/s (read+write)")
    ok = True
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(shape, device=dev) * 1.5 + 0.5).to(dtype).requires_grad_()
            g = torch.randn(shape, device=dev, dtype=dtype)
            res = {}
            # compiling costs ~10-30 s per shape and dtype: fp32 only, to stay inside the GPU budget
            todo = {**impls, "torch.compile plain loop": compiled} if dtype == torch.float32 else impls
            for name, fn in todo.items():
                try:
                    fn(x).backward(g)  # warm-up / compile
                    def step(fn=fn):
                        x.grad = None
                        fn(x).backward(g)

                    res[name] = _cuda_ms(step, repeats)
                except Exception as e:  # report and continue: one peer failing must not hide the rest
                    print(f"  {name}: failed ({type(e).__name__}: {str(e)[:120]})")
            if "spikingjelly LIFNode" in impls:
                ms = _sj_torch_path_ms(shape, dtype, repeats)
                if ms is not None:
                    res["spikingjelly LIFNode torch path"] = ms
            x2 = x.detach().reshape(shape[0], -1)
            fwd_ms = _cuda_ms(lambda: K.lif(x2, impl="triton", return_membrane=True), repeats)
            s, h = K.lif(x2, impl="triton", return_membrane=True)
            gs = torch.randn_like(s)
            bwd_ms = _cuda_ms(lambda: torch.ops.efficient.lif_backward(
                gs, None, h, None, TAU, VTH, 0.0, 0, 0, ALPHA, True, dtype, "triton"), repeats)
            n, eb = x2.numel(), x2.element_size()
            fwd_bw = n * (eb + eb + 4) / (fwd_ms * 1e-3)  # read x, write spikes and H
            bwd_bw = n * (eb + 4 + eb) / (bwd_ms * 1e-3)  # read grad spikes and H, write grad x
            print(f"\n| {list(shape)} {str(dtype).replace('torch.', '')} | fwd+bwd ms | vs spikingjelly |")
            print("|---|---|---|")
            sj = res.get("spikingjelly LIFNode")
            for name, ms in res.items():
                print(f"| {name} | {ms:.3f} | {sj / ms:.2f}x |" if sj else f"| {name} | {ms:.3f} | n/a |")
            GPU_ROWS.append({"shape": list(shape), "dtype": str(dtype), "fwd_bwd_ms": res, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
                             "fwd_share_of_copy": fwd_bw / peak, "bwd_share_of_copy": bwd_bw / peak, "copy_GBps": peak / 1e9})
            print(f"ours triton: forward {fwd_ms:.3f} ms = {fwd_bw / 1e9:.0f} GB/s ({100 * fwd_bw / peak:.0f}% of copy), "
                  f"backward {bwd_ms:.3f} ms = {bwd_bw / 1e9:.0f} GB/s ({100 * bwd_bw / peak:.0f}% of copy)")
            if sj and "ours triton" in res:
                speed_ok = sj / res["ours triton"] >= 1.2
                bw_ok = min(fwd_bw, bwd_bw) >= 0.7 * peak
                print(f"targets: >=1.2x spikingjelly {'PASS' if speed_ok else 'FAIL'}, "
                      f">=70% bandwidth {'PASS' if bw_ok else 'FAIL'}")
                ok &= speed_ok and bw_ok
    return ok


# ---- neurons on the device (bench/gpu.sh): LIF, PLIF, DLIF vs spikingjelly and a compiled loop ----------

LEAK = 0.9  # DLIF's charge H = leak * V + X
NEURON_SHAPES = ((4, 32, 24576), (8, 64, 65536), (16, 32, 24576))  # the two benchmark shapes, then T=16
TARGET_SHAPES = NEURON_SHAPES[:2]
DRY_NEURON_SHAPES = ((4, 2, 96), (8, 2, 64), (16, 2, 48))


def _plain_neuron(kind: str):
    """The neuron as a user writes it in torch: a loop over T (hard reset to 0, detached, sigmoid surrogate)."""
    def loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v, out = torch.zeros_like(x[0]), []
        rate = w.sigmoid()
        for t in range(x.shape[0]):
            if kind == "dlif":
                h = LEAK * v + x[t]
            elif kind == "plif":
                h = v + (x[t] - v) * rate
            else:
                h = v + (x[t] - v) / TAU
            s = K._Heaviside.apply(h - VTH, 0, ALPHA)
            v = h * (1.0 - s.detach())
            out.append(s)
        return torch.stack(out)
    return loop


def _neuron_impls(kind: str, device: torch.device) -> dict:
    """name -> fn(x, w) for one neuron kind; w is PLIF's parameter (rate = sigmoid(w)), unused by the others."""
    backend = "triton" if device.type == "cuda" else "torch"
    extra = {"dlif": lambda w: {"leak": LEAK}, "plif": lambda w: {"rate": w.sigmoid()}, "lif": lambda w: {}}[kind]
    impls = {f"ours {backend}": lambda x, w: K.lif(x, TAU, VTH, 0.0, True, True, "sigmoid", ALPHA, backend=backend, **extra(w))}
    try:
        from spikingjelly.activation_based import functional, neuron, surrogate

        node = None
        if kind == "lif":
            node = neuron.LIFNode(tau=TAU, decay_input=True, v_threshold=VTH, v_reset=0.0, detach_reset=True,
                                  surrogate_function=surrogate.Sigmoid(alpha=ALPHA), step_mode="m")
        elif kind == "plif":  # its w starts at -log(tau - 1) = 0: rate sigmoid(0) = 1/2, as ours; ours reads the same w
            node = neuron.ParametricLIFNode(init_tau=TAU, decay_input=True, v_threshold=VTH, v_reset=0.0, detach_reset=True,
                                            surrogate_function=surrogate.Sigmoid(alpha=ALPHA), step_mode="m")
        if node is not None:
            node = node.to(device)

            def run(x, w, node=node):
                functional.reset_net(node)
                if kind == "plif":
                    node.w = torch.nn.Parameter(w) if not isinstance(w, torch.nn.Parameter) else w
                return node(x)

            impls["spikingjelly " + ("Triton" if device.type == "cuda" else "torch (CPU)")] = run
    except ImportError:
        print("spikingjelly not installed: its rows are skipped")
    impls["torch.compile plain loop"] = torch.compile(_plain_neuron(kind), dynamic=False)
    return impls


def _time_ms(fn, repeats: int, device: torch.device) -> float:
    if device.type == "cuda":
        return _cuda_ms(fn, repeats)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def neuron_speed(kinds, shapes, repeats: int, device: torch.device, target_shapes) -> tuple[bool, list[dict]]:
    """Per neuron and shape: every implementation checked against the plain eager loop (spikes, input and
    PLIF-rate gradients), then fwd+bwd timed (CUDA events); targets as PASS/FAIL lines. Returns
    (every check passed, rows)."""
    ok, rows = True, []
    for knob in ("recompile_limit", "cache_size_limit"):  # one compiled loop per (neuron, shape): more than the default 8
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    for kind in kinds:
        impls = _neuron_impls(kind, device)
        oracle = _plain_neuron(kind)
        for shape in shapes:
            torch.manual_seed(0)
            x0 = torch.randn(shape, device=device) * 1.5 + 0.5
            g = torch.randn(shape, device=device)
            w0 = torch.zeros((), device=device)
            xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            sr = oracle(xr, wr)
            sr.backward(g)
            res: dict[str, Any] = {}
            for name, fn in impls.items():
                x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
                try:
                    s = fn(x, w)  # first call: compiles / JIT-compiles its kernels
                    s.backward(g)
                except Exception as e:
                    res[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                    print(f"  {kind} {list(shape)} {name}: failed ({res[name]['error']})")
                    continue
                flips = int((s.detach() != sr.detach()).sum())
                gx = float((x.grad - xr.grad).norm() / xr.grad.norm().clamp_min(1e-30))
                gw = float((w.grad - wr.grad).abs() / wr.grad.abs().clamp_min(1e-6)) if kind == "plif" and w.grad is not None else 0.0
                good = flips <= max(0, s.numel() // 10**6) and gx <= 1e-4 and gw <= 1e-3
                rec = {"spike_flips": flips, "grad_x_rel": gx, "grad_rate_rel": gw, "match": good}
                if not good:
                    ok = False
                    print(f"FAIL {kind} {list(shape)} {name} vs the plain loop: {flips} spikes differ, grad x rel {gx:.1e}, "
                          f"grad rate rel {gw:.1e}")
                else:
                    def step(fn=fn, x=x, w=w):
                        x.grad = None
                        w.grad = None
                        fn(x, w).backward(g)
                    rec["ms"] = _time_ms(step, repeats, device)
                res[name] = rec
            timed = {n: r["ms"] for n, r in res.items() if "ms" in r}
            ours = next((n for n in timed if n.startswith("ours")), None)
            peers = {n: t for n, t in timed.items() if not n.startswith("ours")}
            print(f"\n| {kind.upper()} {list(shape)} fp32 | fwd+bwd ms | check vs plain loop (spike flips, grad x rel) |")
            print("|---|---|---|")
            for n, r in res.items():
                chk = r.get("error") or f"{'match' if r['match'] else 'MISMATCH'} ({r['spike_flips']}, {r['grad_x_rel']:.1e})"
                print(f"| {n} | {r['ms']:.3f} | {chk} |" if "ms" in r else f"| {n} | not timed | {chk} |")
            row = {"neuron": kind, "shape": list(shape), "impls": res}
            if ours and peers:
                best = min(peers, key=peers.get)
                ratio = peers[best] / timed[ours]
                row.update(best_peer=best, vs_best_peer=ratio)
                judged = tuple(shape) in {tuple(s) for s in target_shapes}
                verdict = ("PASS" if ratio >= 1.2 else "FAIL") if judged else "(reported, no target)"
                print(f"target {kind.upper()} fwd+bwd >= 1.2x the best of spikingjelly and a compiled loop {list(shape)}: "
                      f"ours {timed[ours]:.3f} ms, {best} {peers[best]:.3f} ms: {ratio:.2f}x {verdict}")
            rows.append(row)
    return ok, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4x32x24576,8x64x65536")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--no-detach-reset", action="store_true", help="spikingjelly's default detach_reset=False")
    p.add_argument("--gpu", action="store_true", help="CUDA: Triton correctness, speed vs spikingjelly, bandwidth")
    p.add_argument("--json", default=None, help="with --gpu: write the timings here")
    p.add_argument("--sj-child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--check-only", action="store_true", help="with --gpu: the correctness pass alone")
    p.add_argument("--speed-only", action="store_true", help="with --gpu: the timings alone (after a --check-only run)")
    p.add_argument("--dry-run", action="store_true", help="with --gpu: rehearse the correctness pass on CPU (TRITON_INTERPRET=1)")
    p.add_argument("--neurons", nargs="+", choices=["lif", "plif", "dlif"], default=None,
                   help="with --gpu --speed-only: LIF/PLIF/DLIF vs spikingjelly and a compiled loop at the benchmark shapes and "
                        "T=16, each checked first (with --dry-run: on this CPU at tiny shapes)")
    args = p.parse_args()
    if args.sj_child:
        _sj_child(args.sj_child[0], args.sj_child[1], int(args.sj_child[2]))
        return
    if args.gpu and args.neurons:
        import json

        dev = torch.device("cpu" if args.dry_run else "cuda")
        shapes = DRY_NEURON_SHAPES if args.dry_run else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.machine()
        print(f"# bench/neurons.py --neurons -- {name}, torch {torch.__version__}, "
              f"SJ_LIF_CUDA_IMPLEMENTATION={os.environ.get('SJ_LIF_CUDA_IMPLEMENTATION', 'unset')}")
        correct, rows = neuron_speed(args.neurons, shapes, max(args.repeats, 20 if dev.type == "cuda" else 3), dev,
                                     shapes[:2] if args.dry_run else TARGET_SHAPES)
        print(f"\nchecks before timing: {'all match' if correct else 'FAILURES above'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "torch": torch.__version__, "correct": correct, "rows": rows}, f, indent=1)
        raise SystemExit(0 if correct else 1)
    if args.gpu:
        shapes = [tuple(int(s) for s in spec.split("x")) for spec in args.shapes.split(",")]
        if args.dry_run:  # CPU rehearsal under TRITON_INTERPRET=1: correctness path only, tiny shapes
            correct = gpu_correctness("cpu", DRY_SHAPES)
            raise SystemExit(0 if correct else 1)
        correct = True if args.speed_only else gpu_correctness()
        if args.check_only:  # bench/gpu.sh checks every kernel before it times any
            if args.json:
                import json

                with open(args.json, "w") as f:
                    json.dump({"correct": correct, "device": torch.cuda.get_device_name(), "torch": torch.__version__}, f)
            raise SystemExit(0 if correct else 1)
        fast = gpu_speed(shapes, max(args.repeats, 20))
        print(f"GPU targets {'met' if fast else 'NOT met'} (see lines above)")
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump({"correct": correct, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": GPU_ROWS}, f, indent=1)
        raise SystemExit(0 if correct else 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    detach = not args.no_detach_reset
    impls = make_impls(detach)
    base = "spikingjelly LIFNode"
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, detach_reset={detach}, auto -> "
          f"{K.resolve_backend('auto', torch.device('cpu'))}")
    for spec in args.shapes.split(","):
        shape = tuple(int(s) for s in spec.split("x"))
        print(f"shape {list(shape)}")
        rows = bench_shape(shape, impls, args.repeats, base)
        print(f"\n| shape {list(shape)} | fwd+bwd median (ms) | speed-up vs spikingjelly | saved activations (MiB) "
              f"| memory vs spikingjelly | spikes equal ours auto |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            agree = "n/a (other dynamics)" if r["agree"] is None else ("yes" if r["agree"] else "NO")
            print(f"| {r['name']} | {r['ms']:.1f} | {r['speedup']:.2f}x | {r['bytes'] / 2**20:.1f} | "
                  f"{r['mem_ratio']:.2f} | {agree} |")
        print()


if __name__ == "__main__":
    main()
