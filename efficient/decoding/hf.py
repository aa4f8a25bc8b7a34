"""Greedy early-exit decoding of Hugging Face causal LMs (Llama, Mistral, Qwen2, GPT-2) on our
engine, batch >= 1 with left-padded prompts.

    from efficient.decoding import generate_hf
    out = generate_hf(model, input_ids, attention_mask, max_new_tokens=64, strategy="speculative", draft_layer=4)
    out.sequences  # [B, P + new], as transformers' generate(do_sample=False) returns them

`model` is a transformers model (an exit after layer k = its final norm and LM head on layer k's
hidden state, LayerSkip's shared head) or one wrapped by `efficient.early_exit` (its exits and
exit heads), or a `HFDecodeModel` built from either (reuse it across calls: building one reads the
weights).

Cache layout (`hf_cache.StaticKV`): one preallocated key and value tensor per layer,
[B, kv_heads, max_len, head_dim], written by slot. Prompts are left-padded to one length P; slot s
is token s of every row, a row's position (rotary angle, GPT-2's learned position) is its slot
minus its padding, and the mask hides padding slots. The prompt but its last token is filled at
full depth first; each strategy then feeds tokens from slot P-1 on.

Strategies (`strategy=`):

- `full`: every token through all layers, one call per layer.
- `recompute` / `copy`: confidence exits. After each exit in `exits` (layer counts, shallow to
  deep) a row takes the exit head's argmax once its max-probability reaches `threshold` (1 never
  exits). The batch runs on until every unfinished row has taken a token, so a row that took an
  early exit still gets exact keys/values for the layers the batch ran; the layers below the
  batch's stop are then missing for the whole batch. `recompute` (EE-LLM) leaves them pending and
  runs them, from the stored hidden states, as one chunk with the next token that reaches them:
  deep layers always read the full model's keys/values, so each row's tokens and exits are those
  of the exit rule applied to the full model on that row alone. `copy` (CALM's state copy) gives
  them the keys/values of the exited hidden state (approximate; with batch > 1 it depends on the
  batch's stop depth), computed as CALM does, together with the next token that reaches them:
  that token's call of each layer takes the waiting slots' exited states as extra key/value-only
  rows, so an exit costs no call of its own and slots no later token reaches are never filled.
- `speculative` (LayerSkip self-speculation with one shared cache): a round feeds the last
  committed token and `num_draft` drafts through layers 1..k (`draft_layer`), each draft the exit
  head's argmax after layer k, saving every fed token's layer-k hidden state; verification runs
  layers k+1..N on those saved states as one chunk and reads the full model's predictions at every
  fed position. It is lossless: layers 1..k of the full model are the drafter's layers, so the
  saved states and the layer 1..k keys/values the drafts wrote are exactly what the full model
  computes for those tokens; layers k+1..N are computed causally in the chunk. The prediction at
  each fed position is therefore the full model's greedy token given the tokens before it. A row
  accepts drafts while they equal those predictions; the batch keeps a = the fewest accepted over
  its unfinished rows and commits a + 1 tokens per row, the full model's predictions at the first
  a + 1 positions (inputs there are verified tokens in every row). The rejected tail of the
  cache is cut off by moving the slot back: the next round rewrites those slots in every layer
  before any query reads them.

`eos_token_id` ends a row (later tokens are `pad_token_id`) and the call once all rows ended, as
transformers does. `forced` (recompute, copy, full) feeds the given tokens instead of choosing
them and records each one's log-probability under the head that decided it: the strategy's
held-out loss as it decodes, copy's approximate keys/values included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.nn.functional as F

from efficient.decoding.hf_cache import StaticKV
from efficient.decoding.hf_model import HFDecodeModel
from efficient.decoding.state import check_threshold
from efficient.errors import ConfigError

HFStrategy = Literal["full", "recompute", "copy", "speculative"]
HF_STRATEGIES = ("full", "recompute", "copy", "speculative")


@dataclass
class HFGeneration:
    """Result of `generate_hf`. `layer_steps` counts (layer, slot) evaluations after the prompt for
    the batch (recomputed and verified ones included; copy's key/value-only rows are `kv_fills`), so
    `full_layer_steps / layer_steps` is the layer-count speed-up bound of the run."""

    sequences: torch.Tensor  # [B, P + new]: the prompts as given, then the new tokens
    tokens: torch.Tensor  # [B, new]; pad_token_id after a row's EOS
    exit_layers: torch.Tensor  # [B, new]: layers run before the head that decided each token
    num_layers: int
    seconds: float  # the whole call: prefill and decode
    prefill_seconds: float
    layer_steps: int
    full_layer_steps: int
    kv_fills: int = 0
    logprobs: torch.Tensor | None = None  # [B, new] with `forced`
    stats: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        n = self.tokens.numel()
        return {"tokens": n, "tokens_per_s": n / self.seconds if self.seconds > 0 else float("inf"),
                "mean_exit_layer": float(self.exit_layers.float().mean()) if n else 0.0,
                "layer_ratio": self.full_layer_steps / max(self.layer_steps, 1), **self.stats}


class _Run:
    """One generation's buffers: token ids by slot, the cache, per-slot position inputs."""

    def __init__(self, dm: HFDecodeModel, ids: torch.Tensor, mask: torch.Tensor, max_len: int) -> None:
        self.dm = dm
        B, P = ids.shape
        pad = P - mask.sum(1)
        self.ids = torch.zeros(B, max_len, dtype=torch.long, device=ids.device)
        self.ids[:, :P] = ids
        self.cache = StaticKV(dm.num_layers, B, dm.heads_kv, dm.head_dim, max_len, pad, dm.device, dm.dtype)
        positions = (torch.arange(max_len, device=ids.device)[None] - pad[:, None]).clamp(min=0)
        tables = dm.position_tables(positions)
        self.cos, self.sin = tables if len(tables) == 2 else (None, None)
        self.wpe = tables[0] if len(tables) == 1 else None
        self.steps = 0
        self._rope_at, self._rope = None, {}

    def embed(self, slot: int, T: int) -> torch.Tensor:
        h = F.embedding(self.ids[:, slot : slot + T], self.dm.embed)
        return h if self.wpe is None else h + self.wpe[:, slot : slot + T]

    def rope(self, slot: int, T: int) -> tuple:
        if self.cos is None:
            return ()
        if self._rope_at != slot + T:  # the layers of one token reuse their slices (keyed by the last slot + 1)
            self._rope_at, self._rope = slot + T, {}
        r = self._rope.get(T)
        if r is None:
            r = self._rope[T] = (self.cos[:, :, slot : slot + T], self.sin[:, :, slot : slot + T])
        return r

    def layers(self, h: torch.Tensor, slot: int, start: int, stop: int) -> torch.Tensor:
        """Layers start+1..stop on the chunk `h` [B, T, C] at slots slot..slot+T-1."""
        T = h.shape[1]
        rope, mask, c, layer = self.rope(slot, T), self.cache.mask(slot, T), self.cache, self.dm.layer
        for i in range(start, stop):
            h = layer(h, i, c.k[i], c.v[i], slot, rope, mask)
        self.steps += T * (stop - start)
        return h

    def layers_filling(self, h: torch.Tensor, slot: int, start: int, stop: int, filled: list[int],
                       exited: list[torch.Tensor | None]) -> tuple[torch.Tensor, int]:
        """Copy: layers start+1..stop on the token `h` [B, 1, C] at `slot`. `filled[i]` is the first
        slot layer i has not stored; when it is below `slot`, the layer first stores slots
        filled[i]..slot-1 (tokens that exited below it) from their exited hidden states
        `exited[s]` [B, 1, C], as key/value-only rows of the same call. Returns the output and the rows filled."""
        c, layer, mask, fills = self.cache, self.dm.layer, self.cache.mask(slot, 1), 0
        for i in range(start, stop):
            f = filled[i]
            if f < slot:
                rows = torch.cat(exited[f:slot] + [h], dim=1)
                h = layer(rows, i, c.k[i], c.v[i], f, self.rope(f, slot + 1 - f), mask, keys_only=slot - f)
                fills += slot - f
            else:
                h = layer(h, i, c.k[i], c.v[i], slot, self.rope(slot, 1), mask)
            filled[i] = slot + 1
        self.steps += stop - start
        return h, fills


def _confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Max-probability and argmax per row of `logits` [B, V] (softmax in at least fp32)."""
    return torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)).max(dim=-1)


def _max_prob(logits: torch.Tensor) -> float:
    """One row's max-probability as a host number: one softmax, one full reduction, one read (the
    batch-1 exit check, where every call is overhead)."""
    return torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)).max().item()


def _logprob(logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(logits.dtype, torch.float32)
    return torch.log_softmax(logits.to(acc), dim=-1).gather(-1, tok[:, None])[:, 0]


def _full(run: _Run, P: int, max_new: int, finished: torch.Tensor, eos: list[int], forced: torch.Tensor | None):
    dm, N = run.dm, run.dm.num_layers
    head = dm.head(N)
    B = run.ids.shape[0]
    logprobs = torch.zeros(B, max_new, device=run.ids.device) if forced is not None else None
    made = 0
    for i in range(max_new):
        n = P - 1 + i
        z = head(run.layers(run.embed(n, 1), n, 0, N)[:, -1])
        tok = z.argmax(-1)
        if forced is not None:
            tok = forced[:, i]
            logprobs[:, i] = _logprob(z, tok)
        run.ids[:, n + 1] = tok
        made += 1
        if eos and _all_done(tok, finished, eos):
            break
    return made, torch.full((B, made), N, dtype=torch.long, device=run.ids.device), logprobs, {}


def _all_done(tok: torch.Tensor, finished: torch.Tensor, eos: list[int]) -> bool:
    """Mark rows whose new token `tok` [B] or [B, m] is an EOS; True once every row has ended."""
    hit = torch.isin(tok, torch.as_tensor(eos, device=tok.device))
    finished |= hit if hit.dim() == 1 else hit.any(-1)
    return bool(finished.all())


def _layerwise(run: _Run, P: int, max_new: int, finished: torch.Tensor, eos: list[int], forced: torch.Tensor | None,
               exits: list[int], threshold: float, strategy: str):
    """recompute / copy, one new token per step (see the module docstring); the pending-depth
    bookkeeping is `efficient.decoding.engine.run_layerwise`'s, shared by the batch."""
    dm, N = run.dm, run.dm.num_layers
    B, dev = run.ids.shape[0], run.ids.device
    visit = [e for e in exits if e < N] + [N] if threshold < 1 else [N]
    heads = {e: dm.head(e) for e in visit}
    c = P - 1  # slots < c hold full-depth keys/values; c..n-1 are pending (recompute)
    filled = [c] * N  # copy: the first slot each layer has not stored
    states = torch.empty(B, run.cache.max_len, dm.embed.shape[1], device=dev, dtype=dm.dtype)  # recompute: pending slots' states
    exited: list[torch.Tensor | None] = [None] * run.cache.max_len  # copy: exited states [B, 1, C] waiting for the layers above
    depth_at = [0] * run.cache.max_len
    exit_layers: list = []  # per step: the exit layer (an int at batch 1, [B] otherwise)
    logprobs = torch.zeros(B, max_new, device=dev) if forced is not None else None
    fills, made = 0, 0
    for i in range(max_new):
        n = P - 1 + i
        start, depth, h = n, 0, run.embed(n, 1)
        if B > 1:
            chosen = torch.zeros(B, dtype=torch.bool, device=dev)
            tok = torch.zeros(B, dtype=torch.long, device=dev)
            ex = torch.full((B,), N, dtype=torch.long, device=dev)
        for e in visit:
            j = start
            if strategy == "recompute" and depth > 0:  # pending slots computed to exactly `depth` sit right before the chunk
                while j > c and depth_at[j - 1] == depth:
                    j -= 1
            if j < start:
                states[:, start : n + 1] = h
                start = j
                h = states[:, start : n + 1]
            if strategy == "copy":
                h, f = run.layers_filling(h, n, depth, e, filled, exited)
                fills += f
            else:
                h = run.layers(h, start, depth, e)
            depth = e
            z = heads[e](h[:, -1])
            if B == 1:  # one row: the decision is one host read, no masks (this loop is overhead-bound)
                took = e == N or _max_prob(z) >= threshold
                if took:
                    tok, ex = z.argmax(-1), e
                    if forced is not None:
                        logprobs[:, i] = _logprob(z, forced[:, i])
                done = took
            else:
                if e == N:
                    take = ~chosen
                    arg = z.argmax(-1)
                else:
                    pmax, arg = _confidence(z)
                    take = ~chosen & (pmax >= threshold)
                tok = torch.where(take, arg, tok)
                ex = torch.where(take, e, ex)
                if forced is not None:
                    logprobs[:, i] = torch.where(take, _logprob(z, forced[:, i]), logprobs[:, i])
                chosen |= take
                done = e == N or bool((chosen | finished).all())
            if e == N:
                c = n + 1
                break
            if done:
                if strategy == "copy":  # the layers above e store this slot when a later token reaches them
                    exited[n] = h
                    c = n + 1
                else:  # slots start..n now stand at depth e
                    depth_at[start : n + 1] = [e] * (n + 1 - start)
                    states[:, start : n + 1] = h
                break
        if forced is not None:
            tok = forced[:, i]
        run.ids[:, n + 1] = tok
        exit_layers.append(ex)
        made += 1
        if eos and _all_done(tok, finished, eos):
            break
    ex = torch.tensor([exit_layers], device=dev) if B == 1 else torch.stack(exit_layers, 1)
    return made, ex, logprobs, {"kv_fills": fills}


def _speculative(run: _Run, P: int, max_new: int, finished: torch.Tensor, eos: list[int], draft_layer: int, num_draft: int):
    dm, N, k = run.dm, run.dm.num_layers, draft_layer
    B, dev = run.ids.shape[0], run.ids.device
    draft_head, full_head = dm.head(k), dm.head(N)
    states = torch.empty(B, run.cache.max_len, dm.embed.shape[1], device=dev, dtype=dm.dtype)  # layer-k states of fed tokens
    exit_layers = torch.full((B, max_new), N, dtype=torch.long, device=dev)
    c, made, drafted, accepted, rounds = P - 1, 0, 0, 0, 0
    while made < max_new:
        d = min(num_draft, max_new - made - 1)
        for j in range(d + 1):  # feed the committed token and d drafts through layers 1..k
            s = c + j
            h = run.layers(run.embed(s, 1), s, 0, k)
            states[:, s] = h[:, 0]
            if j < d:
                run.ids[:, s + 1] = draft_head(h[:, -1]).argmax(-1)
        full = full_head(run.layers(states[:, c : c + d + 1], c, k, N)).argmax(-1)  # [B, d + 1]
        ok = (full[:, :d] == run.ids[:, c + 1 : c + d + 1]).long().cumprod(dim=1).sum(dim=1)
        a = int(ok[~finished].min()) if d else 0
        new = full[:, : a + 1]
        run.ids[:, c + 1 : c + a + 2] = new
        exit_layers[:, made : made + a] = k
        c, made = c + a + 1, made + a + 1
        drafted, accepted, rounds = drafted + d, accepted + a, rounds + 1
        if eos and _all_done(new, finished, eos):
            break
    stats = {"draft_acceptance": accepted / max(drafted, 1), "tokens_per_round": made / max(rounds, 1), "rounds": rounds,
             "drafted": drafted, "accepted": accepted}
    return made, exit_layers[:, :made], None, stats


def _check_exits(exits, N: int, what: str) -> list[int]:
    out = sorted({int(e) for e in exits})
    if not out or out[0] < 1 or out[-1] > N:
        raise ConfigError(f"generate_hf: {what} must be layer counts in 1..{N} (an exit after that many layers), got {list(exits)}")
    return out


def _prompts(dm: HFDecodeModel, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=dm.device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ConfigError(f"generate_hf: input_ids must be [batch, length] token ids, got shape {tuple(ids.shape)}")
    mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask, device=dm.device).long().view(ids.shape)
    if bool(((mask != 0) & (mask != 1)).any()) or bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask[:, -1] == 0).any()):
        raise ConfigError("generate_hf: prompts must be left-padded: each attention_mask row is zeros, then ones up to the end "
                          "(tokenizer padding_side='left')")
    if bool((ids < 0).any()) or bool((ids >= dm.vocab_size).any()):
        raise ConfigError(f"generate_hf: token ids must lie in [0, {dm.vocab_size})")
    return ids, mask


@torch.inference_mode()
def generate_hf(
    model,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    strategy: HFStrategy = "full",
    threshold: float | None = 1.0,
    exits: Sequence[int] | None = None,
    draft_layer: int | None = None,
    num_draft: int = 4,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    forced: torch.Tensor | None = None,
) -> HFGeneration:
    """Greedy decoding of a transformers causal LM with early exits (see the module docstring).

    `exits` (recompute, copy) and `draft_layer` (speculative) default to the wrapped model's exits
    (all but the last for recompute/copy, the first for speculative)."""
    dm = model if isinstance(model, HFDecodeModel) else HFDecodeModel(model)
    N = dm.num_layers
    if strategy not in HF_STRATEGIES:
        raise ConfigError(f"generate_hf: strategy must be one of {', '.join(HF_STRATEGIES)}, got {strategy!r}")
    if max_new_tokens < 1:
        raise ConfigError(f"generate_hf: max_new_tokens must be >= 1, got {max_new_tokens}")
    threshold = check_threshold(threshold)
    own = [e for e in (dm.wrapped_exits or []) if e < N]
    if strategy in ("recompute", "copy"):
        if exits is None and not own:
            raise ConfigError(f"generate_hf: {strategy} needs `exits` (layer counts in 1..{N - 1} after which an exit may read)")
        exits = _check_exits(own if exits is None else exits, N, "exits")
    if strategy == "speculative":
        if draft_layer is None and not own:
            raise ConfigError(f"generate_hf: speculative needs `draft_layer` (the layers 1..k that draft, k in 1..{N - 1})")
        draft_layer = own[0] if draft_layer is None else int(draft_layer)
        if not 1 <= draft_layer < N:
            raise ConfigError(f"generate_hf: draft_layer must lie in 1..{N - 1} (the model has {N} layers), got {draft_layer}")
        if num_draft < 1:
            raise ConfigError(f"generate_hf: num_draft must be >= 1, got {num_draft}")
    if forced is not None and strategy == "speculative":
        raise ConfigError("generate_hf: forced decoding runs full, recompute or copy (speculative is lossless by construction)")
    ids, mask = _prompts(dm, input_ids, attention_mask)
    B, P = ids.shape
    if forced is not None:
        forced = torch.as_tensor(forced, dtype=torch.long, device=dm.device).view(B, -1)
        if forced.shape[1] != max_new_tokens:
            raise ConfigError(f"generate_hf: forced has {forced.shape[1]} tokens per row, max_new_tokens is {max_new_tokens}; they must be equal")
    total = P + max_new_tokens
    if total > dm.max_positions:
        raise ConfigError(f"generate_hf: prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds the model's {dm.max_positions} positions")
    if dm.sliding_window is not None and total > dm.sliding_window:
        raise ConfigError(f"generate_hf: sequences longer than the sliding window ({dm.sliding_window}) are not supported; "
                          f"prompt + max_new_tokens is {total}")
    eos = [] if eos_token_id is None else [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    top = dm.wrapper if isinstance(dm.wrapper, torch.nn.Module) else dm.hf
    was = [(m, m.training) for m in top.modules()]  # restored module by module: a parent's train() would reset its children
    top.eval()
    try:
        t0 = time.perf_counter()
        run = _Run(dm, ids, mask, total)
        if P > 1:
            run.layers(run.embed(0, P - 1), 0, 0, N)
        run.steps = 0
        t1 = time.perf_counter()
        finished = torch.zeros(B, dtype=torch.bool, device=dm.device)
        if strategy == "full":
            made, exit_layers, logprobs, stats = _full(run, P, max_new_tokens, finished, eos, forced)
        elif strategy == "speculative":
            made, exit_layers, logprobs, stats = _speculative(run, P, max_new_tokens, finished, eos, draft_layer, num_draft)
        else:
            made, exit_layers, logprobs, stats = _layerwise(run, P, max_new_tokens, finished, eos, forced, exits, threshold, strategy)
        tokens = run.ids[:, P : P + made].clone()
        t2 = time.perf_counter()
    finally:
        for m, w in was:
            m.training = w
    if eos:
        tokens, exit_layers = _after_eos(tokens, exit_layers, eos, pad)
        if logprobs is not None:
            logprobs = logprobs[:, : tokens.shape[1]]
    elif logprobs is not None:
        logprobs = logprobs[:, :made]
    fills = int(stats.pop("kv_fills", 0))
    return HFGeneration(torch.cat([ids, tokens], dim=1), tokens, exit_layers, N, t2 - t0, t1 - t0, run.steps,
                        tokens.shape[1] * N, fills, logprobs, stats)


def _after_eos(tokens: torch.Tensor, exit_layers: torch.Tensor, eos: list[int], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every row after its first EOS; cut the columns after the last row's first EOS (transformers
    stops there too)."""
    hit = torch.isin(tokens, torch.as_tensor(eos, device=tokens.device))
    after = (hit.long().cumsum(1) - hit.long()) > 0  # strictly after the first EOS
    tokens = tokens.masked_fill(after, pad)
    if bool(hit.any(1).all()):
        end = int((hit.long().cumsum(1) == 0).sum(1).max()) + 1
        tokens, exit_layers = tokens[:, :end], exit_layers[:, :end]
    return tokens, exit_layers
