"""Early-exit statistics of EE-GPT-style models: projection MACs per token of a layer and of each
exit head, and the share of tokens leaving at each exit under the max-probability rule.

    layer_macs(model)                          -> {"layer": .., "head1": .., "head4": ..}
    exit_distribution(model, batches, tau)     -> {exit layer: fraction of tokens}

The model provides `exit_layers`, `num_layers`, `exit_states(idx)`, `n_embd`, `vocab_size`,
`layers` and `exits` (see `efficient.models.ee_gpt`).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn


def layer_macs(model: nn.Module) -> dict[str, int]:
    """Multiply-accumulates per token (projections only; attention scores add 2*C*context):
    "layer" for one backbone layer, "head{k}" for the exit after layer k (its block or MLP, if
    any, plus the vocab projection; the final head is the projection alone)."""
    C = model.n_embd
    F_ = model.layers[0].mlp.w_gate.out_features
    layer = 4 * C * C + 3 * C * F_
    head = {k: C * model.vocab_size + (layer if h.block is not None else 3 * C * F_ if h.mlp is not None else 0) for k, h in model.exits.items()}
    head[str(model.num_layers)] = C * model.vocab_size
    return {"layer": layer, **{f"head{k}": v for k, v in head.items()}}


@torch.no_grad()
def exit_distribution(model: nn.Module, batches: Iterable[Any], threshold: float) -> dict[int, float]:
    """Fraction of tokens whose first exit with max-prob >= `threshold` is each exit layer
    (teacher-forced; tokens that never pass exit at the last layer; threshold >= 1 disables).
    A batch is token ids [B, S] or a tuple whose first item they are."""
    counts = dict.fromkeys(model.exit_layers, 0)
    total = 0
    for idx in batches:
        idx = idx[0] if isinstance(idx, (tuple, list)) else idx
        states = model.exit_states(idx)
        chosen = torch.full(idx.shape, model.num_layers, device=idx.device)
        done = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
        if threshold < 1:
            for s in states[:-1]:
                pmax = torch.softmax((s.hidden @ s.weight.T).float(), -1).amax(-1)
                hit = (pmax >= threshold) & ~done
                chosen[hit], done = s.layer, done | hit
        for k in counts:
            counts[k] += int((chosen == k).sum())
        total += idx.numel()
    return {k: v / max(total, 1) for k, v in counts.items()}
