"""`generate`: checks a request, fills the prompt's KV, runs one strategy on one implementation
(`engine` or `modules`) and times the decode."""

from __future__ import annotations


from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Sequence

import torch

from efficient.decoding.modules import layerwise, new_cache, prefill, speculative
from efficient.decoding.state import IMPLS, STRATEGIES, Generation, Impl, Sampler, Strategy, as_ids, check_threshold
from efficient.errors import ConfigError

if TYPE_CHECKING:
    from efficient.decoding.engine import DecodeEngine


@torch.inference_mode()  # no autograd bookkeeping at all: per-op overhead is what a decode step costs on CPU
def generate(
    model,
    prompt: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    threshold: float | None = 1.0,
    strategy: Strategy = "recompute",
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    num_draft: int = 8,
    max_pending: int | None = None,
    impl: Impl = "engine",
    engine: DecodeEngine | None = None,
    forced: Sequence[int] | None = None,
) -> Generation:
    """Decode `max_new_tokens` tokens after `prompt` with early exits (see the module docstring).

    `impl="engine"` runs the strategies on `efficient.decoding.DecodeEngine` (fused weights,
    one call per segment between exits; pass a built `engine`, e.g. a compiled one, to reuse it);
    `impl="modules"` runs them module by module, layer by layer. Both give the same tokens.

    `forced` (recompute and copy, on the engine): decode these tokens instead of choosing them,
    under the same exit rule, and record each one's log-prob under the head that decided it in
    `Generation.logprobs` -- a strategy's held-out loss as it decodes (copy's approximate KV
    included)."""
    threshold = check_threshold(threshold)
    if impl not in IMPLS:
        raise ConfigError(f"generate: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if engine is not None and (impl != "engine" or engine.model is not model):
        raise ConfigError("generate: `engine` must be a DecodeEngine built from this model, with impl='engine'")
    if strategy not in STRATEGIES:
        raise ConfigError(f"generate: strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if max_new_tokens < 1:
        raise ConfigError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise ConfigError(f"generate: need temperature >= 0, top_k >= 1, 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
    if num_draft < 1:
        raise ConfigError(f"generate: num_draft must be >= 1, got {num_draft}")
    if max_pending is not None and max_pending < 1:
        raise ConfigError(f"generate: max_pending must be >= 1 or unset, got {max_pending}")
    if forced is not None:
        if impl != "engine" or strategy == "speculative":
            raise ConfigError("generate: forced decoding runs recompute or copy on the engine (speculative is lossless by construction)")
        forced = as_ids(model, forced).tolist()
        if len(forced) != max_new_tokens:
            raise ConfigError(f"generate: forced has {len(forced)} tokens, max_new_tokens is {max_new_tokens}; they must be equal")
    ids = as_ids(model, prompt)
    total = len(ids) + max_new_tokens
    if total > model.seq_len:
        raise ConfigError(f"generate: prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's seq_len {model.seq_len}")
    if strategy == "speculative" and len(model.exit_layers) < 2:
        raise ConfigError("generate: speculative decoding drafts with an early exit, and this model has none")
    gen = torch.Generator(device=ids.device)
    gen.manual_seed(0 if seed is None else seed)
    sampler = Sampler(temperature, top_k, top_p, gen)
    cuda = ids.device.type == "cuda"
    was_training = model.training
    model.eval()
    try:
        if impl == "engine":
            from efficient.decoding.engine import DecodeEngine, run_layerwise, run_speculative

            engine = engine or DecodeEngine(model)
            cache = engine.new_cache(total)
            engine.bind(cache)
            run = partial(run_speculative, engine) if strategy == "speculative" else partial(run_layerwise, engine, feed=forced)
        else:
            cache = new_cache(model, 1, total)
            run = partial(speculative if strategy == "speculative" else layerwise, model)
        prefill(model, ids[:-1], cache)  # the prompt's KV, untimed, the same for both
        if cuda:  # the untimed prefill's queued kernels must not land in the timed decode
            torch.cuda.synchronize(ids.device)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = run(ids, max_new_tokens, threshold, sampler, cache, strategy=strategy, num_draft=num_draft, max_pending=max_pending)
        if cuda:  # nor may the last step's kernels still be queued when the clock is read
            torch.cuda.synchronize(ids.device)
        out.seconds, out.cpu_seconds = time.perf_counter() - t0, time.thread_time() - c0
    finally:
        model.train(was_training)
    return out
