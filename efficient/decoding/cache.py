"""The KV cache of early-exit decoding: preallocated keys/values per attention slot (the model's
layers, then its exit blocks), written at absolute positions."""

from __future__ import annotations

import torch


class KVCache:
    """Pre-allocated keys/values per attention slot (layers, then exit blocks): [B, H, max_len, hd].

    Slots are written at absolute positions; a query at position p reads keys 0..p, so entries
    beyond the current position (rejected drafts, stale exits) are never read before rewritten.
    """

    def __init__(self, slots: int, batch: int, heads: int, max_len: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (batch, heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(slots)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(slots)]
        self.max_len = max_len
        # causal[i, j]: position i may read position j; chunk masks are slices of it
        self.causal = torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()

    def write(self, slot: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values [B, H, T, hd] of positions pos..pos+T-1 in `slot`."""
        T = k.shape[2]
        self.k[slot][:, :, pos : pos + T] = k
        self.v[slot][:, :, pos : pos + T] = v

    def update(self, slot: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store a chunk's keys/values, then return the keys/values of positions 0..pos+T-1 and the
        mask of which ones each query reads (None for one query: it reads them all)."""
        self.write(slot, pos, k, v)
        T = k.shape[2]
        mask = None if T == 1 else self.causal[pos : pos + T, : pos + T]  # query i (position pos+i) reads keys 0..pos+i
        return self.k[slot][:, :, : pos + T], self.v[slot][:, :, : pos + T], mask
