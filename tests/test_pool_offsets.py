"""2-D max-pool keeping window offsets (`efficient.kernels.pool_offsets`): the pool's output and its
input's gradient are aten's bit for bit, and offsets take the narrowest integer type that holds them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from efficient.kernels.pool_offsets import max_pool_offsets, max_pool_offsets_backward

CASES = [  # (input shape, kernel, stride, padding, dilation, ceil_mode)
    ((2, 3, 9, 9), 3, 2, 1, 1, False),
    ((2, 3, 8, 11), 2, 2, 0, 1, False),
    ((1, 2, 10, 7), 3, 2, 1, 2, True),
    ((3, 1, 6, 6), (3, 2), (1, 2), (1, 0), 1, False),
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_output_and_gradient_are_atens(case: tuple, contiguous: bool) -> None:
    from torch.nn.modules.utils import _pair

    shape, k, s, p, d, ceil = case
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(shape, generator=g) < 0.3).float()  # spikes: ties everywhere, the first maximum wins
    if not contiguous:
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    pool = (list(_pair(k)), list(_pair(s)), list(_pair(p)), list(_pair(d)), ceil)
    out, offsets = max_pool_offsets(x, pool)
    ref = x.clone().requires_grad_()
    expect = F.max_pool2d(ref, k, s, p, d, ceil)
    gout = torch.randn(expect.shape, generator=g)
    expect.backward(gout)
    assert torch.equal(out, expect.detach()) and offsets.dtype == torch.uint8
    grad = max_pool_offsets_backward(gout, offsets, pool, x.shape, None if contiguous else x.stride())
    assert torch.equal(grad, ref.grad)


def test_offsets_widen_with_the_plane() -> None:
    x = torch.randn(1, 1, 3, 200)
    _, offsets = max_pool_offsets(x, ([3, 3], [2, 2], [1, 1], [1, 1], False))
    assert offsets.dtype == torch.int16  # (3 - 1) * 200 + 2 = 402 does not fit uint8
