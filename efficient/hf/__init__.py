"""Early exits for transformers causal LMs: the Llama family (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM: rotary, RMSNorm, GQA) and GPT2LMHeadModel. Others raise a ConfigError naming these.

    import efficient
    ee = efficient.early_exit(model, exits=[2, 4, 6], head="shared")   # model: a transformers causal LM
    ee(ids)                        # final-head logits [B, S, V], equal to model(ids).logits
    ee(ids, exit_layer=4)          # logits of the exit after layer 4 (layers 5.. do not run)
    ee.exit_outputs(ids, labels)   # every exit's logits and losses in one pass
    ee.save_pretrained("ckpt")     # a transformers directory + the exits
    efficient.load("hf", path="ckpt")   # back, exits intact (or EarlyExitLM.from_pretrained)

Interface (what training, the profiler and decoding read; `EarlyExitLM`):

- `.model`: the transformers model itself (parameters shared, not copied); `.family`: its
  `families.Family` (LLAMA or GPT2).
- `.exits` (= `.exit_layers`): list[int], 1-based layer counts after which an exit reads, sorted,
  the final layer `num_layers` always last. `.num_layers`, `.vocab_size`, `.n_embd`.
- `.exit_head(k)`: a module hidden[..., d] -> logits [..., V] with `.norm` and `.proj` (a bias-free
  Linear): the model's final norm + LM head for k = num_layers and for `head="shared"` (LayerSkip),
  exit k's own norm + projection for `head="own"` (initialised as copies of those, EE-Tuning style).
- `.layers` (the decoder layers, a ModuleList), `.embed` (token embedding), `.final_norm`,
  `.lm_head`; `families.embed(model, ids, attention_mask, position_ids, cache)` gives the hidden
  state after the embedding (GPT-2: plus positions) and the per-layer inputs (masks, rotary
  tables, the transformers Cache), `families.run_layer(layer, i, h, inputs)` runs one layer as the
  model's own forward would.
- `.exit_states(ids, layers)`: per exit an `ExitState(layer, hidden, weight)` with
  logits = hidden @ weight.T, the form `objective: exits` trains on.
- `.layer_dropout`: LayerSkip's layer dropout (`dropout.LayerDropout`), active in training mode
  only; the trainer moves its time scale (`set_progress`).

Save format (`save_pretrained(dir)`): the transformers files (`config.json`, `model.safetensors`,
...; `AutoModelForCausalLM.from_pretrained(dir)` gives the same final-head logits) plus

- `early_exit.json`: {"format": "efficient-early-exit", "version": 1, "architecture": class name,
  "family": "llama"|"gpt2", "num_layers", "exits": [..., num_layers], "head": "shared"|"own",
  "layer_dropout": {max, scale, time, time_epochs, per}, "heads_file": null or {"name", "sha256"}};
- `early_exit_heads.safetensors` (own heads only): exit k's tensors under "k.norm.weight"
  (GPT-2 also "k.norm.bias") and "k.proj.weight".

Each side file is written atomically (temp file + rename), the JSON last. In a recipe,
`model: {name: hf, path: DIR}` continues from such a directory (or a plain transformers one, with
`exits:`), `model: {name: hf, config: {model_type: llama, ...}}` builds a fresh model.
"""

from __future__ import annotations

from efficient.hf.dropout import LayerDropout, LayerDropoutConfig
from efficient.hf.families import SUPPORTED
from efficient.hf.wrapper import EarlyExitLM, EarlyExitOutput, early_exit

__all__ = ["SUPPORTED", "EarlyExitLM", "EarlyExitOutput", "LayerDropout", "LayerDropoutConfig", "early_exit"]
