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
runs them on `efficient.decode_engine.DecodeEngine` (fused weights, one call per segment between
exits, optionally compiled); `impl="modules"` steps through the model's modules layer by layer
with `new_cache`, `run_layers`, `fill_kv` (and the model's own `exit_hidden(layer, h, mid, cache,
pos)` for exit blocks) -- the readable reference. On CUDA, `generate` synchronizes the device
around the timed decode, so `Generation.seconds` is the decode time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Literal, Sequence

import torch

from efficient.errors import ConfigError
from efficient.kernels.exit_confidence import exit_confidence
from efficient.profiler.exits import layer_macs

if TYPE_CHECKING:
    from efficient.decode_engine import DecodeEngine
    from efficient.models.ee_gpt import EEGPT

Strategy = Literal["recompute", "copy", "speculative"]
STRATEGIES = ("recompute", "copy", "speculative")
Impl = Literal["engine", "modules"]
IMPLS = ("engine", "modules")


def exits_enabled(threshold: float) -> bool:
    return threshold < 1.0


def should_exit(pmax: float, threshold: float) -> bool:
    """EE-LLM's rule p_max >= tau, with tau >= 1 meaning 'never exit' (see ee_llm.md 4.1)."""
    return exits_enabled(threshold) and pmax >= threshold


@dataclass
class Sampler:
    """Greedy when temperature == 0, else temperature / top-k / top-p sampling."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling distribution [..., V] after temperature, top-k and top-p."""
        z = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < z.shape[-1]:
            kth = torch.topk(z, self.top_k, dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        p = torch.softmax(z, dim=-1)
        if self.top_p is not None and self.top_p < 1:
            sp, si = torch.sort(p, dim=-1, descending=True)
            drop = sp.cumsum(-1) - sp > self.top_p  # keep the smallest prefix reaching top_p
            p = p.scatter(-1, si, sp.masked_fill(drop, 0))
            p = p / p.sum(-1, keepdim=True)
        return p

    def draw(self, p: torch.Tensor) -> int:
        return int(torch.multinomial(p.reshape(-1), 1, generator=self.generator))

    def pick(self, logits: torch.Tensor) -> int:
        return int(logits.argmax()) if self.greedy else self.draw(self.probs(logits))


@dataclass
class Generation:
    """Generated ids, the exit layer of each, costs, and the final cache state (for inspection)."""

    prompt: list[int]
    tokens: list[int]
    exit_layers: list[int]
    num_layers: int
    seconds: float
    macs: int  # projection MACs actually spent after the prompt (incl. recompute / copy / verify)
    full_macs: int  # the same for the full model without exits: tokens x (L layers + final head)
    expected_macs: int  # sum over tokens of (layers to its exit + exit heads evaluated on the way)
    committed: int = 0  # positions < committed hold full-depth KV
    cache: KVCache | None = None
    stats: dict[str, float] = field(default_factory=dict)
    cpu_seconds: float = 0.0  # CPU time of the decoding thread: robust to other jobs on a shared machine
    logprobs: list[float] = field(default_factory=list)  # forced decoding: log-prob of each fed token under the head that decided it

    def summary(self) -> dict[str, float]:
        n = max(len(self.tokens), 1)
        return {
            "tokens": len(self.tokens),
            "tokens_per_s": len(self.tokens) / self.seconds if self.seconds > 0 else float("inf"),
            "mean_exit_layer": sum(self.exit_layers) / n,
            "mean_exit_depth": sum(self.exit_layers) / n / self.num_layers,
            "expected_mac_saving": 1 - self.expected_macs / max(self.full_macs, 1),
            "mac_saving": 1 - self.macs / max(self.full_macs, 1),
            **self.stats,
        }

    def exit_histogram(self) -> dict[int, float]:
        n = max(len(self.exit_layers), 1)
        return {k: self.exit_layers.count(k) / n for k in sorted(set(self.exit_layers))}


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


def new_cache(model: EEGPT, batch: int, max_len: int | None = None) -> KVCache:
    """An empty cache for `model`: one slot per layer, then one per exit (exit blocks use theirs)."""
    p = model.tok_emb.weight
    return KVCache(model.num_layers + len(model.exit_layers), batch, model.n_head, max_len or model.seq_len, model.n_embd // model.n_head, p.device, p.dtype)


def run_layers(model: EEGPT, h: torch.Tensor, start: int, stop: int, cache: KVCache, pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run layers start+1..stop (1-based) on the chunk `h` [B, T, C] at positions pos..pos+T-1,
    writing their keys/values into `cache`. Returns the output and the last post-attention residual."""
    cos, sin = model._rope(pos, h.shape[1])
    mid = None
    for i in range(start, stop):
        h, mid = model.layers[i](h, cos, sin, cache, pos)
    return h, mid


def fill_kv(model: EEGPT, h: torch.Tensor, start: int, cache: KVCache, pos: int) -> None:
    """CALM-style state propagation: keys/values of layers start+1..L (and of deeper exit blocks)
    from the hidden state `h` that exited after layer `start` (an approximation of the full model's KV)."""
    cos, sin = model._rope(pos, h.shape[1])
    blocks = list(model.layers[start:])
    blocks += [model.exits[str(e)].block for e in model.exit_layers[:-1] if e > start and model.exits[str(e)].block is not None]
    for block in blocks:
        _, k, v = block.attn.qkv(block.norm1(h), cos, sin)
        cache.write(block.attn.slot, pos, k, v)


def _prefill(model: EEGPT, ids: torch.Tensor, cache: KVCache) -> None:
    """Full-depth KV for `ids` at positions 0..; exit blocks too, so later exits can attend to them."""
    if len(ids) == 0:
        return
    h, mid, depth = model.tok_emb(ids[None]), None, 0
    for e in model.exit_layers:
        h, mid = run_layers(model, h, depth, e, cache, 0)
        depth = e
        if e < model.num_layers and model.exits[str(e)].block is not None:
            model.exit_hidden(e, h, mid, cache, 0)


class _Costs:
    """Projection-MAC bookkeeping from the profiler's `layer_macs(model)`."""

    def __init__(self, model: EEGPT) -> None:
        m = layer_macs(model)
        self.layer, self.L = m["layer"], model.num_layers
        self.head = {int(k[4:]): v for k, v in m.items() if k.startswith("head")}
        self.C, self.V = model.n_embd, model.vocab_size
        self.spent = 0

    def layers(self, tokens: int, n: int) -> None:
        self.spent += tokens * n * self.layer

    def exit(self, layer: int, chunk: int) -> int:
        """Exit head on the last position; an exit block runs on the whole `chunk` (it writes KV)."""
        body = self.head[layer] - self.C * self.V
        cost = chunk * body + self.C * self.V
        self.spent += cost
        return body + self.C * self.V

    def full_token(self) -> int:
        return self.L * self.layer + self.head[self.L]


def _as_ids(model, prompt: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(prompt, dtype=torch.long, device=model.tok_emb.weight.device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ConfigError(f"generate: the prompt must be a non-empty 1-D sequence of token ids (batch size 1), got shape {tuple(ids.shape)}")
    if int(ids.max()) >= model.vocab_size or int(ids.min()) < 0:
        raise ConfigError(f"generate: prompt ids must lie in [0, {model.vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    return ids


def check_threshold(threshold: float | None) -> float:
    """The exit threshold as a max-probability in (0, 1]; None ("none") and 1 never exit."""
    if threshold is None:
        return 1.0
    if not 0 < threshold <= 1:
        raise ConfigError(f"the exit threshold is a max-probability in (0, 1] (1 or none = never exit), got {threshold}")
    return float(threshold)


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

    `impl="engine"` runs the strategies on `efficient.decode_engine.DecodeEngine` (fused weights,
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
        forced = _as_ids(model, forced).tolist()
        if len(forced) != max_new_tokens:
            raise ConfigError(f"generate: forced has {len(forced)} tokens, max_new_tokens is {max_new_tokens}; they must be equal")
    ids = _as_ids(model, prompt)
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
            from efficient.decode_engine import DecodeEngine, run_layerwise, run_speculative

            engine = engine or DecodeEngine(model)
            cache = engine.new_cache(total)
            engine.bind(cache)
            run = partial(run_speculative, engine) if strategy == "speculative" else partial(run_layerwise, engine, feed=forced)
        else:
            cache = new_cache(model, 1, total)
            run = partial(_speculative if strategy == "speculative" else _layerwise, model)
        _prefill(model, ids[:-1], cache)  # the prompt's KV, untimed, the same for both
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


def _layerwise(model, ids, max_new, threshold, sampler, cache, strategy, max_pending, **_) -> Generation:
    """`recompute` and `copy`: one new token per step, exits visited shallow to deep.

    recompute keeps, for every pending position (exited early, deep KV missing), the depth it was
    computed to and its hidden state there. Each segment of layers runs on the new token plus the
    pending positions that lack those layers, starting from their stored states, so every (layer,
    position) pair is computed exactly once. Depths never increase along the pending positions (a
    token that runs to depth d takes every earlier pending position with it), so the positions
    that need a segment form a contiguous suffix and the chunk is one slice of the cache.
    """
    L, costs = model.num_layers, _Costs(model)
    seq = ids.tolist()
    c = len(seq) - 1  # positions < c have full-depth KV; positions c..n-1 are pending
    depth_of: list[int] = []  # recompute: computed depth of pending positions c, c+1, ...
    state_of: list[torch.Tensor] = []  # ... and their hidden state [1, 1, C] at that depth
    tokens, exits, expected = [], [], 0
    for _ in range(max_new):
        n = len(seq) - 1
        forced = max_pending is not None and n - c >= max_pending
        h = model.tok_emb(torch.tensor([seq[n:]], device=ids.device))
        start, depth, mid, spent_heads = n, 0, None, 0
        for e in model.exit_layers:
            if strategy == "recompute":
                # pending positions computed to exactly `depth` sit right before the chunk
                j = start - c
                while j > 0 and depth_of[j - 1] == depth:
                    j -= 1
                if j < start - c:
                    h = torch.cat(state_of[j : start - c] + [h], dim=1)
                    start = c + j
            h, mid = run_layers(model, h, depth, e, cache, start)
            T = h.shape[1]
            costs.layers(T, e - depth)
            depth = e
            if e < L and not exits_enabled(threshold):
                continue
            head = model.exits[str(e)] if e < L else None
            if head is not None and head.block is not None:  # an exit block writes KV for the chunk
                hid = model.exit_hidden(e, h, mid, cache, start)[:, -1]
                spent_heads += costs.exit(e, T)
            else:
                hid = model.exit_hidden(e, h[:, -1:], None if mid is None else mid[:, -1:])[:, -1]
                spent_heads += costs.exit(e, 1)
            w = model.head_weight(e)
            if e == L:
                tok, c = sampler.pick(hid @ w.T), n + 1
                depth_of, state_of = [], []
                break
            pmax, arg = exit_confidence(hid, w)
            if should_exit(float(pmax), threshold) and not forced:
                tok = int(arg) if sampler.greedy else sampler.pick(hid @ w.T)
                if strategy == "copy":
                    fill_kv(model, h, e, cache, n)
                    costs.spent += 3 * model.n_embd**2 * (L - e)
                    c = n + 1
                else:  # positions start..n now stand at depth e
                    k = start - c
                    depth_of[k:] = [e] * (T - 1)
                    state_of[k:] = [h[:, i : i + 1] for i in range(T - 1)]
                    depth_of.append(e)
                    state_of.append(h[:, -1:])
                break
        expected += costs.layer * e + spent_heads
        seq.append(tok)
        tokens.append(tok)
        exits.append(e)
    return Generation(ids.tolist(), tokens, exits, L, 0.0, costs.spent, max_new * costs.full_token(), expected, c, cache)


def speculative_accept(p: torch.Tensor, q: torch.Tensor, draft: int, sampler: Sampler) -> tuple[bool, int]:
    """Speculative sampling (Leviathan et al., 2023): keep the draft d ~ q with prob min(1, p(d)/q(d)),
    else draw from norm(max(p - q, 0)); the result is distributed exactly as p."""
    u = float(torch.rand((), generator=sampler.generator))
    if u * float(q[draft]) < float(p[draft]):
        return True, draft
    resid = (p - q).clamp(min=0)
    return False, sampler.draw(resid / resid.sum())


def verify_drafts(logits: torch.Tensor, drafts: Sequence[int], q: Sequence[torch.Tensor], sampler: Sampler) -> tuple[list[int], int]:
    """Check drafts against the full model's predictions `logits` [len(drafts) + 1, V]: the tokens
    to commit (accepted drafts, then the correction or the bonus token) and how many drafts were
    accepted. Greedy: a draft stands if it is the full model's argmax; sampling: speculative
    acceptance against the drafter's distributions `q`."""
    new: list[int] = []
    full_arg = logits.argmax(-1).tolist() if sampler.greedy else None  # one op for the whole chunk
    for j, d in enumerate(drafts):
        if sampler.greedy:
            ok, tok = full_arg[j] == d, full_arg[j]
        else:
            ok, tok = speculative_accept(sampler.probs(logits[j]), q[j], d, sampler)
        new.append(tok)
        if not ok:
            break
    else:
        new.append(sampler.pick(logits[len(drafts)]))
    return new, min(len(new) - 1, len(drafts))


def round_exits(exits: list[int], n_new: int, a: int, E: int, L: int, costs: _Costs) -> int:
    """Record a speculation round's exit layers (accepted drafts at the drafting exit E, the rest at
    L) in `exits`; return the round's expected MACs under the exit rule."""
    for j in range(n_new):
        exits.append(E if j < a else L)
    return a * (costs.layer * E + costs.head[E]) + (n_new - a) * costs.full_token()


def _speculative(model, ids, max_new, threshold, sampler, cache, num_draft, **_) -> Generation:
    """Draft with the first exit, verify with layers E+1..L over the drafter's hidden states."""
    L, E, costs = model.num_layers, model.exit_layers[0], _Costs(model)
    wE, wL = model.head_weight(E), model.head_weight(L)
    seq = ids.tolist()
    c = len(seq) - 1
    tokens, exits, expected = [], [], 0
    drafted = accepted = rounds = 0
    while len(tokens) < max_new:
        budget = max_new - len(tokens)
        hs, drafts, q = [], [], []
        tok, pos, unsure = seq[c], c, False
        while True:  # feed tokens through layers 1..E; each fed token but the last yields a draft
            h, mid = run_layers(model, model.tok_emb(torch.tensor([[tok]], device=ids.device)), 0, E, cache, pos)
            costs.layers(1, E)
            hs.append(h)
            if unsure or len(drafts) >= min(num_draft, budget - 1):
                break
            hid = model.exit_hidden(E, h, mid, cache, pos)[:, -1]
            costs.exit(E, 1)
            if sampler.greedy:
                pmax, arg = exit_confidence(hid, wE)
                tok = int(arg)
            else:
                qp = sampler.probs(hid @ wE.T)[0]
                tok, pmax = sampler.draw(qp), qp.max()
                q.append(qp)
            drafts.append(tok)
            pos += 1
            unsure = 0 < threshold < 1 and float(pmax) < threshold  # an unsure draft ends the round
        H = torch.cat(hs, dim=1)
        h, _ = run_layers(model, H, E, L, cache, c)
        costs.layers(H.shape[1], L - E)
        logits = model.exit_hidden(L, h, None)[0] @ wL.T  # [m+1, V]: full-model predictions
        costs.spent += H.shape[1] * model.n_embd * model.vocab_size
        new, a = verify_drafts(logits, drafts, q, sampler)
        drafted, accepted, rounds = drafted + len(drafts), accepted + a, rounds + 1
        expected += round_exits(exits, len(new), a, E, L, costs)
        seq += new
        tokens += new
        c += len(new)
    stats = {"draft_acceptance": accepted / max(drafted, 1), "tokens_per_round": len(tokens) / max(rounds, 1)}
    return Generation(ids.tolist(), tokens, exits, L, 0.0, costs.spent, max_new * costs.full_token(), expected, c, cache, stats)


@torch.no_grad()
def generate_reference(model, prompt: torch.Tensor | Sequence[int], max_new_tokens: int, threshold: float = 1.0) -> tuple[list[int], list[int]]:
    """The spec, without a cache: every step re-runs the whole prefix, then applies the exit rule to
    the last position (greedy). Returns (tokens, exit layers)."""
    seq = _as_ids(model, prompt).tolist()
    tokens, exits = [], []
    for _ in range(max_new_tokens):
        states = model.exit_states(torch.tensor([seq], device=model.tok_emb.weight.device))
        for s in states:
            logits = s.hidden[0, -1] @ s.weight.T
            if s.layer == model.num_layers or should_exit(float(torch.softmax(logits.float(), -1).max()), threshold):
                break
        tok = int(logits.argmax())
        seq.append(tok)
        tokens.append(tok)
        exits.append(s.layer)
    return tokens, exits
