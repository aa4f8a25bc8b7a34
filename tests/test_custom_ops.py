"""Every custom op in the `efficient` namespace passes `torch.library.opcheck` on CPU (schema, fake
tensor, autograd registration, AOT dispatch), and its fake (meta) implementation returns the dtypes
and shapes of the real one for fp32 / fp16 / bf16 inputs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import efficient.kernels.exit_confidence  # noqa: F401 - registers the ops
import efficient.kernels.linear_ce  # noqa: F401
import efficient.kernels.spike_pack  # noqa: F401
import efficient.kernels.ssa  # noqa: F401
from efficient.kernels import bn_lif  # noqa: F401 - registers efficient::bn_lif_*
from efficient.kernels import lif as K
from efficient.kernels import token_select as ts
from efficient.kernels.pool_offsets import max_pool_offsets
from efficient.kernels.spike_pack import pack_spikes
from efficient.memory import conv_backward  # noqa: F401 - registers efficient::conv2d_backward_from_bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
POOL = ([3, 3], [2, 2], [1, 1], [1, 1], False)  # the SPS stem's MaxPool2d(3, 2, 1) as aten's arguments


def _spikes(*shape, dtype, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) < 0.3).to(dtype).requires_grad_(grad)


def _randn(*shape, dtype, seed, grad=False, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(grad)


def op_cases(dtype):
    """(id, op, args) for every op; small shapes, the CPU (torch) path."""
    q, k, v = (_spikes(2, 1, 2, 9, 8, dtype=dtype, seed=i) for i in range(3))
    qm, km, vm = (_spikes(2, 1, 9, 16, dtype=dtype, seed=60 + i) for i in range(3))
    qkv = _spikes(2, 1, 9, 48, dtype=dtype, seed=63)
    idx = torch.tensor([[0, 3, 3, 8], [1, 2, 5, 7]])
    h = _randn(6, 8, dtype=dtype, seed=3, grad=True, scale=0.3)
    w = _randn(10, 8, dtype=dtype, seed=4, grad=True)
    t = torch.tensor([1, 9, -100, 0, 4, 4])
    x = _randn(3, 5, dtype=dtype, seed=5, grad=True, scale=2.0)
    hm = _randn(3, 5, dtype=torch.float32, seed=6, scale=2.0)
    gs = _randn(3, 5, dtype=dtype, seed=7)
    rate = torch.tensor(0.3, requires_grad=True)
    v0 = _randn(5, dtype=torch.float32, seed=11, grad=True, scale=0.5)
    beta = torch.linspace(0.2, 0.9, 5).requires_grad_()
    thr = torch.full((5,), 0.8, requires_grad=True)
    return [
        ("ssa-scores-anchor", torch.ops.efficient.ssa, (q, k, v, 0.125, True, True, "torch")),
        ("ssa-scores", torch.ops.efficient.ssa, (q, k, v, 0.125, False, True, "torch")),
        ("ssa-no-scores", torch.ops.efficient.ssa, (q, k, v, 0.125, False, False, "torch")),
        # heads split off a [T, B, N, H, d] projection: q non-contiguous, as the Spikformer's fused QKV gives it
        ("ssa-strided-q", torch.ops.efficient.ssa, (q.detach().transpose(2, 3).contiguous().transpose(2, 3).requires_grad_(q.requires_grad),
                                                   k, v, 0.125, True, True, "torch")),
        # the attention as one unit: Q, K, V with their heads merged, [T, B, N, H d]; the strided case as
        # the fused QKV unit gives them (three slices of one [T, B, N, 3 H d] tensor)
        ("ssa_unit-scores-anchor", torch.ops.efficient.ssa_unit, (qm, km, vm, 2, 0.125, True, True, "torch")),
        ("ssa_unit-no-scores", torch.ops.efficient.ssa_unit, (qm, km, vm, 2, 0.125, False, False, "torch")),
        ("ssa_unit-fused-qkv", torch.ops.efficient.ssa_unit, (*qkv.split(16, -1), 4, 0.125, False, True, "torch")),
        ("ssa_unit_backward-scores", torch.ops.efficient.ssa_unit_backward,
         (_randn(2, 1, 9, 16, dtype=dtype, seed=52), _randn(2, 1, 8, dtype=dtype, seed=53),
          _randn(2, 1, 8, dtype=dtype, seed=54), qm.detach(), km.detach(), vm.detach(), 2, 0.125, True, "torch")),
        ("ssa_unit_backward-no-scores", torch.ops.efficient.ssa_unit_backward,
         (_randn(2, 1, 9, 16, dtype=dtype, seed=52), None, None, *qkv.detach().split(16, -1), 2, 0.125, False,
          "torch")),
        ("ssa_backward", torch.ops.efficient.ssa_backward,
         (_randn(2, 1, 2, 9, 8, dtype=dtype, seed=55), q.detach(), k.detach(), v.detach(), 0.125, "torch")),
        ("stata_select", torch.ops.efficient.stata_select, (_randn(2, 2, 9, dtype=dtype, seed=8), 4, 1e-6, True, "torch")),
        ("token_gather", torch.ops.efficient.token_gather, (_randn(2, 2, 9, 4, dtype=dtype, seed=9, grad=True), idx, "torch")),
        ("token_scatter", torch.ops.efficient.token_scatter, (_randn(2, 2, 4, 4, dtype=dtype, seed=10, grad=True), idx, 9, "torch")),
        ("linear_ce", torch.ops.efficient.linear_ce, (h, w, t, -100, False, 4, "torch", True)),
        ("linear_ce-conf-no-grad", torch.ops.efficient.linear_ce,
         (h.detach(), w.detach(), t, -100, True, 5, "torch", False)),
        ("exit_confidence", torch.ops.efficient.exit_confidence, (h.detach(), w.detach(), "torch")),
        ("lif_forward", torch.ops.efficient.lif_forward,
         (x, None, 2.0, 1.0, 0.0, K.CHARGE_DECAY_INPUT, 0, 4.0, False, dtype, "loop")),
        ("lif_forward-plif", torch.ops.efficient.lif_forward,
         (x, rate, 2.0, 1.0, None, K.CHARGE_NO_DECAY, 1, 2.0, True, torch.float16, "loop")),
        ("lif_backward", torch.ops.efficient.lif_backward,
         (gs, None, hm, None, 2.0, 1.0, 0.0, K.CHARGE_DECAY_INPUT, 0, 4.0, False, dtype, "loop")),
        ("lif_forward-v0", torch.ops.efficient.lif_forward,
         (x, None, 2.0, 1.0, 0.0, K.CHARGE_DECAY_INPUT, 0, 4.0, False, dtype, "loop", v0)),
        ("leaky_forward", torch.ops.efficient.leaky_forward,
         (x, v0, beta, thr, K.RESET_SUBTRACT, 1, 2.0, dtype, "loop")),
        ("leaky_backward", torch.ops.efficient.leaky_backward,
         (gs, None, hm, None, beta.detach(), thr.detach(), K.RESET_ZERO, 0, 4.0, dtype, "loop")),
        # BatchNorm + LIF on a conv unit's [T*B, C, H, W] (T=2), training and eval
        ("bn_lif_forward", torch.ops.efficient.bn_lif_forward,
         (_randn(4, 3, 2, 2, dtype=dtype, seed=13, grad=True), 2, _randn(3, dtype=dtype, seed=14, grad=True),
          _randn(3, dtype=dtype, seed=15, grad=True), torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype), True, 0.1, 1e-5, 2.0, 1.0, 0.0,
          K.CHARGE_DECAY_INPUT, 0, 4.0, True, dtype, "loop")),
        # inside a recomputed region: H is not kept (an empty output), the backward rebuilds it
        ("bn_lif_forward-lean", torch.ops.efficient.bn_lif_forward,
         (_randn(4, 3, 2, 2, dtype=dtype, seed=13, grad=True), 2, _randn(3, dtype=dtype, seed=14, grad=True),
          _randn(3, dtype=dtype, seed=15, grad=True), torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype), True, 0.1, 1e-5, 2.0, 1.0, 0.0,
          K.CHARGE_DECAY_INPUT, 0, 4.0, True, dtype, "loop", False)),
        ("bn_lif_forward-eval", torch.ops.efficient.bn_lif_forward,
         (_randn(4, 3, dtype=dtype, seed=16, grad=True), 2, _randn(3, dtype=dtype, seed=17, grad=True),
          _randn(3, dtype=dtype, seed=18, grad=True), torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype), False, 0.1,
          1e-5, 2.0, 1.0, None,
          K.CHARGE_NO_DECAY, 1, 2.0, False, dtype, "loop")),
        ("bn_lif_backward", torch.ops.efficient.bn_lif_backward,
         (_randn(4, 3, dtype=dtype, seed=19), _randn(4, 3, dtype=dtype, seed=20), _randn(2, 6, dtype=torch.float32, seed=21),
          _randn(3, dtype=dtype, seed=22), torch.stack([torch.zeros(3), torch.ones(3)]).to(dtype), True, 1e-5, 2.0, 1.0, 0.0,
          K.CHARGE_DECAY_INPUT, 0, 4.0, True, "loop")),
        ("bn_lif_backward_recompute", torch.ops.efficient.bn_lif_backward_recompute,
         (_randn(4, 3, 2, 2, dtype=dtype, seed=34), _randn(4, 3, 2, 2, dtype=dtype, seed=35), 2,
          _randn(3, dtype=dtype, seed=36), _randn(3, dtype=dtype, seed=37),
          torch.stack([torch.zeros(3), torch.ones(3)]).to(dtype), True, 1e-5, 2.0, 1.0, 0.0, K.CHARGE_DECAY_INPUT, 0, 4.0,
          True, "loop")),
        # the whole Linear -> BatchNorm -> LIF unit: x [T*M, D_in] = [6, 5] (T=2), 4 channels
        ("linear_bn_lif_forward", torch.ops.efficient.linear_bn_lif_forward,
         (_randn(6, 5, dtype=dtype, seed=23, grad=True), _randn(4, 5, dtype=dtype, seed=24, grad=True),
          _randn(4, dtype=dtype, seed=25, grad=True), 2, _randn(4, dtype=dtype, seed=26, grad=True),
          _randn(4, dtype=dtype, seed=27, grad=True), torch.zeros(4, dtype=dtype), torch.ones(4, dtype=dtype), True, 0.1,
          1e-5, 2.0, 1.0, 0.0, K.CHARGE_DECAY_INPUT, 0, 4.0, True, dtype, "loop")),
        ("linear_bn_lif_backward", torch.ops.efficient.linear_bn_lif_backward,
         (_randn(6, 4, dtype=dtype, seed=28), _randn(6, 5, dtype=dtype, seed=29), _randn(4, 5, dtype=dtype, seed=30),
          _randn(6, 4, dtype=dtype, seed=31), _randn(2, 12, dtype=torch.float32, seed=32), _randn(4, dtype=dtype, seed=33),
          torch.stack([torch.zeros(4), torch.ones(4)]).to(dtype), True, 1e-5, 2.0, 1.0, 0.0, K.CHARGE_DECAY_INPUT, 0, 4.0,
          True, "loop")),
        # BatchNorm + LIF + the SPS stem's max-pool (3, 2, 1), a chunk of channels at a time: z [T*B, C, 4, 4], T=2
        ("bn_lif_max_pool_forward", torch.ops.efficient.bn_lif_max_pool_forward,
         (_randn(4, 3, 4, 4, dtype=dtype, seed=38, grad=True), 2, _randn(3, dtype=dtype, seed=39, grad=True),
          _randn(3, dtype=dtype, seed=40, grad=True), torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype), True, 0.1,
          1e-5, 2.0, 1.0, 0.0, K.CHARGE_DECAY_INPUT, 0, 4.0, True, dtype, "loop", *POOL)),
        ("bn_lif_max_pool_backward", torch.ops.efficient.bn_lif_max_pool_backward,
         (_randn(4, 3, 2, 2, dtype=dtype, seed=41), _randn(4, 3, 4, 4, dtype=dtype, seed=42), _randn(3, dtype=dtype, seed=43),
          _randn(3, dtype=dtype, seed=44), torch.stack([torch.zeros(3), torch.ones(3)]).to(dtype),
          max_pool_offsets(_spikes(4, 3, 4, 4, dtype=torch.float32, seed=45, grad=False), POOL)[1], 2, True, 1e-5, 2.0, 1.0,
          0.0, K.CHARGE_DECAY_INPUT, 0, 4.0, True, dtype, "loop", *POOL)),
        # the same backward writing z's gradient into z (a convolution's fresh output nothing else reads)
        ("bn_lif_max_pool_backward_into", torch.ops.efficient.bn_lif_max_pool_backward_into,
         (_randn(4, 3, 2, 2, dtype=dtype, seed=61), _randn(4, 3, 4, 4, dtype=dtype, seed=62), _randn(3, dtype=dtype, seed=63),
          _randn(3, dtype=dtype, seed=64), torch.stack([torch.zeros(3), torch.ones(3)]).to(dtype),
          max_pool_offsets(_spikes(4, 3, 4, 4, dtype=torch.float32, seed=65, grad=False), POOL)[1], 2, True, 1e-5, 2.0, 1.0,
          0.0, K.CHARGE_DECAY_INPUT, 0, 4.0, True, dtype, "loop", *POOL)),
        # BatchNorm -> the DLIF's per-step gain -> LIF by chunks (a recomputed stable-SNN unit): z [T*B, C, 2, 2], T=2
        ("bn_gain_lif_forward", torch.ops.efficient.bn_gain_lif_forward,
         (_randn(4, 3, 2, 2, dtype=dtype, seed=52, grad=True), 2, _randn(2, dtype=dtype, seed=53, grad=True),
          _randn(3, dtype=dtype, seed=54, grad=True), _randn(3, dtype=dtype, seed=55, grad=True),
          torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype), 0.1, 1e-5, 0.99, 0.5, K.SURROGATES["triangle"],
          1.0, dtype, "loop")),
        ("bn_gain_lif_backward", torch.ops.efficient.bn_gain_lif_backward,
         (_randn(4, 3, 2, 2, dtype=dtype, seed=56), _randn(4, 3, 2, 2, dtype=dtype, seed=57), _randn(2, dtype=dtype, seed=58),
          _randn(3, dtype=dtype, seed=59), _randn(3, dtype=dtype, seed=60), torch.stack([torch.zeros(3), torch.ones(3)]).to(dtype),
          2, 1e-5, 0.99, 0.5, K.SURROGATES["triangle"], 1.0, "loop")),
        # the same backward writing z's gradient into z (a convolution's fresh output nothing else reads)
        ("bn_gain_lif_backward_into", torch.ops.efficient.bn_gain_lif_backward_into,
         (_randn(4, 3, 2, 2, dtype=dtype, seed=66), _randn(4, 3, 2, 2, dtype=dtype, seed=67), _randn(2, dtype=dtype, seed=68),
          _randn(3, dtype=dtype, seed=69), _randn(3, dtype=dtype, seed=70), torch.stack([torch.zeros(3), torch.ones(3)]).to(dtype),
          2, 1e-5, 0.99, 0.5, K.SURROGATES["triangle"], 1.0, "loop")),
        # a compiled region's stem convolution of spikes: x [3, 2, 4, 4] kept as bits, weight [5, 2, 3, 3]
        ("conv2d_backward_from_bits", torch.ops.efficient.conv2d_backward_from_bits,
         (_randn(3, 5, 4, 4, dtype=dtype, seed=46), pack_spikes(_spikes(3, 2, 4, 4, dtype=dtype, seed=47, grad=False)),
          [3, 2, 4, 4], dtype, _randn(5, 2, 3, 3, dtype=dtype, seed=48), True, [1, 1], [1, 1], [1, 1], 1,
          [True, True, True])),
        ("conv2d_backward_from_bits-weight-only", torch.ops.efficient.conv2d_backward_from_bits,
         (_randn(3, 5, 2, 2, dtype=dtype, seed=49), pack_spikes(_spikes(3, 2, 3, 3, dtype=dtype, seed=50, grad=False)),
          [3, 2, 3, 3], dtype, _randn(5, 2, 3, 3, dtype=dtype, seed=51), False, [2, 2], [1, 1], [1, 1], 1,
          [False, True, False])),
        ("pack_spikes", torch.ops.efficient.pack_spikes, (_spikes(3, 7, dtype=dtype, seed=12, grad=False), "torch")),
        ("unpack_spikes", torch.ops.efficient.unpack_spikes,
         (torch.tensor([5, 255, 0], dtype=torch.uint8), [3, 7], dtype, "torch")),
    ]


def _package_ops() -> set[str]:
    """The ops `efficient`'s kernel modules register, listed by a fresh interpreter: in this one, other
    test files may have registered ops of their own in the namespace."""
    code = (
        "import importlib, pkgutil, torch, efficient.kernels as k\n"
        "for m in pkgutil.iter_modules(k.__path__): importlib.import_module('efficient.kernels.' + m.name)\n"
        "ns = torch.ops.efficient\n"
        "print(' '.join(n for n in dir(ns) if not n.startswith('_') and n != 'name'\n"
        "               and isinstance(getattr(ns, n), torch._ops.OpOverloadPacket)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_every_registered_op_has_a_case():
    covered = {str(op).split(".")[-1] for _, op, _ in op_cases(torch.float32)}
    registered = _package_ops()
    assert registered and registered <= covered, f"custom ops without an opcheck case: {sorted(registered - covered)}"


# variants checked in fp32 only: in half precision one variant per op is checked
FP32_ONLY = ("ssa-scores", "ssa_unit-scores", "ssa_unit_backward-scores", "linear_ce-conf", "lif_forward-plif", "lif_forward-v0", "leaky", "bn_lif_forward-eval",
             "bn_lif_forward-lean", "conv2d_backward_from_bits-weight-only")
OPCHECK_CASES = [
    pytest.param(i, dtype, id=f"{name}-{dtype_id}")
    for dtype, dtype_id in zip(DTYPES, ["fp32", "fp16", "bf16"])
    for i, (name, _, _) in enumerate(op_cases(torch.float32))
    if dtype == torch.float32 or not name.startswith(FP32_ONLY)
]


@pytest.mark.parametrize("case,dtype", OPCHECK_CASES)
def test_opcheck(case, dtype):
    _, op, args = op_cases(dtype)[case]
    torch.library.opcheck(op, args)


def _meta(out):
    return [(tuple(o.shape), o.dtype) for o in (out if isinstance(out, (tuple, list)) else (out,))]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_fake_outputs_match_real_outputs(dtype):
    """Shapes and dtypes of the fake implementation equal the real ones, case by case (with and
    without scores for ssa)."""
    for name, op, args in op_cases(dtype):
        real = op(*args)
        with FakeTensorMode() as mode:
            fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = op(*fargs)
        assert _meta(fake) == _meta(real), name


LAYOUT_FREE = ("bn_lif_forward", "bn_lif_backward_recompute", "bn_lif_max_pool_forward", "bn_lif_max_pool_backward",
               "bn_gain_lif_forward", "bn_gain_lif_backward")


@pytest.mark.parametrize("name", LAYOUT_FREE)
def test_ops_inductor_may_give_any_layout_compute_the_same_and_return_contiguous(name):
    """The BatchNorm + LIF ops a compiled region runs on a convolution's output take it in any layout
    (tagged `flexible_layout`, so inductor hands them a channels-last output as it is, and any strides
    for the per-channel arguments): the values are those of contiguous inputs bit for bit and the
    outputs contiguous, as the fake implementations say."""
    (_, op, args), = [c for c in op_cases(torch.float32) if c[0] == name]
    assert not bn_lif.LAYOUT_TAGS or torch.Tag.flexible_layout in op.default.tags
    ref = op(*args)

    def strided(a):  # 4-D: channels-last; per-channel vectors and [2, C] statistics: every other element
        if not isinstance(a, torch.Tensor) or a.dtype == torch.uint8:
            return a
        a = a.detach()
        if a.dim() == 4:
            return a.to(memory_format=torch.channels_last)
        wide = torch.zeros(*a.shape[:-1], 2 * a.shape[-1], dtype=a.dtype)
        wide[..., ::2] = a
        return wide[..., ::2]

    cl = [strided(a) for a in args]
    assert all(not a.is_contiguous() for a in cl if isinstance(a, torch.Tensor) and a.dim() and a.dtype != torch.uint8)
    got = op(*cl)
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in cl])
    for r, g, f in zip(ref, got, fake):
        assert torch.equal(r, g), name
        assert g.is_contiguous() and g.stride() == f.stride(), name


def test_the_triton_path_of_the_layout_free_ops_reads_strided_arguments_right():
    """The Triton kernels index their per-channel arguments as contiguous: the layout-free ops make
    them so first (here a channels-last z and gradient, and weight, bias and statistics taken every
    other element give the contiguous call's outputs bit for bit, in the interpreter)."""
    pytest.importorskip("triton")
    from _interpreter import run_interpreted

    script = r"""
import json, torch
import efficient.kernels.bn_lif  # noqa: F401
torch.manual_seed(0)
z, g = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
w, b = torch.randn(3), torch.randn(3)
stats = torch.stack([torch.randn(3), torch.rand(3) + 0.5])
def strided(a):
    wide = torch.zeros(*a.shape[:-1], 2 * a.shape[-1]); wide[..., ::2] = a; return wide[..., ::2]
cl = lambda t: t.to(memory_format=torch.channels_last)
neuron = (2.0, 1.0, 0.0, 0, 0, 4.0, True)
ops = torch.ops.efficient
same = []
for keep in (True, False):
    ref = ops.bn_lif_forward(z, 2, w, b, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5, *neuron, torch.float32, "triton", keep)
    got = ops.bn_lif_forward(cl(z), 2, strided(w), strided(b), strided(torch.zeros(3)), strided(torch.ones(3)), True, 0.1,
                             1e-5, *neuron, torch.float32, "triton", keep)
    same.append(all(torch.equal(x, y) for x, y in zip(ref, got)))
ref = ops.bn_lif_backward_recompute(g, z, 2, w, b, stats, True, 1e-5, *neuron, "triton")
got = ops.bn_lif_backward_recompute(cl(g), cl(z), 2, strided(w), strided(b), strided(stats), True, 1e-5, *neuron, "triton")
same.append(all(torch.equal(x, y) for x, y in zip(ref, got)))
print(json.dumps(same))
"""
    assert run_interpreted(script, []) == [True, True, True]


def test_ssa_triton_outputs_match_fake_dtypes_without_scores():
    """The Triton wrapper's empty score placeholders carry the input dtype, as the fake says."""
    pytest.importorskip("triton")
    from _interpreter import run_interpreted

    script = r"""
import json, sys, torch
from efficient.kernels import ssa
out = []
for dt in (torch.float32, torch.float16, torch.bfloat16):
    q = (torch.rand(1, 1, 2, 33, 16) < 0.3).to(dt)
    for scores in (True, False):
        y, s, c = ssa.ssa_triton(q, q, q, 0.125, scores, scores)
        out.append([str(t.dtype) for t in (y, s, c)])
print(json.dumps(out))
"""
    res = run_interpreted(script, [])
    for got, dt in zip(res, ["torch.float32"] * 2 + ["torch.float16"] * 2 + ["torch.bfloat16"] * 2):
        assert got == [dt, dt, dt]


def test_a_function_mode_sees_a_neuron_op_unless_it_lets_it_through():
    """A torch-function mode sees the LIF call as its op (by name), as a FLOP counter or memory's
    op-following needs; a mode whose `sees_op` lets the op through gets the direct implementation
    instead (no op dispatch), sees nothing inside it, and the spikes and gradients are the same."""
    from torch.overrides import TorchFunctionMode

    class Names(TorchFunctionMode):
        def __init__(self, lets_through: bool) -> None:
            super().__init__()
            self.names: list[str] = []
            if lets_through:
                self.sees_op = lambda name: False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0)) + 0.8
    got = {}
    for lets_through in (False, True):
        xx = x.clone().requires_grad_()
        with Names(lets_through) as mode:
            s = K.lif(xx, backend="loop")
        s.sum().backward()
        got[lets_through] = (s, xx.grad, mode.names)
    assert "lif_forward" in got[False][2]
    assert "lif_forward" not in got[True][2]
    assert not {"sigmoid", "where", "mul", "sub", "add"} & set(got[True][2]), "the mode saw inside the implementation"
    assert torch.equal(got[False][0], got[True][0]) and torch.equal(got[False][1], got[True][1])
