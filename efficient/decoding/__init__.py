"""Early-exit decoding for EE-GPT: the KV cache, the decoding steps, the exit rule and three
KV-cache strategies.

- `recompute` (EE-LLM, PP=1): tokens that exit early leave their deeper layers' KV unfilled; the
  next token that runs to full depth re-feeds them as one chunk, so deep layers always attend to
  the full model's KV (exact: equals re-running the whole prefix under the same exit rule).
- `copy` (CALM's state propagation, the baseline): an exited token's deeper KV is computed from
  its exited hidden state (approximate).
- `speculative` (LayerSkip self-speculation): the first exit drafts up to `num_draft` tokens, the
  remaining layers verify them in one chunk reusing the drafter's hidden states; greedy output is
  the full model's, sampled output follows the full model's distribution (speculative sampling).

Exit rule (EE-LLM): visit exits shallow to deep, stop at the first with max-prob >= tau.
tau >= 1 disables exiting (exits are not evaluated); tau <= 0 always takes the first exit.
Batch size 1.

Two implementations of the same strategies, giving the same tokens: `impl="engine"` (default)
runs them on `DecodeEngine` (`engine.py`: fused weights, one call per segment between exits,
optionally compiled); `impl="modules"` (`modules.py`) steps through the model's modules layer by
layer with `new_cache`, `run_layers`, `fill_kv` (and the model's own `exit_hidden(layer, h, mid,
cache, pos)` for exit blocks) -- the readable reference.

Inside the package imports point one way: `cache` <- `state` <- `modules` <- `engine`, and
`decode` (the `generate` entry point) uses them all. On CUDA, `generate` synchronizes the device
around the timed decode, so `Generation.seconds` is the decode time.

Hugging Face causal LMs (Llama, Mistral, Qwen2, GPT-2; batch >= 1, greedy): `generate_hf` in
`hf.py` runs full depth, recompute/copy exits and self-speculation with one shared static cache
on the model's own weights (`hf_model.HFDecodeModel`, `hf_cache.StaticKV`).
"""

from efficient.decoding.cache import KVCache
from efficient.decoding.decode import generate
from efficient.decoding.engine import DecodeEngine
from efficient.decoding.hf import HF_STRATEGIES, HFGeneration, generate_hf
from efficient.decoding.hf_model import HFDecodeModel
from efficient.decoding.modules import fill_kv, generate_reference, new_cache, run_layers
from efficient.decoding.state import IMPLS, STRATEGIES, Generation, Impl, Sampler, SpeculationTally, Strategy, check_threshold
from efficient.decoding.state import exits_enabled, round_exits, should_exit, speculative_accept, verify_drafts

__all__ = [
    "HF_STRATEGIES", "IMPLS", "STRATEGIES", "DecodeEngine", "Generation", "HFDecodeModel", "HFGeneration", "Impl", "KVCache", "Sampler", "SpeculationTally", "Strategy",
    "check_threshold", "exits_enabled", "fill_kv", "generate", "generate_hf", "generate_reference", "new_cache", "round_exits", "run_layers",
    "should_exit", "speculative_accept", "verify_drafts",
]
