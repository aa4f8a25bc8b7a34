"""The eager recomputed region (`efficient.memory.recompute._Region`): a unit's forward without autograd,
its rerun in backward. Gradients, running statistics and random draws as a plain step's; the calls it
leaves to torch's checkpoint; the error for a unit that uses a parameter it does not own."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from efficient.memory import recompute


class _Unit(nn.Module):
    """Linear -> BatchNorm -> dropout, two outputs and plain values beside them."""

    recompute_unit = True

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, scale: float = 1.0, tag: str = "") -> tuple:
        h = self.drop(self.bn(self.fc(x))) * scale
        return h * gate, None, {"sum": h.sum(1), "n": 3}


class _Net(nn.Module):
    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self.inp, self.unit, self.out = nn.Linear(4, 6), unit, nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y, none, extra = self.unit(self.inp(x), gate, scale=2.0, tag="t")
        assert none is None and extra["n"] == 3
        return self.out(y) + extra["sum"][:, None]


def _step(net: nn.Module, saved: list | None = None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, gate = torch.randn(8, 4, generator=g), torch.rand(8, 6, generator=g)
    torch.manual_seed(0)  # the dropout's draw
    if saved is None:
        loss = (net(x, gate) ** 2).mean()
    else:  # the forward's saves, by shape
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            loss = (net(x, gate) ** 2).mean()
    loss.backward()
    return [p.grad.clone() for p in net.parameters()], {k: v.clone() for k, v in net.state_dict().items()}


def test_a_region_trains_as_the_plain_unit_and_keeps_only_its_inputs() -> None:
    torch.manual_seed(0)
    plain = _Net(_Unit()).train()
    region = copy.deepcopy(plain)
    recompute.wrap(region.unit)
    saved: list[torch.Size] = []
    calls = {"region": 0}
    forward = recompute._Region.forward

    def counting(*args, **kwargs):
        calls["region"] += 1
        return forward(*args, **kwargs)

    _step(region)  # a unit's first call runs under torch's checkpoint, which measures its output
    _step(plain)
    for net in (region, plain):
        net.zero_grad(set_to_none=True)
    recompute._Region.forward = staticmethod(counting)
    try:
        g_region, s_region = _step(region, saved)
    finally:
        recompute._Region.forward = staticmethod(forward)
    g_plain, s_plain = _step(plain)
    assert calls["region"] == 1
    for a, b in zip(g_region, g_plain):  # the dropout replays its draw, BatchNorm its batch statistics
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for k in s_plain:  # running statistics and the batch count updated once
        assert torch.equal(s_region[k], s_plain[k]), k
    # what the forward keeps of the unit: its two tensor inputs, nothing of the Linear, BatchNorm or dropout
    plain_saved: list[torch.Size] = []
    _step(copy.deepcopy(plain), plain_saved)
    assert saved.count(torch.Size([8, 6])) == 2 + 1, saved  # x and gate for the region, the out Linear's input
    assert plain_saved.count(torch.Size([8, 6])) > 3, plain_saved


class _Holder:
    """An argument the region cannot look into: it holds a tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _HolderUnit(nn.Module):
    recompute_unit = True

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, holder: _Holder) -> torch.Tensor:
        return self.fc(x) * holder.t


def test_a_call_with_an_object_argument_is_left_to_torch_checkpoint() -> None:
    """The tensor inside the object is differentiable: torch's checkpoint sees it, the region could not."""
    torch.manual_seed(0)
    unit = _HolderUnit()
    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(8, 6)
    unit(x, _Holder(w)).sum().backward()
    expected = (w.grad.clone(), unit.fc.weight.grad.clone())
    w.grad = None
    unit.fc.weight.grad = None
    recompute.wrap(unit)
    unit.__dict__[recompute._OUT_NUMEL] = 0  # as after a first call with a small output
    applied = {"n": 0}
    apply = recompute._Region.apply

    def counting(*a):
        applied["n"] += 1
        return apply(*a)

    recompute._Region.apply = counting
    try:
        unit(x, _Holder(w)).sum().backward()
    finally:
        recompute._Region.apply = apply
    assert applied["n"] == 0
    torch.testing.assert_close(w.grad, expected[0])
    torch.testing.assert_close(unit.fc.weight.grad, expected[1])


class _Borrowing(nn.Module):
    """A unit that calls a module it does not own (and does not name in recompute_modules())."""

    recompute_unit = True

    def __init__(self, other: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        object.__setattr__(self, "other", other)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(self.fc(x))


def test_a_unit_using_a_parameter_it_does_not_own_is_an_error_not_a_lost_gradient() -> None:
    unit = _Borrowing(nn.Linear(6, 6))
    recompute.wrap(unit)
    unit.__dict__[recompute._OUT_NUMEL] = 0  # as after a first call with a small output
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"_Borrowing uses trainable tensors .*recompute_modules"):
        unit(x).sum().backward()


def test_a_region_is_differentiable_once() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    lin = nn.Linear(6, 6)
    recompute.wrap(lin)
    lin.__dict__[recompute._OUT_NUMEL] = 0  # as after a first call with a small output
    y = lin(x).pow(2).sum()
    (gx,) = torch.autograd.grad(y, x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|marked with @once_differentiable"):
        gx.sum().backward()


class _Counts(nn.Module):
    """A unit whose input is a count of spikes, as it says (`recompute_count_bound`), and which reports
    whether the spike propagation watched its forward."""

    recompute_unit = True
    recompute_residual = True
    recompute_count_bound = 2

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.watched: list[bool] = []


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from efficient.memory.spikes import active_tracker

        self.watched.append((torch.is_grad_enabled(), active_tracker() is not None))
        return x + self.fc(x)


def test_a_region_forward_runs_unwatched_and_keeps_a_vouched_input_as_counts() -> None:
    """The region's forward runs without the spike propagation (it saves nothing; the mode costs a
    Python frame per torch call) and its rerun in backward outside it as before; the input the unit
    vouches for is still kept as uint8 counts, though no op the propagation followed made it."""
    from efficient import memory
    from efficient.memory.spikes import PackedSaved
    from efficient.models.neurons import LIF

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.n1, self.n2, self.unit, self.out = nn.Linear(4, 6), LIF(), LIF(), _Counts(), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            with torch._C.DisableTorchFunction():  # an op the propagation does not see: untracked sum
                c = self.n1(h) + self.n2(-h)
            return self.out(self.unit(c))

    torch.manual_seed(0)
    net = Net()
    plan = memory.optimize(net, "recompute")
    x = torch.randn(4, 3, 4) * 3
    net(x).sum().backward()  # the first call measures the unit's output (a checkpoint's)
    kept: list = []
    plan.hooks.observer = lambda t, k: kept.append(k)
    net.unit.watched.clear()
    net(x).sum().backward()
    assert net.unit.watched == [(False, False), (True, False)]  # forward unwatched; rerun outside the mode
    counts = [k for k in kept if isinstance(k, PackedSaved) and k.bound == 2]
    assert len(counts) == 1 and counts[0].data.dtype == torch.uint8 and tuple(counts[0].shape) == (4, 3, 6)
