"""The stem convolution whose backward runs over slices of the batch (`efficient.memory.conv_backward`):
the forward of `F.conv2d`, its gradients, and a backward that never takes more than a slice's
samples at once; used only inside a recomputed region, and never where a hook watches the conv."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from efficient.kernels import bn_lif
from efficient.memory import recompute as rc
from efficient.kernels.spike_pack import pack_spikes
from efficient.memory.conv_backward import _BatchSlicedConv2d, batch_slices, conv2d_backward_from_bits, region_conv2d


FORWARD = torch.ops.aten.convolution.default


class _ConvCalls(TorchDispatchMode):
    """Records the batch size of every call of an aten convolution op (by default its backward)."""

    def __init__(self, op=torch.ops.aten.convolution_backward.default) -> None:
        super().__init__()
        self.op = op
        self.batches: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.batches.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def test_batch_slices_cover_the_batch_within_the_limit() -> None:
    g = torch.empty(10, 3, 4, 4)  # 48 elements per sample
    for limit, width in [(48, 1), (100, 2), (480, 10), (10_000, 10), (1, 1)]:
        s = batch_slices(g, limit)
        assert [i for sl in s for i in range(10)[sl]] == list(range(10))
        assert {sl.stop - sl.start for sl in s[:-1]} <= {width} and s[-1].stop - s[-1].start <= width


@pytest.mark.parametrize("stride,padding,groups,bias,input_grad", [
    (1, 1, 1, False, True), (2, 1, 1, True, True), (1, 0, 2, True, False), (1, 2, 1, False, False)])
@pytest.mark.parametrize("spikes", [False, True], ids=["dense", "spikes"])
def test_sliced_backward_equals_the_convolution(stride, padding, groups, bias, input_grad, spikes,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward is F.conv2d's call; the gradients are the convolution's; backward takes the
    slices of the batch `batch_slices` gives; an input of spikes is kept as bits, one uint8 tensor
    per slice."""
    torch.manual_seed(0)
    x = torch.rand(7, 4, 9, 9).lt(0.3).float().requires_grad_(input_grad)
    conv = nn.Conv2d(4, 6, 3, stride, padding, groups=groups, bias=bias)
    args = (conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups, spikes)
    ref = F.conv2d(x, *args[:2], stride=stride, padding=padding, groups=groups)
    g = torch.randn_like(ref)
    wanted = [t for t in (x, conv.weight, conv.bias) if t is not None and t.requires_grad]
    ref_grads = torch.autograd.grad(ref, wanted, g)
    per_sample = ref[0].numel()
    for limit in (per_sample, 3 * per_sample, 100 * per_sample):
        monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", limit)
        slices = batch_slices(g)
        out = _BatchSlicedConv2d.apply(x, *args)
        assert torch.equal(out, ref)
        kept = out.grad_fn.saved_tensors[1:]
        if spikes:
            assert [k.dtype for k in kept] == [torch.uint8] * len(slices)
        else:
            assert len(kept) == 1 and kept[0] is x
        calls = _ConvCalls()
        with calls:
            grads = torch.autograd.grad(out, wanted, g)
        assert calls.batches == [len(range(7)[s]) for s in slices]
        assert max(calls.batches) == min(7, limit // per_sample)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, 1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return region_conv2d(self.conv, x).sigmoid()


def _grads(stage: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    calls = _ConvCalls()
    with calls:
        stage(x).square().sum().backward()
    grads = [x.grad.clone(), stage.conv.weight.grad.clone()]
    x.grad = stage.conv.weight.grad = None
    return grads, calls.batches


def test_only_a_recomputed_region_slices_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a region the module is called as it is (one backward over the batch); inside one its
    rerun's backward takes the batch a slice at a time, with the same gradients."""
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 8 * 6 * 6)  # 1 sample of the output
    torch.manual_seed(0)
    x = torch.rand(5, 3, 6, 6, requires_grad=True)
    stage = _Stage()
    plain, plain_calls = _grads(stage, x)
    assert plain_calls == [5]
    rc.wrap(stage)
    region, region_calls = _grads(stage, x)
    assert region_calls == [1] * 5
    for a, b in zip(region, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a hook on the conv (the profiler's, for one) must see the module called, even inside a region
    seen = []
    stage.conv.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    _, hooked_calls = _grads(stage, x)
    assert hooked_calls == [5] and seen  # forward, and the rerun in backward


@pytest.mark.parametrize("stride,padding,bias", [(1, 1, False), (2, 0, True), (1, 2, True)])
def test_sliced_forward_computes_the_convolution_a_slice_at_a_time(stride, padding, bias,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`sliced_conv2d`: F.conv2d's values (a convolution is per sample; within rounding, as a BLAS may
    block a slice unlike the whole), computed over slices of at most `FORWARD_SLICE` output elements."""
    from efficient.memory import conv_backward as cb

    torch.manual_seed(0)
    x, w = torch.rand(7, 4, 9, 9).lt(0.3).float(), torch.randn(6, 4, 3, 3)
    b = torch.randn(6) if bias else None
    ref = F.conv2d(x, w, b, stride, padding)
    per = ref[0].numel()
    for limit, want in ((per, [1] * 7), (3 * per, [3, 3, 1]), (100 * per, [7])):
        monkeypatch.setattr(cb, "FORWARD_SLICE", limit)
        calls = _ConvCalls(FORWARD)
        with calls:
            out = cb.sliced_conv2d(x, w, b, stride, padding, 1, 1)
        assert calls.batches == want and out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_a_regions_forward_and_rerun_slice_the_convolution_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a recomputed region the forward (run without autograd) and its rerun in backward take the
    same slices, so the rerun rebuilds the forward's output; outside a region the conv is one call."""
    from efficient.memory import conv_backward as cb

    monkeypatch.setattr(cb, "FORWARD_SLICE", 2 * 8 * 6 * 6)  # 2 samples of the output
    torch.manual_seed(0)
    x = torch.rand(5, 3, 6, 6, requires_grad=True)
    stage = _Stage()
    calls = _ConvCalls(FORWARD)
    with calls:
        plain = stage(x)
    assert calls.batches == [5]
    (gx,) = torch.autograd.grad(plain.square().sum(), x)
    rc.wrap(stage)
    calls = _ConvCalls(FORWARD)
    with calls:
        out = stage(x)
        assert calls.batches == [2, 2, 1]  # the region's forward
        (gx_region,) = torch.autograd.grad(out.square().sum(), x)
    assert calls.batches == [2, 2, 1] * 2  # and its rerun
    torch.testing.assert_close(out, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx_region, gx, rtol=1e-5, atol=1e-6)


def test_autocast_runs_the_convolution_in_its_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 8 * 6 * 6)
    torch.manual_seed(0)
    x = torch.rand(4, 3, 6, 6, requires_grad=True)
    stage = _Stage()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = stage.conv(x)
    rc.wrap(stage)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        calls = _ConvCalls()
        out = stage(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref.sigmoid())
        with calls:
            out.float().sum().backward()
    assert calls.batches == [1] * 4
    assert stage.conv.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


@pytest.mark.parametrize("shape,stride,bias,mask", [
    ((7, 4, 6, 6), 1, True, (True, True, True)),     # 144 spikes per sample: slices start on a byte
    ((7, 3, 5, 5), 2, False, (True, True, False)),   # 75 per sample: unpacked whole once, sliced after
    ((5, 4, 6, 6), 1, True, (False, True, True)),    # the stem's first stage: no input gradient
])
def test_the_compiled_regions_backward_from_bits_equals_the_convolution(shape, stride, bias, mask,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`efficient::conv2d_backward_from_bits` (a compiled region's convolution of spikes): from the
    input's bits alone, the convolution's gradients, one slice of the batch at a time; an unwanted
    gradient is an empty tensor."""
    torch.manual_seed(0)
    x = torch.rand(*shape).lt(0.3).float()
    conv = nn.Conv2d(shape[1], 5, 3, stride, 1, bias=bias)
    ref_x = x.clone().requires_grad_(True)
    out = conv(ref_x)
    g = torch.randn_like(out)
    gx, gw, *gb = torch.autograd.grad(out, [ref_x, conv.weight] + ([conv.bias] if bias else []), g)
    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 2 * out[0].numel())  # two samples per slice
    args = (g, pack_spikes(x), list(shape), torch.float32, conv.weight.detach(), bias, [stride] * 2, [1, 1], [1, 1], 1,
            list(mask))
    calls = _ConvCalls()
    with calls:  # the op's implementation, whose aten calls a dispatch mode sees
        got = conv2d_backward_from_bits._init_fn(*args)
    for a, b in zip(got, torch.ops.efficient.conv2d_backward_from_bits(*args)):
        assert torch.equal(a, b)
    assert calls.batches == [2] * (shape[0] // 2) + [1] * (shape[0] % 2)
    for want, ref, value in zip(mask, [gx, gw, gb[0] if bias else None], got):
        if want:
            torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-5)
            assert value.is_contiguous()
        else:
            assert value.numel() == 0
