"""STATA token sparsification (Zhuge et al., ICML 2024) as one component, `TokenPruner`.

Our reconstruction (seeds/stata.md): a learnable anchor token per timestep sits at token index 0;
in each pruning block the anchor's query scores the patch tokens (s_t(i) = <q_anchor, k_i>), the
scores are standardized per timestep and averaged over time, and the top ceil(rho*N) tokens -- one
set for every t, so membrane state stays aligned -- are physically gathered, so the following
layers run on fewer tokens. The anchor is never pruned and never pooled. rho warms up from 1 with
EViT's cosine rule while training (`set_progress`), and is the target in eval mode.

A spiking transformer holds one `TokenPruner` and hands each block a `PruneStep` (its ratio and
the pruner's scoring, selection and gather). The pruner keeps what the last forward scored and
kept; `stata_outputs(model)` returns it to the STATA objective (`efficient.objectives.stata`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.kernels.ssa import scores_ref
from efficient.kernels.token_select import gather_tokens, select_tokens, topk_lower_index
from efficient.models.replay import replaying
from efficient.models.progress import TracksProgress
from efficient.models.weight_init import trunc_normal_

Anchor = Literal["per_timestep", "shared", "off"]
PrunePoint = Literal["after_attn", "after_block"]
Score = Literal["standardized", "raw", "random"]


@dataclass
class StataConfig:
    """STATA switches (recipe keys of the same names). `prune_blocks` are 1-based; `keep_ratio` is
    one rho for every pruning block or one per block; `anchor="off"` scores with the mean patch query
    (the tokens' mean received attention, EViT without a class token) instead of an anchor token,
    `anchor="shared"` uses one anchor for every timestep. Ablations of the score: `score="raw"`
    skips standardization; `score="random"` keeps a uniformly random set of the same size (the
    floor any criterion must beat), drawn from torch's global generator in training (seeded by the
    run, restored on resume) and, at inference, from one seeded by `random_seed` at the start of
    every evaluation pass (each train()/eval() switch)."""

    anchor: Anchor = "off"
    prune_blocks: list[int] | None = None
    keep_ratio: float | list[float] = 1.0
    prune_point: PrunePoint = "after_attn"
    fuse_pruned: bool = False
    keep_warmup_start: float = 0.0
    keep_warmup_epochs: float = 0.0
    score: Score = "standardized"
    std_eps: float = 1e-6
    random_seed: int = 0
    # unit scale, like the spike-count residual stream: a 0.02-scale anchor (ViT's CLS init) never
    # makes its query fire, so every timestep abstains and selection degenerates to index order
    anchor_init_std: float = 1.0


@dataclass
class StataOutputs:
    """What one forward scored and kept: per pruning block the anchor / mean-query scores `(s, c)`,
    each `[T, B, N]` (kept in training, or in eval with `record_scores`), and statistics:
    `tokens_in` per block, `tokens_out`, `keep_ratio` (the smallest current rho), `degenerate`
    (a 0-d tensor on the device: samples whose scores were flat at every timestep), `kept_idx` (`[B, k]` per pruning block)."""

    scores: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


def kept_count(ratio: float, n: int) -> int:
    """ceil(ratio * n), robust to float round-off (0.7 * 50 must give 35, not 36)."""
    return max(1, math.ceil(ratio * n - 1e-9))


def warmup_keep_ratio(target: float, epoch: float, start: float, span: float) -> float:
    """EViT's keep-rate warm-up: 1 before `start`, then cosine from 1 down to `target` over `span` epochs."""
    if epoch < start:
        return 1.0
    if span <= 0:
        return target
    u = min(1.0, (epoch - start) / span)
    return target + (1.0 - target) * 0.5 * (1.0 + math.cos(math.pi * u))


def not_flat(s: torch.Tensor) -> torch.Tensor:
    """Rows (last axis) whose values are not all equal. Exact where `var > 0` is not: the variance
    of a constant non-integer row is often a rounding residue above 0 (the mean of n equal floats
    need not be that float)."""
    lo, hi = torch.aminmax(s, dim=-1)
    return hi > lo


def anchor_scores(q_anchor: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """s_t(i) = sum_h <q_anchor, k_i> from the anchor's query alone: `[T, B, H, d]` x `[T, B, H, N, d]` -> `[T, B, N]`."""
    return torch.einsum("tbhd,tbhmd->tbm", q_anchor, k)


class TokenPruner(nn.Module, TracksProgress):
    """Owns STATA: the anchor, the keep-ratio schedule, scoring, selection and fusion, and the
    record of the last forward. `depth`, `timesteps`, `embed_dim`, `n_patches` describe the host
    model; `kernel_backend` is the token-selection kernels' backend."""

    def __init__(self, cfg: StataConfig, depth: int, timesteps: int, embed_dim: int, n_patches: int,
                 kernel_backend: str = "auto") -> None:
        super().__init__()
        self.cfg, self.depth, self.kernel_backend = cfg, depth, kernel_backend
        self.standardize = cfg.score == "standardized"
        if cfg.keep_warmup_start < 0 or cfg.keep_warmup_epochs < 0:
            raise ConfigError("keep_warmup_start and keep_warmup_epochs must be >= 0")
        self.prune_at = self._prune_at(cfg, depth)  # 0-based block -> target rho
        self.n_prefix = 0 if cfg.anchor == "off" else 1
        self.n_patches = n_patches
        self.token_schedule()  # validates: raises if a block would keep zero tokens
        if self.n_prefix:  # drawn by `reset_parameters`, once the host model's weights are
            self.anchor = nn.Parameter(torch.zeros(timesteps if cfg.anchor == "per_timestep" else 1, embed_dim))
        self._epoch: float | None = None
        self._eval_rng: torch.Generator | None = None  # random selection at inference, reseeded by train()/eval()
        self.record_scores = False  # also keep scores in eval mode (training always keeps them)
        self.last = StataOutputs()

    @staticmethod
    def _prune_at(cfg: StataConfig, depth: int) -> dict[int, float]:
        blocks = sorted(cfg.prune_blocks or [])
        bad = [b for b in blocks if not 1 <= b <= depth]
        if bad or len(set(blocks)) != len(blocks):
            raise ConfigError(
                f"prune_blocks {list(cfg.prune_blocks or [])}: block indices are 1-based, distinct and at most depth={depth}"
                + (f"; {bad} is out of range" if bad else "")
            )
        many = isinstance(cfg.keep_ratio, (list, tuple))
        ratios = list(cfg.keep_ratio) if many else [cfg.keep_ratio] * len(blocks)
        if many and len(ratios) != len(blocks):
            raise ConfigError(f"keep_ratio has {len(ratios)} values for {len(blocks)} prune_blocks; give one ratio or one per block")
        for r in ratios if ratios else [cfg.keep_ratio]:
            if not (isinstance(r, (int, float)) and 0 < r <= 1):
                raise ConfigError(f"keep_ratio must be in (0, 1] (the fraction of tokens a pruning block keeps), got {r}")
        return {b - 1: r for b, r in zip(blocks, ratios)}

    def reset_parameters(self) -> None:
        """Draw the anchor (truncated normal at `anchor_init_std`)."""
        if self.n_prefix:
            std = self.cfg.anchor_init_std
            trunc_normal_(self.anchor, std=std, a=-2 * std, b=2 * std)

    def train(self, mode: bool = True) -> TokenPruner:
        self._eval_rng = None  # the next inference pass draws again from `random_seed`
        return super().train(mode)

    # ------------------------------------------------------------------ keep-ratio schedule

    def set_progress(self, epoch: float) -> None:
        """Training progress in (fractional) epochs: drives the keep-ratio warm-up."""
        self._epoch = float(epoch)

    def keep_ratios(self) -> dict[int, float]:
        """Current rho per pruning block (0-based): the warm-up value while training, rho* in eval."""
        if not self.training or self._epoch is None:
            return dict(self.prune_at)
        start, span = self.cfg.keep_warmup_start, self.cfg.keep_warmup_epochs
        return {b: warmup_keep_ratio(r, self._epoch, float(start), float(span)) for b, r in self.prune_at.items()}

    def token_schedule(self, ratios: dict[int, float] | None = None) -> list[tuple[int, int]]:
        """(tokens into attention, tokens into the MLP) per block, anchor and fused token included."""
        ratios = self.prune_at if ratios is None else ratios
        p, cand, out = self.n_prefix, self.n_patches, []
        for i in range(self.depth):
            n_attn = cand + p
            if i in ratios:
                if ratios[i] * cand < 1:
                    raise ConfigError(
                        f"keep schedule leaves zero tokens: block {i + 1} keeps {ratios[i]:g} x {cand} candidate tokens "
                        f"= {ratios[i] * cand:.2f} < 1; raise keep_ratio or prune in fewer blocks"
                    )
                k = kept_count(ratios[i], cand)
                cand = k + (1 if self.cfg.fuse_pruned and k < cand else 0)
            n_mlp = cand + p if self.cfg.prune_point == "after_attn" else n_attn
            out.append((n_attn, n_mlp))
        return out

    # ------------------------------------------------------------------------- the anchor

    def check_timesteps(self, timesteps: int, expected: int) -> None:
        if self.cfg.anchor == "per_timestep" and timesteps != expected:
            raise ValueError(f"this model has one anchor per timestep (T={expected}); got T={timesteps}")

    def insert_anchor(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens `[T, B, N, D]` -> with the anchor at index 0 (unchanged without an anchor)."""
        if not self.n_prefix:
            return x
        T, B, _, D = x.shape
        return torch.cat([self.anchor[:, None, None, :].expand(T, B, 1, D).to(x.dtype), x], 2)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """The patch tokens of `[T, B, N, D]`: the anchor is never pooled."""
        return x[:, :, self.n_prefix:]

    # -------------------------------------------------------------------------- a forward

    def begin(self) -> dict[int, PruneStep]:
        """Start a forward: reset the record and return the pruning step of each pruning block."""
        ratios = self.keep_ratios()
        # not min(..., default=): torch.compile before 2.12 breaks its graph on that keyword
        low = min(ratios.values()) if ratios else 1.0
        self.last = StataOutputs(stats={"tokens_in": [], "degenerate": 0, "keep_ratio": low})
        return {i: PruneStep(self, r) for i, r in ratios.items()}

    def enter_block(self, x: torch.Tensor) -> None:
        if not replaying():
            self.last.stats["tokens_in"].append(x.shape[2])

    def end(self, tokens_out: int) -> None:
        self.last.stats["tokens_out"] = tokens_out

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchor row s, mean-query column c), each `[T, B, N]`, from binary `[T, B, H, N, d]` Q and K."""
        return scores_ref(q, k, bool(self.n_prefix))

    def select(self, s: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(kept indices `[B, k]`, selection score `[B, N]`) of the top ceil(ratio*N) candidates by
        standardized score, the same set at every t; None when every candidate is kept."""
        n = s.shape[2]
        k = kept_count(ratio, n)
        record = not replaying()  # a recomputed block's rerun repeats what its forward recorded
        if record:  # a device tensor (no host sync in the step): samples whose scores are flat at every t
            flat = ~not_flat(s.detach())
            self.last.stats["degenerate"] = self.last.stats["degenerate"] + flat.all(0).sum()
        if k == n:  # nothing to prune: keep order and shape exactly (identity at rho = 1)
            return None
        if self.cfg.score == "random":
            z = self.random_scores(s.shape[1], n, s.device)
            idx = topk_lower_index(z, k)  # top-k of i.i.d. uniforms: a uniformly random k-subset
        else:
            idx, z = select_tokens(s, k, self.cfg.std_eps, self.standardize, self.kernel_backend)
        if record:
            self.last.stats.setdefault("kept_idx", []).append(idx)
        return idx, z

    def random_scores(self, b: int, n: int, device: torch.device) -> torch.Tensor:
        """`[B, N]` i.i.d. uniform scores for `score="random"`: torch's global generator in training;
        in eval one seeded by `random_seed` whenever the model is switched to eval or train mode, so
        every evaluation pass over the same data keeps the same sets."""
        if self.training:
            return torch.rand(b, n).to(device)
        if self._eval_rng is None:
            self._eval_rng = torch.Generator().manual_seed(self.cfg.random_seed)
        return torch.rand(b, n, generator=self._eval_rng).to(device)

    def prune(self, x: torch.Tensor, s: torch.Tensor, c: torch.Tensor, ratio: float) -> torch.Tensor:
        """Keep the anchor and the top ceil(ratio*N) candidates of `x` `[T, B, N, D]` by `s`, the
        same set at every t (plus the fused token of the pruned ones, if enabled)."""
        p = self.n_prefix
        cand = x[:, :, p:]
        if (self.training or self.record_scores) and not replaying():
            self.last.scores.append((s, c))
        sel = self.select(s, ratio)
        if sel is None:
            return x
        idx, z = sel
        if p:  # one gather of the anchor (token 0) and the kept tokens: no concatenation copy (nor its backward)
            kept = gather_tokens(x, F.pad(idx + 1, (1, 0)), self.kernel_backend)
        else:
            kept = gather_tokens(cand, idx, self.kernel_backend)
        if not self.cfg.fuse_pruned:
            return kept
        # EViT: one token = softmax(z)-weighted sum of the pruned tokens
        w = z.scatter(1, idx, float("-inf")).softmax(-1).to(x.dtype)  # [B, N], zero on kept tokens
        return torch.cat([kept, torch.einsum("bn,tbnd->tbd", w, cand).unsqueeze(2)], 2)

    def outputs(self) -> StataOutputs:
        """Scores and statistics of the last forward."""
        return self.last


@dataclass
class PruneStep:
    """One pruning block's share of the pruner: its current ratio, where to prune, how to score,
    select and gather. Calling it prunes `x` by the scores `(s, c)`."""

    pruner: TokenPruner
    ratio: float

    @property
    def point(self) -> PrunePoint:
        return self.pruner.cfg.prune_point

    @property
    def anchor(self) -> bool:
        return bool(self.pruner.n_prefix)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pruner.scores(q, k)

    def select(self, s: torch.Tensor) -> torch.Tensor | None:
        """Kept indices `[B, k]` by the scores `s`, or None to keep every candidate."""
        sel = self.pruner.select(s, self.ratio)
        return None if sel is None else sel[0]

    def __call__(self, x: torch.Tensor, s: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.pruner.prune(x, s, c, self.ratio)


def residual_block(x: torch.Tensor, attn_out: torch.Tensor, s: torch.Tensor | None, c: torch.Tensor | None,
                   mlp: nn.Module, step: PruneStep | None) -> torch.Tensor:
    """x += attention; x += MLP(x), pruned by `step` (if any) at its `prune_point`: after the
    attention residual (where EViT prunes) or after the whole block. `s`, `c`: the block's scores."""
    return after_attention(x + attn_out, s, c, mlp, step)


def after_attention(x: torch.Tensor, s: torch.Tensor | None, c: torch.Tensor | None, mlp: nn.Module,
                    step: PruneStep | None) -> torch.Tensor:
    """`residual_block` from the stream with the attention already added."""
    if step is not None and step.point == "after_attn":
        x = step(x, s, c)
    x = x + mlp(x)
    if step is not None and step.point == "after_block":
        x = step(x, s, c)
    return x


def surviving_patches(stats: dict[str, Any]) -> torch.Tensor | None:
    """`[B, k]` indices into the original patch grid of the tokens that survive every pruning block
    of a forward (`StataOutputs.stats`), in order; -1 marks a fused token. None if nothing was pruned.
    Each block's `kept_idx` indexes that block's candidates, so the sets are composed."""
    kept = None
    for idx in stats.get("kept_idx", []):
        if kept is None:
            kept = idx
            continue
        fused = idx >= kept.shape[1]  # the fused token sits after the kept candidates
        prev = kept.gather(1, idx.clamp_max(kept.shape[1] - 1))
        kept = torch.where(fused | (prev < 0), torch.full_like(idx, -1), prev)
    return kept


def find_pruner(model: nn.Module) -> TokenPruner | None:
    """The model's `TokenPruner` (through DDP / compile wrappers), or None for a model without STATA."""
    return next((m for m in model.modules() if isinstance(m, TokenPruner)), None)


def stata_outputs(model: nn.Module) -> StataOutputs:
    """Scores and statistics of the model's last forward (empty for a model without STATA)."""
    pruner = find_pruner(model)
    return pruner.outputs() if pruner is not None else StataOutputs()


def keep_anchor_key(model: nn.Module, pruner_name: str) -> None:
    """Checkpoints name the anchor `anchor`, a parameter of the model itself, as they did before the
    pruner owned it: map `<pruner_name>.anchor` to that key when saving and back when loading, so
    published weights load and saved ones stay readable by older releases."""
    inner = f"{pruner_name}.anchor"

    def on_save(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if prefix + inner in state:  # rename in place, keeping the key's position
            items = [(prefix + "anchor" if k == prefix + inner else k, v) for k, v in state.items()]
            state.clear()
            state.update(OrderedDict(items))

    def on_load(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "anchor" in state:
            state[prefix + inner] = state.pop(prefix + "anchor")

    model.register_state_dict_post_hook(on_save)
    model.register_load_state_dict_pre_hook(on_load)
