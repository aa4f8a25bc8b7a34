"""The zoo entry `hf`: a transformers causal LM with early exits, built from a config mapping
(`model.config`) or continued from a checkpoint directory (`model.path`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from efficient.errors import ConfigError
from efficient.hf.wrapper import CONFIG_FILE, EarlyExitLM, read_exit_config
from efficient.zoo import InputSpec, register_model

PAPER = "LayerSkip: Enabling Early Exit Inference and Self-Speculative Decoding (Elhoushi et al., ACL 2024)"

# what `hf` builds with neither config nor path: a 4-layer byte-level Llama with GQA
DEFAULT_CONFIG: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False,
}


def build_config(config: dict[str, Any]) -> Any:
    """A transformers config from a mapping with `model_type` (llama, mistral, qwen2, gpt2)."""
    from transformers import AutoConfig

    cfg = dict(config)
    kind = cfg.pop("model_type", None)
    if not isinstance(kind, str):
        raise ConfigError("model.config needs `model_type` (llama, mistral, qwen2 or gpt2) beside the transformers config keys")
    try:
        return AutoConfig.for_model(kind, **cfg)
    except ValueError as e:
        raise ConfigError(f"model.config: {e}") from None


@register_model("hf", input_spec=InputSpec((128,), dtype="long", num_classes=256), paper=PAPER, family="hf",
                description="transformers causal LM (Llama/Mistral/Qwen2/GPT-2) with early exits; model.config or model.path")
def hf(config: dict[str, Any] | None = None, path: str | None = None, exits: list[int] | None = None,
       head: Literal["shared", "own"] | None = None, layer_dropout: dict[str, Any] | None = None,
       attn_implementation: str | None = None) -> EarlyExitLM:
    """`config`: a transformers config mapping (with `model_type`) for fresh weights; `path`: a
    checkpoint directory to continue from (its `early_exit.json` brings exits and heads unless given
    here). `exits`: 1-based layers (default: saved, else half depth); `head`: shared (default) or own;
    `layer_dropout`: {max, scale, time, time_epochs, per} (efficient.hf.dropout);
    `attn_implementation`: transformers' attention kernel (sdpa, eager, ...; default: its choice)."""
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if config is not None and path is not None:
        raise ConfigError("model: give either config (fresh weights) or path (a checkpoint directory), not both")
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise ConfigError(f"model.path: {p} is not a directory; point it at a transformers checkpoint directory "
                              f"(e.g. one written by save_pretrained, with {CONFIG_FILE} for its exits)")
        if exits is None and read_exit_config(p) is None:  # a plain transformers directory: half depth
            from transformers import AutoConfig

            exits = [_num_layers(AutoConfig.from_pretrained(p)) // 2]
        return EarlyExitLM.from_pretrained(p, exits, head, layer_dropout, **kw)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(build_config(DEFAULT_CONFIG if config is None else config), **kw)
    return EarlyExitLM(model, exits, head or "shared", layer_dropout)


def _num_layers(cfg: Any) -> int:
    return int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer"))
