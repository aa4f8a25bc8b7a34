"""What the `bits` level may pack: outputs of neurons (bits), counts of spikes (residual sums,
integer multiples: uint8/int16), products of them, and nothing a later op made non-integer. Each
case checks the gradients against the dense path bitwise and what autograd kept."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from efficient import memory
from efficient.memory.spikes import PackedSaved
from efficient.models.neurons import LIF


class Probe(nn.Module):
    """Two LIF layers over one input, and `body(s1, s2, self)` after them, read out linearly."""

    def __init__(self, body: Callable[..., torch.Tensor], d: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.n1, self.n2 = LIF(), LIF()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.n1(self.a(x)), self.n2(self.b(x)), self))


def _run(body: Callable[..., torch.Tensor], level: str, shape=(4, 3, 16)) -> tuple[dict, list]:
    """Gradients of one backward at `level`, and what autograd kept for each saved tensor."""
    torch.manual_seed(0)
    model = Probe(body, shape[-1])
    plan = memory.optimize(model, level)
    kept: list = []
    if plan.hooks is not None:
        plan.hooks.observer = lambda t, k: kept.append(k)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2
    model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, kept


def _same_grads(body: Callable[..., torch.Tensor], shape=(4, 3, 16)) -> list:
    dense, _ = _run(body, "none", shape)
    packed, kept = _run(body, "bits", shape)
    for n in dense:
        assert torch.equal(dense[n], packed[n]), n
    return kept


def _packed(kept: list) -> list[PackedSaved]:
    return [k for k in kept if isinstance(k, PackedSaved)]


def test_spikes_scaled_by_a_fraction_are_not_packed() -> None:
    # 0.5 * spikes is not binary: packing it as bits would give the next layer 1s for 0.5s
    kept = _same_grads(lambda s1, s2, m: s1 * 0.5)
    assert not _packed(kept)


def test_a_sum_of_spikes_is_kept_as_small_integers() -> None:
    kept = _same_grads(lambda s1, s2, m: s1 + s2 + 2 * s1)  # a residual stream: counts up to 4
    packed = _packed(kept)
    assert [p.bound for p in packed] == [4] and packed[0].data.dtype == torch.uint8


def test_a_large_count_is_kept_as_int16() -> None:
    kept = _same_grads(lambda s1, s2, m: s1 * 300 + s2)
    assert [(p.bound, p.data.dtype) for p in _packed(kept)] == [(301, torch.int16)]


def test_spikes_as_they_are_are_bits() -> None:
    kept = _same_grads(lambda s1, s2, m: s1.transpose(0, 1).reshape(3, 4, -1).transpose(0, 1) * s2)
    assert {p.bound for p in _packed(kept)} == {1}  # an AND of spikes is spikes (and so are its operands)


def _sigmoid_into(s: torch.Tensor) -> None:
    with torch.no_grad():  # `out=` does not record autograd
        torch.sigmoid(s.clone(), out=s)


@pytest.mark.parametrize("write", [
    lambda s: s.add_(0.25), lambda s: s.mul_(-1.0), lambda s: s.__setitem__((0, 0), 0.5),
    _sigmoid_into, lambda s: F.relu(s.sub_(0.5), inplace=True),
], ids=["add_", "mul_", "setitem", "out=", "inplace="])
def test_a_write_that_breaks_the_bound_ends_tracking(write) -> None:
    def body(s1: torch.Tensor, s2: torch.Tensor, m: nn.Module) -> torch.Tensor:
        s = s1.clone()
        write(s)
        return s
    assert not _packed(_same_grads(body))


def test_a_write_the_propagation_did_not_see_ends_tracking() -> None:
    """A tracked storage written while no `SpikePropagation` watched (a recomputed region's forward runs
    without it) drops out by its version counter, views included: scaled spikes are never packed."""
    from efficient.memory.spikes import SpikeTracker

    tracker = SpikeTracker()
    s = (torch.rand(4, 8) > 0.5).float()
    tracker.add(s)
    view = s[1:]
    assert tracker.bound(view) == 1
    view.mul_(0.5)
    assert tracker.bound(s) is None and tracker.bound(view) is None
    tracker.add(s, 3)  # recorded again after the write: tracked from the new version on
    assert tracker.bound(s) == 3
    with torch.inference_mode():
        t = torch.ones(3)
    tracker.add(t)
    assert tracker.bound(t) == 1  # inference tensors have no version counter


def test_a_write_that_keeps_integers_updates_the_bound() -> None:
    def body(s1: torch.Tensor, s2: torch.Tensor, m: nn.Module) -> torch.Tensor:
        s = s1.clone()
        s += s2  # counts up to 2 now: still exact as uint8, no longer bits
        return s
    assert [p.bound for p in _packed(_same_grads(body))] == [2]


@pytest.mark.parametrize("spikes", [True, False], ids=["spikes", "real"])
def test_a_max_pool_keeps_small_window_offsets_not_its_input_or_int64_indices(spikes: bool) -> None:
    def body(s1: torch.Tensor, s2: torch.Tensor, m: nn.Module) -> torch.Tensor:
        img = (s1 + 0 * s2) if spikes else torch.sigmoid(m.a(s1) + s2)  # a real-valued input, too
        pooled = F.max_pool2d(img.reshape(12, 1, 4, 4), 3, 2, 1)  # as [T*B, C, H, W]
        return pooled.reshape(4, 3, -1).repeat(1, 1, 4)

    kept = _same_grads(body)
    ints = [k for k in kept if isinstance(k, torch.Tensor) and not k.is_floating_point()]
    # one offset per output (2 x 2 per plane) in a byte: the largest offset of a 3x3 window on a
    # 4-wide plane is 2 * 4 + 2
    assert [(k.dtype, tuple(k.shape)) for k in ints] == [(torch.uint8, (12, 1, 2, 2))]
    assert not any(getattr(k, "shape", None) == (12, 1, 4, 4) for k in kept)  # the pool's input is not kept


def test_max_pool_offsets_route_the_gradient_as_aten_does() -> None:
    from efficient.memory.spikes import _CompactMaxPool2d, _pool2d_args

    g = torch.Generator().manual_seed(0)
    for (k, s, p, d, ceil), shape in [((3, 2, 1, 1, False), (2, 3, 7, 9)), ((3, 2, 1, 1, True), (3, 5, 6)),
                                      ((3, 1, 1, 2, False), (2, 2, 8, 8)), (((2, 3), (1, 2), (1, 0), 1, True), (1, 2, 5, 7))]:
        for x in ((torch.rand(shape, generator=g) > 0.6).float(),  # ties everywhere: the first maximum wins
                  torch.rand(shape, generator=g).contiguous(memory_format=torch.channels_last)
                  if len(shape) == 4 else torch.rand(shape, generator=g)):
            a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya = F.max_pool2d(a, k, s, p, d, ceil)
            yb = _CompactMaxPool2d.apply(b, *_pool2d_args((b, k, s, p, d, ceil), {}))
            grad = torch.randn(ya.shape, generator=g)
            ya.backward(grad)
            yb.backward(grad)
            assert torch.equal(ya, yb) and torch.equal(a.grad, b.grad) and a.grad.stride() == b.grad.stride()


def test_a_matmul_of_strided_spike_views_keeps_them_as_bits() -> None:
    def body(s1: torch.Tensor, s2: torch.Tensor, m: nn.Module) -> torch.Tensor:
        q = s1.reshape(4, 3, 4, 4).transpose(2, 3)  # heads split off: a strided view
        k = s2.reshape(4, 3, 4, 4).transpose(2, 3)
        return (q @ (k.transpose(-2, -1) @ q) * 0.125).transpose(2, 3).reshape(4, 3, 16)

    kept = _same_grads(body)
    dense_float = [k for k in kept if isinstance(k, torch.Tensor) and k.is_floating_point() and k.dim() >= 3]
    assert not dense_float  # q, k and k^T q (counts up to 4) are all packed
    assert sorted(p.bound for p in _packed(kept)) == [1, 1, 1, 4]


# --------------------------------------------------------------------------- BatchNorm outputs


class GainUnit(nn.Module):
    """Conv -> BatchNorm -> times a per-step gain -> LIF (the stable-SNN unit), twice, read out:
    the gain's product keeps the BatchNorm output for the gain's gradient."""

    def __init__(self, write: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)])
        self.bns = nn.ModuleList([nn.BatchNorm2d(4), nn.BatchNorm2d(4)])
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.lifs = nn.ModuleList([LIF(), LIF()])
        self.out = nn.Linear(4 * 16, 3)
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T=3, B, 2, 4, 4]
        T, B = x.shape[:2]
        for conv, bn, lif in zip(self.convs, self.bns, self.lifs):
            y = bn(conv(x.flatten(0, 1)))
            if self.write is not None:
                y = self.write(y)
            x = lif(y.view(T, B, *y.shape[1:]) * self.gain.view(T, 1, 1, 1, 1))
        return self.out(x.flatten(2).mean(0))


def _gain_run(level: str, write=None, amp: bool = False) -> tuple[dict, list, dict]:
    torch.manual_seed(0)
    model = GainUnit(write).train()
    plan = memory.optimize(model, level)
    kept: list = []
    if plan.hooks is not None:
        plan.hooks.observer = lambda t, k: kept.append(k)
    x = torch.randn(3, 5, 2, 4, 4, generator=torch.Generator().manual_seed(1)) * 2
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = model(x).float().square().sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, kept, {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_batchnorm_output_is_kept_as_its_input_and_rebuilt_exactly(amp: bool) -> None:
    from efficient.memory.spikes import RecomputedNorm

    dense, _, dense_buffers = _gain_run("none", amp=amp)
    bits, kept, bits_buffers = _gain_run("bits", amp=amp)
    for n in dense:
        assert torch.equal(dense[n], bits[n]), n
    for n in dense_buffers:  # running statistics updated once, by the forward
        assert torch.equal(dense_buffers[n], bits_buffers[n]), n
    norms = [k for k in kept if isinstance(k, RecomputedNorm)]
    assert len(norms) == 2 and all(k.shape == (3, 5, 4, 4, 4) for k in norms)
    # nothing fp32 of the BatchNorm outputs' size is kept dense but the BatchNorm inputs themselves
    # (autocast's bf16 copies of the spikes are made below the level spikes are tracked at)
    dense_kept = [k for k in kept if isinstance(k, torch.Tensor) and k.shape[-3:] == (4, 4, 4) and k.dtype == torch.float32]
    assert {k.untyped_storage().data_ptr() for k in dense_kept} <= {k.x.untyped_storage().data_ptr() for k in norms}


def test_measured_bytes_drop_by_the_batchnorm_outputs() -> None:
    from efficient.memory.measure import activation_memory

    x = torch.randn(3, 5, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    got = {}
    for level in ("none", "bits"):
        torch.manual_seed(0)
        got[level] = activation_memory(GainUnit().train(), x, lambda out: out.square().sum(), level=level).total_bytes
    out_bytes = 2 * 15 * 4 * 16 * 4  # two BatchNorm outputs [15, 4, 4, 4] in fp32
    spikes = 15 * 4 * 16 * 4  # the second conv's input spikes (and the readout's), dense vs bits
    assert got["none"] - got["bits"] >= out_bytes + spikes - spikes // 16


def test_a_batchnorm_output_written_in_place_is_kept_as_it_is() -> None:
    # after an in-place write the saved tensor is no longer the normalisation of the input
    from efficient.memory.spikes import RecomputedNorm

    write = lambda y: y.mul_(1.5)  # noqa: E731
    dense, _, _ = _gain_run("none", write)
    bits, kept, _ = _gain_run("bits", write)
    for n in dense:
        assert torch.equal(dense[n], bits[n]), n
    assert not [k for k in kept if isinstance(k, RecomputedNorm)]


def test_a_batchnorm_input_written_after_the_forward_is_an_error_not_a_wrong_gradient() -> None:
    class Unit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn, self.gain = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Parameter(torch.ones(()))
            self.lif = LIF()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.h = self.lin(x)
            return self.lif((self.bn(self.h) * self.gain).view(2, 3, 4)).sum()

    model = Unit().train()
    memory.optimize(model, "bits")
    loss = model(torch.randn(6, 4))
    with torch.no_grad():
        model.h.add_(1.0)  # the BatchNorm input changes before backward rebuilds its output
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


# --------------------------------------------------------------------------- AMP and FSDP2

def _spikformer_grads(level: str, amp: bool) -> dict[str, torch.Tensor]:
    from efficient import zoo

    torch.manual_seed(0)
    model = zoo.create("spikformer-tiny-stata", timesteps=2, img_size=16, num_classes=4).train()
    memory.optimize(model, level)
    x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x)
        loss = F.cross_entropy(out.float(), torch.tensor([0, 1, 3]))
    loss.backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_levels_under_autocast(amp: bool) -> None:
    """bf16 autocast saves bf16 tensors: spikes and counts in bf16 pack as exactly as in fp32."""
    dense, bits, recomputed = (_spikformer_grads(level, amp) for level in ("none", "bits", "recompute"))
    assert dense.keys() == bits.keys() == recomputed.keys() and dense
    for n in dense:
        assert torch.equal(dense[n], bits[n]), n
        scale = max(g.abs().max() for g in dense.values())
        tol = 2e-2 if amp else 1e-5  # bf16 keeps 8 bits of mantissa; a rerun may round its sums differently
        assert (recomputed[n] - dense[n]).abs().max() <= tol * scale, n


@pytest.mark.slow
def test_levels_under_fsdp2(tmp_path) -> None:
    """Two ranks shard the model with FSDP2 after `optimize`: bits gives none's gradients bitwise,
    recompute within rounding (a block's rerun in backward sees its unsharded parameters)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = tmp_path / "grads.pt"
    worker = Path(__file__).with_name("_memory_fsdp_worker.py")
    r = subprocess.run([sys.executable, str(worker), str(out), port], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    grads = torch.load(out, weights_only=True)
    dense = grads["none"]
    assert dense and dense.keys() == grads["bits"].keys() == grads["recompute"].keys()
    scale = max(g.abs().max() for g in dense.values())
    for n, g in dense.items():
        assert torch.equal(grads["bits"][n], g), n
        assert (grads["recompute"][n] - g).abs().max() <= 1e-5 * scale, n


# --------------------------------------------------------------------------- recompute and buffers

class _Counting(nn.Module):
    """A unit whose forward reads a running statistic and then updates it (as a conv padded with
    BatchNorm's running mean does): its rerun must read the value the forward read."""

    recompute_unit = True

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.lif = nn.Linear(16, 16), LIF()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lif(self.lin(x) * (1.0 + self.seen))
        if self.training:
            with torch.no_grad():
                self.seen.add_(1.0)
        return y


def test_a_rerun_reads_the_buffers_the_forward_read_and_leaves_them_updated_once() -> None:
    grads, buffers = {}, {}
    for level in ("none", "recompute"):
        torch.manual_seed(0)
        model = nn.Sequential(_Counting(), nn.Linear(16, 3))
        with torch.no_grad():
            model[0].seen.fill_(0.5)
        memory.optimize(model, level)
        x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1)) * 3
        model(x).square().sum().backward()
        grads[level] = [p.grad.clone() for p in model.parameters()]
        buffers[level] = model[0].seen.item()
    assert buffers["recompute"] == buffers["none"] == 1.5
    for a, b in zip(grads["none"], grads["recompute"]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
