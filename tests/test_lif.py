"""efficient.kernels.lif: parity with spikingjelly 2.0, the custom op vs the reference, gradcheck,
saved memory, dtypes and bad input. Triton kernels are checked in test_lif_triton.py."""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch
from conftest import needs_cxx

from efficient.kernels import lif as K

try:  # the parity oracle; only the tests marked needs_spikingjelly use it
    from spikingjelly.activation_based import functional as sj_functional
    from spikingjelly.activation_based import neuron as sj_neuron
    from spikingjelly.activation_based import surrogate as sj_surrogate
except ImportError:
    sj_functional = sj_neuron = sj_surrogate = None
needs_spikingjelly = pytest.mark.skipif(sj_neuron is None, reason="spikingjelly (the parity oracle) is not installed")

SJ_SURROGATES = {  # our name -> (spikingjelly class name, alpha)
    "sigmoid": ("Sigmoid", 4.0),
    "atan": ("ATan", 2.0),
    "triangle": ("PiecewiseQuadratic", 1.5),  # spikingjelly's triangle-shaped derivative
}
COMBOS = list(itertools.product([0.0, None], [True, False], [True, False], sorted(SJ_SURROGATES)))


def _input(shape=(6, 3, 11), seed=0, scale=1.5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + 0.6).to(dtype)


def _post_reset(s, h, v_th, v_reset, detach_reset):
    """V[t] from our (S, H), differentiable like spikingjelly's v_seq."""
    sr = s.detach() if detach_reset else s
    return h - sr * v_th if v_reset is None else sr * v_reset + (1.0 - sr) * h


def _run_sj(node, x, g, gv):
    sj_functional.reset_net(node)
    xs = x.clone().requires_grad_()
    s = node(xs)
    ((s * g).sum() + (node.v_seq * gv).sum()).backward()
    return s.detach(), node.v_seq.detach(), xs.grad


def _run_ours(x, g, gv, v_th, v_reset, detach_reset, **kw):
    xs = x.clone().requires_grad_()
    s, h = kw.pop("fn")(xs, v_threshold=v_th, v_reset=v_reset, detach_reset=detach_reset, **kw)
    v = _post_reset(s, h, v_th, v_reset, detach_reset)
    ((s * g).sum() + (v * gv).sum()).backward()
    return s.detach(), v.detach(), xs.grad


def _reference(x, **kw):
    return K.lif_reference(x, **kw)


def _op_loop(x, **kw):
    return K.lif(x, backend="loop", return_membrane=True, **kw)


@needs_spikingjelly
@pytest.mark.parametrize("v_reset,detach_reset,decay_input,surrogate", COMBOS)
def test_lif_matches_spikingjelly(v_reset, detach_reset, decay_input, surrogate):
    sg_name, alpha = SJ_SURROGATES[surrogate]
    sg_cls = getattr(sj_surrogate, sg_name)
    tau, v_th = 3.0, 0.8
    x, g, gv = _input(), _input(seed=1), _input(seed=2)
    node = sj_neuron.LIFNode(
        tau=tau, decay_input=decay_input, v_threshold=v_th, v_reset=v_reset,
        surrogate_function=sg_cls(alpha=alpha), detach_reset=detach_reset, step_mode="m", store_v_seq=True,
    )
    s_sj, v_sj, gx_sj = _run_sj(node, x, g, gv)
    assert 0 < s_sj.mean() < 1, "input should make some but not all neurons spike"
    for fn in (_reference, _op_loop):
        s, v, gx = _run_ours(x, g, gv, v_th, v_reset, detach_reset, fn=fn, tau=tau,
                             decay_input=decay_input, surrogate=surrogate, alpha=alpha)
        assert torch.equal(s, s_sj), fn.__name__
        torch.testing.assert_close(v, v_sj, rtol=0, atol=1e-5)
        torch.testing.assert_close(gx, gx_sj, rtol=0, atol=1e-5)


@needs_spikingjelly
@pytest.mark.parametrize("v_reset,detach_reset,decay_input,surrogate", COMBOS)
def test_plif_matches_spikingjelly(v_reset, detach_reset, decay_input, surrogate):
    sg_name, alpha = SJ_SURROGATES[surrogate]
    sg_cls = getattr(sj_surrogate, sg_name)
    x, g = _input(seed=3), _input(seed=4)
    node = sj_neuron.ParametricLIFNode(
        init_tau=2.5, decay_input=decay_input, v_threshold=1.0, v_reset=v_reset,
        surrogate_function=sg_cls(alpha=alpha), detach_reset=detach_reset, step_mode="m",
    )
    xs = x.clone().requires_grad_()
    s_sj = node(xs)
    (s_sj * g).sum().backward()
    for impl in ("torch", "loop"):
        w = torch.nn.Parameter(torch.tensor(-math.log(2.5 - 1.0)))
        assert torch.equal(w.detach(), node.w.detach())
        xo = x.clone().requires_grad_()
        kw = dict(v_threshold=1.0, v_reset=v_reset, detach_reset=detach_reset, decay_input=decay_input,
                  surrogate=surrogate, alpha=alpha, rate=w.sigmoid())
        s = K.lif(xo, backend=impl, **kw)
        (s * g).sum().backward()
        assert torch.equal(s.detach(), s_sj.detach())
        torch.testing.assert_close(xo.grad, xs.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(w.grad, node.w.grad, rtol=1e-5, atol=1e-5)


@needs_cxx
def test_compiled_cpu_path_matches_reference():
    """The `auto` CPU path (inductor-compiled fused loop inside the custom op), Spikformer's config."""
    x, g, gm = _input((4, 2, 5, 7), seed=5), _input((4, 2, 5, 7), seed=6), _input((4, 2, 5, 7), seed=7)
    outs = []
    for backend in ("torch", "compile"):
        xs = x.clone().requires_grad_()
        s, h = K.lif(xs, return_membrane=True, backend=backend)
        ((s * g).sum() + (h * gm).sum()).backward()
        outs.append((s.detach(), h.detach(), xs.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # inductor may contract the surrogate's arithmetic into FMAs or vectorize it otherwise: an ulp
    torch.testing.assert_close(outs[1][2], outs[0][2], rtol=1e-6, atol=1e-6)
    cpu = torch.device("cpu")
    assert K.resolve_backend("auto", cpu) == "compile" == K.resolve_backend("auto", cpu, K.COMPILE_MIN_NUMEL)
    assert K.resolve_backend("auto", cpu, K.COMPILE_MIN_NUMEL - 1) == "loop"  # small: no compile wait


def test_op_saves_only_fp32_membrane():
    x = _input((5, 4, 6)).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        K.lif(x, impl="loop", return_membrane=True)
    big = [t for t in saved if t.numel() > 1]
    assert len(big) == 1 and big[0].dtype == torch.float32 and big[0].shape == (5, 24)
    assert big[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compute_in_fp32(dtype):
    x = _input((4, 3, 5), dtype=dtype)
    xo = x.clone().requires_grad_()
    s, h = K.lif(xo, impl="loop", detach_reset=False, return_membrane=True)
    s.float().sum().backward()
    assert s.dtype == dtype and h.dtype == torch.float32 and xo.grad.dtype == dtype
    xr = x.float().requires_grad_()
    s_ref, h_ref = K.lif_reference(xr, detach_reset=False)
    s_ref.sum().backward()
    assert torch.equal(s.float(), s_ref) and torch.equal(h, h_ref)
    # both are fp32 gradients rounded to `dtype`; the fused loop's and the reference's fp32 sums may
    # differ in the last bit and round to neighbouring half values: 1 ulp of `dtype` (eps relative,
    # and the subnormal step near zero)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(xo.grad.float(), xr.grad.to(dtype).float(), rtol=eps, atol=torch.finfo(dtype).tiny * eps)


def test_spike_dtype_option():
    s = K.lif(_input((3, 4)), spike_dtype=torch.bool, backend="torch")
    s2 = K.lif(_input((3, 4)), spike_dtype=torch.bool, impl="loop", return_membrane=True)[0]
    assert s.dtype == torch.bool and torch.equal(s, s2)


def test_opcheck_custom_op():
    x = _input((3, 5)).requires_grad_()
    args = (x, None, 2.0, 1.0, 0.0, K.CHARGE_DECAY_INPUT, 0, 4.0, False, torch.float32, "loop")
    torch.library.opcheck(torch.ops.efficient.lif_forward.default, args)
    w = torch.tensor(0.2, requires_grad=True)
    args = (x, w, 2.0, 1.0, None, K.CHARGE_NO_DECAY, 1, 2.0, True, torch.float32, "loop")
    torch.library.opcheck(torch.ops.efficient.lif_forward.default, args)


def test_flop_formula_registered():
    from torch.utils.flop_counter import FlopCounterMode

    x = _input((4, 10)).requires_grad_()
    with FlopCounterMode(display=False) as counter:
        K.lif(x, impl="loop", return_membrane=True)[0].sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.efficient.lif_forward] == 6 * 40
    assert counts[torch.ops.efficient.lif_backward] == 13 * 40


# ---- gradcheck of the reference (float64) -----------------------------------------------------


@pytest.mark.parametrize("v_reset,decay_input", [(0.0, True), (None, False), (0.2, False)])
def test_reference_gradcheck_membrane(v_reset, decay_input):
    """With a detached reset, H is a piecewise-affine function of x: finite differences apply."""
    x = _input((4, 2, 3), seed=8).double().requires_grad_()
    rate = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)

    def h_of(x, rate):
        return K.lif_reference(x, v_threshold=0.7, v_reset=v_reset, detach_reset=True,
                               decay_input=decay_input, rate=rate)[1]

    assert torch.autograd.gradcheck(h_of, (x, rate), eps=1e-7, atol=1e-6)
    assert torch.autograd.gradcheck(lambda x: K.lif_reference(x, 3.0, leak=None, v_reset=v_reset)[1], (x,), eps=1e-7)


@pytest.mark.parametrize("surrogate,alpha", [("sigmoid", 4.0), ("atan", 2.0), ("triangle", 1.5), ("ste", 1.5)])
def test_surrogate_is_derivative_of_its_primitive(surrogate, alpha):
    u = torch.linspace(-2, 2, 101, dtype=torch.float64).requires_grad_()
    primitive = {
        "sigmoid": lambda u: torch.sigmoid(alpha * u),
        "atan": lambda u: torch.atan(math.pi / 2 * alpha * u) / math.pi + 0.5,
        "triangle": lambda u: torch.where(
            u.abs() > 1 / alpha, (u > 0).double(),
            torch.where(u <= 0, (alpha * u + 1) ** 2 / 2, 1 - (alpha * u - 1) ** 2 / 2)),
        "ste": lambda u: alpha * u,  # straight-through: the identity's slope, scaled
    }[surrogate]
    (grad,) = torch.autograd.grad(primitive(u).sum(), u)
    torch.testing.assert_close(K.surrogate_grad(u.detach(), K.SURROGATES[surrogate], alpha), grad)


@needs_spikingjelly
@pytest.mark.parametrize("surrogate", sorted(SJ_SURROGATES))
def test_default_alpha_is_spikingjellys_default(surrogate):
    """Without alpha, each surrogate is spikingjelly's class at its own default alpha."""
    sg_cls = getattr(sj_surrogate, SJ_SURROGATES[surrogate][0])
    assert K.SURROGATE_ALPHA[surrogate] == inspect.signature(sg_cls).parameters["alpha"].default
    u = torch.linspace(-2, 2, 401).requires_grad_()
    sg_cls()(u).sum().backward()  # spikingjelly's surrogate, default alpha
    ours = K.surrogate_grad(u.detach(), K.SURROGATES[surrogate], K.default_alpha(surrogate))
    torch.testing.assert_close(ours, u.grad, rtol=1e-6, atol=1e-7)


@needs_spikingjelly
@pytest.mark.parametrize("surrogate", sorted(SJ_SURROGATES))
def test_lif_without_alpha_matches_spikingjelly_default_surrogate(surrogate):
    sg_cls = getattr(sj_surrogate, SJ_SURROGATES[surrogate][0])
    x, g, gv = _input(seed=11), _input(seed=12), _input(seed=13)
    node = sj_neuron.LIFNode(tau=2.0, v_threshold=1.0, v_reset=0.0, surrogate_function=sg_cls(),
                             detach_reset=False, step_mode="m", store_v_seq=True)
    s_sj, v_sj, gx_sj = _run_sj(node, x, g, gv)
    for fn in (_reference, _op_loop):  # no alpha given
        s, v, gx = _run_ours(x, g, gv, 1.0, 0.0, False, fn=fn, surrogate=surrogate)
        assert torch.equal(s, s_sj), fn.__name__
        torch.testing.assert_close(gx, gx_sj, rtol=0, atol=1e-5)


def test_straight_through_estimator_matches_reference_through_resets():
    """The ste surrogate (no spikingjelly twin) gives the reference loop's gradients in the fused op,
    and differs from the triangle's on an input that spikes."""
    x, g, gv = _input(seed=21), _input(seed=22), _input(seed=23)
    ref = _run_ours(x, g, gv, 1.0, 0.0, False, fn=_reference, surrogate="ste", leak=0.9)
    op = _run_ours(x, g, gv, 1.0, 0.0, False, fn=_op_loop, surrogate="ste", leak=0.9)
    tri = _run_ours(x, g, gv, 1.0, 0.0, False, fn=_op_loop, surrogate="triangle", leak=0.9)
    assert ref[0].sum() > 0 and torch.equal(ref[0], op[0])
    torch.testing.assert_close(op[2], ref[2], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(op[2], tri[2])


def test_explicit_alpha_still_wins():
    x = _input((4, 3, 5), seed=14)
    grads = {}
    for alpha in (None, 2.0, 4.0):
        xs = x.clone().requires_grad_()
        K.lif(xs, surrogate="atan", alpha=alpha, backend="loop").sum().backward()
        grads[alpha] = xs.grad
    assert torch.equal(grads[None], grads[2.0]) and not torch.allclose(grads[2.0], grads[4.0])
    with pytest.raises(ValueError, match="surrogate"):
        K.default_alpha("gaussian")


# ---- semantics --------------------------------------------------------------------------------


def test_spike_at_equality_and_zero_state_each_call():
    x = torch.tensor([[2.0], [0.0], [2.0]])  # tau=2, hard reset: H = 1.0 (== v_th) -> spike
    s, h = K.lif(x, return_membrane=True, backend="torch")
    assert s.flatten().tolist() == [1.0, 0.0, 1.0] and h.flatten().tolist() == [1.0, 0.0, 1.0]
    s2 = K.lif(x, impl="loop", return_membrane=True)[0]
    assert torch.equal(s, s2)


def test_gradient_through_membrane_output():
    x = _input((5, 3), seed=9)
    gm = _input((5, 3), seed=10)
    outs = []
    for fn in (
        lambda x: K.lif_reference(x, detach_reset=False),
        lambda x: K.lif(x, detach_reset=False, impl="loop", return_membrane=True),
    ):
        xs = x.clone().requires_grad_()
        s, h = fn(xs)
        ((h * gm).sum() + s.sum()).backward()
        outs.append(xs.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


def test_env_overrides_auto(monkeypatch):
    monkeypatch.setenv("EFFICIENT_BACKEND", "torch")
    assert K.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert K.resolve_backend("compile", torch.device("cpu")) == "compile"
    monkeypatch.setenv("EFFICIENT_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="EFFICIENT_BACKEND"):
        K.resolve_backend("auto", torch.device("cpu"))


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x,match",
    [
        (torch.randn(5), "at least 2 dims"),
        (torch.randn(()), "at least 2 dims"),
        (torch.randn(0, 3), "T=0"),
        (torch.ones(3, 4, dtype=torch.int64), "floating point"),
        (torch.ones(3, 4, dtype=torch.bool), "floating point"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "compile"])
def test_bad_input_raises_clear_error(x, match, backend):
    with pytest.raises(ValueError, match=match):
        K.lif(x, backend=backend)


def test_bad_options_raise():
    x = _input((3, 4))
    with pytest.raises(ValueError, match="surrogate"):
        K.lif(x, surrogate="gaussian")
    with pytest.raises(ValueError, match="backend"):
        K.lif(x, backend="cuda")
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        K.lif(x, impl="triton", return_membrane=True)
    with pytest.raises(ValueError, match="rate"):
        K.lif(x, rate=torch.ones(2))


def test_strided_input_reaches_the_op_and_matches_reference(monkeypatch):
    """A transposed [T, N] goes into the custom op without a copy on the way, and the op gives the
    reference's spikes, H and gradients (the Triton kernel's version is in test_lif_triton.py)."""
    seen = []
    real_check = K._check_op_args
    monkeypatch.setattr(K, "_check_op_args", lambda x, *a: (seen.append(x.is_contiguous()), real_check(x, *a)))
    x = _input((35, 5), seed=4).t()  # [5, 35], strides (1, 5)
    g, gm = _input((5, 35), seed=1), _input((5, 35), seed=2)
    kw = dict(v_reset=None, detach_reset=False, surrogate="atan", alpha=2.0)
    out = []
    for fn in (lambda xs: K.lif_reference(xs, **kw), lambda xs: K.lif(xs, impl="loop", return_membrane=True, **kw)):
        xs = x.detach().clone().requires_grad_()
        assert not xs.is_contiguous()
        s, h = fn(xs)
        ((s * g).sum() + (h * gm).sum()).backward()
        out.append((s.detach(), h.detach(), xs.grad))
    assert seen == [False], "the op should have been called once, with the strided tensor"
    (s0, h0, gx0), (s1, h1, gx1) = out
    assert 0 < s0.mean() < 1
    assert torch.equal(s0, s1)
    torch.testing.assert_close(h1, h0, rtol=0, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-6, atol=1e-6)


def test_op_called_directly_with_bad_shape_raises():
    with pytest.raises(ValueError, match=r"floating \[T>=1, N\]"):
        torch.ops.efficient.lif_forward(torch.randn(2, 3, 4), None, 2.0, 1.0, 0.0, 0, 0, 4.0, True, torch.float32, "loop")
    with pytest.raises(ValueError, match="unknown impl"):
        torch.ops.efficient.lif_forward(torch.randn(2, 3), None, 2.0, 1.0, 0.0, 0, 0, 4.0, True, torch.float32, "cuda")


def test_nan_input_documented_behaviour():
    x = _input((4, 3))
    x[1, 0] = float("nan")
    for s, h in (K.lif(x, return_membrane=True, backend="torch"), K.lif(x, impl="loop", return_membrane=True)):
        assert s[1:, 0].eq(0).all(), "a NaN membrane never fires"
        assert h[1:, 0].isnan().all(), "and stays NaN (no spike, so no reset)"
        assert not h[:, 1:].isnan().any(), "other neurons are unaffected"
    with pytest.raises(ValueError, match=r"NaN/inf values at time steps \[1\]"):
        K.lif(x, check_finite=True)


def test_empty_neuron_dims_return_empty():
    x = torch.randn(3, 0, 4)
    assert K.lif(x).shape == (3, 0, 4)


# --- initial membrane (stateful callers) and snntorch's update order -------------------------


@pytest.mark.parametrize("impl", ["loop", "torch"])
@pytest.mark.parametrize("kw", [dict(v_reset=0.0, detach_reset=False), dict(v_reset=None, decay_input=False),
                                dict(leak=1.0, v_reset=0.0)], ids=["hard", "soft-nodecay", "if"])
def test_v_init_matches_two_calls_of_the_reference(impl, kw):
    """Starting from v_init equals continuing one long run: spikes of [T1+T2] == first T1 then T2 from V."""
    torch.manual_seed(0)
    x = (torch.randn(7, 3, 5) + 0.5).requires_grad_()
    s_all, h_all = K.lif_reference(x, **kw)
    s1, h1 = K.lif_reference(x[:3], **kw)
    sr = s1[-1].detach() if kw.get("detach_reset", True) else s1[-1]
    v = sr * kw["v_reset"] + (1.0 - sr) * h1[-1] if kw["v_reset"] is not None else h1[-1] - sr * 1.0
    backend = dict(backend="torch") if impl == "torch" else dict(impl=impl)
    s2, h2 = K.lif(x[3:], v_init=v, return_membrane=True, **kw, **backend)
    assert torch.equal(torch.cat([s1, s2]), s_all) and torch.equal(torch.cat([h1, h2]), h_all)
    g = torch.randn_like(s_all)
    (gx_ref,) = torch.autograd.grad((s_all * g).sum(), x)
    (gx,) = torch.autograd.grad((torch.cat([s1, s2]) * g).sum(), x)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta_shape", ["per_neuron", "shared"])
@pytest.mark.parametrize("reset", ["subtract", "zero", "none"])
@pytest.mark.parametrize("impl", ["loop", pytest.param("inductor", marks=needs_cxx)])
def test_leaky_matches_snntorch(reset, impl, beta_shape):
    """The snntorch order against snntorch's own Leaky stepped in Python: equal spikes and membrane,
    gradients of input, initial membrane, beta (per neuron, or one value the kernel broadcasts and
    whose gradient it sums) and threshold (one value) within 1e-5."""
    snn = pytest.importorskip("snntorch")
    torch.manual_seed(0)
    T, B, F = 6, 3, 10
    x = (torch.randn(T, B, F) * 1.2 + 0.5).requires_grad_()
    mem0 = (torch.randn(B, F) * 0.5).requires_grad_()
    beta = torch.rand(F) if beta_shape == "per_neuron" else torch.tensor(0.7)
    n = snn.Leaky(beta=beta, threshold=torch.tensor(0.8), learn_beta=True, learn_threshold=True,
                  reset_mechanism=reset)
    mem, spk, mems = mem0, [], []
    for t in range(T):
        s, mem = n(x[t], mem)
        spk.append(s)
        mems.append(mem)
    S, M = torch.stack(spk), torch.stack(mems)
    g1, g2 = torch.randn_like(S), torch.randn_like(M)
    ref = torch.autograd.grad((S * g1 + M * g2).sum(), (x, mem0, n.beta, n.threshold))
    s2, m2 = K.leaky(x, n.beta.clamp(0, 1), n.threshold, reset, mem=mem0, impl=impl, return_membrane=True)
    got = torch.autograd.grad((s2 * g1 + m2 * g2).sum(), (x, mem0, n.beta, n.threshold))
    assert torch.equal(S, s2) and torch.equal(M, m2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_lif_order_snntorch_is_leaky():
    x = torch.randn(5, 2, 4) + 0.6
    assert torch.equal(K.lif(x, leak=0.9, v_reset=None, order="snntorch", impl="loop"),
                       K.leaky(x, 0.9, 1.0, "subtract", impl="loop"))
    with pytest.raises(ValueError, match="order='snntorch'"):
        K.lif(x, tau=2.0, order="snntorch")
    with pytest.raises(ValueError, match="unknown order"):
        K.lif(x, order="brian")
    with pytest.raises(ValueError, match="reset_mechanism"):
        K.leaky(x, 0.9, reset_mechanism="hard")
    with pytest.raises(ValueError, match="does not broadcast"):
        K.leaky(x, torch.ones(3), impl="loop")


@pytest.mark.parametrize("impl", ["loop", pytest.param("inductor", marks=needs_cxx)])
@pytest.mark.parametrize("reset", ["subtract", "zero"])
def test_leaky_eager_path_equals_the_custom_op(reset, impl):
    """On CPU `leaky` skips the op's dispatch (K._EagerLeaky); it must give the op's spikes, membrane and
    gradients bit for bit, per-neuron beta and an initial membrane included."""
    torch.manual_seed(0)
    T, N = 6, 40
    x = (torch.randn(T, N) + 0.6).requires_grad_()
    beta = torch.rand(N).mul(0.5).add(0.4).requires_grad_()
    thr = torch.full((N,), 0.9).requires_grad_()
    m0 = torch.rand(N)
    args = (K.RESETS[reset], K._surrogate_id("atan"), 2.0, torch.float32, impl)
    s1, m1 = K._EagerLeaky.apply(x, m0, beta, thr, *args)
    g1 = torch.autograd.grad((s1 * torch.linspace(0, 1, N)).sum() + m1.pow(2).sum(), (x, beta, thr))
    s2, m2 = torch.ops.efficient.leaky_forward(x, m0, beta, thr, *args)
    g2 = torch.autograd.grad((s2 * torch.linspace(0, 1, N)).sum() + m2.pow(2).sum(), (x, beta, thr))
    assert s1.sum() > 0 and (s1 == 0).any()
    assert torch.equal(s1, s2) and torch.equal(m1, m2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["loop", pytest.param("inductor", marks=needs_cxx)])
@pytest.mark.parametrize("case", ["lif", "plif-soft", "v0"])
def test_lif_eager_path_equals_the_custom_op(case, impl):
    """Eager `lif` skips the op's dispatch (K._EagerLIF); spikes, membrane and every gradient must be
    the op's, bit for bit: PLIF's rate, soft reset and an initial membrane included."""
    torch.manual_seed(0)
    x = (torch.randn(6, 40) + 0.6).requires_grad_()
    rate = torch.tensor(0.4, requires_grad=True) if case == "plif-soft" else None
    v0 = torch.rand(40, requires_grad=True) if case == "v0" else None
    charge = K.CHARGE_NO_DECAY if case == "plif-soft" else K.CHARGE_DECAY_INPUT
    args = (x, rate, 2.0, 1.0, None if case == "plif-soft" else 0.0, charge, K._surrogate_id("atan"), 2.0, True,
            torch.float32, impl, v0)
    wrt = [t for t in (x, rate, v0) if t is not None]
    outs = []
    for fn in (K._EagerLIF.apply, torch.ops.efficient.lif_forward):
        s, h = fn(*args)
        outs.append((s, h, torch.autograd.grad((s * torch.linspace(0, 1, 40)).sum() + h.pow(2).sum(), wrt)))
    (s1, h1, g1), (s2, h2, g2) = outs
    assert s1.sum() > 0 and (s1 == 0).any()
    assert torch.equal(s1, s2) and torch.equal(h1, h2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@needs_cxx
@pytest.mark.parametrize("case", ["hard-detach-sigmoid", "leak-soft-atan-v0-gm"])
def test_the_compiled_backward_runs_step_by_step_over_h(case):
    """The compiled CPU backward (`impl="inductor"`) runs one fused loop per step: grad x (and v0's) equal
    the eager loop's to rounding; given H to overwrite it writes grad x into H's storage and holds no
    tensor of H's size besides (two steps' carries; the all-T formulation held three), and otherwise
    leaves H as it was."""
    from efficient.memory.measure import step_peak_bytes

    # Spikformer's neuron, and every other branch at once: DLIF's leak, soft reset through the reset's
    # gradient, atan, an initial membrane and a gradient of H
    hard = detach = case == "hard-detach-sigmoid"
    surrogate = K._surrogate_id("sigmoid" if hard else "atan")
    charge = K.CHARGE_DECAY_INPUT if hard else K.CHARGE_LEAK
    g = torch.Generator().manual_seed(5)
    T, N = 5, 4096
    h = torch.randn(T, N, generator=g) * 0.8 + 0.7
    gs = torch.randn(T, N, generator=g)
    gm = None if hard else torch.randn(T, N, generator=g)
    v0 = None if hard else torch.randn(N, generator=g)
    args = (gs, gm, h, None, 0.9 if charge == K.CHARGE_LEAK else 2.0, 1.0, 0.0 if hard else None, charge, surrogate,
            4.0, detach, torch.float32)
    ref = K._run_backward(*args, "loop", v0)
    h0 = h.clone()
    kept = K._run_backward(*args, "inductor", v0)
    assert torch.equal(h, h0)  # not overwritten unless given up
    over = K._run_backward(*args, "inductor", v0, overwrite=True)
    assert over[0].data_ptr() == h.data_ptr()
    for a, b, c in zip(ref, kept, over):
        if a is None:
            assert b is None and c is None
            continue
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        assert torch.equal(b, c)
    h = h0.clone()
    peak_over = step_peak_bytes(lambda: K._run_backward(*args[:2], h, *args[3:], "inductor", v0, overwrite=True))
    peak_kept = step_peak_bytes(lambda: K._run_backward(*args, "inductor", v0))
    assert peak_over < h.nbytes <= peak_kept < 2 * h.nbytes, (peak_over, peak_kept, h.nbytes)


@needs_cxx
@pytest.mark.parametrize("case", ["decay-hard-zero-reset", "leak-soft-v0", "no-decay-hard-reset-bf16"])
def test_the_compiled_forward_runs_step_by_step_over_its_input(case, monkeypatch):
    """Where it makes H, the compiled CPU forward runs one fused loop per step: spikes and H equal the all-T
    loop's bit for bit; given x to overwrite it writes H into x's storage and holds no tensor of x's size
    beside the spikes (two steps' membranes), and otherwise leaves x as it was."""
    from efficient.memory.measure import step_peak_bytes

    monkeypatch.setattr(K, "STEPWISE_FORWARD_MIN", 1)
    charge, v_reset, v0, dtype = {
        "decay-hard-zero-reset": (K.CHARGE_DECAY_INPUT, 0.0, False, torch.float32),  # Spikformer's, from rest
        "leak-soft-v0": (K.CHARGE_LEAK, None, True, torch.float32),
        "no-decay-hard-reset-bf16": (0, 0.3, False, torch.bfloat16),  # spikes in bf16
    }[case]
    g = torch.Generator().manual_seed(9)
    T, N = 4, 4096
    x = torch.randn(T, N, generator=g) * 1.5 + 0.3
    v0 = torch.randn(N, generator=g) * 0.5 if v0 else None
    args = (None, 0.9 if charge == K.CHARGE_LEAK else 2.0, 1.0, v_reset, charge, dtype, "inductor")
    monkeypatch.setattr(K, "STEPWISE_FORWARD", False)
    ref = K._run_forward(x, *args, v0)
    monkeypatch.setattr(K, "STEPWISE_FORWARD", True)
    x0 = x.clone()
    kept = K._run_forward(x, *args, v0)
    assert torch.equal(x, x0)  # not overwritten unless given up
    over = K._run_forward(x, *args, v0, over=True)
    assert over[1].data_ptr() == x.data_ptr() and over[0].dtype == dtype
    for a, b, c in zip(ref, kept, over):
        assert torch.equal(a, b) and torch.equal(a, c)
    x = x0.clone()
    spikes = x.numel() * dtype.itemsize
    peak_over = step_peak_bytes(lambda: K._run_forward(x, *args, v0, over=True))
    peak_kept = step_peak_bytes(lambda: K._run_forward(x0, *args, v0))
    assert peak_over <= spikes + 0.5 * x.nbytes < x.nbytes + spikes <= peak_kept, (peak_over, peak_kept, x.nbytes)


@needs_cxx
def test_the_eager_lif_writes_over_its_membrane_only_when_nobody_holds_it():
    """Eager `lif` with the compiled loop gives H's storage to grad x when the caller dropped H and no
    later backward reads it (a smaller peak); a caller holding H (`return_membrane`) or keeping the
    graph finds H unchanged. Gradients bit for bit the same every way."""
    from efficient.memory.measure import step_peak_bytes

    x0 = torch.randn(4, 4096, generator=torch.Generator().manual_seed(8)) + 0.6
    g = torch.randn(4, 4096, generator=torch.Generator().manual_seed(9))
    res = {}

    def run(name, membrane=False, retain=False):
        x = x0.clone().requires_grad_()

        def step():
            out = K.lif(x, impl="inductor", return_membrane=membrane)
            s, h = out if membrane else (out, None)
            before = h.detach().clone() if membrane else None
            (s * g).sum().backward(retain_graph=retain)
            if membrane:
                assert torch.equal(h, before)
            res[name] = x.grad.clone()

        return step_peak_bytes(step)

    peak_over = run("over")
    peak_held = run("held", membrane=True)
    peak_kept = run("kept", retain=True)
    assert torch.equal(res["over"], res["held"]) and torch.equal(res["over"], res["kept"])
    assert peak_kept - peak_over >= 0.9 * x0.nbytes, (peak_over, peak_kept)


def test_lif_runs_the_op_only_where_something_observes_it():
    """Plain eager calls take the direct path; a dispatch mode (FLOP counters, FakeTensor) or a
    torch-function mode (memory's spike tracking) sees the custom op."""
    from torch.overrides import TorchFunctionMode
    from torch.utils.flop_counter import FlopCounterMode

    x = _input((4, 10)).requires_grad_()

    def node(out):  # the autograd node under lif's reshape
        return type(out.grad_fn.next_functions[0][0]).__name__

    assert node(K.lif(x, impl="loop")) == "_EagerLIFBackward"
    assert node(K.leaky(x, 0.9, impl="loop")) == "_EagerLeakyBackward"
    with FlopCounterMode(display=False):
        assert "Eager" not in node(K.lif(x, impl="loop"))
    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert "Eager" not in node(K.leaky(x, 0.9, impl="loop"))
        assert "Eager" not in node(K.lif(x, impl="loop"))
