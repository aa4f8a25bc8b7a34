"""BatchNorm + LIF as one op (`efficient.kernels.bn_lif`, with or without the Linear before it): on
CPU bit for bit the separate calls (spikes, running statistics, batch count, gradients of input,
weights and biases), in training and eval, for a Linear unit's and a conv unit's layout; the zoo
units that use it train exactly as the separate modules; bad input is named; the Triton kernel
matches under the interpreter."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from efficient.kernels.bn_lif import bn_lif, bn_lif_reference
from efficient.models.neurons import LIF, PLIF, fusable, norm_fire


def _pair(shape, channels, seed, dtype=torch.float32):
    """A BatchNorm with trained-looking statistics and parameters, and an input for it."""
    g = torch.Generator().manual_seed(seed)
    bn = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(channels).to(dtype)
    with torch.no_grad():
        bn.weight.copy_(1 + 0.3 * torch.randn(channels, generator=g))
        bn.bias.copy_(0.2 * torch.randn(channels, generator=g))
        bn.running_mean.copy_(0.1 * torch.randn(channels, generator=g))
        bn.running_var.copy_(0.5 + torch.rand(channels, generator=g))
    z = (1.5 * torch.randn(*shape, generator=g)).to(dtype)
    return bn, z


def _run(bn, neuron, z, shape, fused: bool):
    z = z.detach().clone().requires_grad_()
    if fused:
        out = norm_fire(bn, neuron, z, shape)
    else:
        y = bn(z)
        out = neuron(y.reshape(shape))
    g = torch.Generator().manual_seed(7)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out, z.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var, bn.num_batches_tracked


LAYOUTS = {  # z's shape (BatchNorm's layout, T=4 folded into the batch) and the neuron's time-major shape
    "linear": ((4 * 2 * 5, 6), (4, 2, 5, 6)),
    "conv": ((4 * 2, 3, 5, 5), (4, 2, 3, 5, 5)),
}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("neuron_kw", [
    {},
    {"v_reset": None, "decay_input": False, "surrogate": "atan", "detach_reset": False},
    {"tau": 3.0, "v_threshold": 0.5, "surrogate": "triangle"},
], ids=["spikformer", "soft-no-decay-atan", "tau3-triangle"])
def test_the_fused_op_is_the_two_calls_bit_for_bit(layout: str, training: bool, neuron_kw: dict) -> None:
    zshape, nshape = LAYOUTS[layout]
    bn, z = _pair(zshape, zshape[1], seed=1)
    neuron = LIF(backend="loop", **neuron_kw)
    bn.train(training)
    assert fusable(neuron, bn)
    for step in range(2):  # the second step starts from the statistics the first one left
        bn_a, bn_b = copy.deepcopy(bn), copy.deepcopy(bn)
        sep = _run(bn_a, neuron, z + step, nshape, fused=False)
        fus = _run(bn_b, neuron, z + step, nshape, fused=True)
        for name, a, b in zip(["spikes", "grad z", "grad weight", "grad bias", "running mean", "running var",
                               "batches"], sep, fus):
            assert torch.equal(a, b), f"{name} differs (step {step})"
        bn = bn_b
    assert 0 < sep[0].mean() < 1  # some neurons fired, some did not


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_unit_op_with_its_linear_is_the_three_calls_bit_for_bit(training: bool, bias: bool) -> None:
    bn, _ = _pair((40, 6), 6, seed=5)
    bn.train(training)
    torch.manual_seed(5)
    lin = nn.Linear(7, 6, bias=bias)
    x = torch.randn(40, 7)
    got = {}
    for fused in (False, True):
        b, l = copy.deepcopy(bn), copy.deepcopy(lin)
        xx = x.clone().requires_grad_()
        out = norm_fire(b, LIF(backend="loop"), xx, (4, 2, 5, 6), linear=l) if fused else \
            LIF(backend="loop")(b(l(xx)).reshape(4, 2, 5, 6))
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
        got[fused] = [out, xx.grad, l.weight.grad, b.weight.grad, b.bias.grad, b.running_mean, b.running_var]
        if bias:
            got[fused].append(l.bias.grad)
    for i, (a, c) in enumerate(zip(got[False], got[True])):
        assert torch.equal(a, c), f"output {i} differs"


@pytest.mark.parametrize("keep_membrane", [True, False])
def test_the_unit_given_its_linear_output_runs_no_matmul_and_computes_the_same(keep_membrane: bool, monkeypatch) -> None:
    """`bn_lif(lin_out=...)`: the eager unit given its Linear's output (a recomputed region's kept one) calls no
    `F.linear`, and its spikes, running statistics and every gradient (the Linear's too) are those of the unit
    computing the output itself, bit for bit. The unit takes the given output over as its own: its backward
    writes BatchNorm's gradient over it, as over the output it would have made. A wrong lin_out is an error."""
    import torch.nn.functional as F

    from efficient.kernels import bn_lif as K
    from efficient.kernels.bn_lif import bn_lif

    monkeypatch.setattr(K, "BN_BACKWARD_OVER_Z_MIN", 1)  # written over z by chunks at this small size too
    monkeypatch.setattr(K, "RECOMPUTE_CHUNK_MIN", 1 << 10)
    bn, _ = _pair((256, 256), 256, seed=5)
    torch.manual_seed(6)
    lin = nn.Linear(16, 256)
    x = (torch.rand(256, 16, generator=torch.Generator().manual_seed(7)) < 0.4).float()
    g = torch.randn(256, 256, generator=torch.Generator().manual_seed(8))
    z = F.linear(x, lin.weight, lin.bias).detach()
    assert len(K._over_z_chunks(z)) > 1
    kept = z.clone()
    got = {}
    for given in (False, True):
        b, l = copy.deepcopy(bn), copy.deepcopy(lin)
        xx = x.clone().requires_grad_()
        calls = []
        real = F.linear
        monkeypatch.setattr(F, "linear", lambda *a: calls.append(1) or real(*a))
        out = bn_lif(xx, 4, b.weight, b.bias, b.running_mean, b.running_var, True, 0.1, b.eps, backend="loop",
                     lin_weight=l.weight, lin_bias=l.bias, lin_out=z if given else None, keep_membrane=keep_membrane)
        (out * g).sum().backward()
        monkeypatch.setattr(F, "linear", real)
        assert len(calls) == (0 if given else 1)
        got[given] = [out, xx.grad, l.weight.grad, l.bias.grad, b.weight.grad, b.bias.grad, b.running_mean, b.running_var]
    for i, (a, c) in enumerate(zip(got[False], got[True])):
        assert torch.equal(a, c), f"output {i} differs"
    assert not torch.equal(z, kept)  # BatchNorm's gradient went into it
    with pytest.raises(ValueError, match=r"lin_out must be the Linear's output \[T\*M, C\] = \(256, 256\), got \(256, 16\)"):
        bn_lif(x, 4, bn.weight, bn.bias, bn.running_mean, bn.running_var, lin_weight=lin.weight, lin_out=x)
    with pytest.raises(ValueError, match="lin_out is a Linear's output and comes with lin_weight"):
        bn_lif(z, 4, bn.weight, bn.bias, bn.running_mean, bn.running_var, lin_out=z)


def test_only_the_spikes_carry_a_gradient() -> None:
    """The ops' statistics, membrane trace and z are marked non-differentiable: they do not require
    grad, and autograd saves them without a detach each way (a dispatched op per saved output, which
    a launch-bound step pays), so a unit's step detaches only for each leaf's gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from efficient.kernels.bn_lif import _EagerLinearBNLIF, _lif_args

    class Detaches(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Detaches.n += func.__name__.startswith("detach")
            return func(*args, **(kwargs or {}))

    bn, _ = _pair((40, 6), 6, seed=5)
    lin = nn.Linear(7, 6)
    x = torch.randn(40, 7, requires_grad=True)
    with Detaches():  # a dispatch mode: the call goes through the custom op and its autograd wrapper
        out = norm_fire(bn, LIF(backend="loop"), x, (4, 2, 5, 6), linear=lin)
        out.sum().backward()
    leaves = [x, lin.weight, lin.bias, bn.weight, bn.bias]
    assert all(t.grad is not None for t in leaves)
    assert Detaches.n <= len(leaves)  # AccumulateGrad's, one per leaf; none for the saved outputs
    # the eager path (no modes) runs the same setup: only the spikes require grad
    outs = _EagerLinearBNLIF.apply(x, lin.weight, lin.bias, 4, bn.weight, bn.bias, bn.running_mean.clone(),
                                   bn.running_var.clone(), True, 0.1, 1e-5,
                                   *_lif_args(2.0, 1.0, 0.0, True, True, "sigmoid", None), torch.float32, "loop")
    assert outs[0].requires_grad and not any(t.requires_grad for t in outs[1:])


def test_momentum_none_is_the_cumulative_average() -> None:
    zshape, nshape = LAYOUTS["linear"]
    bn, z = _pair(zshape, 6, seed=2)
    bn.momentum = None
    a, b = copy.deepcopy(bn), copy.deepcopy(bn)
    for step in range(3):
        sep = _run(a, LIF(backend="loop"), z * (step + 1), nshape, fused=False)
        fus = _run(b, LIF(backend="loop"), z * (step + 1), nshape, fused=True)
    assert all(torch.equal(x, y) for x, y in zip(sep[4:], fus[4:]))
    assert int(b.num_batches_tracked) == 3


@pytest.mark.slow
def test_the_compiled_cpu_loop_is_the_two_calls_bit_for_bit() -> None:
    from conftest import needs_cxx  # noqa: F401 - the marker's condition, checked here

    from efficient.kernels._backend import have_cxx_compiler

    if not have_cxx_compiler():
        pytest.skip("no C++ compiler: inductor cannot compile on CPU")
    zshape, nshape = LAYOUTS["conv"]
    bn, z = _pair(zshape, 3, seed=3)
    neuron = LIF(backend="compile")
    sep = _run(copy.deepcopy(bn), neuron, z, nshape, fused=False)
    fus = _run(copy.deepcopy(bn), neuron, z, nshape, fused=True)
    assert all(torch.equal(a, b) for a, b in zip(sep, fus))


def test_a_kept_membrane_is_written_over_only_when_no_backward_reads_it_again() -> None:
    """The eager unit's compiled backward writes the LIF's gradient over its kept H, one tensor of z's size
    fewer at the step's peak; with the graph kept (`retain_graph`) it leaves H alone, so a second
    backward gives the first one's gradients. Gradients are the same either way, bit for bit."""
    from efficient.kernels._backend import have_cxx_compiler
    from efficient.memory.measure import step_peak_bytes

    if not have_cxx_compiler():
        pytest.skip("no C++ compiler: inductor cannot compile on CPU")
    T, R, D, C = 4, 64, 16, 32
    x = (torch.rand(T * R, D, generator=torch.Generator().manual_seed(2)) < 0.3).float()
    lin = nn.Linear(D, C)
    bn, _ = _pair((T * R, C), C, seed=6)
    neuron = LIF(backend="compile")
    g = torch.randn(T, R, C, generator=torch.Generator().manual_seed(3))

    def grads(retain: bool, twice: bool = False):
        for p in (*lin.parameters(), *bn.parameters()):
            p.grad = None
        out = []

        def step() -> None:
            s = norm_fire(bn, neuron, x, (T, R, C), linear=lin)
            loss = (s * g).sum()
            loss.backward(retain_graph=retain)
            if twice:
                first = [p.grad.clone() for p in (*lin.parameters(), *bn.parameters())]
                for p in (*lin.parameters(), *bn.parameters()):
                    p.grad = None
                loss.backward()
                out.append(first)

        peak = step_peak_bytes(step)
        return [p.grad.clone() for p in (*lin.parameters(), *bn.parameters())], peak, out

    over, peak_over, _ = grads(False)
    kept, peak_kept, _ = grads(True)
    again, _, (first,) = grads(True, twice=True)
    for a, b, c, d in zip(over, kept, again, first):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    assert peak_kept - peak_over >= 0.9 * T * R * C * 4, (peak_over, peak_kept)  # H's bytes, less per-channel ones


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape", [(4 * 64, 192), (4 * 64, 200), (4 * 4, 24, 6, 6)], ids=["linear", "linear-tail", "conv"])
def test_batchnorm_backward_over_z_is_the_whole_call_bit_for_bit(shape, training: bool, monkeypatch) -> None:
    """BatchNorm's backward a chunk of channels at a time, each chunk's gradient written over z, gives the
    whole call's input, weight and bias gradients bit for bit (BatchNorm is per channel; a Linear's chunks
    start on multiples of 64 channels, so the channels past the last full vector are the whole call's), in
    z's storage."""
    from efficient.kernels import bn_lif as K

    monkeypatch.setattr(K, "RECOMPUTE_CHUNK_MIN", 64)  # several chunks at this size
    bn, z = _pair(shape, shape[1], seed=11)
    gy = torch.randn(shape, generator=torch.Generator().manual_seed(12))
    if training:
        _, mean, invstd = torch.native_batch_norm(z, bn.weight, bn.bias, None, None, True, 0.0, bn.eps)
        stats = torch.stack([mean, invstd])
    else:
        stats = torch.stack([bn.running_mean, bn.running_var])
    chunks = K._over_z_chunks(z)
    assert len(chunks) > 1
    if len(shape) == 2:  # and a tail past the last 64 channels in the "linear-tail" case
        assert all(c0 % K.OVER_Z_ALIGN == 0 for c0, _ in chunks)
    whole = K._bn_backward(gy, z, bn.weight.detach(), stats, training, bn.eps)
    z_over = z.clone()
    over = K._bn_backward_over_z(gy, z_over, bn.weight.detach(), stats, training, bn.eps)
    assert over[0].data_ptr() == z_over.data_ptr()
    for a, b in zip(over, whole):
        assert torch.equal(a, b)


class _LinearUnit(nn.Module):
    def __init__(self, shape: tuple[int, int, int], d_in: int) -> None:
        super().__init__()
        self.shape = shape
        self.lin, self.bn, self.lif = nn.Linear(d_in, shape[-1]), nn.BatchNorm1d(shape[-1]), LIF(backend="compile")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_fire(self.bn, self.lif, x, self.shape, linear=self.lin)


def test_the_eager_linear_unit_writes_batchnorm_gradient_over_z_unless_the_graph_is_kept(monkeypatch) -> None:
    """Without a kept graph the eager Linear unit's backward from its kept H writes BatchNorm's gradient over
    z (its own Linear output, which nothing else reads) where z is large: the step's peak falls by z's
    gradient and H beside the retained graph's, and the gradients are the same, bit for bit."""
    from efficient.kernels import bn_lif as K
    from efficient.kernels._backend import have_cxx_compiler
    from efficient.memory.measure import step_peak_bytes

    if not have_cxx_compiler():
        pytest.skip("no C++ compiler: inductor cannot compile on CPU")
    monkeypatch.setattr(K, "RECOMPUTE_CHUNK_MIN", 1 << 10)
    monkeypatch.setattr(K, "BN_BACKWARD_OVER_Z_MIN", 1 << 12)
    T, R, D, C = 4, 64, 16, 256
    torch.manual_seed(0)
    unit = _LinearUnit((T, R, C), D)
    x = (torch.rand(T * R, D, generator=torch.Generator().manual_seed(2)) < 0.3).float()
    g = torch.randn(T, R, C, generator=torch.Generator().manual_seed(3))
    assert len(K._over_z_chunks(torch.empty(T * R, C))) > 1

    def grads(retain: bool):
        for p in unit.parameters():
            p.grad = None
        peak = step_peak_bytes(lambda: (unit(x) * g).sum().backward(retain_graph=retain))
        return [p.grad.clone() for p in unit.parameters()], peak

    over, peak_over = grads(False)
    kept, peak_kept = grads(True)
    for a, b in zip(over, kept):
        assert torch.equal(a, b)
    z_bytes = T * R * C * 4  # H and z's gradient (aten's CPU backward also allocates an unwritten second buffer)
    assert peak_kept - peak_over >= 0.9 * 2 * z_bytes, (peak_over, peak_kept)


@pytest.mark.parametrize("keep_membrane", [True, False], ids=["kept-h", "rebuilt-h"])
def test_the_eager_linear_unit_drops_its_unpacked_input_before_the_input_gradient(keep_membrane: bool) -> None:
    """At level bits the Linear unit's input is kept as bits and unpacked in backward; the eager unit reads
    it for the weight's gradient and drops it before it makes the input's, so the backward never holds both
    (each of the input's size, here 16 times z's), and its gradients are level none's bit for bit."""
    from efficient import memory
    from efficient.kernels._backend import have_cxx_compiler
    from efficient.memory.measure import step_peak_bytes
    from efficient.models.replay import KEEP_TRACE_MARK, recording_rebuilds

    if not have_cxx_compiler():
        pytest.skip("no C++ compiler: inductor cannot compile on CPU")
    T, R, D, C = 4, 64, 512, 32
    z_in = torch.randn(T, R, D, generator=torch.Generator().manual_seed(2)) + 0.5
    g = torch.randn(T, R, C, generator=torch.Generator().manual_seed(3))
    out = {}
    for level in ("none", "bits"):
        torch.manual_seed(0)
        first, unit = LIF(backend="compile"), _LinearUnit((T, R, C), D)  # `first` makes the input spikes
        model = nn.Sequential(first, nn.Flatten(0, 1), unit)
        memory.optimize(model, level)
        if keep_membrane:
            unit.bn.__dict__[KEEP_TRACE_MARK] = True
            unit.lif.__dict__[KEEP_TRACE_MARK] = True
        with recording_rebuilds() as rebuilt:
            loss = (model(z_in) * g).sum()
        assert bool(rebuilt) == (level == "bits" and not keep_membrane)  # the path this case is about
        peak = step_peak_bytes(loss.backward)
        out[level] = [p.grad.clone() for p in unit.parameters()], peak
    for a, b in zip(out["none"][0], out["bits"][0]):
        assert torch.equal(a, b)
    x_bytes = T * R * D * 4
    assert out["bits"][1] < 1.5 * x_bytes, out["bits"][1] / x_bytes


def test_reference_backend_is_batch_norm_then_the_lif_reference() -> None:
    zshape, nshape = LAYOUTS["conv"]
    bn, z = _pair(zshape, 3, seed=4, dtype=torch.float64)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    s = bn_lif(z, 4, bn.weight, bn.bias, rm, rv, backend="torch")
    ref, _ = bn_lif_reference(z, 4, bn.weight, bn.bias, bn.running_mean.clone(), bn.running_var.clone())
    loop = bn_lif(z, 4, bn.weight, bn.bias, bn.running_mean.clone(), bn.running_var.clone(), backend="loop")
    assert torch.equal(s, ref) and torch.equal(loop, ref)
    assert not torch.equal(rm, bn.running_mean)  # training moved the running statistics


def test_units_fall_back_where_fusion_would_hide_something() -> None:
    bn = nn.BatchNorm1d(6)
    assert fusable(LIF(), bn)
    assert not fusable(PLIF(), bn)  # a learnable rate is not fused
    assert not fusable(LIF(store_membrane=True), bn)
    watched = LIF()
    watched.register_forward_hook(lambda *a: None)  # a profiler or spike tracker must see the neuron run
    assert not fusable(watched, bn)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast chooses each call's dtype
        assert not fusable(LIF(), bn)
    h = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert not fusable(LIF(), bn)
    finally:
        h.remove()
    # BatchNorm without running statistics or without affine parameters: the separate calls
    zshape, nshape = LAYOUTS["linear"]
    z = torch.randn(zshape)
    for plain in (nn.BatchNorm1d(6, track_running_stats=False), nn.BatchNorm1d(6, affine=False)):
        out = norm_fire(plain, LIF(backend="loop"), z, nshape)
        assert torch.equal(out, LIF(backend="loop")(plain(z).reshape(nshape)))


def test_a_spikformer_unit_trains_as_the_separate_modules() -> None:
    """Three SGD steps of a Linear -> BatchNorm -> LIF unit: weights and statistics bit for bit."""
    from efficient.models.spikformer import LinearBNLIF

    torch.manual_seed(0)
    fused = LinearBNLIF(8, 6, {"backend": "loop"})
    separate = copy.deepcopy(fused)
    separate.lif.register_forward_hook(lambda *a: None)  # a hooked neuron runs the separate modules
    x = (torch.rand(4, 2, 5, 8, generator=torch.Generator().manual_seed(1)) < 0.4).float()
    for unit in (fused, separate):
        opt = torch.optim.SGD(unit.parameters(), lr=0.5)
        for _ in range(3):
            opt.zero_grad()
            (unit(x) * torch.arange(6.0)).sum().backward()
            opt.step()
    for (k, a), b in zip(fused.state_dict().items(), separate.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_running_out_gives_each_concatenated_batchnorm_its_own_statistics(backend: str) -> None:
    """Two BatchNorms (3 and 5 channels) run as one over their concatenated channels, as a fused
    unit runs them: each one's running statistics end as if it had run alone."""
    torch.manual_seed(0)
    bns = [nn.BatchNorm1d(3), nn.BatchNorm1d(5)]
    for b in bns:
        b.running_mean.uniform_(-1, 1)
        b.running_var.uniform_(0.5, 2.0)
    alone = copy.deepcopy(bns)
    z = torch.randn(8, 8)
    alone[0](z[:, :3])
    alone[1](z[:, 3:])
    rm, rv = torch.cat([b.running_mean for b in bns]), torch.cat([b.running_var for b in bns])
    w, bias = torch.cat([b.weight for b in bns]), torch.cat([b.bias for b in bns])
    dest = [b.running_mean for b in bns] + [b.running_var for b in bns]
    bn_lif(z, 2, w, bias, rm, rv, True, 0.1, 1e-5, backend=backend, running_out=dest)
    for mine, ref in zip(bns, alone):
        assert torch.allclose(mine.running_mean, ref.running_mean, rtol=1e-6, atol=1e-7)
        assert torch.allclose(mine.running_var, ref.running_var, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="running_out must hold k means then k variances"):
        bn_lif(z, 2, w, bias, rm, rv, backend=backend, running_out=dest[:3])


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("neuron_kw", [
    {},
    {"v_reset": None, "decay_input": False, "surrogate": "atan", "detach_reset": False},
], ids=["spikformer", "soft-no-decay-atan"])
def test_without_the_membrane_the_backward_rebuilds_it(training: bool, neuron_kw: dict, monkeypatch) -> None:
    """`keep_membrane=False`: autograd keeps z and not H, and the backward rebuilds H from z a chunk
    of channels at a time: the same spikes and running statistics, gradients within the rounding of
    the surrogate's exp, and a lower peak of live tensor bytes over forward + backward. A unit
    smaller than two chunks keeps H (rebuilt whole, it would hold as much)."""
    from efficient.kernels import bn_lif as K
    from efficient.memory.measure import step_peak_bytes

    bn, z0 = _pair((4 * 4, 8, 16, 16), 8, seed=3)

    def run(keep: bool) -> tuple[list[torch.Tensor], int, int]:
        b, z = copy.deepcopy(bn), z0.clone().requires_grad_()
        go = torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
        kept = []
        out = []

        def step() -> None:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
                s = bn_lif(z, 4, b.weight, b.bias, b.running_mean, b.running_var, training, 0.1, 1e-5, backend="loop",
                           keep_membrane=keep, **neuron_kw)
            (s * go).sum().backward()
            out.append(s)

        peak = step_peak_bytes(step)
        return [out[0], z.grad, b.weight.grad, b.bias.grad, b.running_mean, b.running_var], peak, sum(kept)

    keep, peak_keep, saved_keep = run(True)
    assert run(False)[2] == saved_keep  # one chunk (the default 4 Mi elements) holds the whole unit: H kept
    for channels in (4, 3):  # 2 chunks; 3 chunks, the last short
        monkeypatch.setattr(K, "RECOMPUTE_CHUNK", channels * z0.numel() // 8)
        lean, peak_lean, saved_lean = run(False)
        assert saved_keep - saved_lean == z0.numel() - 8  # H (z's size) is not kept; BatchNorm's bias (8) is
        assert torch.equal(keep[0], lean[0])
        for a, b in zip(keep[1:], lean[1:]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert peak_lean < peak_keep, (channels, peak_lean, peak_keep)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_without_the_membrane_the_forward_runs_by_chunks_of_channels(training: bool, monkeypatch) -> None:
    """Without H the forward of a conv unit takes a chunk of channels at a time: the spikes, BatchNorm's
    statistics and the running statistics of the whole call bit for bit (in place or as new tensors),
    and a lower peak of live tensor bytes (BatchNorm's output and the LIF's temporaries for one chunk)."""
    from efficient.kernels import bn_lif as K
    from efficient.memory.measure import step_peak_bytes

    bn, z = _pair((4 * 4, 8, 16, 16), 8, seed=12)
    w, b = bn.weight.detach(), bn.bias.detach()
    rm0, rv0 = torch.rand(8), torch.rand(8) + 0.5  # away from the defaults

    def run(channels: int, inplace: bool) -> tuple[list[torch.Tensor], int]:
        monkeypatch.setattr(K, "RECOMPUTE_CHUNK", channels * z.numel() // 8)
        rm, rv = rm0.clone(), rv0.clone()
        out = []
        peak = step_peak_bytes(lambda: out.append(K._forward_impl(
            z, 4, w, b, rm, rv, training, 0.1, 1e-5, 2.0, 1.0, 0.0, 0, 0, 4.0, True, torch.float32, "loop",
            keep_membrane=False, inplace=inplace)))
        s, h, stats, new_mean, new_var = out[0]
        assert h.numel() == 0
        return [s, stats, new_mean, new_var, rm, rv], peak

    for inplace in (False, True):
        whole, peak_whole = run(8, inplace)
        assert len(K._channel_chunks(z)) == 1
        for channels, chunks in ((4, 2), (3, 3)):  # 4 channels each; 3 then 3 then 2
            got, peak = run(channels, inplace)
            assert len(K._channel_chunks(z)) == chunks
            for a, c in zip(whole, got):
                assert torch.equal(a, c), (inplace, chunks)
            assert peak < peak_whole, (inplace, chunks, peak, peak_whole)
    if training:
        assert not torch.equal(whole[4], rm0)  # the statistics did move (the last runs update in place)


def test_the_rebuilt_membrane_is_the_forwards_bit_for_bit() -> None:
    """The op's backward without H, in one piece, is the backward from the kept H bit for bit."""
    from efficient.kernels import bn_lif as K

    bn, z = _pair((2 * 4, 6, 8, 8), 6, seed=6)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(2))
    for training in (True, False):
        s, h, stats, _, _ = K._forward_impl(z, 2, bn.weight.detach(), bn.bias.detach(), bn.running_mean.clone(),
                                            bn.running_var.clone(), training, 0.1, 1e-5, 2.0, 1.0, 0.0, 0, 0, 4.0, True,
                                            torch.float32, "loop")
        args = (training, 1e-5, 2.0, 1.0, 0.0, 0, 0, 4.0, True, "loop")
        kept = K._backward_impl(g, z, h, bn.weight.detach(), stats, *args)
        rebuilt = K._recompute_backward_impl(g, z, 2, bn.weight.detach(), bn.bias.detach(), stats, *args)
        for a, b in zip(kept, rebuilt):
            assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(96, 40), (37, 13), (8, 6, 9, 9), (12, 16, 8, 8), (5, 7, 11)])
@pytest.mark.parametrize("eps", [1e-5, 1e-3, 0.1])
def test_batchnorm_rebuilt_from_its_statistics_is_the_training_output_bit_for_bit(shape, eps: float) -> None:
    """The backward's BatchNorm output from the forward's saved mean and invstd (one pass, aten's eval
    kernel) is the training call's bit for bit, whole and for a chunk of channels."""
    from efficient.kernels import bn_lif as K

    gen = torch.Generator().manual_seed(len(shape) + int(1 / eps))
    C = shape[1]
    z = torch.randn(shape, generator=gen) * 3 + 1.5
    w, b = torch.randn(C, generator=gen), torch.randn(C, generator=gen)
    y, mean, invstd = torch.native_batch_norm(z, w, b, torch.zeros(C), torch.ones(C), True, 0.1, eps)
    stats = torch.stack([mean, invstd])
    assert K._unit_variance(eps) is not None  # the one-pass path is taken, not the fallback
    assert torch.equal(K._bn_rebuild(z, w, b, stats, eps), y)
    zc = z[:, 1:C - 1].contiguous()
    assert torch.equal(K._bn_rebuild(zc, w[1:C - 1], b[1:C - 1], stats[:, 1:C - 1].contiguous(), eps), y[:, 1:C - 1])
    # a dtype the one-pass path does not cover runs BatchNorm's training call again
    zd, wd, bd = z.double(), w.double(), b.double()
    yd, md, sd = torch.native_batch_norm(zd, wd, bd, None, None, True, 0.1, eps)
    assert torch.equal(K._bn_rebuild(zd, wd, bd, torch.stack([md, sd]), eps), yd)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_the_unit_with_its_linear_rebuilds_the_membrane_too(training: bool, monkeypatch) -> None:
    """The Linear -> BatchNorm -> LIF op without H: the same spikes and gradients (input, Linear and
    BatchNorm parameters) as keeping it, a chunk of channels at a time too."""
    from efficient.kernels import bn_lif as K

    bn, z0 = _pair((4 * 6, 8), 8, seed=4)
    g = torch.Generator().manual_seed(9)
    x0, lw0, lb0 = torch.randn(4 * 6, 5, generator=g), torch.randn(8, 5, generator=g), torch.randn(8, generator=g)

    def run(keep: bool) -> list[torch.Tensor]:
        b = copy.deepcopy(bn)
        x, lw, lb = (t.clone().requires_grad_() for t in (x0, lw0, lb0))
        s = bn_lif(x, 4, b.weight, b.bias, b.running_mean, b.running_var, training, 0.1, 1e-5, lin_weight=lw,
                   lin_bias=lb, backend="loop", keep_membrane=keep)
        (s * torch.linspace(-1, 1, s.numel()).view(s.shape)).sum().backward()
        return [s, x.grad, lw.grad, lb.grad, b.weight.grad, b.bias.grad, b.running_mean, b.running_var]

    keep = run(True)
    monkeypatch.setattr(K, "RECOMPUTE_CHUNK", 3 * 4 * 6)  # 3 channels a chunk
    chunked = run(False)
    assert torch.equal(keep[0], chunked[0])
    for a, b in zip(keep[1:], chunked[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad, match", [
    (dict(z=torch.randn(7, 3)), "must be T\\*R for T=2"),
    (dict(z=torch.randn(8)), "at least 2 dims"),
    (dict(weight=torch.ones(4)), "weight must hold one value per channel \\(3\\)"),
    (dict(z=torch.ones(8, 3, dtype=torch.long)), "floating point"),
    (dict(z=torch.randn(8, 5), lin_weight=torch.randn(3, 4)), "with lin_weight \\[C, D_in\\] the input must be"),
])
def test_bad_input_is_named(bad: dict, match: str) -> None:
    args = dict(z=torch.randn(8, 3), steps=2, weight=torch.ones(3), bias=torch.zeros(3), running_mean=torch.zeros(3),
                running_var=torch.ones(3))
    with pytest.raises(ValueError, match=match):
        bn_lif(**{**args, **bad}, backend="loop")


INTERPRETER = textwrap.dedent(
    """
    import copy, torch
    from torch import nn
    from efficient.kernels.bn_lif import bn_lif
    torch.manual_seed(0)

    def batch_norm_and_input(shape):
        bn = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(shape[1])
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5); bn.bias.uniform_(-0.2, 0.2)
            bn.running_mean.uniform_(-0.5, 0.5); bn.running_var.uniform_(0.5, 2.0)
        return bn, (torch.randn(shape) * 1.3).requires_grad_()

    for shape, T in (((4 * 3 * 5, 6), 4), ((2 * 2, 3, 4, 4), 2)):
        C = shape[1]
        bn, z = batch_norm_and_input(shape)
        for training in (True, False):
            outs = {}
            for impl in ("loop", "triton"):
                b = copy.deepcopy(bn)
                zz = z.detach().clone().requires_grad_()
                s = bn_lif(zz, T, b.weight, b.bias, b.running_mean, b.running_var, training, 0.1, 1e-5, impl=impl)
                g = torch.linspace(-1, 1, s.numel()).view(s.shape)
                (s * g).sum().backward()
                outs[impl] = (s, zz.grad, b.weight.grad, b.bias.grad, b.running_mean, b.running_var)
            a, t = outs["loop"], outs["triton"]
            flips = int((a[0] != t[0]).sum())
            assert flips <= 1, f"{flips} spikes differ"
            for x, y in zip(a[1:], t[1:]):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    # the forward's launches: one reduction (training) and the kernel, no per-channel arithmetic
    from torch.utils._python_dispatch import TorchDispatchMode
    from efficient.kernels import bn_lif as K

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, f, types, args=(), kwargs=None):
            self.names.append(f.overloadpacket.__name__)
            return f(*args, **(kwargs or {}))

    class Launcher:  # stands in for the jitted kernel: records each launch
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(k["TRAINING"])

    launches, real = [], K._bn_lif_fwd_kernel
    K._bn_lif_fwd_kernel = Launcher()
    try:
        bn = nn.BatchNorm1d(5)
        z, w, b = torch.randn(12, 5), bn.weight.detach(), bn.bias.detach()
        for training in (True, False):
            with Ops() as ops:
                K._triton_forward(z, 2, w, b, bn.running_mean, bn.running_var, training, 0.1, 1e-5, 2.0, 1.0, 0.0, 0,
                                  torch.float32)
            work = [n for n in ops.names if not n.startswith("empty") and n != "new_empty"]
            assert work == (["var_mean"] if training else []), work
        assert launches == [True, False], launches
    finally:
        K._bn_lif_fwd_kernel = real
    # without the membrane trace: the recompute kernel rebuilds H as the forward kernel made it, whole
    # and a chunk of channels at a time (each chunk reads its own channels' statistics)
    for shape, T in (((4 * 3 * 5, 6), 4), ((2 * 2, 5, 4, 4), 2)):
        C = shape[1]
        bn, z = batch_norm_and_input(shape)
        for training in (True, False):
            outs = []
            for keep, chunk in ((True, 1 << 22), (False, 1 << 22), (False, 2 * z.numel() // C)):
                K.RECOMPUTE_CHUNK = chunk
                b = copy.deepcopy(bn)
                zz = z.detach().clone().requires_grad_()
                s = bn_lif(zz, T, b.weight, b.bias, b.running_mean, b.running_var, training, 0.1, 1e-5,
                           impl="triton", surrogate="sigmoid", keep_membrane=keep)
                (s * torch.linspace(-1, 1, s.numel()).view(s.shape)).sum().backward()
                outs.append((s, zz.grad, b.weight.grad, b.bias.grad))
            K.RECOMPUTE_CHUNK = 1 << 22
            for other in outs[1:]:
                assert torch.equal(outs[0][0], other[0])
                for x, y in zip(outs[0][1:], other[1:]):
                    torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    # BatchNorm -> LIF -> max-pool a chunk of channels at a time: the Triton forward and recompute kernels per chunk
    import torch.nn.functional as F
    from efficient.kernels.bn_lif import bn_lif_max_pool
    bn, z = batch_norm_and_input((2 * 2, 5, 6, 6))
    z = z.detach()
    K.RECOMPUTE_CHUNK = 2 * z.numel() // 5
    outs = []
    for pooled in (False, True):
        b = copy.deepcopy(bn)
        zz = z.clone().requires_grad_()
        args = (zz, 2, b.weight, b.bias, b.running_mean, b.running_var)
        if pooled:
            p = bn_lif_max_pool(*args, ([3, 3], [2, 2], [1, 1], [1, 1], False), True, 0.1, 1e-5, impl="triton")
        else:
            p = F.max_pool2d(bn_lif(*args, True, 0.1, 1e-5, impl="triton"), 3, 2, 1)
        (p * torch.linspace(-1, 1, p.numel()).view(p.shape)).sum().backward()
        outs.append((p, zz.grad, b.weight.grad, b.bias.grad, b.running_mean, b.running_var))
    K.RECOMPUTE_CHUNK = 1 << 22
    assert int((outs[0][0] != outs[1][0]).sum()) <= 1
    for x, y in zip(outs[0][1:], outs[1][1:]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    print("TRITON-OK")
    """
)


def test_triton_kernel_matches_the_cpu_path_in_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "TRITON-OK" in proc.stdout, proc.stderr[-3000:]


def test_flop_counts_do_not_change_with_the_path() -> None:
    """torch's FLOP counter (and so any profile built on it) counts the unit op as it counts the
    separate Linear, BatchNorm and LIF calls, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from efficient.models.spikformer import LinearBNLIF

    torch.manual_seed(0)
    unit = LinearBNLIF(8, 6, {"backend": "loop"})
    x = torch.rand(4, 2, 5, 8).requires_grad_()
    counts = []
    for separate in (False, True):
        u = copy.deepcopy(unit)
        if separate:
            u.lif.register_forward_hook(lambda *a: None)
        with FlopCounterMode(display=False) as fc:
            u(x).sum().backward()
        counts.append(fc.get_total_flops())
    assert counts[0] == counts[1] > 0


POOL = ([3, 3], [2, 2], [1, 1], [1, 1], False)  # the SPS stem's MaxPool2d(3, 2, 1)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("neuron_kw", [
    {},
    {"v_reset": None, "decay_input": False, "surrogate": "atan", "detach_reset": False},
], ids=["spikformer", "soft-no-decay-atan"])
def test_the_pooled_stage_is_bn_lif_then_its_max_pool(training: bool, neuron_kw: dict, monkeypatch) -> None:
    """`bn_lif_max_pool` (BatchNorm, LIF and max-pool a chunk of channels at a time, backward
    likewise): the pooled spikes and running statistics of `bn_lif` then the pool, gradients within
    the rounding of the surrogate's exp, and a lower peak of live tensor bytes than `bn_lif` without
    its membrane followed by a pool that keeps window offsets."""
    import torch.nn.functional as F

    from efficient.kernels import bn_lif as K
    from efficient.kernels.bn_lif import bn_lif_max_pool
    from efficient.memory.measure import step_peak_bytes
    from efficient.memory.spikes import _CompactMaxPool2d

    bn, z0 = _pair((4 * 4, 8, 16, 16), 8, seed=8)
    monkeypatch.setattr(K, "RECOMPUTE_CHUNK", 3 * z0.numel() // 8)  # 3 chunks, the last short

    def run(how: str) -> tuple[list[torch.Tensor], int]:
        b, z = copy.deepcopy(bn), z0.clone().requires_grad_()
        out = []

        def step() -> None:
            args = (z, 4, b.weight, b.bias, b.running_mean, b.running_var)
            if how == "pooled":
                p = bn_lif_max_pool(*args, POOL, training, 0.1, 1e-5, backend="loop", **neuron_kw)
            else:
                s = bn_lif(*args, training, 0.1, 1e-5, backend="loop", keep_membrane=how == "keep", **neuron_kw)
                p = F.max_pool2d(s, 3, 2, 1) if how == "keep" else _CompactMaxPool2d.apply(s, *POOL)
            (p * torch.linspace(-1, 1, p.numel()).view(p.shape)).sum().backward()
            out.append(p)

        peak = step_peak_bytes(step)
        return [out[0], z.grad, b.weight.grad, b.bias.grad, b.running_mean, b.running_var], peak

    keep, _ = run("keep")
    lean, peak_lean = run("lean")
    pooled, peak_pooled = run("pooled")
    assert pooled[0].shape == (16, 8, 8, 8) and torch.equal(keep[0], pooled[0])
    for a, b in zip(keep[1:], pooled[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert peak_pooled < peak_lean, (peak_pooled, peak_lean)


def test_the_pooled_stage_writes_z_gradient_into_a_donated_z(monkeypatch) -> None:
    """`bn_lif_max_pool(donate=True)` on a fresh z (a convolution's output): z's gradient is written into
    z's storage, so backward never holds the two whole. The gradients are the undonated call's bit for
    bit, the peak is lower, and a second backward through the graph fails autograd's saved-tensor check."""
    from efficient.kernels import bn_lif as K
    from efficient.kernels.bn_lif import bn_lif_max_pool
    from efficient.memory.measure import step_peak_bytes

    bn, z0 = _pair((4 * 4, 8, 16, 16), 8, seed=13)
    w = torch.randn(8, 8, 1, 1, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(K, "RECOMPUTE_CHUNK", 3 * z0.numel() // 8)  # 3 chunks, the last short

    def run(donate: bool, retain: bool = False):
        b, x, cw = copy.deepcopy(bn), z0.clone().requires_grad_(), w.clone().requires_grad_()
        out = []

        def step() -> None:
            z = torch.nn.functional.conv2d(x, cw)  # fresh: nothing else reads it
            p = bn_lif_max_pool(z, 4, b.weight, b.bias, b.running_mean, b.running_var, POOL, True, 0.1, 1e-5,
                                backend="loop", donate=donate)
            (p * torch.linspace(-1, 1, p.numel()).view(p.shape)).sum().backward(retain_graph=retain)
            out.append(p)

        peak = step_peak_bytes(step)
        return [out[0], x.grad, cw.grad, b.weight.grad, b.bias.grad, b.running_mean, b.running_var], peak

    kept, peak_kept = run(False)
    donated, peak_donated = run(True)
    for a, c in zip(kept, donated):
        assert torch.equal(a, c)
    assert peak_donated < peak_kept, (peak_donated, peak_kept)
    b, x = copy.deepcopy(bn), z0.clone().requires_grad_()
    p = bn_lif_max_pool(x * 1, 4, b.weight, b.bias, b.running_mean, b.running_var, POOL, True, 0.1, 1e-5,
                        backend="loop", donate=True)
    loss = p.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_the_pooled_stage_left_uncomputed_has_the_computed_calls_gradients(donate: bool, monkeypatch) -> None:
    """`bn_lif_max_pool(compute=False)` (a rerun whose output nothing reads): zeros of the pooled shape
    that own no memory, the running statistics left alone, and a backward whose gradients are the
    computed call's bit for bit (its chunks take BatchNorm's statistics again, per channel)."""
    from efficient.kernels import bn_lif as K
    from efficient.kernels.bn_lif import bn_lif_max_pool

    bn, x0 = _pair((4 * 4, 8, 16, 16), 8, seed=21)
    w = torch.randn(8, 8, 1, 1, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(K, "RECOMPUTE_CHUNK", 3 * x0.numel() // 8)  # 3 chunks, the last short
    g = torch.linspace(-1, 1, 16 * 8 * 8 * 8).view(16, 8, 8, 8)

    def run(compute: bool):
        b, x, cw = copy.deepcopy(bn), x0.clone().requires_grad_(), w.clone().requires_grad_()
        z = torch.nn.functional.conv2d(x, cw)
        p = bn_lif_max_pool(z, 4, b.weight, b.bias, b.running_mean, b.running_var, POOL, True, 0.1, 1e-5,
                            backend="loop", donate=donate, compute=compute)
        p.backward(g)
        return p, [x.grad, cw.grad, b.weight.grad, b.bias.grad], [b.running_mean, b.running_var]

    p, grads, running = run(True)
    q, grads_unread, running_unread = run(False)
    assert q.shape == p.shape == (16, 8, 8, 8) and q.stride() == (0, 0, 0, 0) and not q.any()
    assert torch.equal(running_unread[0], bn.running_mean) and torch.equal(running_unread[1], bn.running_var)
    assert not torch.equal(running[0], bn.running_mean)
    for a, c in zip(grads, grads_unread):
        assert torch.equal(a, c)


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_the_pooled_stage_compiled_runs_as_its_op_pair_with_the_eager_values(donate: bool, monkeypatch) -> None:
    """Under torch.compile `bn_lif_max_pool` runs as `efficient::bn_lif_max_pool_forward` / `_backward`
    (the eager path's autograd.Function is not traced): the pooled spikes, running statistics and
    batch-count bookkeeping of the eager call, gradients within rounding, the op in the graph. With a
    donated z (a convolution's output), backward is `_backward_into`, which writes z's gradient into z."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from efficient.kernels import bn_lif as K
    from efficient.kernels.bn_lif import bn_lif_max_pool

    bn, z0 = _pair((4 * 4, 8, 16, 16), 8, seed=9)
    monkeypatch.setattr(K, "RECOMPUTE_CHUNK", 3 * z0.numel() // 8)  # 3 chunks, the last short
    seen: list = []

    def grab(gm: torch.fx.GraphModule, _inputs):
        # a mutating op reaches the graph functionalized: auto_functionalized(op, ...)
        seen.extend(n.args[0] if "auto_functionalized" in str(n.target) else n.target
                    for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm)

    cw0 = torch.randn(8, 8, 1, 1, generator=torch.Generator().manual_seed(3))

    def run(compiled: bool) -> list[torch.Tensor]:
        b, z, cw = copy.deepcopy(bn), z0.clone().requires_grad_(), cw0.clone().requires_grad_()

        def f(z: torch.Tensor) -> torch.Tensor:
            if donate:  # a convolution's fresh output, which nothing else reads
                z = torch.nn.functional.conv2d(z, cw)
            return bn_lif_max_pool(z, 4, b.weight, b.bias, b.running_mean, b.running_var, POOL, True, 0.1, 1e-5,
                                   backend="loop", donate=donate)

        if compiled:
            torch._dynamo.reset()
            f = torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=grab, bw_compiler=grab))
        p = f(z)
        (p * torch.linspace(-1, 1, p.numel()).view(p.shape)).sum().backward()
        torch._dynamo.reset()
        return [p, z.grad, b.weight.grad, b.bias.grad, b.running_mean, b.running_var] + ([cw.grad] if donate else [])

    eager, compiled = run(False), run(True)
    assert torch.ops.efficient.bn_lif_max_pool_forward.default in seen
    backward = torch.ops.efficient.bn_lif_max_pool_backward_into if donate else torch.ops.efficient.bn_lif_max_pool_backward
    assert backward.default in seen, seen
    assert torch.equal(eager[0], compiled[0])
    for a, b in zip(eager[1:], compiled[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_pooled_stage_declines_where_it_does_not_apply() -> None:
    """None (the caller runs `bn_lif` and its pool) for the reference backend and for a unit of one
    chunk; a named error for a z that is not a conv stage's."""
    from efficient.kernels.bn_lif import bn_lif_max_pool

    bn, z = _pair((2 * 2, 3, 8, 8), 3, seed=1)
    args = (z, 2, bn.weight, bn.bias, bn.running_mean, bn.running_var, POOL)
    assert bn_lif_max_pool(*args, backend="torch") is None
    assert bn_lif_max_pool(*args, backend="loop") is None  # 768 elements: one chunk
    with pytest.raises(ValueError, match="conv stage's \\[T\\*R, C, H, W\\]"):
        bn_lif_max_pool(z.flatten(2), *args[1:], backend="loop")
