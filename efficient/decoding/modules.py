"""The readable reference of the decoding strategies: the model's own modules, layer by layer, on a
`KVCache` (`impl="modules"` of `efficient.decoding.generate`). `efficient.decoding.engine` runs the
same algorithms step for step on fused weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from efficient.decoding.cache import KVCache
from efficient.decoding.state import Generation, SpeculationTally, _Costs, as_ids, exits_enabled, should_exit, verify_drafts
from efficient.kernels.exit_confidence import exit_confidence

if TYPE_CHECKING:
    from efficient.models.ee_gpt import EEGPT


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


def prefill(model: EEGPT, ids: torch.Tensor, cache: KVCache) -> None:
    """Full-depth KV for `ids` at positions 0..; exit blocks too, so later exits can attend to them."""
    if len(ids) == 0:
        return
    h, mid, depth = model.tok_emb(ids[None]), None, 0
    for e in model.exit_layers:
        h, mid = run_layers(model, h, depth, e, cache, 0)
        depth = e
        if e < model.num_layers and model.exits[str(e)].block is not None:
            model.exit_hidden(e, h, mid, cache, 0)


def layerwise(model, ids, max_new, threshold, sampler, cache, strategy, max_pending, **_) -> Generation:
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


def speculative(model, ids, max_new, threshold, sampler, cache, num_draft, **_) -> Generation:
    """Draft with the first exit, verify with layers E+1..L over the drafter's hidden states."""
    L, E, costs = model.num_layers, model.exit_layers[0], _Costs(model)
    wE, wL = model.head_weight(E), model.head_weight(L)
    seq = ids.tolist()
    c = len(seq) - 1
    tally = SpeculationTally(costs, E, L)
    while len(tally.tokens) < max_new:
        budget = max_new - len(tally.tokens)
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
        tally.commit(new, len(drafts), a)
        seq += new
        c += len(new)
    return tally.result(ids.tolist(), max_new, c, cache)


@torch.no_grad()
def generate_reference(model, prompt: torch.Tensor | Sequence[int], max_new_tokens: int, threshold: float = 1.0) -> tuple[list[int], list[int]]:
    """The spec, without a cache: every step re-runs the whole prefix, then applies the exit rule to
    the last position (greedy). Returns (tokens, exit layers)."""
    seq = as_ids(model, prompt).tolist()
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
