"""What every decoding strategy shares: the sampler, the exit rule, the result (`Generation`), the
projection-MAC bookkeeping and the verification of speculative drafts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Sequence

import torch

from efficient.decoding.cache import KVCache
from efficient.errors import ConfigError
from efficient.profiler.exits import layer_macs

if TYPE_CHECKING:
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


def as_ids(model, prompt: torch.Tensor | Sequence[int]) -> torch.Tensor:
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


@dataclass
class SpeculationTally:
    """Running totals of self-speculative decoding (draft with exit E, verify with layers E+1..L),
    shared by both implementations so their results are assembled the same way."""

    costs: _Costs
    E: int
    L: int
    tokens: list[int] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    expected: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    def commit(self, new: list[int], drafted: int, accepted: int) -> None:
        """Record one verified round: its committed tokens, drafts made and drafts accepted."""
        self.drafted, self.accepted, self.rounds = self.drafted + drafted, self.accepted + accepted, self.rounds + 1
        self.expected += round_exits(self.exits, len(new), accepted, self.E, self.L, self.costs)
        self.tokens += new

    def result(self, prompt: list[int], max_new: int, committed: int, cache: KVCache) -> Generation:
        stats = {"draft_acceptance": self.accepted / max(self.drafted, 1), "tokens_per_round": len(self.tokens) / max(self.rounds, 1)}
        return Generation(prompt, self.tokens, self.exits, self.L, 0.0, self.costs.spent, max_new * self.costs.full_token(),
                          self.expected, committed, cache, stats)
