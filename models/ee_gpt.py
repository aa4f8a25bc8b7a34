"""EE-GPT: a decoder-only transformer with early exits (EE-LLM, Chen et al., ICML 2024).

Backbone: pre-norm blocks with RMSNorm, RoPE, SwiGLU, no biases, optional tied embeddings.
Exits sit after chosen layers; each is [optional exit block | exit MLP] -> [optional norm] ->
vocab projection (tied to the final head, or its own). The final head is always the last exit.

    model(idx)                -> final logits [B, S, V] (or the forced exit's, see `forced_exit`)
    model.exit_states(idx)    -> per exit: pre-projection hidden state + projection weight
    model.all_logits(idx)     -> {exit layer: logits}

Decoding uses the step primitives at the bottom (`new_cache`, `run_layers`, `exit_hidden`,
`fill_kv`); the strategies themselves live in `efficient.decoding`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.zoo import InputSpec, Variant, config_from_options, register_variants

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


class KVCache:
    """Pre-allocated keys/values per attention slot (layers, then exit blocks): [B, H, max_len, hd].

    Slots are written at absolute positions; a query at position p reads keys 0..p, so entries
    beyond the current position (rejected drafts, stale exits) are never read before rewritten.
    """

    def __init__(self, slots: int, batch: int, heads: int, max_len: int, head_dim: int, device, dtype) -> None:
        shape = (batch, heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(slots)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(slots)]
        self.max_len = max_len
        # causal[i, j]: position i may read position j; chunk masks are slices of it
        self.causal = torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, T, C = x.shape
        qkv = self.wqkv(x).view(B, T, 3, self.n_head, self.head_dim).transpose(1, 3)  # [B, H, 3, T, hd]
        qk = apply_rope(qkv[:, :, :2], cos, sin)  # q and k rotated in one call
        return qk[:, :, 0], qk[:, :, 1], qkv[:, :, 2]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, slot: int = 0, pos: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            cache.k[slot][:, :, pos : pos + T] = k
            cache.v[slot][:, :, pos : pos + T] = v
            k, v = cache.k[slot][:, :, : pos + T], cache.v[slot][:, :, : pos + T]
            if T == 1:  # a single query at the newest position sees every cached key: no mask to build
                y = F.scaled_dot_product_attention(q, k, v)
            else:  # query i (absolute position pos+i) sees keys 0..pos+i
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.causal[pos : pos + T, : pos + T])
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

    def __init__(self, dim: int, n_head: int, mlp_hidden: int, eps: float) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(dim, eps), Attention(dim, n_head)
        self.norm2, self.mlp = RMSNorm(dim, eps), SwiGLU(dim, mlp_hidden)

    def forward(self, x, cos, sin, cache=None, slot=0, pos=0) -> tuple[torch.Tensor, torch.Tensor]:
        mid = x + self.attn(self.norm1(x), cos, sin, cache, slot, pos)
        return mid + self.mlp(self.norm2(mid)), mid


class ExitHead(nn.Module):
    """[exit block | exit MLP] -> [norm] -> projection. The projection weight lives in the model
    (tied heads share the final head's), so the head returns the pre-projection state."""

    def __init__(self, kind: HeadKind, dim: int, n_head: int, mlp_hidden: int, eps: float, vocab: int, tied: bool) -> None:
        super().__init__()
        self.kind = kind
        self.block = Block(dim, n_head, mlp_hidden, eps) if kind == "norm_block" else None
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
        self.layers = nn.ModuleList(Block(n_embd, n_head, mlp_hidden, norm_eps) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(n_embd, norm_eps)
        # tied: the final head reads the embedding matrix (no second parameter, so checkpoints
        # hold each tensor once)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(n_embd, vocab_size, bias=False)
        # one head per early exit, keyed by the layer whose output it reads
        self.exits = nn.ModuleDict(
            {str(k): ExitHead(cfg.exit_head, n_embd, n_head, mlp_hidden, norm_eps, vocab_size, cfg.exit_tied)
             for k in self.exit_layers[:-1]}
        )
        cos, sin = rope_tables(n_embd // n_head, cfg.seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._forced: int | None = None
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

    # --------------------------------------------------------------------------- training path

    def head_weight(self, layer: int) -> torch.Tensor:
        """Vocab projection [V, C] of the exit after `layer`; tied exits share the final head's."""
        if layer == self.num_layers:
            return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        proj = self.exits[str(layer)].proj
        return self.head_weight(self.num_layers) if proj is None else proj.weight

    def exit_hidden(self, layer: int, h: torch.Tensor, mid: torch.Tensor | None, cache: KVCache | None = None, pos: int = 0) -> torch.Tensor:
        """Pre-projection state of the exit after `layer` from that layer's output `h` (and its
        post-attention residual `mid`, for exit MLPs)."""
        if layer == self.num_layers:
            return self.norm_f(h)
        head = self.exits[str(layer)]
        if head.block is not None:
            cos, sin = self._rope(pos, h.shape[1])
            h, _ = head.block(h, cos, sin, cache, self.exit_slot(layer), pos)
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
        for i in range(max(want, default=0)):
            h, mid = self.layers[i](h, cos, sin)
            if i + 1 in want:
                out.append(ExitState(i + 1, self.exit_hidden(i + 1, h, mid), self.head_weight(i + 1)))
        return out

    def all_logits(self, idx: torch.Tensor) -> dict[int, torch.Tensor]:
        return {s.layer: s.hidden @ s.weight.T for s in self.exit_states(idx)}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Final-head logits [B, S, V]; under `forced_exit(k)` the logits of the exit at k."""
        layer = self.num_layers if self._forced is None else self._forced
        s = self.exit_states(idx, [layer])[-1]
        return s.hidden @ s.weight.T

    @contextlib.contextmanager
    def forced_exit(self, layer: int | None) -> Iterator[None]:
        """Within the block, plain calls run only layers 1..`layer` and that exit's head."""
        if layer is not None and layer not in self.exit_layers:
            raise ValueError(f"no exit at layer {layer}; this model's exits are {self.exit_layers}")
        prev, self._forced = self._forced, layer
        try:
            yield
        finally:
            self._forced = prev

    @torch.no_grad()
    def exit_distribution(self, batches: Iterable[torch.Tensor], threshold: float) -> dict[int, float]:
        """Fraction of tokens whose first exit with max-prob >= `threshold` is each exit layer
        (teacher-forced; tokens that never pass exit at the last layer; threshold >= 1 disables)."""
        counts = dict.fromkeys(self.exit_layers, 0)
        total = 0
        for idx in batches:
            idx = idx[0] if isinstance(idx, (tuple, list)) else idx
            states = self.exit_states(idx)
            chosen = torch.full(idx.shape, self.num_layers, device=idx.device)
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

    # --------------------------------------------------------------------------- decoding steps

    def exit_slot(self, layer: int) -> int:
        """KV-cache slot of the exit block after `layer` (slots 0..L-1 are the backbone layers)."""
        return self.num_layers + self.exit_layers.index(layer)

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        p = self.tok_emb.weight
        return KVCache(self.num_layers + len(self.exit_layers), batch, self.n_head, max_len or self.seq_len, self.n_embd // self.n_head, p.device, p.dtype)

    def run_layers(self, h: torch.Tensor, start: int, stop: int, cache: KVCache, pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run layers start+1..stop (1-based) on the chunk `h` [B, T, C] at positions pos..pos+T-1,
        writing their keys/values into `cache`. Returns the output and the last post-attention residual."""
        cos, sin = self._rope(pos, h.shape[1])
        mid = None
        for i in range(start, stop):
            h, mid = self.layers[i](h, cos, sin, cache, i, pos)
        return h, mid

    def fill_kv(self, h: torch.Tensor, start: int, cache: KVCache, pos: int) -> None:
        """CALM-style state propagation: keys/values of layers start+1..L from the hidden state `h`
        that exited after layer `start` (an approximation of the full model's KV)."""
        cos, sin = self._rope(pos, h.shape[1])
        T = h.shape[1]
        slots = [(i, self.layers[i]) for i in range(start, self.num_layers)]
        slots += [(self.exit_slot(e), self.exits[str(e)].block) for e in self.exit_layers[:-1] if e > start and self.exits[str(e)].block is not None]
        for slot, layer in slots:
            _, k, v = layer.attn.qkv(layer.norm1(h), cos, sin)
            cache.k[slot][:, :, pos : pos + T], cache.v[slot][:, :, pos : pos + T] = k, v

    def layer_macs(self) -> dict[str, int]:
        """Multiply-accumulates per token (projections only; attention scores add 2*C*context)."""
        C = self.n_embd
        F_ = self.layers[0].mlp.w_gate.out_features
        layer = 4 * C * C + 3 * C * F_
        head = {k: C * self.vocab_size + (layer if h.block is not None else 3 * C * F_ if h.mlp is not None else 0) for k, h in self.exits.items()}
        head[str(self.num_layers)] = C * self.vocab_size
        return {"layer": layer, **{f"head{k}": v for k, v in head.items()}}


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
