"""The static KV cache of Hugging Face decoding: one preallocated key and one value tensor,
[layers, B, kv_heads, max_len, head_dim], written by slot index (`k[i]`, `v[i]`: layer i's views).

Slots are shared by the batch: prompts are left-padded to one length P, so slot s holds every
row's token s, and a row's position is its slot minus its padding. Padding slots are never read
(the mask hides them). A query at slot s reads slots 0..s, so whatever lies beyond the current
slot (a rejected draft, an exited token's stale deep keys) is rewritten before it is read: cutting
the cache back to an accepted length is moving the write slot, not copying.
"""

from __future__ import annotations

import torch


class StaticKV:
    """Keys/values per layer plus the padding mask of the batch (see the module docstring)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int, pad: torch.Tensor,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (layers, batch, kv_heads, max_len, head_dim)
        self.K = torch.zeros(shape, device=device, dtype=dtype)
        self.V = torch.zeros(shape, device=device, dtype=dtype)
        self.k, self.v = list(self.K.unbind(0)), list(self.V.unbind(0))
        self.max_len = max_len
        slots = torch.arange(max_len, device=device)
        self.padded = bool((pad > 0).any())
        self.valid = (slots[None] >= pad[:, None])[:, None, None]  # [B, 1, 1, max_len]: slot holds a real token
        self.causal = torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()
        self.diag = torch.eye(max_len, dtype=torch.bool, device=device)

    def mask(self, slot: int, T: int) -> torch.Tensor | None:
        """Which keys the queries at slots slot..slot+T-1 read: causal and not padding. None when
        every key is read (one query, no padding). A padding query reads itself, so its row of the
        attention stays finite (its output is never used)."""
        end = slot + T
        if T == 1:
            return self.valid[..., :end] if self.padded else None
        m = self.causal[slot:end, :end]
        if self.padded:
            m = (m & self.valid[..., :end]) | self.diag[slot:end, :end]
        return m
