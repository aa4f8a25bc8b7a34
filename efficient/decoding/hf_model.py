"""A Hugging Face causal LM in decode form: its weights read once into plain tensors, one layer
function per family, and the exit heads.

Two families: the Llama family (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`:
RMSNorm, rotary positions in transformers' rotate-half convention, grouped-query attention, SwiGLU)
and GPT-2 (`GPT2LMHeadModel`: learned positions, LayerNorm, GELU, Conv1D weights stored [in, out]).
The query/key/value projections become one matrix, the gate and up projections another; GPT-2's
Conv1D weights are transposed once. The model's parameters are not changed, and the engine reads
them at construction (build a new one after the weights change).

An exit after layer k reads that layer's hidden state through an exit head: the model's own final
norm and LM head (LayerSkip) for a plain transformers model and for a model wrapped by
`efficient.early_exit(..., head="shared")`, the wrapper's `exit_head(k)` for `head="own"`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from efficient.errors import ConfigError
from efficient.hf.families import LLAMA, SUPPORTED
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only


class LayerWeights(NamedTuple):
    """One pre-norm decoder layer; `wqkv` = [q; k; v], `w_in` = [gate; up] (Llama) or fc (GPT-2).
    `n1b`/`n2b` are LayerNorm biases (GPT-2; None for RMSNorm); other biases may be None."""

    n1: torch.Tensor
    n1b: torch.Tensor | None
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    n2: torch.Tensor
    n2b: torch.Tensor | None
    w_in: torch.Tensor
    b_in: torch.Tensor | None
    w_out: torch.Tensor
    b_out: torch.Tensor | None
    scale: float  # attention score scale


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
    return None if any(t is None for t in ts) else torch.cat([t.detach() for t in ts])


def unwrap(model) -> tuple[torch.nn.Module, object | None]:
    """(transformers model, early-exit wrapper or None) of `model`: a transformers causal LM, or one
    wrapped by `efficient.early_exit` (recognised by its `.model`, `.exits` and `.exit_head`)."""
    if all(hasattr(model, a) for a in ("model", "exits", "exit_head")) and hasattr(model.model, "config"):
        return model.model, model
    return model, None


class HFDecodeModel:
    """Decode form of a supported transformers causal LM (see the module docstring).

    `layer(h, i, k_cache, v_cache, slot, rope, mask)` runs layer i on a chunk [B, T, C] at cache
    slots slot..slot+T-1, writing its keys/values there and attending to slots 0..slot+T-1;
    `keys_only=j` makes the first j rows write their keys/values only (copy exits' deferred fill)."""

    def __init__(self, model, exits: list[int] | None = None) -> None:
        base, self.wrapper = unwrap(model)
        name = type(base).__name__
        if name not in SUPPORTED:
            raise ConfigError(
                f"decoding: {name} is not supported; supported causal LMs: {', '.join(SUPPORTED)} "
                "(Llama, Mistral, Qwen2 and GPT-2 checkpoints load as these with AutoModelForCausalLM)")
        cfg = base.config
        self.hf, self.config, self.name = base, cfg, name
        self.family = "llama" if name in LLAMA.classes else "gpt2"
        p = next(base.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.num_layers = cfg.num_hidden_layers
        self.wrapped_exits = None if self.wrapper is None else [int(e) for e in self.wrapper.exits]
        # own exit heads are the wrapper's modules; shared ones (and the final head) are read here
        self.own_heads = self.wrapper is not None and getattr(self.wrapper, "head", "shared") != "shared"
        if self.family == "llama":
            self._read_llama(base)
        else:
            self._read_gpt2(base)
        self.vocab_size = self.lm_head.shape[0]
        self.heads: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    # ---------------------------------------------------------------- reading weights

    def _read_llama(self, base) -> None:
        cfg, m = base.config, base.model
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in STATIC_ROPE:
            raise ConfigError(f"decoding: rotary scaling {rope_type!r} changes with the sequence length and is not supported; supported: {', '.join(STATIC_ROPE)}")
        if self.num_layers != len(m.layers):
            raise ConfigError(f"decoding: config.num_hidden_layers ({self.num_layers}) differs from the model's {len(m.layers)} layers; restore it before decoding")
        self.heads_q, self.heads_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.act = m.layers[0].mlp.act_fn
        windows = [getattr(cfg, "sliding_window", None)] if self.name == "MistralForCausalLM" else (
            [cfg.sliding_window] if "sliding_attention" in (getattr(cfg, "layer_types", None) or []) else [])
        self.sliding_window = min([w for w in windows if w], default=None)
        self.embed = m.embed_tokens.weight.detach()
        self.wpe = None
        self.layers = []
        for layer in m.layers:
            a, f = layer.self_attn, layer.mlp
            self.layers.append(LayerWeights(
                layer.input_layernorm.weight.detach(), None,
                _cat(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), _cat(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                a.o_proj.weight.detach(), _d(a.o_proj.bias),
                layer.post_attention_layernorm.weight.detach(), None,
                _cat(f.gate_proj.weight, f.up_proj.weight), _cat(f.gate_proj.bias, f.up_proj.bias),
                f.down_proj.weight.detach(), _d(f.down_proj.bias), a.scaling))
        self.norm_w, self.norm_b = m.norm.weight.detach(), None
        self.lm_head = base.lm_head.weight.detach()
        self.lm_head_b = _d(getattr(base.lm_head, "bias", None))
        self._rotary = m.rotary_emb

    def _read_gpt2(self, base) -> None:
        cfg, m = base.config, base.transformer
        if getattr(cfg, "add_cross_attention", False):
            raise ConfigError("decoding: GPT-2 with cross-attention (add_cross_attention=True) is not supported; use a decoder-only GPT2LMHeadModel")
        self.heads_q = self.heads_kv = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.layer_norm_epsilon
        self.act = m.h[0].mlp.act
        self.sliding_window = None
        self.embed, self.wpe = m.wte.weight.detach(), m.wpe.weight.detach()
        self.layers = []
        for i, b in enumerate(m.h):
            a, f = b.attn, b.mlp
            scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
            if cfg.scale_attn_by_inverse_layer_idx:
                scale /= float(i + 1)
            self.layers.append(LayerWeights(
                b.ln_1.weight.detach(), b.ln_1.bias.detach(), a.c_attn.weight.detach().t().contiguous(), a.c_attn.bias.detach(),
                a.c_proj.weight.detach().t().contiguous(), a.c_proj.bias.detach(), b.ln_2.weight.detach(), b.ln_2.bias.detach(),
                f.c_fc.weight.detach().t().contiguous(), f.c_fc.bias.detach(), f.c_proj.weight.detach().t().contiguous(), f.c_proj.bias.detach(), scale))
        self.norm_w, self.norm_b = m.ln_f.weight.detach(), m.ln_f.bias.detach()
        self.lm_head, self.lm_head_b = base.lm_head.weight.detach(), None
        self._rotary = None

    # ---------------------------------------------------------------- positions

    @property
    def max_positions(self) -> int:
        return self.wpe.shape[0] if self.wpe is not None else int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def position_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-slot position inputs for `positions` [B, S]: (cos, sin) [B, 1, S, hd] for rotary
        models, (wpe,) [B, S, C] for learned positions. Built once per generation."""
        if self._rotary is None:
            return (F.embedding(positions, self.wpe),)
        dummy = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self._rotary(dummy, positions)
        return cos[:, None], sin[:, None]

    # ---------------------------------------------------------------- heads

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm_b is None:
            return F.rms_norm(h, (h.shape[-1],), self.norm_w, self.eps)
        return F.layer_norm(h, (h.shape[-1],), self.norm_w, self.norm_b, self.eps)

    def head(self, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Hidden state after layer k -> logits: the final norm and LM head (the last layer, a plain
        model, a wrapper with shared heads), or the wrapper's own exit head k."""
        if k not in self.heads:
            if k == self.num_layers or not self.own_heads:
                self.heads[k] = lambda h: F.linear(self.final_norm(h), self.lm_head, self.lm_head_b)
            elif k in self.wrapped_exits:
                self.heads[k] = self.wrapper.exit_head(k)
            else:
                raise ConfigError(f"decoding: no exit head after layer {k}; this model's own exit heads are after layers "
                                  f"{self.wrapped_exits[:-1]} (shared heads read any layer)")
        return self.heads[k]

    # ---------------------------------------------------------------- one layer

    def layer(self, h: torch.Tensor, i: int, kc: torch.Tensor, vc: torch.Tensor, slot: int, rope: tuple,
              mask: torch.Tensor | None, keys_only: int = 0) -> torch.Tensor:
        """Layer i on `h` [B, T, C] at slots slot..slot+T-1 (see the class docstring). The first
        `keys_only` rows only store their keys/values (the rest of the layer runs on the others,
        whose queries `mask` describes); the output has T - keys_only rows."""
        w = self.layers[i]
        B, T, C = h.shape
        hq, hk, hd = self.heads_q, self.heads_kv, self.head_dim
        if w.n1b is None:
            x = F.rms_norm(h, (C,), w.n1, self.eps)
        else:
            x = F.layer_norm(h, (C,), w.n1, w.n1b, self.eps)
        qkv = F.linear(x, w.wqkv, w.bqkv).view(B, T, hq + 2 * hk, hd).transpose(1, 2)  # heads: q, then k, then v
        qk, v = qkv[:, : hq + hk], qkv[:, hq + hk :]
        if len(rope) == 2:  # rotary on queries and keys at once, transformers' rotate-half convention
            cos, sin = rope
            qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk[:, :hq], qk[:, hq:]
        end = slot + T
        kc[:, :, slot:end] = k
        vc[:, :, slot:end] = v
        if keys_only:
            q, h, T = q[:, :, keys_only:], h[:, keys_only:], T - keys_only
        y = F.scaled_dot_product_attention(q, kc[:, :, :end], vc[:, :, :end], attn_mask=mask, scale=w.scale, enable_gqa=hq != hk)
        h = h + F.linear(y.transpose(1, 2).reshape(B, T, hq * hd), w.wo, w.bo)
        if w.n2b is None:
            x = F.rms_norm(h, (C,), w.n2, self.eps)
            g, u = F.linear(x, w.w_in, w.b_in).chunk(2, dim=-1)
            return h + F.linear(self.act(g) * u, w.w_out, w.b_out)
        x = F.layer_norm(h, (C,), w.n2, w.n2b, self.eps)
        return h + F.linear(self.act(F.linear(x, w.w_in, w.b_in)), w.w_out, w.b_out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
