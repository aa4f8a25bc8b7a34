"""Weight initialisers whose draws do not change with the torch release.

`nn.init.trunc_normal_` changed its sampler between torch 2.11 and 2.14 (an inverse-CDF transform of
uniform draws before, normal draws with rejection since), so the same seed gave a zoo model other
initial weights on another torch: a run could not be reproduced there, and the zoo's reference values
(tests/) held on one release only. `trunc_normal_` here draws the same values on every release (it uses
`normal_` and `uniform_`, whose streams torch keeps), and where the truncation is wide (the zoo's
cases) the values are those of the newer `nn.init.trunc_normal_`, draw for draw.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator: torch.Generator | None = None) -> Tensor:
    """Fill `tensor` in place from N(mean, std^2) truncated to [a, b] (as `nn.init.trunc_normal_`).

    Where [a, b] holds more than 30 % of the mass, normal draws outside it are drawn again until none is
    left (the newer torch's sampler, draw for draw); where it holds less, each value is the inverse CDF of
    one uniform draw (few draws would land inside)."""
    if not std > 0:
        raise ValueError(f"trunc_normal_: std must be > 0, got {std}")
    if not a < b:
        raise ValueError(f"trunc_normal_: the range [a, b] = [{a}, {b}] is empty; a must be below b")
    if tensor.is_meta:
        return tensor
    lo_cdf, hi_cdf = _normal_cdf((a - mean) / std), _normal_cdf((b - mean) / std)
    with torch.no_grad():
        if hi_cdf - lo_cdf > 0.3:
            # the bounds as the tensor's dtype holds them (so a value equal to a bound is inside), on its device
            lo, hi = (torch.tensor(v, dtype=tensor.dtype, device=tensor.device) for v in (a, b))
            result = tensor.normal_(mean, std, generator=generator)
            while True:
                outside = (result < lo) | (result > hi)
                if not outside.any():
                    break
                result = torch.where(outside, torch.empty_like(result).normal_(mean, std, generator=generator), result)
            if result is not tensor:
                tensor.copy_(result)
        else:
            # u ~ U(2 F(a) - 1, 2 F(b) - 1); mean + std * sqrt(2) * erfinv(u) has the truncated law
            tensor.uniform_(2 * lo_cdf - 1, 2 * hi_cdf - 1, generator=generator)
            tensor.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(min=a, max=b)
    return tensor


__all__ = ["trunc_normal_"]
