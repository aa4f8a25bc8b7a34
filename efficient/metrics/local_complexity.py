"""Local complexity (Humayun et al., "Deep networks always grok", ICML 2024): how many neurons
change sign within a small cross-polytope around each input -- the density of the network's
linear-region boundaries near the data. It falls late in training when a network groks.

Around x, n_frame vertices x +- r v_k (v_k: n_frame/2 random orthonormal input directions); a
neuron (the output of a Linear / Conv layer, i.e. a pre-activation) counts if its sign differs
across the vertices. LC = the count summed over layers, averaged over the probed samples.
Layer 1 is exact for these vertices; deeper layers are vertex-sampled (they can miss an even
number of crossings along an edge). Cost: n_frame forward passes per probed sample.
"""

from __future__ import annotations

import torch
from torch import nn


def frame_directions(dim: int, n_frame: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """n_frame/2 orthonormal directions [k, dim] (random, fixed by `seed`)."""
    k = n_frame // 2
    if n_frame % 2 or k < 1 or k > dim:
        raise ValueError(f"n_frame must be an even number in [2, {2 * dim}] for {dim}-dimensional inputs, got {n_frame}")
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, k, generator=g, dtype=torch.float64))
    return q.T.to(dtype)


def _probe_layers(model: nn.Module, include_head: bool) -> list[nn.Module]:
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    return layers if include_head else layers[:-1]


@torch.no_grad()
def local_complexity(model: nn.Module, batch, radius: float = 0.05, n_frame: int = 8, max_samples: int = 64, seed: int = 0, include_head: bool = False) -> dict[str, float]:
    """{"lc": mean sign-changing neurons per sample, "lc/<i>": per probed layer}."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    x = x[:max_samples]
    n, shape = x.shape[0], x.shape[1:]
    dirs = frame_directions(shape.numel(), n_frame, seed, x.dtype).to(x.device)  # [k, D]
    verts = torch.cat([dirs, -dirs]) * radius  # [n_frame, D]
    pts = (x.flatten(1)[:, None, :] + verts[None]).reshape(n * len(verts), *shape)
    layers = _probe_layers(model, include_head)
    if not layers:
        raise ValueError("local_complexity: the model has no Linear/Conv layer to probe")
    outs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: outs.append(o.detach())) for m in layers]
    was = model.training
    model.eval()
    try:
        model(pts)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    res: dict[str, float] = {}
    total = torch.zeros(n, device=x.device)
    for i, o in enumerate(outs):
        s = (o.reshape(n, len(verts), -1) > 0)
        changed = (s.any(1) & ~s.all(1)).sum(-1).float()  # neurons whose sign differs across vertices
        res[f"lc/{i}"] = changed.mean().item()
        total += changed
    res["lc"] = total.mean().item()
    return res
