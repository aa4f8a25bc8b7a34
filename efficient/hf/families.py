"""The two transformers decoder families early exits run on, and how one forward pass of each is
laid out: embedding, the per-layer inputs (attention masks, rotary tables), one decoder layer.

    fam = family_of(model)                     # LLAMA (Llama, Mistral, Qwen2) or GPT2; else ConfigError
    h, inputs = embed(model, input_ids)        # hidden [B, S, d] and what every layer reads besides it
    h = run_layer(layers(model)[i], i, h, inputs)   # decoder layer i (0-based)
    logits = lm_head(model)(final_norm(model)(h))

The layer loop is ours (so a forward can stop after layer k, skip dropped layers, or read several
exits in one pass), but everything inside a layer, the masks and the rotary tables is transformers'
own code, called as the model's own forward calls it (transformers 5: the `cache=` keyword).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from efficient.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """Where a family keeps its parts: `model.<base>.<layers>` etc.; `classes` are transformers'
    causal-LM class names of the family."""

    name: str
    classes: tuple[str, ...]
    base: str
    layers: str
    embed: str
    norm: str


LLAMA = Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), "model", "layers", "embed_tokens", "norm")
GPT2 = Family("gpt2", ("GPT2LMHeadModel",), "transformer", "h", "wte", "ln_f")
FAMILIES = (LLAMA, GPT2)
SUPPORTED = tuple(c for f in FAMILIES for c in f.classes)


def family_of(model: nn.Module) -> Family:
    """The family of a transformers causal LM (its class or a subclass of one); a ConfigError naming
    the supported classes for anything else."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            for fam in FAMILIES:
                if cls.__name__ in fam.classes:
                    return fam
    raise ConfigError(
        f"early exits support the transformers causal LMs {', '.join(SUPPORTED)}; got {type(model).__name__} "
        f"({type(model).__module__}). Load one of those (e.g. AutoModelForCausalLM.from_pretrained on a Llama, "
        "Mistral, Qwen2 or GPT-2 checkpoint)."
    )


def base(model: nn.Module) -> nn.Module:
    """The decoder stack without the LM head (`model.model` / `model.transformer`)."""
    return getattr(model, family_of(model).base)


def layers(model: nn.Module) -> nn.ModuleList:
    return getattr(base(model), family_of(model).layers)


def embedding(model: nn.Module) -> nn.Embedding:
    """The token embedding (GPT-2 adds its learned positions in `embed`)."""
    return getattr(base(model), family_of(model).embed)


def final_norm(model: nn.Module) -> nn.Module:
    return getattr(base(model), family_of(model).norm)


def lm_head(model: nn.Module) -> nn.Linear:
    return model.lm_head


@dataclass
class LayerInputs:
    """What each decoder layer of one forward reads besides the hidden state: its attention mask
    (None: plain causal), the keyword arguments shared by all layers, and the KV cache if any."""

    masks: list[Any]
    kwargs: dict[str, Any] = field(default_factory=dict)


def _mask_kinds(config: Any, n: int) -> list[str]:
    """Per layer: full or sliding-window attention, as the model's own forward chooses."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds[:n])
    return ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * n


def embed(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
          position_ids: torch.Tensor | None = None, cache: Any = None) -> tuple[torch.Tensor, LayerInputs]:
    """Token ids [B, S] -> (hidden [B, S, d], the layers' inputs). `attention_mask` [B, S_total]
    (1 = attend) marks padding; `cache` is a transformers Cache the layers append to."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    fam, b = family_of(model), base(model)
    config = model.config
    tok = embedding(model)(input_ids)
    if position_ids is None:
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)
    mask_args = dict(config=config, inputs_embeds=tok, attention_mask=attention_mask, cache=cache, position_ids=position_ids)
    n = len(layers(model))
    if fam is GPT2:
        h = b.drop(tok + b.wpe(position_ids))
        mask = create_causal_mask(**mask_args)
        return h, LayerInputs([mask] * n, {"cache": cache, "use_cache": cache is not None, "position_ids": position_ids})
    kinds = _mask_kinds(config, n)
    made = {}
    if "full_attention" in kinds:
        made["full_attention"] = create_causal_mask(**mask_args)
    if "sliding_attention" in kinds:
        made["sliding_attention"] = create_sliding_window_causal_mask(**mask_args)
    rotary = b.rotary_emb(tok, position_ids)
    return tok, LayerInputs([made[k] for k in kinds], {"position_embeddings": rotary, "position_ids": position_ids,
                                                       "cache": cache, "use_cache": cache is not None})


def run_layer(layer: nn.Module, i: int, h: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
    """Decoder `layer` (index `i`, 0-based, of `layers(model)`) on hidden state `h`."""
    return layer(h, attention_mask=inputs.masks[i], **inputs.kwargs)
