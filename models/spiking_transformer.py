"""The core Spikformer and the Spike-driven Transformer share: configuration, neurons with one
model-wide backend, weight init, input checks, and the encoder loop that runs the blocks with a
STATA `TokenPruner`.

A model subclasses `SpikingTransformer` and passes its layers in by building them in `build_stem`,
`build_block` and `build_head` (called in that order, so weights draw the same random numbers as
when each model built them itself); it pools with `pool_head`. Tensors are time-major `[T, B, N, C]`.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.kernels.lif import resolve_backend
from efficient.models.neurons import LIF
from efficient.models.progress import inform_progress
from efficient.models.stata import StataConfig, StataOutputs, TokenPruner, keep_anchor_key
from efficient.models.weight_init import trunc_normal_

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class ModelLIF(LIF):
    """LIF whose `auto` backend is chosen once for the whole model, not per call.

    On CPU, `auto` compiles the fused LIF loop only for inputs of at least `COMPILE_MIN_NUMEL`
    elements, since compiling costs seconds that small inputs never repay. In a model whose largest
    neuron input crosses that size the loop gets compiled anyway, so every neuron of that model uses
    it (same spikes and membrane as the eager loop, several times faster at Spikformer's sizes).
    `peak_numel` (elements per timestep and sample of the model's largest neuron input) is set by the
    model; input is time-major `[T, B, ...]`.
    """

    peak_numel: int = 0

    def backend_for_shape(self, shape: torch.Size | tuple[int, ...], device: torch.device) -> str:
        if self.backend != "auto" or self.store_membrane or self.peak_numel <= 0 or len(shape) < 2:
            return self.backend
        return resolve_backend("auto", device, max(math.prod(shape), shape[0] * shape[1] * self.peak_numel))


def check_stem_grid(img_size: int, dim: int, pool_stages: int, stem: str) -> int:
    """Validate a conv stem whose `pool_stages` stride-2 stages (of 4) set the token grid and whose
    stages are dim/8 .. dim wide; returns the total stride. Errors name `stem` and what to change."""
    if not 1 <= pool_stages <= 4:
        raise ConfigError(f"pool_stages must be in 1..4 (got {pool_stages})")
    stride = 2**pool_stages
    if img_size < stride or img_size % stride:
        raise ConfigError(
            f"img_size {img_size} does not fit the {stem}: with pool_stages={pool_stages} it must be a positive multiple "
            f"of {stride} (the token grid is img_size/{stride} per side); resize the images or change pool_stages")
    if dim % 8:
        raise ConfigError(f"embed_dim must be divisible by 8 for the {stem} (its stages are D/8 .. D wide), got {dim}")
    return stride


def _lif(cfg: dict, **kw: Any) -> ModelLIF:
    return ModelLIF(**{**cfg, **kw})


def share_neuron_backend(model: nn.Module, peak_numel: int) -> None:
    """Tell every `ModelLIF` of `model` the size of its largest neuron input (per timestep and sample)."""
    for m in model.modules():
        if isinstance(m, ModelLIF):
            m.peak_numel = int(peak_numel)


@dataclass
class SpikingTransformerConfig:
    """Options every spiking transformer of the zoo shares (recipe keys of the same names); the
    STATA switches sit in `stata` and are given flat in recipes (`keep_ratio: 0.7`)."""

    img_size: int = 32
    in_chans: int = 3
    num_classes: int = 10
    embed_dim: int = 384
    depth: int = 4
    num_heads: int = 12
    mlp_ratio: float = 4.0
    timesteps: int = 4
    pool_stages: int = 2
    tau: float = 2.0
    surrogate: str = "sigmoid"
    alpha: float | None = None  # None: the surrogate's default (kernels.lif.SURROGATE_ALPHA; sigmoid 4)
    backend: str = "auto"
    stata: StataConfig = field(default_factory=StataConfig)

    def __post_init__(self) -> None:
        if self.timesteps < 1:
            raise ConfigError(f"timesteps must be >= 1 (got {self.timesteps})")
        if self.depth < 1:
            raise ConfigError(f"depth must be >= 1 (got {self.depth})")

    def neuron(self) -> dict[str, Any]:
        """Keyword arguments of every neuron of the model."""
        return dict(tau=self.tau, v_reset=0.0, detach_reset=True, surrogate=self.surrogate, alpha=self.alpha, backend=self.backend)

    def kernel_backend(self) -> str:
        """Backend of the attention and token-selection kernels (they have no compiled-loop variant)."""
        return self.backend if self.backend in ("auto", "triton", "torch") else "auto"


class SpikingTransformer(nn.Module):
    """Stem -> blocks (pruned by `self.stata`) -> head. Input `[B, C, H, W]` (repeated over T) or `[T, B, C, H, W]`."""

    lean_inference = False  # a model whose blocks can skip dead rows at inference turns this on

    def __init__(self, cfg: SpikingTransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.timesteps, self.num_classes, self.embed_dim = cfg.timesteps, cfg.num_classes, cfg.embed_dim
        self.kernel_backend = cfg.kernel_backend()
        lif_cfg = cfg.neuron()
        stem = self.build_stem(cfg, lif_cfg)
        # the pruner is the first child, so its anchor leads the state dict and the optimizer's
        # parameter order as when it was the model's own parameter; its key stays `anchor`
        self.stata = TokenPruner(cfg.stata, cfg.depth, cfg.timesteps, cfg.embed_dim, stem.grid**2, self.kernel_backend)
        keep_anchor_key(self, "stata")
        self.patch_embed = stem
        self.blocks = nn.ModuleList(self.build_block(cfg, lif_cfg) for _ in range(cfg.depth))
        self.build_head(cfg, lif_cfg)
        self.apply(self._init_weights)
        hidden = int(cfg.embed_dim * cfg.mlp_ratio) * (stem.grid**2 + 1)  # the MLP over every token + one prefix
        share_neuron_backend(self, max(stem.neuron_peak(), hidden))
        self.stata.reset_parameters()  # last: the other weights draw the random numbers they always drew

    # -------------------------------------------------------------------- the layers passed in

    def build_stem(self, cfg: Any, lif_cfg: dict) -> nn.Module:
        """The patch stem: `[T, B, C, H, W]` -> `[T, B, N, D]`, with `grid`, `img_size`, `in_chans`, `neuron_peak()`."""
        raise NotImplementedError

    def build_block(self, cfg: Any, lif_cfg: dict) -> nn.Module:
        """One encoder block: `block(x, step, anchor=...)`, `step` a `PruneStep` or None, `anchor`
        whether token 0 is the anchor (and, if lean inference is on, `lean=True, last=...`)."""
        raise NotImplementedError

    def build_head(self, cfg: Any, lif_cfg: dict) -> None:
        """Register the classifier layers that `pool_head` uses."""
        raise NotImplementedError

    def pool_head(self, patches: torch.Tensor) -> torch.Tensor:
        """Patch tokens `[T, B, N, D]` -> logits."""
        raise NotImplementedError

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    # ---------------------------------------------------------------------------- forward

    def encode_input(self, x: torch.Tensor) -> torch.Tensor:
        stem = self.patch_embed
        if x.dim() == 4:
            x = x.unsqueeze(0).expand(self.timesteps, *x.shape)
        if x.dim() != 5 or x.shape[2] != stem.in_chans or x.shape[-2:] != (stem.img_size, stem.img_size):
            raise ValueError(
                f"{type(self).__name__} expects images [B, {stem.in_chans}, {stem.img_size}, {stem.img_size}] "
                f"(or [T, B, ...]); got {list(x.shape)}"
            )
        self.stata.check_timesteps(x.shape[0], self.timesteps)
        return x

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> tokens `[T, B, N, D]` from the stem, with the anchor at index 0 if enabled."""
        return self.stata.insert_anchor(self.patch_embed(self.encode_input(x)))

    def uses_lean_path(self, x: torch.Tensor) -> bool:
        """Whether `forward` runs the blocks' lean inference path on tokens `x` (see `Spikformer`)."""
        return False

    def forward_blocks(self, x: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """The encoder: tokens through every block, pruning where the schedule says. With `lean`
        (see `uses_lean_path`) the last block returns the patch tokens only (no anchor)."""
        steps = self.stata.begin()
        p, last = self.stata.n_prefix, len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            self.stata.enter_block(x)
            step = steps.get(i)
            if lean and (step is not None or i == last):
                x = blk(x, step, anchor=p == 1, lean=True, last=i == last)
            else:
                x = blk(x, step, anchor=p == 1)
        self.stata.end(x.shape[2] + (p if lean else 0))
        return x

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """Token features -> logits, pooling the patch tokens only (the anchor is excluded)."""
        return self.pool_head(self.stata.patches(x))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Token features `[T, B, N', D]` after the last block (anchor at index 0 if present)."""
        return self.forward_blocks(self.embed(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x)
        if self.uses_lean_path(tokens):
            return self.pool_head(self.forward_blocks(tokens, lean=True))
        return self.forward_head(self.forward_blocks(tokens))

    # ------------------------------------------- STATA, as seen from the model (the pruner's)

    def set_progress(self, epoch: float) -> None:
        """Training progress in (fractional) epochs, passed to the components that track it."""
        inform_progress(self, epoch)

    def keep_ratios(self) -> dict[int, float]:
        return self.stata.keep_ratios()

    def token_schedule(self, ratios: dict[int, float] | None = None) -> list[tuple[int, int]]:
        return self.stata.token_schedule(ratios)

    def stata_outputs(self) -> StataOutputs:
        """Scores and statistics of the last forward (`TokenPruner.outputs`)."""
        return self.stata.outputs()

    @property
    def n_prefix(self) -> int:
        """Tokens before the patches: 1 with an anchor, else 0."""
        return self.stata.n_prefix

    @property
    def anchor(self) -> nn.Parameter:
        return self.stata.anchor

    @property
    def record_scores(self) -> bool:
        """Also keep the scores in eval mode (training always keeps them)."""
        return self.stata.record_scores

    @record_scores.setter
    def record_scores(self, on: bool) -> None:
        self.stata.record_scores = bool(on)

    @property
    def stata_scores(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.stata.last.scores

    @property
    def stata_stats(self) -> dict[str, Any]:
        return self.stata.last.stats

    @stata_stats.setter
    def stata_stats(self, stats: dict[str, Any]) -> None:
        self.stata.last.stats = stats

    def _prune(self, x: torch.Tensor, s: torch.Tensor, c: torch.Tensor, ratio: float) -> torch.Tensor:
        """`TokenPruner.prune`, for callers of the former model method."""
        return self.stata.prune(x, s, c, ratio)
