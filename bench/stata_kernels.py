"""STATA's kernels against their torch references on a device: attention + scores, token selection,
the alignment losses compiled against their eager closed form, and whole-model gradients with every
kernel on Triton vs every kernel on torch.

    python bench/stata_kernels.py --device cuda --json out.json       # CIFAR, ImageNet and N=1024 shapes
    TRITON_INTERPRET=1 python bench/stata_kernels.py --device cpu --dry-run   # the same code path, tiny

Shapes `[T, B, H, N, d]`: CIFAR Spikformer-4-384 (N=64 tokens + anchor, 12 heads of 32), ImageNet
Spikformer-8-512 (196 + anchor, 8 heads of 64) and N=1024. Q, K, V are binary spikes, so every
partial sum of the attention is an integer: fp32 must match exactly, bf16/fp16 within the dtype's
rounding of the outputs. Selection must keep the same token set as the reference. Model-level
check: the same zoo model, seed and batch run with EFFICIENT_BACKEND=triton and =torch; logits and
every parameter gradient are compared (fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from efficient.kernels import ssa
from efficient.kernels import token_select as ts

SHAPES = {  # name: (T, B, H, N incl. anchor, d)
    "cifar N=65 d=32": (4, 16, 12, 65, 32),
    "imagenet N=197 d=64": (4, 8, 8, 197, 64),
    "N=1025 d=64": (4, 2, 8, 1025, 64),
}
DRY_SHAPES = {"cifar N=65 d=32": (1, 2, 2, 65, 32), "imagenet N=197 d=64": (1, 1, 1, 197, 64)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALIGN_SHAPES = {"cifar b64": (4, 64, 64), "imagenet b32": (4, 32, 196)}  # scores [T, B, N] of a pruning block
DRY_ALIGN_SHAPES = {"toy": (2, 3, 9)}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_ms(fn, dev, repeats: int) -> float:
    """Median wall time of `fn` in ms over `repeats` calls after one warm-up, the device synchronised."""
    fn()
    _sync(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def check_kernels(dev: torch.device, shapes: dict, dtypes: list[str], repeats: int) -> tuple[bool, list[dict]]:
    ok, rows = True, []
    for name, (T, B, H, N, d) in shapes.items():
        for dn in dtypes:
            dt = DTYPES[dn]
            g = torch.Generator(device=dev).manual_seed(N * d)
            q, k, v = ((torch.rand(T, B, H, N, d, device=dev, generator=g) < 0.25).to(dt) for _ in range(3))
            ref = ssa.ssa_ref(q.float(), k.float(), v.float(), 0.125, True, True)
            out = ssa.spiking_attention(q, k, v, 0.125, anchor=True, scores=True, backend="triton")
            # y: integer sums times 1/8, exact in fp32; in half precision only the output's rounding
            y_err = (out[0].float() - ref[0]).abs().max().item()
            y_tol = 0.0 if dt == torch.float32 else ref[0].abs().max().item() * (2**-7 if dt == torch.bfloat16 else 2**-10)
            s_err = max((o.float() - r).abs().max().item() for o, r in zip(out[1:], ref[1:]))
            s_tol = 1e-5 if dt == torch.float32 else ref[1].abs().max().item() * (2**-7 if dt == torch.bfloat16 else 2**-10)
            # selection on the kernel's own scores (both paths see the same input), keep 70 %
            keep = max(1, int(0.7 * (N - 1)))
            idx_t, z_t = ts.select_tokens(out[1], keep, backend="triton")
            idx_r, z_r = ts.select_tokens(out[1], keep, backend="torch")
            same_set = torch.equal(idx_t, idx_r)
            z_err = (z_t - z_r).abs().max().item()
            good = y_err <= y_tol and s_err <= s_tol and same_set and z_err <= 1e-4
            ok &= good
            t_ssa = median_ms(lambda: ssa.spiking_attention(q, k, v, 0.125, anchor=True, scores=True, backend="triton"), dev, repeats)
            t_ref = median_ms(lambda: ssa.spiking_attention(q, k, v, 0.125, anchor=True, scores=True, backend="torch"), dev, repeats)
            t_sel = median_ms(lambda: ts.select_tokens(out[1], keep, backend="triton"), dev, repeats)
            t_selr = median_ms(lambda: ts.select_tokens(out[1], keep, backend="torch"), dev, repeats)
            row = {"shape": name, "dtype": dn, "y_err": y_err, "y_tol": y_tol, "score_err": s_err, "score_tol": s_tol,
                   "same_kept_set": same_set, "z_err": z_err, "ok": good,
                   "ssa_triton_ms": t_ssa, "ssa_torch_ms": t_ref, "select_triton_ms": t_sel, "select_torch_ms": t_selr}
            rows.append(row)
            print(f"{name:22s} {dn}: y err {y_err:.2e} (tol {y_tol:.1e}), scores err {s_err:.2e} (tol {s_tol:.1e}), "
                  f"same kept set {same_set}, z err {z_err:.1e} -> {'ok' if good else 'MISMATCH'}; "
                  f"ssa {t_ssa:.3f} ms vs torch {t_ref:.3f} ms, select {t_sel:.3f} ms vs torch {t_selr:.3f} ms", flush=True)
    return ok, rows


def check_alignment(dev: torch.device, shapes: dict, repeats: int) -> tuple[bool, list[dict]]:
    """The alignment losses' forward + backward compiled (what "auto" runs on CUDA) against the
    eager closed form: values and gradient, then both timed."""
    from efficient.objectives.stata import alignment_losses

    ok, rows = True, []
    for name, shape in shapes.items():
        g = torch.Generator(device=dev).manual_seed(shape[-1])
        s = torch.randn(shape, device=dev, generator=g) * 2
        c = torch.randn(shape, device=dev, generator=g)

        def run(backend: str):
            x = s.clone().requires_grad_()
            intra, inter = alignment_losses(x, c, 1.0, backend=backend)
            (intra + 0.5 * inter).backward()
            return torch.stack([intra, inter]).detach(), x.grad

        (v0, g0), (v1, g1) = run("loop"), run("compile")
        v_err = ((v1 - v0).abs() / v0.abs().clamp_min(1e-6)).max().item()
        g_err = ((g1 - g0).abs().max() / g0.abs().max().clamp_min(1e-12)).item()
        good = v_err <= 1e-5 and g_err <= 1e-4
        ok &= good
        t_eager = median_ms(lambda: run("loop"), dev, repeats)
        t_comp = median_ms(lambda: run("compile"), dev, repeats)
        rows.append({"shape": name, "value_rel_err": v_err, "grad_rel_err": g_err, "ok": good,
                     "eager_ms": t_eager, "compiled_ms": t_comp})
        print(f"alignment {name:14s}: value err {v_err:.1e}, grad err {g_err:.1e} -> {'ok' if good else 'MISMATCH'}; "
              f"fwd+bwd compiled {t_comp:.3f} ms vs eager {t_eager:.3f} ms", flush=True)
    return ok, rows


def _model_run(name: str, backend: str, dev: torch.device, x: torch.Tensor, y: torch.Tensor, kw: dict):
    from efficient.zoo import create

    os.environ["EFFICIENT_BACKEND"] = backend
    try:
        torch.manual_seed(0)
        m = create(name, **kw).to(dev).train()
        if hasattr(m, "warmup"):
            m.warmup = (0.0, 0.0)  # the final keep ratio: selection active in every pruned block
        out = m(x)
        torch.nn.functional.cross_entropy(out.float(), y).backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        return out.detach(), grads
    finally:
        del os.environ["EFFICIENT_BACKEND"]


def check_models(dev: torch.device, cases: dict) -> tuple[bool, list[dict]]:
    ok, rows = True, []
    for name, (batch, img, classes, kw) in cases.items():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, img, img, generator=g).to(dev)
        y = torch.randint(0, classes, (batch,), generator=g).to(dev)
        out_t, gr_t = _model_run(name, "triton", dev, x, y, kw)
        out_r, gr_r = _model_run(name, "torch", dev, x, y, kw)
        out_err = (out_t - out_r).abs().max().item()
        # relative to each tensor's scale, floored at 1e-3 of the model's largest gradient: biases in
        # front of a BatchNorm have a true gradient of zero, and their ~1e-9 round-off is no signal
        floor = 1e-3 * max(gr.abs().max().item() for gr in gr_r.values())
        rel = max(((gr_t[n] - gr_r[n]).abs().max() / gr_r[n].abs().max().clamp_min(floor)).item() for n in gr_r)
        good = set(gr_t) == set(gr_r) and out_err <= 1e-4 and rel <= 1e-3
        ok &= good
        rows.append({"model": name, "batch": batch, "img": img, "logit_err": out_err, "worst_rel_grad_err": rel, "ok": good})
        print(f"{name} b{batch} {img}px fp32, triton vs torch kernels: logits max diff {out_err:.2e}, "
              f"worst relative grad diff {rel:.2e} over {len(gr_r)} tensors -> {'ok' if good else 'MISMATCH'}", flush=True)
    return ok, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, fp32/fp16 (CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.dry_run:
        shapes, dtypes, repeats = DRY_SHAPES, ["fp32", "fp16"], 1
        models, align_shapes = {"spikformer-stata": (2, 32, 10, {})}, DRY_ALIGN_SHAPES
    else:
        shapes, dtypes, repeats = SHAPES, ["fp32", "bf16", "fp16"], args.repeats
        models = {"spikformer-stata": (8, 32, 10, {}), "spikformer-8-512-stata": (2, 224, 1000, {})}
        align_shapes = ALIGN_SHAPES
    k_ok, k_rows = check_kernels(dev, shapes, dtypes, repeats)
    a_ok, a_rows = check_alignment(dev, align_shapes, repeats)
    m_ok, m_rows = check_models(dev, models)
    good = k_ok and a_ok and m_ok
    print(f"STATA kernels: {'all match' if good else 'MISMATCHES above'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": k_rows, "alignment": a_rows, "models": m_rows}, f, indent=1)
    raise SystemExit(0 if good else 1)


if __name__ == "__main__":
    main()
