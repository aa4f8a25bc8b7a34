"""BatchNorm then a 2-D max-pool by chunks of channels (`efficient.kernels.bn_max_pool`): the separate aten
calls' outputs, running statistics and gradients channel for channel, a lower peak, and a declined call
where something must see the ops."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from efficient.kernels import bn_lif as K
from efficient.kernels.bn_max_pool import bn_max_pool
from efficient.memory.measure import step_peak_bytes

POOL = ([3, 3], [2, 2], [1, 1], [1, 1], False)  # the stems' MaxPool2d(3, 2, 1)


def _bn(channels: int, seed: int) -> nn.BatchNorm2d:
    """A BatchNorm with trained-looking parameters and running statistics (negative scales too: a max-pool
    of its output is not its max-pool's normalisation)."""
    g = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.weight.copy_(torch.randn(channels, generator=g))
        bn.bias.copy_(0.2 * torch.randn(channels, generator=g))
        bn.running_mean.copy_(0.1 * torch.randn(channels, generator=g))
        bn.running_var.copy_(0.5 + torch.rand(channels, generator=g))
    return bn


def _run(bn0: nn.BatchNorm2d, x0: torch.Tensor, how: str, pool: tuple = POOL):
    """One step of a scaling (whose output is fresh, as a convolution's: `donate` may write into it, and whose
    backward keeps nothing) -> BatchNorm -> max-pool: [output, x.grad, bn weight grad, bn bias grad, running
    mean, running var], and the step's peak of live bytes."""
    bn, x = copy.deepcopy(bn0), x0.clone().requires_grad_()
    out = []

    def pooled() -> torch.Tensor:  # z lives only in autograd's graph, as a model's intermediate does
        z = x * 1.5
        if how == "separate":
            return F.max_pool2d(bn(z), *pool)
        return bn_max_pool(z, bn.weight, bn.bias, bn.running_mean, bn.running_var, pool, 0.1, bn.eps,
                           donate=how == "donated")

    def step() -> None:
        p = pooled()
        (p * torch.linspace(-1, 1, p.numel()).view(p.shape)).sum().backward()
        out.append(p.detach())

    peak = step_peak_bytes(step)
    return [out[0], x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var], peak


@pytest.mark.parametrize("pool", [POOL, ([2, 2], [2, 2], [0, 0], [1, 1], False), ([3, 3], [2, 2], [1, 1], [1, 1], True)],
                         ids=["3x3-s2-p1", "2x2-s2", "ceil"])
def test_chunks_give_the_separate_calls_values_and_gradients_with_a_lower_peak(pool: tuple, monkeypatch) -> None:
    """By chunks of channels (6 here, the last short), kept or donated: the pooled output, the running
    statistics and every gradient (input, BatchNorm) are the separate calls', channel for channel; the peak
    of live bytes is lower than theirs (no BatchNorm output nor int64 indices kept, no pool gradient whole),
    and lower again when z's gradient is written into z."""
    monkeypatch.setattr(K, "RECOMPUTE_CHUNK", 3 * 16 * 16 * 16)  # 3 channels a chunk
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 16, 16, 16, generator=g)
    bn = _bn(16, seed=1)
    assert K._channel_chunks(x)[-1] == (15, 16)
    separate, peak_separate = _run(bn, x, "separate", pool)
    kept, peak_kept = _run(bn, x, "kept", pool)
    donated, peak_donated = _run(bn, x, "donated", pool)
    for name, a, b, c in zip(["output", "x grad", "bn weight grad", "bn bias grad", "running mean",
                              "running var"], separate, kept, donated):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
        assert torch.equal(b, c), name
    assert peak_donated < peak_kept < peak_separate, (peak_donated, peak_kept, peak_separate)


def test_a_donated_z_cannot_be_backpropagated_twice() -> None:
    """z's gradient takes z's storage: a second backward through a retained graph fails autograd's check
    instead of reading a gradient as z."""
    bn = _bn(8, seed=2)
    z = torch.randn(4, 8, 8, 8, requires_grad=True) * 1  # fresh
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "RECOMPUTE_CHUNK", 4 * 8 * 8 * 4)
        p = bn_max_pool(z, bn.weight, bn.bias, bn.running_mean, bn.running_var, POOL, donate=True)
        loss = p.sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_it_declines_where_the_ops_must_be_seen_and_names_bad_input(monkeypatch) -> None:
    """None (the caller runs BatchNorm and the pool) for one chunk, a dispatch mode (a FLOP counter), and z
    in another dtype than BatchNorm's parameters (autocast); a named error for a z that is not [N, C, H, W]
    and for parameters of another width."""
    from torch.utils.flop_counter import FlopCounterMode

    bn = _bn(8, seed=3)
    z = torch.randn(4, 8, 8, 8)
    args = (bn.weight, bn.bias, bn.running_mean, bn.running_var, POOL)
    assert bn_max_pool(z, *args) is None  # 2048 elements: one chunk
    monkeypatch.setattr(K, "RECOMPUTE_CHUNK", 4 * 8 * 8 * 2)
    assert bn_max_pool(z, *args) is not None
    with FlopCounterMode(display=False):
        assert bn_max_pool(z, *args) is None
    assert bn_max_pool(z.bfloat16(), *args) is None
    with pytest.raises(ValueError, match=r"conv stage's \[N, C, H, W\], got \(4, 8, 64\)"):
        bn_max_pool(z.flatten(2), *args)
    with pytest.raises(ValueError, match="one entry per channel of z \\(8\\), got \\(6,\\)"):
        bn_max_pool(z, bn.weight[:6], bn.bias[:6], *args[2:])
