"""A decode engine for EE-GPT whose per-token cost is the layers' arithmetic.

`DecodeEngine(model)` takes the model's weights once, in decode form: the QKV projection as one
matrix (as the model stores it), the SwiGLU gate and up projections concatenated into one [2F, C]
matrix, norms and projections as plain tensors. The model's parameters and checkpoint format are
unchanged; an engine built from a model reads its weights at construction (build a new one after
the weights change).

A token's step is one call per segment between exits: the segment's layers, the exit head, and the
exit confidence (max softmax probability and argmax) together. With `compile=True` that call is a
`torch.compile(dynamic=False)` graph on static shapes: one token, its position a tensor, the KV
cache a preallocated window per slot whose unwritten tail is masked out. Multi-token chunks (KV
recomputation of pending tokens, speculative verification) are padded to the next of a few static
lengths and compiled the same way; longer ones run eagerly. Eagerly (`compile=False`), a token is
a chunk of one that reads exactly its keys. Python work per token is the exit rule between
segments; nothing per layer beyond the eager path's own op calls. The prompt's KV is filled by
the module path (untimed, the same for both).

The strategies (`recompute`, `copy`, `speculative`; see `efficient.decoding`) are the same
algorithms as the module-by-module path (`efficient.decoding.modules`), step for step, so greedy
decoding gives the same tokens and exit layers. `efficient.decoding.generate(..., impl="engine")`
runs them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from efficient.decoding.cache import KVCache
from efficient.decoding.modules import new_cache
from efficient.decoding.state import Generation, Sampler, SpeculationTally, _Costs, exits_enabled, should_exit, verify_drafts
from efficient.errors import ConfigError
from efficient.kernels._backend import have_cxx_compiler

if TYPE_CHECKING:
    from efficient.models.ee_gpt import EEGPT

WINDOW_STEP = 32  # the static KV window is the generation's length rounded up to this


class LayerWeights(NamedTuple):
    """One pre-norm layer in decode form; `w13` = [w_gate; w_up] (one matmul for both)."""

    norm1: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    norm2: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor


class MLPWeights(NamedTuple):
    """An exit MLP with the norm of the layer it branches from (EE-LLM's exit-MLP)."""

    norm2: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor


class HeadWeights(NamedTuple):
    """[exit block | exit MLP] -> [norm] -> projection; `slot`: the exit block's cache slot."""

    block: LayerWeights | None
    mlp: MLPWeights | None
    norm: torch.Tensor | None
    proj: torch.Tensor
    slot: int


class StepOut(NamedTuple):
    """A segment's output: hidden state, post-attention residual of its last layer, and for a
    segment that ends in an exit head the head's last-position logits [1, V], max-prob and argmax."""

    h: torch.Tensor
    mid: torch.Tensor
    logits: torch.Tensor | None
    pmax: torch.Tensor | None
    arg: torch.Tensor | None


def _layer_weights(block) -> LayerWeights:
    mlp = block.mlp
    return LayerWeights(
        block.norm1.weight.detach(), block.attn.wqkv.weight.detach(), block.attn.wo.weight.detach(), block.norm2.weight.detach(),
        torch.cat([mlp.w_gate.weight, mlp.w_up.weight]).detach(), mlp.w_down.weight.detach(),
    )


# ----------------------------------------------------------------------------- the step maths
# One layer = the same operations as `efficient.models.ee_gpt.Block`, with the gate and up
# projections in one matmul. Two attention forms: one token at a tensor position over a static
# window (compiled), or a chunk at an int position over exactly the keys it reads (eager).


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _qkv(x: torch.Tensor, w: LayerWeights, n_head: int, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    B, T, C = x.shape
    qkv = F.linear(F.rms_norm(x, (C,), w.norm1, eps), w.wqkv).view(B, T, 3, n_head, C // n_head).transpose(1, 3)
    qk = _rope(qkv[:, :, :2], cos, sin)
    return qk[:, :, 0], qk[:, :, 1], qkv[:, :, 2]


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    g, u = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w2)


def _finish(h: torch.Tensor, y: torch.Tensor, w: LayerWeights, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, _, T, _ = y.shape
    mid = h + F.linear(y.transpose(1, 2).reshape(B, T, -1), w.wo)
    return mid + _swiglu(F.rms_norm(mid, (mid.shape[-1],), w.norm2, eps), w.w13, w.w2), mid


def _layer_one(h, w: LayerWeights, kc, vc, pos, cos, sin, mask, n_head: int, eps: float):
    """One token at position `pos` (a 1-element long tensor); `mask` [1, window] hides keys after it."""
    q, k, v = _qkv(h, w, n_head, eps, cos, sin)
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    return _finish(h, F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask), w, eps)


def _layer_chunk(h, w: LayerWeights, kc, vc, pos: int, cos, sin, mask, n_head: int, eps: float):
    """A chunk at positions pos..pos+T-1 reading keys 0..pos+T-1 (`mask`: causal within, None for T=1)."""
    q, k, v = _qkv(h, w, n_head, eps, cos, sin)
    T = h.shape[1]
    kc[:, :, pos : pos + T] = k
    vc[:, :, pos : pos + T] = v
    return _finish(h, F.scaled_dot_product_attention(q, kc[:, :, : pos + T], vc[:, :, : pos + T], attn_mask=mask), w, eps)


def _confidence(hid: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, max-prob and argmax of the last position (as `exit_confidence`'s torch path computes them)."""
    logits = hid @ proj.T
    acc = torch.promote_types(logits.dtype, torch.float32)
    pmax, arg = torch.softmax(logits.to(acc), dim=-1).max(dim=-1)
    return logits, pmax, arg


def step_one(x, pos, cos_t, sin_t, emb, layers, kv, head, head_kv, n_head: int, eps: float) -> StepOut:
    """One token through `layers` (and `head`, if given): the compiled unit. `x` is the token id
    [1, 1] when `emb` is given, else the hidden state [1, 1, C]; `pos` a 1-element long tensor."""
    h = F.embedding(x, emb) if emb is not None else x
    window = kv[0][0].shape[2] if kv else head_kv[0].shape[2]
    cos, sin = cos_t.index_select(0, pos), sin_t.index_select(0, pos)
    mask = (torch.arange(window, device=pos.device) <= pos).view(1, window)
    mid = h
    for w, (kc, vc) in zip(layers, kv):
        h, mid = _layer_one(h, w, kc, vc, pos, cos, sin, mask, n_head, eps)
    if head is None:
        return StepOut(h, mid, None, None, None)
    hid = h
    if head.block is not None:
        hid, _ = _layer_one(hid, head.block, head_kv[0], head_kv[1], pos, cos, sin, mask, n_head, eps)
    elif head.mlp is not None:
        hid = mid + _swiglu(F.rms_norm(mid, (mid.shape[-1],), head.mlp.norm2, eps), head.mlp.w13, head.mlp.w2)
    if head.norm is not None:
        hid = F.rms_norm(hid, (hid.shape[-1],), head.norm, eps)
    return StepOut(h, mid, *_confidence(hid[:, -1], head.proj))


def fill_one(h, pos, cos_t, sin_t, layers, kv, n_head: int, eps: float) -> None:
    """CALM-style state propagation for one token: keys/values of `layers` from the hidden state `h`."""
    cos, sin = cos_t.index_select(0, pos), sin_t.index_select(0, pos)
    for w, (kc, vc) in zip(layers, kv):
        _, k, v = _qkv(h, w, n_head, eps, cos, sin)
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)


def chunk_static(h, pos, last, cos_t, sin_t, layers, kv, head, head_kv, n_head: int, eps: float, all_positions: bool) -> StepOut:
    """A chunk padded to a static length Tb at positions pos..pos+Tb-1 (`pos` a 1-element long
    tensor): the compiled form of `DecodeEngine.chunk`. Padding rows come after the real ones, so
    causality keeps them out of the real rows; their keys/values land on future positions, which
    are rewritten before any query reads them. `last`: index of the last real row (1-element)."""
    Tb = h.shape[1]
    window = kv[0][0].shape[2]
    idx = pos + torch.arange(Tb, device=pos.device)
    cos, sin = cos_t.index_select(0, idx), sin_t.index_select(0, idx)
    mask = torch.arange(window, device=pos.device).view(1, window) <= idx.view(Tb, 1)
    mid = h
    for w, (kc, vc) in zip(layers, kv):
        h, mid = _layer_one(h, w, kc, vc, idx, cos, sin, mask, n_head, eps)
    if head is None:
        return StepOut(h, mid, None, None, None)
    hid = h
    if head.block is not None:
        hid, _ = _layer_one(hid, head.block, head_kv[0], head_kv[1], idx, cos, sin, mask, n_head, eps)
    elif head.mlp is not None:
        m = mid if all_positions else mid.index_select(1, last)
        hid = m + _swiglu(F.rms_norm(m, (m.shape[-1],), head.mlp.norm2, eps), head.mlp.w13, head.mlp.w2)
    if not all_positions and head.mlp is None:
        hid = hid.index_select(1, last)
    if head.norm is not None:
        hid = F.rms_norm(hid, (hid.shape[-1],), head.norm, eps)
    if all_positions:
        return StepOut(h, mid, hid[0] @ head.proj.T, None, None)
    return StepOut(h, mid, *_confidence(hid[:, -1], head.proj))


# ----------------------------------------------------------------------------- the engine

CHUNK_BUCKETS = (2, 4, 8, 16)  # compiled chunk lengths; a chunk is padded to the next one (longer: eager)


@dataclass
class _Head:
    weights: HeadWeights
    fill_layers: list[LayerWeights]  # copy: what an exit here propagates its state into
    fill_slots: list[int]


class DecodeEngine:
    """Decode-time form of an `EEGPT` (see the module docstring). `compile=True` compiles the
    one-token segment steps and the chunks of up to max(`chunk_lengths`) tokens (padded to the
    next length) with `torch.compile(dynamic=False)` (a C++ compiler is needed on CPU);
    compilation happens on first use, or up front in `warm_up`."""

    def __init__(self, model: EEGPT, compile: bool = False, chunk_lengths: tuple[int, ...] = CHUNK_BUCKETS) -> None:
        if compile and model.tok_emb.weight.device.type == "cpu" and not have_cxx_compiler():
            raise ConfigError("DecodeEngine(compile=True) needs a C++ compiler on CPU (inductor builds the step with it); install g++ or use compile=False")
        if not chunk_lengths or sorted(chunk_lengths) != list(chunk_lengths) or chunk_lengths[0] < 2:
            raise ConfigError(f"DecodeEngine: chunk_lengths must be increasing lengths >= 2, got {chunk_lengths}")
        self.model, self.compiled, self.chunk_lengths = model, compile, tuple(chunk_lengths)
        self.num_layers, self.exit_layers, self.n_head = model.num_layers, list(model.exit_layers), model.n_head
        self.eps = model.layers[0].norm1.eps if model.num_layers else 1e-5
        self.emb = model.tok_emb.weight.detach()
        self.cos, self.sin = model.rope_cos, model.rope_sin
        self.layers = [_layer_weights(b) for b in model.layers]
        L, self.heads = model.num_layers, {}
        for e in self.exit_layers:
            if e == L:
                hw = HeadWeights(None, None, model.norm_f.weight.detach(), model.head_weight(L).detach(), -1)
            else:
                ex = model.exits[str(e)]
                mlp = None if ex.mlp is None else MLPWeights(model.layers[e - 1].norm2.weight.detach(), torch.cat([ex.mlp.w_gate.weight, ex.mlp.w_up.weight]).detach(), ex.mlp.w_down.weight.detach())
                hw = HeadWeights(None if ex.block is None else _layer_weights(ex.block), mlp, None if ex.norm is None else ex.norm.weight.detach(),
                                 model.head_weight(e).detach(), -1 if ex.block is None else ex.block.attn.slot)
            deeper = [x for x in self.exit_layers[:-1] if x > e and model.exits[str(x)].block is not None]
            self.heads[e] = _Head(hw, self.layers[e:] + [_layer_weights(model.exits[str(x)].block) for x in deeper],
                                  list(range(e, L)) + [model.exits[str(x)].block.attn.slot for x in deeper])
        self._step = torch.compile(step_one, dynamic=False, fullgraph=True) if compile else step_one
        self._fill = torch.compile(fill_one, dynamic=False, fullgraph=True) if compile else fill_one
        self._chunk_static = torch.compile(chunk_static, dynamic=False, fullgraph=True) if compile else None
        if compile:
            # one graph per (segment shape, head kind, window); allow more than dynamo's default 8
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)

    # ---------------------------------------------------------------- buffers

    @staticmethod
    def window(total: int) -> int:
        """The static KV window for a generation of `total` positions."""
        return -(-total // WINDOW_STEP) * WINDOW_STEP

    def new_cache(self, total: int) -> KVCache:
        return new_cache(self.model, 1, self.window(total))

    def _kv(self, cache: KVCache, slots) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(cache.k[s], cache.v[s]) for s in slots]

    def bind(self, cache: KVCache) -> None:
        """Per-slot cache views and the step's input tensors, built once per generation (not per token)."""
        self._cache = cache
        self._slot_kv = self._kv(cache, range(len(cache.k)))
        dev = self.emb.device
        self._tok = torch.zeros(1, 1, dtype=torch.long, device=dev)  # inputs of the compiled step,
        self._pos = torch.zeros(1, dtype=torch.long, device=dev)  # refilled in place each token
        self._last = torch.zeros(1, dtype=torch.long, device=dev)
        # compiled chunks: one padded input per length, zeros so padding rows stay finite
        self._pad = {b: torch.zeros(1, b, self.emb.shape[1], device=dev, dtype=self.emb.dtype) for b in self.chunk_lengths} if self.compiled else {}
        self._limit = min(cache.max_len, self.cos.shape[0])  # positions a padded chunk may reach

    # ---------------------------------------------------------------- steps

    def step(self, x: int | torch.Tensor, pos: int, start: int, stop: int, head: int | None) -> StepOut:
        """One token at position `pos` through layers start+1..stop, then the exit head after layer
        `head` (None: no head). `x`: the token id when start == 0, else the hidden state [1, 1, C].
        Compiled: one graph call on static shapes; eager: the chunk path with T = 1."""
        if not self.compiled:
            h = self.emb[x].view(1, 1, -1) if start == 0 else x
            return self._chunk(h, pos, start, stop, head, False)
        self._pos.fill_(pos)
        if start == 0:
            self._tok.fill_(x)
        hw = None if head is None else self.heads[head].weights
        head_kv = self._slot_kv[hw.slot] if hw is not None and hw.block is not None else None
        return self._step(self._tok if start == 0 else x, self._pos, self.cos, self.sin, self.emb if start == 0 else None,
                          self.layers[start:stop], self._slot_kv[start:stop], hw, head_kv, self.n_head, self.eps)

    def chunk(self, h: torch.Tensor, pos: int, start: int, stop: int, head: int | None, all_positions: bool = False) -> StepOut:
        """A chunk of hidden states [1, T, C] at positions pos.. through layers start+1..stop and the
        exit head after `head`: on the last position, or on all of them when `all_positions` (an exit
        block always runs on the whole chunk: it writes its keys/values). Compiled: padded to the
        next of `chunk_lengths` where that fits before the end of the cache; else eager."""
        T = h.shape[1]
        Tb = next((b for b in self.chunk_lengths if b >= T), None) if self.compiled and T > 1 else None
        if Tb is None or pos + Tb > self._limit:
            return self._chunk(h, pos, start, stop, head, all_positions)
        pad = self._pad[Tb]
        pad[:, :T] = h
        self._pos.fill_(pos)
        self._last.fill_(T - 1)
        hw = None if head is None else self.heads[head].weights
        head_kv = self._slot_kv[hw.slot] if hw is not None and hw.block is not None else None
        out = self._chunk_static(pad, self._pos, self._last, self.cos, self.sin, self.layers[start:stop], self._slot_kv[start:stop],
                                 hw, head_kv, self.n_head, self.eps, all_positions)
        logits = out.logits[:T] if all_positions else out.logits
        return StepOut(out.h[:, :T], out.mid[:, :T], logits, out.pmax, out.arg)

    def _chunk(self, h: torch.Tensor, pos: int, start: int, stop: int, head: int | None, all_positions: bool) -> StepOut:
        T, cache = h.shape[1], self._cache
        cos, sin = self.cos[pos : pos + T], self.sin[pos : pos + T]
        mask = None if T == 1 else cache.causal[pos : pos + T, : pos + T]
        mid = h
        for i in range(start, stop):
            h, mid = _layer_chunk(h, self.layers[i], cache.k[i], cache.v[i], pos, cos, sin, mask, self.n_head, self.eps)
        if head is None:
            return StepOut(h, mid, None, None, None)
        hw = self.heads[head].weights
        rows = slice(None) if all_positions else slice(-1, None)  # the head runs on these positions
        if hw.block is not None:
            hid = _layer_chunk(h, hw.block, cache.k[hw.slot], cache.v[hw.slot], pos, cos, sin, mask, self.n_head, self.eps)[0][:, rows]
        elif hw.mlp is not None:
            m = mid[:, rows]
            hid = m + _swiglu(F.rms_norm(m, (m.shape[-1],), hw.mlp.norm2, self.eps), hw.mlp.w13, hw.mlp.w2)
        else:
            hid = h[:, rows]
        if hw.norm is not None:
            hid = F.rms_norm(hid, (hid.shape[-1],), hw.norm, self.eps)
        if all_positions:
            return StepOut(h, mid, hid[0] @ hw.proj.T, None, None)
        return StepOut(h, mid, *_confidence(hid[:, -1], hw.proj))

    def fill(self, h: torch.Tensor, pos: int, exit_layer: int) -> None:
        """Keys/values of every layer (and exit block) deeper than `exit_layer` at `pos`, from the
        exited hidden state `h` [1, 1, C] (the copy strategy)."""
        hd = self.heads[exit_layer]
        self._pos.fill_(pos)
        self._fill(h, self._pos, self.cos, self.sin, hd.fill_layers, [self._slot_kv[s] for s in hd.fill_slots], self.n_head, self.eps)

    # ---------------------------------------------------------------- warm-up

    @torch.inference_mode()
    def warm_up(self, total: int, strategies=("recompute", "copy", "speculative"), exits: bool = True) -> float:
        """Run every one-token step the strategies can take, for a generation of `total` positions,
        on a scratch cache; with `compile=True` this compiles them. Returns the seconds it took.
        `exits=False` (a generation that never exits) runs only the full-depth step it will use."""
        t0 = time.perf_counter()
        saved = getattr(self, "_cache", None)
        self.bind(self.new_cache(total))
        tok, pos, L = 0, 0, self.num_layers
        self.step(tok, pos, 0, L, L)  # full depth in one call (exits disabled)
        if exits:
            self._warm_up_exits(tok, pos, strategies)
        if saved is not None:
            self.bind(saved)
        return time.perf_counter() - t0

    def _warm_up_exits(self, tok: int, pos: int, strategies) -> None:
        """The steps of `warm_up` that a generation with exits takes: each segment with its exit head,
        the copy fills, the speculative draft step and (compiled) the padded chunks."""
        L = self.num_layers
        depth, h = 0, None
        for e in self.exit_layers:  # segment by segment, each with its exit head
            out = self.step(tok if depth == 0 else h, pos, depth, e, e)
            h, depth = out.h, e
            if "copy" in strategies and e < L:
                self.fill(h, pos, e)
        if "speculative" in strategies and len(self.exit_layers) > 1:
            self.step(tok, pos, 0, self.exit_layers[0], None)  # the last fed token of a round: no draft
        if self.compiled:  # padded chunks: recomputation between exits, speculative verification
            C = self.emb.shape[1]
            for b in self.chunk_lengths:
                if b > self._limit:
                    break
                h = torch.zeros(1, b, C, device=self.emb.device, dtype=self.emb.dtype)
                if "recompute" in strategies:
                    for d, e in zip(self.exit_layers, self.exit_layers[1:]):
                        self.chunk(h, 0, d, e, e)
                if "speculative" in strategies and len(self.exit_layers) > 1:
                    self.chunk(h, 0, self.exit_layers[0], L, L, all_positions=True)


# ----------------------------------------------------------------------------- the strategies
# The same algorithms as `efficient.decoding.modules.layerwise` / `speculative`, step for step (see
# there for the why); hidden states of pending or drafted positions live in one preallocated
# buffer, so a chunk is a slice of it.


def run_layerwise(eng: DecodeEngine, ids: torch.Tensor, max_new: int, threshold: float, sampler: Sampler, cache: KVCache,
                  strategy: str, max_pending: int | None, feed: list[int] | None = None, **_) -> Generation:
    """`recompute` and `copy` on the engine: one new token per step, exits visited shallow to deep.
    `feed`: decode these tokens instead of choosing them, recording their log-probs."""
    model, L = eng.model, eng.num_layers
    costs = _Costs(model)
    seq = ids.tolist()
    c = len(seq) - 1  # positions < c have full-depth KV; positions c..n-1 are pending
    states = torch.empty(1, cache.max_len, model.n_embd, device=ids.device, dtype=eng.emb.dtype)  # pending positions' hidden states
    depth_at = [0] * cache.max_len  # ... and the depth they were computed to
    exits = eng.exit_layers if exits_enabled(threshold) else [L]  # tau >= 1: one call for all layers
    tokens, exit_layers, expected, logprobs = [], [], 0, []
    for i in range(max_new):
        n = len(seq) - 1
        forced = max_pending is not None and n - c >= max_pending
        start, depth, h, spent_heads = n, 0, seq[n], 0
        for e in exits:
            j = start
            if strategy == "recompute" and depth > 0:  # pending positions computed to exactly `depth` sit right before the chunk
                while j > c and depth_at[j - 1] == depth:
                    j -= 1
            if j == start == n:
                out = eng.step(h, n, depth, e, e)
            else:
                states[:, start : n + 1] = h
                start = j
                out = eng.chunk(states[:, start : n + 1], start, depth, e, e)
            T = n + 1 - start
            costs.layers(T, e - depth)
            spent_heads += costs.exit(e, T if eng.heads[e].weights.block is not None else 1)
            depth, h = e, out.h
            if e == L:
                tok, c = sampler.pick(out.logits), n + 1
                break
            if should_exit(float(out.pmax), threshold) and not forced:
                tok = int(out.arg) if sampler.greedy else sampler.pick(out.logits)
                if strategy == "copy":
                    eng.fill(h, n, e)
                    costs.spent += 3 * model.n_embd**2 * (L - e)
                    c = n + 1
                else:  # positions start..n now stand at depth e
                    depth_at[start : n + 1] = [e] * T
                    states[:, start : n + 1] = h
                break
        expected += costs.layer * e + spent_heads
        if feed is not None:
            tok = feed[i]
            z = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32))
            logprobs.append(float(torch.log_softmax(z, dim=-1)[0, tok]))
        seq.append(tok)
        tokens.append(tok)
        exit_layers.append(e)
    g = Generation(ids.tolist(), tokens, exit_layers, L, 0.0, costs.spent, max_new * costs.full_token(), expected, c, cache)
    g.logprobs = logprobs
    return g


def run_speculative(eng: DecodeEngine, ids: torch.Tensor, max_new: int, threshold: float, sampler: Sampler, cache: KVCache,
                    num_draft: int, **_) -> Generation:
    """Self-speculation on the engine: draft with the first exit, verify with layers E+1..L."""
    model, L, E = eng.model, eng.num_layers, eng.exit_layers[0]
    costs = _Costs(model)
    seq = ids.tolist()
    c = len(seq) - 1
    states = torch.empty(1, cache.max_len, model.n_embd, device=ids.device, dtype=eng.emb.dtype)  # drafter's states of the fed tokens
    tally = SpeculationTally(costs, E, L)
    while len(tally.tokens) < max_new:
        budget = max_new - len(tally.tokens)
        drafts, q = [], []
        tok, pos, unsure = seq[c], c, False
        while True:  # feed tokens through layers 1..E; each fed token but the last yields a draft
            last = unsure or len(drafts) >= min(num_draft, budget - 1)
            out = eng.step(tok, pos, 0, E, None if last else E)
            costs.layers(1, E)
            states[:, pos] = out.h[:, 0]
            if last:
                break
            costs.exit(E, 1)
            if sampler.greedy:
                pmax, tok = out.pmax, int(out.arg)
            else:
                qp = sampler.probs(out.logits)[0]
                tok, pmax = sampler.draw(qp), qp.max()
                q.append(qp)
            drafts.append(tok)
            pos += 1
            unsure = 0 < threshold < 1 and float(pmax) < threshold  # an unsure draft ends the round
        T = pos + 1 - c
        logits = eng.chunk(states[:, c : pos + 1], c, E, L, L, all_positions=True).logits  # [T, V]: full-model predictions
        costs.layers(T, L - E)
        costs.spent += T * model.n_embd * model.vocab_size
        new, a = verify_drafts(logits, drafts, q, sampler)
        tally.commit(new, len(drafts), a)
        seq += new
        c += len(new)
    return tally.result(ids.tolist(), max_new, c, cache)
