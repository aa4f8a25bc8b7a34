"""Spike packing: bytes against a hand example and the reference, exact round trips for every dtype
and ragged size, custom ops (opcheck, torch.compile), errors, and the Triton kernels under
TRITON_INTERPRET=1 in a subprocess."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from efficient.kernels import spike_pack as sp

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPE_IDS = ["fp32", "fp16", "bf16", "fp64"]
SHAPES = [(0,), (1,), (7,), (8,), (9,), (1000,), (), (3, 5, 7), (2, 0, 3), (4, 1, 13), (2, 3, 64, 11)]


def spikes(shape, dtype=torch.float32, p=0.3, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < p).to(dtype)


def test_byte_layout_matches_a_hand_example():
    # element i is bit i % 8 of byte i // 8, least significant bit first; the last byte is padded with 0
    x = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0,  0, 1, 1, 0, 0, 0, 0, 1,  1, 1, 1], dtype=torch.float32)
    want = torch.tensor([0b00000001, 0b10000110, 0b00000111], dtype=torch.uint8)
    for f in (sp.pack_spikes_ref, sp.pack_spikes_torch, sp.pack_spikes):
        assert torch.equal(f(x), want), f
    assert torch.equal(sp.pack_spikes(torch.ones(8)), torch.tensor([255], dtype=torch.uint8))
    assert sp.pack_spikes(torch.ones(2, 8, 2)).tolist() == [255, 255, 255, 255]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_exact(shape, dtype):
    x = spikes(shape, dtype, seed=math.prod(shape) + 1)
    bits = sp.pack_spikes(x)
    assert bits.dtype == torch.uint8 and bits.shape == (-(-x.numel() // 8),)
    y = sp.unpack_spikes(bits, x.shape, dtype)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert torch.equal(y, x)
    # PackedSpikes carries shape and dtype
    p = sp.pack(x)
    assert p.shape == tuple(x.shape) and p.dtype == dtype and p.nbytes == bits.numel()
    assert torch.equal(p.bits, bits) and torch.equal(p.unpack(), x)


@pytest.mark.parametrize("p", [0.0, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("n", [0, 1, 9, 63, 64, 65, 4097, 100_003])
def test_reference_equals_the_cpu_path_bit_for_bit(n, p):
    x = spikes((n,), p=p, seed=n)
    bits = sp.pack_spikes_ref(x)
    assert torch.equal(sp.pack_spikes_torch(x), bits)
    rand_bytes = torch.randint(0, 256, (len(bits),), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    for b in (bits, rand_bytes):  # random bytes: every bit pattern, padding bits included
        for dtype in (torch.float32, torch.bfloat16, torch.bool):
            r = sp.unpack_spikes_ref(b, (n,), dtype)
            f = sp.unpack_spikes_torch(b, (n,), dtype)
            assert f.dtype == r.dtype == dtype and torch.equal(f, r)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pack_binary_gives_the_reference_bytes_for_spikes(dtype):
    # the matrix-vector path (floating, numel a multiple of 8) and its fallback (other sizes, dtypes)
    for shape in [(8,), (4, 16), (3, 5, 8), (2, 3, 64, 11), (7,), (3, 5, 7), (0,)]:
        x = spikes(shape, dtype, p=0.5, seed=math.prod(shape))
        want = sp.pack_spikes_ref(x)
        assert torch.equal(sp.pack_binary(x), want)
        assert torch.equal(sp.pack_binary(x.clone().requires_grad_()), want)  # a saved neuron output needs grad
        if x.dim() > 1:
            v = x.transpose(0, -1)
            assert torch.equal(sp.pack_binary(v), sp.pack_spikes_ref(v))
    x = torch.ones(64, dtype=dtype)
    assert sp.pack_binary(x).tolist() == [255] * 8
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sp.pack_binary(x).tolist() == [255] * 8
    for other in (torch.ones(16, dtype=torch.bool), torch.ones(16, dtype=torch.int32)):
        assert sp.pack_binary(other).tolist() == [255, 255]


def test_nonzero_packs_as_one():
    x = torch.tensor([0.0, -0.0, 2.5, -1.0, float("nan"), float("inf"), 1e-40, -3.0, 0.0, 7.0])
    want = [0, 0, 1, 1, 1, 1, 1, 1, 0, 1]
    for f in (sp.pack_spikes_ref, sp.pack_spikes_torch):
        assert sp.unpack_spikes(f(x), (10,), torch.float32).tolist() == want
    assert not sp.is_binary(x)
    with pytest.raises(ValueError, match="other than 0 and 1"):
        sp.pack(x, check=True)
    assert sp.pack(spikes((5, 3)), check=True).nbytes == 2


def test_non_contiguous_input_packs_in_logical_order():
    x = spikes((6, 10, 5), seed=3)
    views = [x.transpose(0, 2), x[:, ::3], x.permute(2, 0, 1)[1:], x[:, 2].unsqueeze(1).expand(6, 4, 5), x[..., 0]]
    for v in views:
        assert not v.is_contiguous()
        bits = sp.pack_spikes(v)
        assert torch.equal(bits, sp.pack_spikes_ref(v.contiguous()))
        assert torch.equal(sp.unpack_spikes(bits, v.shape, v.dtype), v)


def test_bool_and_integer_inputs_and_bool_output():
    x = spikes((3, 11), seed=4)
    bits = sp.pack_spikes(x)
    for v in (x.bool(), x.to(torch.int32), x.to(torch.uint8), x.to(torch.int64) * 5):
        assert torch.equal(sp.pack_spikes(v), bits)
    assert torch.equal(sp.unpack_spikes(bits, x.shape, torch.bool), x.bool())


def test_is_binary():
    assert sp.is_binary(spikes((4, 9)))
    assert sp.is_binary(torch.zeros(0)) and sp.is_binary(torch.ones(3, dtype=torch.bfloat16))
    assert sp.is_binary(torch.rand(5) < 0.5)
    assert not sp.is_binary(torch.tensor([0.0, 1.0, 0.5]))
    assert not sp.is_binary(torch.tensor([0.0, float("nan")]))


def test_packed_spikes_is_frozen_and_small():
    x = spikes((4, 64, 64, 38))
    p = sp.pack(x)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.shape = (1,)
    assert p.nbytes * 32 == x.numel() * x.element_size()  # 1 bit where fp32 keeps 32


def test_saved_tensor_packed_gives_bitwise_equal_gradients():
    """What packing is for: an op saves its spike input as bits and unpacks it in backward."""

    class Weighted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, s, w, packed):
            ctx.packed = packed
            if packed:
                ctx.spikes = sp.pack(s)
                ctx.save_for_backward(w)
            else:
                ctx.save_for_backward(w, s)
            return s * w

        @staticmethod
        def backward(ctx, g):
            if ctx.packed:
                (w,) = ctx.saved_tensors
                s = ctx.spikes.unpack()
            else:
                w, s = ctx.saved_tensors
            return g * w, (g * s).sum(0), None

    for dtype in DTYPES:
        s = spikes((37, 19), dtype, seed=5).requires_grad_()
        w = torch.randn(19, generator=torch.Generator().manual_seed(6)).to(dtype).requires_grad_()
        g = torch.randn(37, 19, generator=torch.Generator().manual_seed(7)).to(dtype)
        grads = [torch.autograd.grad(Weighted.apply(s, w, packed), (s, w), g) for packed in (False, True)]
        assert all(torch.equal(a, b) for a, b in zip(*grads)), dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(0,), (13,), (3, 8), (2, 5, 7)], ids=str)
def test_opcheck(shape, dtype):
    x = spikes(shape, dtype, seed=8)
    torch.library.opcheck(torch.ops.efficient.pack_spikes, (x, "torch"))
    bits = sp.pack_spikes(x)
    torch.library.opcheck(torch.ops.efficient.unpack_spikes, (bits, list(shape), dtype, "torch"))


def test_compile_fullgraph_without_graph_breaks():
    def f(x, w):
        bits = sp.pack_spikes(x)
        y = sp.unpack_spikes(bits, x.shape, x.dtype) * w
        return y, sp.pack(y > 0).unpack()

    x, w = spikes((4, 6, 5)), torch.randn(5)
    y0, m0 = f(x, w)
    explain = torch._dynamo.explain(f)(x, w)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    for backend, dynamic in (("eager", False), ("aot_eager", False), ("aot_eager", True)):
        torch._dynamo.reset()
        y1, m1 = torch.compile(f, backend=backend, fullgraph=True, dynamic=dynamic)(x, w)
        assert torch.equal(y1, y0) and torch.equal(m1, m0) and m1.dtype == torch.bool
        if dynamic:  # a second shape through the same symbolic graph
            x2 = spikes((3, 7, 5), seed=9)
            y2, _ = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)(x2, w)
            assert torch.equal(y2, f(x2, w)[0])


def test_bad_input_fails_clearly():
    bits = sp.pack_spikes(spikes((3, 5)))  # 15 spikes -> 2 bytes
    with pytest.raises(ValueError, match=r"shape \[3, 6\] has 18 elements, which pack into 3 bytes, but bits has 2"):
        sp.unpack_spikes(bits, (3, 6), torch.float32)
    with pytest.raises(ValueError, match="pack into 1 bytes, but bits has 2"):
        sp.unpack_spikes(bits, (8,), torch.float32)
    with pytest.raises(ValueError, match="bits must be the uint8 tensor"):
        sp.unpack_spikes(bits.to(torch.int32), (3, 5), torch.float32)
    with pytest.raises(ValueError, match="bits must be the uint8 tensor"):
        sp.unpack_spikes(spikes((15,)), (15,), torch.float32)
    for dt in (torch.int32, torch.uint8, torch.int64, torch.complex64):
        with pytest.raises(ValueError, match="dtype must be a floating dtype"):
            sp.unpack_spikes(bits, (3, 5), dt)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        sp.unpack_spikes(bits, (3, 5), "float32")
    with pytest.raises(ValueError, match="non-negative"):
        sp.unpack_spikes(bits, (-3, -5), torch.float32)
    with pytest.raises(ValueError, match="real 0/1 spikes"):
        sp.pack_spikes(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="backend must be one of"):
        sp.pack_spikes(spikes((4,)), backend="cuda")


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("EFFICIENT_BACKEND", raising=False)
    x = spikes((9,))
    assert sp.resolve_backend("auto", x) == "torch"
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        sp.pack_spikes(x, backend="triton")
    monkeypatch.setenv("EFFICIENT_BACKEND", "triton")  # the variable steers 'auto'
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        sp.pack_spikes(x)
    assert torch.equal(sp.pack_spikes(x, backend="torch"), sp.pack_spikes_ref(x))  # an explicit argument wins
    monkeypatch.setenv("EFFICIENT_BACKEND", "compile")
    assert sp.resolve_backend("auto", x) == "torch"
    monkeypatch.setenv("EFFICIENT_BACKEND", "fastest")
    with pytest.raises(ValueError, match="EFFICIENT_BACKEND='fastest'"):
        sp.unpack_spikes(sp.pack_spikes(x, backend="torch"), (9,), torch.float32)


# ------------------------------------------------------------------------- Triton (interpreter)

# the interpreter runs on NumPy, which has no bfloat16: fp32, fp16, fp64 and bool here (bf16 is
# compiled for sm_80 / sm_90 in test_kernel_resources); sizes cross the 256-byte block of a program
_INTERP = r"""
import json, sys, torch
from efficient.kernels import spike_pack as sp
out = []
for name, shape, dtype_name, view in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(len(out))
    x = (torch.rand(shape, generator=g) < 0.4).to(dtype)
    if view == "transpose":
        x = x.transpose(0, -1)
    elif view == "stride":
        x = x[..., ::2]
    elif view == "nonbinary":
        x = x * torch.randn(shape, generator=g).to(dtype)
        x.view(-1)[:3] = float("nan") if dtype.is_floating_point else 2
    bits = sp.pack_spikes(x, backend="triton")
    y = sp.unpack_spikes(bits, x.shape, dtype, backend="triton")
    rand_bytes = torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=g)
    out.append({
        "name": name,
        "bits_equal": bool(torch.equal(bits, sp.pack_spikes_ref(x))),
        "bits_meta": [str(bits.dtype), list(bits.shape)],
        "round_trip": bool(torch.equal(y, (x != 0).to(dtype))),
        "meta": [str(y.dtype), list(y.shape), y.is_contiguous()],
        "unpack_any_bytes": bool(torch.equal(sp.unpack_spikes(rand_bytes, x.shape, dtype, backend="triton"),
                                             sp.unpack_spikes_ref(rand_bytes, x.shape, dtype))),
        "auto_is_triton": sp.resolve_backend("auto", x) == "triton",
    })
print(json.dumps(out))
"""

INTERP_CASES = [
    [f"{dt}-{list(shape)}-{view}", list(shape), dt, view]
    for dt in ("float32", "float16", "float64", "bool")
    for shape, view in [((0,), ""), ((1,), ""), ((7,), ""), ((8,), ""), ((9,), ""), ((1000,), ""), ((3, 5, 7), ""),
                        ((4099,), ""), ((5, 9, 11), "transpose"), ((6, 34), "stride"), ((3, 67), "nonbinary")]
]


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    from _interpreter import run_interpreted

    return {r["name"]: r for r in run_interpreted(_INTERP, INTERP_CASES)}


@pytest.mark.parametrize("case", INTERP_CASES, ids=[c[0] for c in INTERP_CASES])
def test_triton_kernels_match_reference_in_interpreter(interpreted, case):
    name, shape, dtype_name, view = case
    r = interpreted[name]
    if view == "transpose":
        shape = shape[::-1]
    elif view == "stride":
        shape = shape[:-1] + [-(-shape[-1] // 2)]
    assert r["bits_meta"] == ["torch.uint8", [-(-math.prod(shape) // 8)]]
    assert r["bits_equal"] and r["round_trip"] and r["unpack_any_bytes"]
    assert r["meta"] == [f"torch.{dtype_name}", shape, True]
    assert r["auto_is_triton"]


def test_triton_kernels_address_with_int64_offsets():
    """numel may pass 2^31: the kernels' element and byte offsets are 64-bit (TTIR compiled for sm_90)."""
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("kernel_resources", Path(__file__).resolve().parents[1] / "bench" / "kernel_resources.py")
    kr = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kernel_resources", kr)
    spec.loader.exec_module(kr)
    why = kr.tools_missing()
    if why:
        pytest.skip(f"cannot compile for NVIDIA targets on this machine: {why}")
    for case in kr.cases():
        if case.kernel in ("pack_spikes", "unpack_spikes") and case.shape == "fp32 N:i32":
            ttir = kr.measure(case, 90)["ttir"]
            ptrs = [ln for ln in ttir.splitlines() if "tt.addptr" in ln]
            assert len(ptrs) == 2 and all("xi64>" in ln.rsplit(":", 1)[-1].split(",")[-1] for ln in ptrs), ptrs


# ----------------------------------------------------------------------------------- CUDA (real)

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and sp.HAS_TRITON), reason="needs a CUDA GPU and triton")


@cuda
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool], ids=DTYPE_IDS + ["bool"])
def test_cuda_kernels_match_cpu(dtype):
    for shape in [(0,), (1,), (9,), (4099,), (4, 64, 64, 384), (3, 5, 7)]:
        x = spikes(shape, dtype, seed=math.prod(shape))
        bits = sp.pack_spikes(x.cuda())
        assert torch.equal(bits.cpu(), sp.pack_spikes_ref(x))
        y = sp.unpack_spikes(bits, shape, dtype)
        assert y.is_cuda and y.dtype == dtype and torch.equal(y.cpu(), x)
        assert torch.equal(sp.pack_spikes(x.cuda().transpose(0, -1)).cpu(), sp.pack_spikes_ref(x.transpose(0, -1)))


@cuda
def test_cuda_kernels_past_2_31_elements():
    n = 2**31 + 13  # fp16: 4 GiB in, 256 MiB of bits
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * n * 2:
        pytest.skip("needs about 13 GiB of free GPU memory")
    x = torch.zeros(n, dtype=torch.float16, device="cuda")
    hot = torch.tensor([0, 5, 2**31 - 1, 2**31, 2**31 + 7, n - 1], device="cuda")
    x[hot] = 1
    bits = sp.pack_spikes(x)
    assert bits.numel() == -(-n // 8) and int(bits.sum(dtype=torch.int64)) == 1 + 32 + 128 + 1 + 128 + 16
    del x
    y = sp.unpack_spikes(bits, (n,), torch.float16)
    assert int(y.sum(dtype=torch.float32)) == len(hot) and torch.equal(y[hot], torch.ones(len(hot), dtype=torch.float16, device="cuda"))
