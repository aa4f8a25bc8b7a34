"""EE-GPT: a decoder-only transformer with early exits (EE-LLM, Chen et al., ICML 2024).

Backbone: pre-norm blocks with RMSNorm, RoPE, SwiGLU, no biases, optional tied embeddings.
Exits sit after chosen layers; each is [optional exit block | exit MLP] -> [optional norm] ->
vocab projection (tied to the final head, or its own). The final head is always the last exit.

    model(idx)                -> final logits [B, S, V]
    model(idx, exit_layer=k)  -> logits of the exit after layer k (only layers 1..k run)
    model.exit_states(idx)    -> per exit: pre-projection hidden state + projection weight
    model.all_logits(idx)     -> {exit layer: logits}

The model computes hidden states and exit logits only. Attention takes an optional KV cache
(`efficient.decoding.KVCache`, one slot per attention layer); the cache, the decoding steps and
the strategies live in `efficient.decoding` (the fused decode form of these weights in
`efficient.decoding.engine`), exit statistics and MAC counts in `efficient.profiler.exits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.zoo import InputSpec, Variant, config_from_options, register_variants

if TYPE_CHECKING:
    from efficient.decoding.cache import KVCache

PAPER = "EE-LLM: Large-Scale Training and Inference of Early-Exit LLMs with 3D Parallelism (Chen et al., ICML 2024)"
HeadKind = Literal["minimal", "norm", "norm_mlp", "norm_block"]


# ----------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * weight in one op (fp32 statistics for half inputs)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, head_dim/2] for rotary embeddings (Su et al., RoFormer)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of `x` [B, H, T, hd] by the angles of its positions."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Causal self-attention; `slot` is where a KV cache keeps this layer's keys and values."""

    def __init__(self, dim: int, n_head: int, slot: int) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.slot = n_head, dim // n_head, slot
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, T, C = x.shape
        qkv = self.wqkv(x).view(B, T, 3, self.n_head, self.head_dim).transpose(1, 3)  # [B, H, 3, T, hd]
        qk = apply_rope(qkv[:, :, :2], cos, sin)  # q and k rotated in one call
        return qk[:, :, 0], qk[:, :, 1], qkv[:, :, 2]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, pos: int = 0) -> torch.Tensor:
        """`x` [B, T, C] at positions pos..pos+T-1; with a cache, its keys/values are stored there
        and the queries read every cached position up to their own."""
        B, T, C = x.shape
        q, k, v = self.qkv(x, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v, mask = cache.update(self.slot, pos, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Pre-norm transformer layer. `forward` also returns the post-attention residual `mid`,
    which an exit MLP reads (EE-LLM's exit-MLP shares the layer's attention and its norm)."""

    def __init__(self, dim: int, n_head: int, mlp_hidden: int, eps: float, slot: int) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(dim, eps), Attention(dim, n_head, slot)
        self.norm2, self.mlp = RMSNorm(dim, eps), SwiGLU(dim, mlp_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        mid = x + self.attn(self.norm1(x), cos, sin, cache, pos)
        return mid + self.mlp(self.norm2(mid)), mid


class ExitHead(nn.Module):
    """[exit block | exit MLP] -> [norm] -> projection. The projection weight lives in the model
    (tied heads share the final head's), so the head returns the pre-projection state. `slot`:
    the exit block's KV-cache slot."""

    def __init__(self, kind: HeadKind, dim: int, n_head: int, mlp_hidden: int, eps: float, vocab: int, tied: bool, slot: int) -> None:
        super().__init__()
        self.kind = kind
        self.block = Block(dim, n_head, mlp_hidden, eps, slot) if kind == "norm_block" else None
        self.mlp = SwiGLU(dim, mlp_hidden) if kind == "norm_mlp" else None
        self.norm = RMSNorm(dim, eps) if kind != "minimal" else None
        self.proj = None if tied else nn.Linear(dim, vocab, bias=False)


@dataclass
class ExitState:
    """One exit's output before the vocab projection: logits = hidden @ weight.T."""

    layer: int
    hidden: torch.Tensor
    weight: torch.Tensor


# ------------------------------------------------------------------------------------- model


@dataclass
class EEGPTConfig:
    """EE-GPT's options (recipe keys of the same names). `mlp_hidden=None` is SwiGLU's 8/3 d rounded
    up to 64; `exit_layers` are 1-based (the final head is always the last exit)."""

    vocab_size: int = 256
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    mlp_hidden: int | None = None
    seq_len: int = 256
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    exit_layers: list[int] | tuple[int, ...] = ()
    exit_position: Literal["post", "pre"] = "post"
    exit_head: HeadKind = "norm"
    exit_tied: bool = True


class EEGPT(nn.Module):
    """Built from an `EEGPTConfig`, or from its flat options (`EEGPT(n_layer=2, exit_layers=[1])`)."""

    def __init__(self, config: EEGPTConfig | None = None, **options: Any) -> None:
        super().__init__()
        cfg = self.config = config_from_options(EEGPTConfig, options, config)
        n_embd, n_head, vocab_size, norm_eps = cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.norm_eps
        if n_embd % n_head or (n_embd // n_head) % 2:
            raise ValueError(f"n_embd={n_embd} must split into n_head={n_head} heads of even size")
        mlp_hidden = cfg.mlp_hidden or 64 * math.ceil(8 * n_embd / 3 / 64)  # SwiGLU's 8/3 d, rounded up to 64
        self.vocab_size, self.num_layers, self.n_embd, self.n_head, self.seq_len = vocab_size, cfg.n_layer, n_embd, n_head, cfg.seq_len
        self.exit_position = cfg.exit_position
        self.exit_layers = self._resolve_exits(list(cfg.exit_layers), cfg.n_layer, cfg.exit_position, cfg.exit_head)

        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        # KV-cache slots: 0..L-1 the layers, then one per exit (used by exit blocks)
        self.layers = nn.ModuleList(Block(n_embd, n_head, mlp_hidden, norm_eps, i) for i in range(cfg.n_layer))
        self.norm_f = RMSNorm(n_embd, norm_eps)
        # tied: the final head reads the embedding matrix (no second parameter, so checkpoints
        # hold each tensor once)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(n_embd, vocab_size, bias=False)
        # one head per early exit, keyed by the layer whose output it reads
        self.exits = nn.ModuleDict(
            {str(k): ExitHead(cfg.exit_head, n_embd, n_head, mlp_hidden, norm_eps, vocab_size, cfg.exit_tied, cfg.n_layer + j)
             for j, k in enumerate(self.exit_layers[:-1])}
        )
        cos, sin = rope_tables(n_embd // n_head, cfg.seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_std = cfg.init_std
        self.apply(self._init)

    @staticmethod
    def _resolve_exits(layers: list[int], n_layer: int, position: str, head: str) -> list[int]:
        """1-based exit layers as the number of layers computed (a pre-exit at k reads layer k-1)."""
        if position not in ("post", "pre"):
            raise ValueError(f"exit_position must be 'post' or 'pre', got {position!r}")
        if head not in ("minimal", "norm", "norm_mlp", "norm_block"):
            raise ValueError(f"exit_head must be one of minimal, norm, norm_mlp, norm_block; got {head!r}")
        if position == "pre" and head == "norm_mlp":
            raise ValueError("exit_head='norm_mlp' shares a layer's attention, so it needs exit_position='post'")
        lo = 2 if position == "pre" else 1
        for k in layers:
            if not lo <= k <= n_layer:
                raise ValueError(f"exit layer {k} is outside {lo}..{n_layer} for a {n_layer}-layer model with {position}-exits")
        depths = sorted({k - 1 if position == "pre" else k for k in layers})
        if len(depths) != len(layers):
            raise ValueError(f"exit_layers {layers} has duplicates")
        return [d for d in depths if d != n_layer] + [n_layer]

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.init_std)

    @torch.no_grad()
    def init_exits_from_backbone(self) -> None:
        """EE-Tuning initialisation (arXiv 2402.00518): each exit starts as a copy of existing
        weights -- final norm -> exit norm, final projection -> untied exit projection, the
        layer's MLP -> exit MLP, last layer -> exit block."""
        for k, head in self.exits.items():
            if head.norm is not None:
                head.norm.load_state_dict(self.norm_f.state_dict())
            if head.proj is not None:
                head.proj.weight.copy_(self.head_weight(self.num_layers))
            if head.mlp is not None:
                head.mlp.load_state_dict(self.layers[int(k) - 1].mlp.state_dict())
            if head.block is not None:
                head.block.load_state_dict(self.layers[-1].state_dict())

    # --------------------------------------------------------------------------- forward

    def head_weight(self, layer: int) -> torch.Tensor:
        """Vocab projection [V, C] of the exit after `layer`; tied exits share the final head's."""
        if layer == self.num_layers:
            return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        proj = self.exits[str(layer)].proj
        return self.head_weight(self.num_layers) if proj is None else proj.weight

    def exit_hidden(self, layer: int, h: torch.Tensor, mid: torch.Tensor | None, cache: KVCache | None = None, pos: int = 0) -> torch.Tensor:
        """Pre-projection state of the exit after `layer` from that layer's output `h` (and its
        post-attention residual `mid`, for exit MLPs); an exit block reads and writes `cache`."""
        if layer == self.num_layers:
            return self.norm_f(h)
        head = self.exits[str(layer)]
        if head.block is not None:
            cos, sin = self._rope(pos, h.shape[1])
            h, _ = head.block(h, cos, sin, cache, pos)
        elif head.mlp is not None:
            h = mid + head.mlp(self.layers[layer - 1].norm2(mid))
        return head.norm(h) if head.norm is not None else h

    def _rope(self, pos: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        if pos + T > self.seq_len:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the model's seq_len={self.seq_len}; build it with a larger seq_len")
        return self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T]

    def _check_idx(self, idx: torch.Tensor) -> None:
        if idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"EE-GPT takes token ids [B, S] (long), got {tuple(idx.shape)} {idx.dtype}")

    def exit_states(self, idx: torch.Tensor, layers: Iterable[int] | None = None) -> list[ExitState]:
        """Pre-projection states of the exits in `layers` (default: all, final included) for token
        ids [B, S], shallow to deep. Only layers up to the deepest requested exit are computed."""
        self._check_idx(idx)
        want = set(self.exit_layers if layers is None else layers)
        if not want <= set(self.exit_layers):
            raise ValueError(f"no exit at layer(s) {sorted(want - set(self.exit_layers))}; this model's exits are {self.exit_layers}")
        h = self.tok_emb(idx)
        cos, sin = self._rope(0, idx.shape[1])
        out, mid = [], None
        for i in range(max(want) if want else 0):  # not max(..., default=): torch.compile < 2.12 breaks on it
            h, mid = self.layers[i](h, cos, sin)
            if i + 1 in want:
                out.append(ExitState(i + 1, self.exit_hidden(i + 1, h, mid), self.head_weight(i + 1)))
        return out

    def all_logits(self, idx: torch.Tensor) -> dict[int, torch.Tensor]:
        """{exit layer: logits [B, S, V]} for every exit, the final head included."""
        return {s.layer: s.hidden @ s.weight.T for s in self.exit_states(idx)}

    def forward(self, idx: torch.Tensor, exit_layer: int | None = None) -> torch.Tensor:
        """Logits [B, S, V] of the exit after `exit_layer` (default: the final head) for token ids
        [B, S]; only layers 1..`exit_layer` and that exit's head run."""
        layer = self.num_layers if exit_layer is None else exit_layer
        if layer not in self.exit_layers:
            raise ValueError(f"no exit at layer {layer}; this model's exits are {self.exit_layers}")
        s = self.exit_states(idx, [layer])[-1]
        return s.hidden @ s.weight.T


# ------------------------------------------------------------------------------------- zoo


def _spec(seq_len: int, vocab: int) -> InputSpec:
    return InputSpec((seq_len,), dtype="long", num_classes=vocab)


TINY = EEGPTConfig(n_layer=4, n_embd=128, n_head=4, seq_len=256, exit_layers=[1, 2])

VARIANTS: dict[str, Variant] = {
    "ee-gpt-tiny": Variant(
        _spec(128, 256), PAPER,
        "4-layer byte-level EE-GPT, exits after layers 1 and 2 (1/4, 1/2 depth); trains on a CPU in minutes", TINY),
    "ee-gpt-small": Variant(
        _spec(512, 256), PAPER, "12-layer 512-wide byte-level EE-GPT, exits after layers 3 and 6 (GPU-sized)",
        EEGPTConfig(n_layer=12, n_embd=512, n_head=8, seq_len=1024, exit_layers=[3, 6])),
    "ee-gpt-1.3b": Variant(
        _spec(2048, 32000), PAPER, "paper-shaped 1.3B (24 x 2048, Llama vocab, tied), minimal exits after layers 6 and 12",
        EEGPTConfig(vocab_size=32000, n_layer=24, n_embd=2048, n_head=16, mlp_hidden=5504, seq_len=2048, init_std=0.01,
                    exit_layers=[6, 12], exit_head="minimal", exit_tied=True, tie_embeddings=True)),
    "ee-gpt-7b": Variant(
        _spec(2048, 32000), PAPER, "paper-shaped 7B (32 x 4096, Llama vocab, untied), minimal untied exits after layers 8 and 16",
        EEGPTConfig(vocab_size=32000, n_layer=32, n_embd=4096, n_head=32, mlp_hidden=11008, seq_len=2048, init_std=0.01,
                    exit_layers=[8, 16], exit_head="minimal", exit_tied=False, tie_embeddings=False)),
}

register_variants(EEGPT, VARIANTS, family="ee-gpt")
