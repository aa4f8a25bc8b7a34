"""Triton LIF kernels vs the torch reference, run under TRITON_INTERPRET=1 (set before triton is
imported, hence a separate process started by test_lif_triton.py). Prints `case <name> ok` or
`case <name> FAIL <why>` per case and exits 0; any crash exits non-zero."""

from __future__ import annotations

import itertools
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from efficient.kernels import lif as K  # noqa: E402


def _x(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 1.5 + 0.6).to(dtype)


def compare(name, x, with_rate=False, membrane_grad=True, **kw):
    """Spikes and H equal, grads (x, and rate for PLIF) within 1e-6 in fp32."""
    g, gm = _x(x.shape, 1), _x(x.shape, 2)
    results = []
    for impl in ("reference", "triton"):
        xs = x.detach().clone().requires_grad_()
        w = torch.tensor(0.3, requires_grad=True)
        extra = {"rate": w.sigmoid()} if with_rate else {}
        if impl == "reference":
            s, h = K.lif_reference(xs, **kw, **extra)
        else:
            s, h = K.lif(xs, impl="triton", return_membrane=True, **kw, **extra)
        loss = (s.float() * g).sum() + ((h * gm).sum() if membrane_grad else 0.0)
        loss.backward()
        results.append((s.detach(), h.detach(), xs.grad, w.grad))
    (s0, h0, gx0, gw0), (s1, h1, gx1, gw1) = results
    tol = 1e-6 if x.dtype == torch.float32 else 1e-3
    problems = []
    if s1.dtype != s0.dtype or not torch.equal(s0, s1):
        problems.append("spikes differ")
    if not torch.allclose(h0, h1, rtol=0, atol=1e-6):
        problems.append(f"H max diff {(h0 - h1).abs().max().item():.2e}")
    if gx1.dtype != x.dtype or not torch.allclose(gx1.float(), gx0.float(), rtol=tol, atol=tol):
        problems.append(f"grad x max diff {(gx0.float() - gx1.float()).abs().max().item():.2e}")
    if with_rate and not torch.allclose(gw0, gw1, rtol=1e-5, atol=1e-5):
        problems.append(f"grad rate {gw0.item()} vs {gw1.item()}")
    print(f"case {name} " + ("ok" if not problems else "FAIL " + "; ".join(problems)), flush=True)


def compare_state(name, x, **kw):
    """lif from a given initial membrane: spikes and H equal, grads of x, rate and v_init within 1e-6."""
    v0 = _x(x.shape[1:], 8) * 0.5
    res = []
    for impl in ("reference", "triton"):
        xs, vs = x.detach().clone().requires_grad_(), v0.clone().requires_grad_()
        w = torch.tensor(0.3, requires_grad=True)
        if impl == "reference":
            s, h = K.lif_reference(xs, v_init=vs, rate=w.sigmoid(), **kw)
        else:
            s, h = K.lif(xs, impl="triton", return_membrane=True, v_init=vs, rate=w.sigmoid(), **kw)
        ((s * _x(x.shape, 1)).sum() + (h * _x(x.shape, 2)).sum()).backward()
        res.append((s, h.detach(), xs.grad, vs.grad, w.grad))
    _report(name, res)


def compare_leaky(name, x, reset, per_neuron, surrogate):
    """snntorch order: spikes and membrane equal, grads of x, mem, beta, threshold within 1e-6."""
    m0 = _x(x.shape[1:], 9) * 0.5
    res = []
    for impl in ("reference", "triton"):
        xs, ms = x.detach().clone().requires_grad_(), m0.clone().requires_grad_()
        beta = (torch.linspace(0.2, 0.95, x.shape[-1]) if per_neuron else torch.tensor(0.8)).requires_grad_()
        thr = torch.tensor(0.9, requires_grad=True)
        fn = K.leaky_reference if impl == "reference" else lambda *a, **k: K.leaky(*a, impl="triton", return_membrane=True, **k)
        s, m = fn(xs, beta, thr, reset, surrogate, mem=ms)
        ((s * _x(x.shape, 1)).sum() + (m * _x(x.shape, 2)).sum()).backward()
        res.append((s, m.detach(), xs.grad, ms.grad, beta.grad, thr.grad))
    _report(name, res)


def _report(name, res):
    a, b = res
    problems = [] if torch.equal(a[0], b[0]) else ["spikes differ"]
    if not torch.equal(a[1], b[1]):
        problems.append(f"membrane max diff {(a[1] - b[1]).abs().max().item():.2e}")
    for i, (u, v) in enumerate(zip(a[2:], b[2:])):
        if not torch.allclose(u, v, rtol=1e-5, atol=1e-6 if i < 2 else 1e-5):  # parameters: sums over N
            problems.append(f"grad {i} max diff {(u - v).abs().max().item():.2e}")
    print(f"case {name} " + ("ok" if not problems else "FAIL " + "; ".join(problems)), flush=True)


def main() -> int:
    base = _x((3, 5, 7), 0)  # odd sizes: N=35, one partially masked block
    for vr, det, dec, sg in itertools.product([0.0, None], [True, False], [True, False], ["sigmoid", "atan", "triangle"]):
        compare(f"lif-vr{vr}-detach{det}-decay{dec}-{sg}", base, tau=3.0, v_threshold=0.8, v_reset=vr,
                detach_reset=det, decay_input=dec, surrogate=sg, alpha=2.0)
    compare("lif-ste", base, tau=3.0, v_threshold=0.8, v_reset=0.0, detach_reset=False, surrogate="ste", alpha=1.5)
    compare("T1", _x((1, 4, 3), 3), tau=1.5, v_reset=0.0, detach_reset=False, surrogate="atan", alpha=2.0)
    nc = _x((35, 5), 4).t()  # [5, 35] with strides (1, 5): flattening keeps it a strided view
    assert not nc.detach().clone().reshape(5, -1).is_contiguous(), "the op must receive the strided tensor"
    seen, real = [], K._triton_forward
    K._triton_forward = lambda x, *a: (seen.append(x.is_contiguous()), real(x, *a))[1]
    try:  # the kernel itself gets the strided view (it reads x through its strides, no copy first)
        compare("noncontiguous", nc, v_reset=None, detach_reset=False)
    finally:
        K._triton_forward = real
    assert seen == [False], f"the Triton forward should see the strided tensor once, saw contiguous={seen}"
    compare("two-blocks", _x((2, 1500), 5), v_reset=0.0, detach_reset=False, surrogate="triangle", alpha=1.0)
    for vr, dec in itertools.product([0.0, None], [True, False]):
        compare(f"plif-vr{vr}-decay{dec}", _x((4, 1100), 6), with_rate=True, v_reset=vr, detach_reset=False,
                decay_input=dec, surrogate="sigmoid", alpha=4.0)
    compare("leak-dlif", base, leak=0.9, v_reset=0.0, detach_reset=False, surrogate="triangle", alpha=1.0)
    compare("no-membrane-grad", base, membrane_grad=False, v_reset=0.0, detach_reset=True)
    compare("fp16", _x((3, 5, 7), 7, torch.float16), v_reset=0.0, detach_reset=False)
    for vr, dec in itertools.product([0.0, None], [True, False]):
        compare_state(f"state-vr{vr}-decay{dec}", _x((4, 3, 400), 10), v_reset=vr, detach_reset=False, decay_input=dec)
    for reset, per, sg in itertools.product(["subtract", "zero", "none"], [False, True], ["atan", "sigmoid"]):
        compare_leaky(f"leaky-{reset}-perneuron{per}-{sg}", _x((5, 3, 700), 11), reset, per, sg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
