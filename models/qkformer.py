"""QKFormer (Zhou et al., NeurIPS 2024): a hierarchical spiking transformer with Q-K attention.

Stages of decreasing resolution and increasing width (D/4, D/2, D for three stages):

* PEDS, a spiking patch embedding with a deformed shortcut: conv3x3-BN(-max-pool)-LIF units, plus a
  1x1 strided conv-BN-LIF shortcut from an earlier point of the same embedding, added to its output
  (integer-valued tokens). The stem embeds the image; every later stage starts with a PEDS that
  halves the grid and doubles the width.
* QKTA blocks in the early stages: Q-K token attention, linear in the tokens. Per head the binary
  queries of a token are summed over channels and thresholded (LIF_0.5): a binary token-attention
  vector that masks the keys, y = A * K, then a projection unit; a spiking MLP follows.
* SSA blocks in the last stage: Spikformer's spiking self-attention (binary Q, K, V, no softmax)
  and MLP, on a flat token sequence -- the same `Block` as `efficient.models.spikformer`.
* Head: mean over tokens, then time, then a linear classifier.

Every neuron sees time-major `[T, B, ...]` input (the reference code hands its SSA projection
neuron `[T*B, ...]`, so its membrane leaks from sample to sample across the batch; QKFormer issue
#14). Tokens are `[T, B, N, C]` as in Spikformer; a PEDS sees `[T, B, C, H, W]` grids. Loaded
with the reference code's weights (`efficient.export.checkpoints`), the CIFAR, ImageNet and DVS
models give its logits bit for bit on a batch of one (where that bug is harmless; run with
spikingjelly's LIF), and on larger batches once its SSA projection neuron gets `[T, B, ...]` too.

STATA (`TokenPruner`, shared with Spikformer and SDT) prunes in the SSA stage only: the QKTA
stages feed a PEDS whose 3x3 convolutions and max-pools need every position of the grid, while
from the last PEDS on the tokens are a flat sequence that is only pooled at the end. The anchor
(if any) is inserted after the last PEDS, and `prune_blocks` count the SSA blocks (1 = the first
SSA block). See `QKFormerConfig.stata_score` for the score.

Variants are data: `VARIANTS` below, with the stems and stage depths of the reference code (CIFAR,
ImageNet and DVS models differ in their embeddings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.models.spiking_transformer import (
    CIFAR_MEAN,
    CIFAR_STD,
    SpikingTransformer,
    SpikingTransformerConfig,
    _lif,
    share_neuron_backend,
)
from efficient.models.spikformer import (
    DIGITS_MEAN,
    DIGITS_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    MLP,
    STATA_PAPER,
    Block,
    LinearBNLIF,
    Spikformer,
)
from efficient.models.stata import PruneStep, StataConfig, TokenPruner, keep_anchor_key, residual_block
from efficient.models.weight_init import trunc_normal_
from efficient.zoo import InputSpec, Variant, config_from_options, register_variants

PAPER = "QKFormer: Hierarchical Spiking Transformer using Q-K Attention (Zhou et al., NeurIPS 2024)"

Stem = Literal["cifar", "imagenet", "dvs"]
StataScore = Literal["attention", "token"]


@dataclass(frozen=True)
class EmbedPlan:
    """The layout of a PEDS: output width of each conv3x3 unit as a fraction of the stage width,
    which of them max-pool, and before which unit the shortcut branches off (0: the input)."""

    widths: tuple[float, ...]
    pools: tuple[bool, ...]
    shortcut_from: int


# the reference code's embeddings: (stem, the downsampling PEDS that starts every later stage)
EMBEDS: dict[str, tuple[EmbedPlan, EmbedPlan]] = {
    "cifar": (EmbedPlan((0.5, 1.0), (False, False), 1), EmbedPlan((1.0, 1.0), (False, True), 0)),
    "imagenet": (EmbedPlan((0.5, 1.0, 1.0), (True, True, False), 1), EmbedPlan((1.0, 1.0), (True, False), 0)),
    "dvs": (EmbedPlan((0.125, 0.25, 0.5, 1.0), (False, True, True, True), 2), EmbedPlan((1.0, 1.0), (False, True), 0)),
}


def _halve(res: int) -> int:
    """Side of a grid after a stride-2 max-pool (3x3, padding 1) or a stride-2 1x1 conv."""
    return (res + 1) // 2


class PEDS(nn.Module):
    """Spiking patch embedding with a deformed shortcut: conv3x3 -> BN (-> max-pool) -> LIF units,
    plus LIF(BN(conv1x1 with the units' total stride)) of the input of unit `shortcut_from`, added
    to the last unit's spikes. `[T, B, C, H, W]` -> tokens `[T, B, N, D]`."""

    # efficient.memory: keeps only its input and reruns in backward
    recompute_unit = True
    recompute_count_bound: int | None = None  # set by `QKFormer` where the input is a count of spikes (a stage's stream)

    def __init__(self, in_chans: int, dim: int, plan: EmbedPlan, res: int, lif_cfg: dict) -> None:
        super().__init__()
        chans = [in_chans] + [int(dim * w) for w in plan.widths]
        if any(c < 1 or c != dim * w for c, w in zip(chans[1:], plan.widths)):
            raise ConfigError(f"stage width {dim} does not split into the PEDS widths {list(plan.widths)}; "
                              f"choose embed_dim so every stage width is a multiple of {round(1 / min(plan.widths))}")
        self.convs = nn.ModuleList(nn.Conv2d(chans[i], chans[i + 1], 3, 1, 1, bias=False) for i in range(len(plan.widths)))
        self.bns = nn.ModuleList(nn.BatchNorm2d(c) for c in chans[1:])
        self.pools = nn.ModuleList(nn.MaxPool2d(3, 2, 1) if p else nn.Identity() for p in plan.pools)
        self.lifs = nn.ModuleList(_lif(lif_cfg) for _ in plan.widths)
        self.shortcut_from = plan.shortcut_from
        stride = 2 ** sum(plan.pools[plan.shortcut_from:])
        self.res_conv = nn.Conv2d(chans[plan.shortcut_from], dim, 1, stride, 0, bias=False)
        self.res_bn = nn.BatchNorm2d(dim)
        self.res_lif = _lif(lif_cfg)
        self.in_chans, self.img_size, self.in_res, self.chans, self.plan = in_chans, res, res, chans, plan
        for p in plan.pools:
            res = _halve(res) if p else res
        self.grid = res

    def neuron_peak(self) -> int:
        """Elements per timestep and sample of this embedding's largest neuron input."""
        res, peak = self.in_res, 0
        for c, p in zip(self.chans[1:], self.plan.pools):
            res = _halve(res) if p else res
            peak = max(peak, c * res * res)
        return peak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B = x.shape[:2]
        x = x.flatten(0, 1)
        feat = x
        for i, (conv, bn, pool, lif) in enumerate(zip(self.convs, self.bns, self.pools, self.lifs)):
            if i == self.shortcut_from:
                feat = x
            y = pool(bn(conv(x)))
            x = lif(y.reshape(T, B, *y.shape[1:])).flatten(0, 1)
        s = self.res_bn(self.res_conv(feat))
        x = x + self.res_lif(s.reshape(T, B, *s.shape[1:])).flatten(0, 1)
        return x.flatten(2).transpose(1, 2).reshape(T, B, -1, x.shape[1])


class QKTA(nn.Module):
    """Q-K token attention: A = LIF_0.5(per-head channel sum of binary Q) (`[T, B, N, H]`, binary),
    y = A * K (each head's keys masked token by token), then Linear -> BN -> LIF. Linear in N."""

    def __init__(self, dim: int, heads: int, lif_cfg: dict) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"stage width {dim} is not divisible by num_heads {heads}")
        self.heads = heads
        self.q = LinearBNLIF(dim, dim, lif_cfg, bias=False)
        self.k = LinearBNLIF(dim, dim, lif_cfg, bias=False)
        self.attn_lif = _lif(lif_cfg, v_threshold=0.5)
        self.proj = LinearBNLIF(dim, dim, lif_cfg)

    def token_attention(self, q: torch.Tensor) -> torch.Tensor:
        """Binary queries `[T, B, N, C]` -> per-head channel sums `[T, B, N, H]` (before the threshold)."""
        return q.unflatten(-1, (self.heads, -1)).sum(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        a = self.attn_lif(self.token_attention(q))  # [T, B, N, H], time-major
        return self.proj((a.unsqueeze(-1) * k.unflatten(-1, (self.heads, -1))).flatten(-2))


class QKTABlock(nn.Module):
    """x += QKTA(x); x += MLP(x), on tokens `[T, B, N, C]`."""

    # efficient.memory: a block keeps only its input (the residual stream) and reruns in backward
    recompute_unit = True
    recompute_residual = True  # its output's gradient also reaches its input unchanged
    recompute_count_bound: int | None = None  # set by `QKFormer`: the stream is a count of spikes

    def __init__(self, dim: int, heads: int, mlp_ratio: float, lif_cfg: dict) -> None:
        super().__init__()
        self.attn = QKTA(dim, heads, lif_cfg)
        self.mlp = MLP(dim, int(dim * mlp_ratio), lif_cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class QKTAStage(nn.Module):
    """QKTA blocks on a `res` x `res` grid of tokens, then the PEDS that starts the next stage."""

    def __init__(self, dim: int, depth: int, heads: int, mlp_ratio: float, res: int, plan: EmbedPlan, lif_cfg: dict) -> None:
        super().__init__()
        self.res = res
        self.blocks = nn.ModuleList(QKTABlock(dim, heads, mlp_ratio, lif_cfg) for _ in range(depth))
        self.downsample = PEDS(dim, 2 * dim, plan, res, lif_cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        T, B, N, C = x.shape
        return self.downsample(x.transpose(2, 3).reshape(T, B, C, self.res, self.res))


class SSABlock(Block):
    """Spikformer's block (x += SSA(x); [prune]; x += MLP(x)) with QKFormer's bias-free q/k/v and,
    with `token_score`, STATA scores from the queries' token-attention sums (`QKFormerConfig.stata_score`)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, lif_cfg: dict, kernel_backend: str = "auto",
                 token_score: bool = False) -> None:
        super().__init__(dim, heads, mlp_ratio, lif_cfg, qkv_bias=False, kernel_backend=kernel_backend)
        self.token_score = token_score

    def recompute_parts(self) -> list[tuple[str, nn.Module]]:
        """Spikformer's halves where the block runs Spikformer's forward; one unit where it scores tokens by
        its queries' token attention, which it reads outside the attention."""
        return [] if self.token_score else [("attn", self._attn_half), ("mlp", self.mlp)]

    def forward(self, x: torch.Tensor, step: PruneStep | None = None, anchor: bool = False, lean: bool = False,
                last: bool = False) -> torch.Tensor:
        if step is None or not self.token_score:
            return super().forward(x, step, anchor, lean, last)
        q, k, v = self.attn.qkv(x)  # [T, B, H, N, d]
        a, _, c = self.attn.attend(q, k, v, anchor=anchor, scores=True)
        s = q[:, :, :, int(anchor):].sum((2, 4))  # QKTA's token attention before its threshold, all heads: [T, B, N]
        return residual_block(x, a, s, c, self.mlp, step)


@dataclass
class QKFormerConfig:
    """QKFormer's options (recipe keys of the same names; STATA's given flat, `keep_ratio: 0.7`).

    `embed_dim` is the width D of the last stage (stage i of S has D / 2**(S-1-i)); `depth` counts
    every block as the paper's HST-depth-D names do, `qkta_depths` the QKTA blocks of each early
    stage (one stage each), so the SSA stage has `depth - sum(qkta_depths)` blocks; `num_heads`
    holds in every stage. `stem` picks the reference code's embeddings: "cifar" (stem at full
    resolution), "imagenet" (stem /4), "dvs" (stem /8); each later stage halves the grid.
    `stata_score`: what ranks the SSA stage's tokens for pruning --

    * "attention" (default): STATA's own score, the anchor query's row of the SSA map
      s_t(i) = <q_anchor, k_i> (the mean query's column without an anchor), fused into the
      attention kernel. The SSA stage is Spikformer's attention unchanged, so this is the score
      STATA was defined and tuned on, its alignment objective trains it (`objectives.stata`), and
      results compare across the zoo's transformers.
    * "token": QKFormer's own notion of token importance, the Q-K token-attention vector before its
      threshold, sum_c q_t(i, c) over every head's channels (how many query channels token i
      fires), from the SSA block's binary queries: O(N D), no anchor needed. With the STATA
      objective, its intra term then teaches the queries' firing to follow the attention each
      token receives. Inference runs every row (no lean path).

    `lean_inference`: skip rows nobody reads at inference, as `Spikformer` does (SSA stage only).
    """

    img_size: int = 32
    in_chans: int = 3
    num_classes: int = 10
    embed_dim: int = 384
    depth: int = 4
    num_heads: int = 8
    mlp_ratio: float = 4.0
    qkta_depths: list[int] = field(default_factory=lambda: [1, 1])
    stem: Stem = "cifar"
    timesteps: int = 4
    tau: float = 2.0
    surrogate: str = "sigmoid"
    alpha: float | None = None  # None: the surrogate's default (kernels.lif.SURROGATE_ALPHA; sigmoid 4)
    backend: str = "auto"
    lean_inference: bool = False
    stata_score: StataScore = "attention"
    stata: StataConfig = field(default_factory=StataConfig)

    neuron = SpikingTransformerConfig.neuron
    kernel_backend = SpikingTransformerConfig.kernel_backend

    def __post_init__(self) -> None:
        if self.timesteps < 1:
            raise ConfigError(f"timesteps must be >= 1 (got {self.timesteps})")
        if self.stem not in EMBEDS:
            raise ConfigError(f"stem must be one of {sorted(EMBEDS)} (got {self.stem!r})")
        if self.stata_score not in ("attention", "token"):
            raise ConfigError(f"stata_score must be 'attention' or 'token' (got {self.stata_score!r})")
        if any(d < 0 for d in self.qkta_depths):
            raise ConfigError(f"qkta_depths must be >= 0 blocks per stage (got {list(self.qkta_depths)})")
        if self.depth <= sum(self.qkta_depths):
            raise ConfigError(f"depth={self.depth} leaves no SSA block after the QKTA stages {list(self.qkta_depths)}; "
                              f"depth counts every block, so it must exceed {sum(self.qkta_depths)}")
        n = len(self.qkta_depths)
        if self.embed_dim % 2**n:
            raise ConfigError(f"embed_dim={self.embed_dim} must be divisible by {2**n} (the widths of {n + 1} stages halve)")
        stride = self.stride()
        if self.img_size < stride or self.img_size % stride:
            raise ConfigError(f"img_size {self.img_size} does not fit: the '{self.stem}' stem and {n} downsampling "
                              f"stage(s) need a positive multiple of {stride}")

    @property
    def ssa_depth(self) -> int:
        """Blocks of the SSA stage (the ones STATA can prune in)."""
        return self.depth - sum(self.qkta_depths)

    def stride(self) -> int:
        """Pixels per token side in the SSA stage."""
        return 2 ** (sum(EMBEDS[self.stem][0].pools) + len(self.qkta_depths))


class QKFormer(SpikingTransformer):
    """QKFormer classifier. Input `[B, C, H, W]` (repeated over T) or `[T, B, C, H, W]` (event frames).

    `patch_embed` (the stem PEDS) -> `stages` (QKTA blocks, then the next PEDS) -> [STATA anchor]
    -> `blocks` (SSA, pruned by `self.stata`) -> `head`. Built from a `QKFormerConfig` or its flat
    options (`QKFormer(embed_dim=64, depth=3, qkta_depths=[1])`).
    """

    def __init__(self, config: QKFormerConfig | None = None, **options: Any) -> None:
        cfg = config_from_options(QKFormerConfig, options, config)
        nn.Module.__init__(self)
        self.cfg = cfg
        self.timesteps, self.num_classes, self.embed_dim = cfg.timesteps, cfg.num_classes, cfg.embed_dim
        self.kernel_backend = cfg.kernel_backend()
        self.lean_inference = cfg.lean_inference
        lif_cfg = cfg.neuron()
        stem_plan, down_plan = EMBEDS[cfg.stem]
        n = len(cfg.qkta_depths)
        dims = [cfg.embed_dim // 2 ** (n - i) for i in range(n + 1)]
        stem = PEDS(cfg.in_chans, dims[0], stem_plan, cfg.img_size, lif_cfg)
        grids = [stem.grid]
        for _ in range(n):
            grids.append(_halve(grids[-1]))
        # the pruner is the first child, so an anchor leads the state dict and the parameters (as in Spikformer)
        self.stata = TokenPruner(cfg.stata, cfg.ssa_depth, cfg.timesteps, cfg.embed_dim, grids[-1] ** 2, self.kernel_backend)
        keep_anchor_key(self, "stata")
        self.patch_embed = stem
        self.stages = nn.ModuleList(QKTAStage(dims[i], d, cfg.num_heads, cfg.mlp_ratio, grids[i], down_plan, lif_cfg)
                                    for i, d in enumerate(cfg.qkta_depths))
        self.blocks = nn.ModuleList(SSABlock(cfg.embed_dim, cfg.num_heads, cfg.mlp_ratio, lif_cfg, self.kernel_backend,
                                             cfg.stata_score == "token") for _ in range(cfg.ssa_depth))
        self.head = nn.Linear(cfg.embed_dim, cfg.num_classes)
        # the reference code's init: PyTorch's defaults (its 1x1 projections are convolutions), the head trunc-normal
        trunc_normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)
        peak = max([stem.neuron_peak()] + [s.downsample.neuron_peak() for s in self.stages]
                   + [int(dims[i] * cfg.mlp_ratio) * grids[i] ** 2 for i in range(n)]
                   + [int(cfg.embed_dim * cfg.mlp_ratio) * (grids[-1] ** 2 + 1)])
        share_neuron_backend(self, peak)
        self.stata.reset_parameters()
        self._state_count_bounds()

    def _state_count_bounds(self) -> None:
        """Tell each unit whose input is a count of spikes by construction its bound (efficient.memory
        keeps such inputs as uint8): a PEDS adds two spike maps (last unit and shortcut), a QKTA or SSA
        block two more (attention and MLP outputs), so block j after a PEDS holds at most 2 + 2j and a
        stage's closing PEDS reads its stage's last count. The SSA blocks only without STATA (its
        anchor and fused tokens are not counts). Nothing where a unit is not the stock one."""
        stock = (type(self.patch_embed) is PEDS and all(type(st) is QKTAStage and type(st.downsample) is PEDS
                                                        and all(type(b) is QKTABlock for b in st.blocks)
                                                        for st in self.stages)
                 and all(type(b) is SSABlock for b in self.blocks))
        if not stock:
            return
        for st in self.stages:
            for j, blk in enumerate(st.blocks):
                blk.recompute_count_bound = 2 + 2 * j
            st.downsample.recompute_count_bound = 2 + 2 * len(st.blocks)
        if not (self.stata.n_prefix or self.stata.prune_at or self.cfg.stata_score == "token"):
            for j, blk in enumerate(self.blocks):
                blk.set_count_bound(2 + 2 * j)

    @property
    def grid(self) -> int:
        """Tokens per side in the SSA stage."""
        return int(math.isqrt(self.stata.n_patches))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> SSA-stage tokens `[T, B, N, D]` (stem, QKTA stages), the anchor at index 0 if enabled."""
        x = self.patch_embed(self.encode_input(x))
        for stage in self.stages:
            x = stage(x)
        return self.stata.insert_anchor(x)

    def pool_head(self, patches: torch.Tensor) -> torch.Tensor:
        """Patch tokens `[T, B, N, D]` -> logits: mean over tokens, then over time, then the linear classifier."""
        return self.head(patches.mean(2).mean(0))

    def uses_lean_path(self, x: torch.Tensor) -> bool:
        """`Spikformer.uses_lean_path` for the SSA stage; never with `stata_score="token"` (it reads every query)."""
        return self.cfg.stata_score == "attention" and Spikformer.uses_lean_path(self, x)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- variants

CIFAR10 = InputSpec((3, 32, 32), timesteps=4, mean=CIFAR_MEAN, std=CIFAR_STD, num_classes=10)
IMAGENET = InputSpec((3, 224, 224), timesteps=4, mean=IMAGENET_MEAN, std=IMAGENET_STD, num_classes=1000)
CIFAR10_DVS = InputSpec((2, 128, 128), timesteps=16, num_classes=10)
DIGITS = InputSpec((1, 16, 16), timesteps=4, mean=DIGITS_MEAN, std=DIGITS_STD, num_classes=10)

CIFAR = QKFormerConfig()  # HST-4-384: stages 1 QKTA (96) + 1 QKTA (192) + 2 SSA (384), 8 heads, T=4


def _imagenet(dim: int, heads: int) -> QKFormerConfig:
    return QKFormerConfig(img_size=224, num_classes=1000, embed_dim=dim, depth=10, num_heads=heads, qkta_depths=[1, 2],
                          stem="imagenet")


# the reference CIFAR10-DVS model (its DVS128 Gesture model: mlp_ratio=4, num_classes=11)
DVS = QKFormerConfig(img_size=128, in_chans=2, num_classes=10, embed_dim=256, depth=2, num_heads=16, mlp_ratio=1.0,
                     qkta_depths=[1], stem="dvs", timesteps=16)
TINY = QKFormerConfig(img_size=16, in_chans=1, embed_dim=64, depth=3, num_heads=4, qkta_depths=[1])
# STATA as in the Spikformer entries (seeds/stata.md): anchor per timestep, rho = 0.7 with EViT's warm-up
STATA = StataConfig(anchor="per_timestep", keep_ratio=0.7, keep_warmup_start=10.0, keep_warmup_epochs=60.0)

VARIANTS: dict[str, Variant] = {
    "qkformer-4-384": Variant(CIFAR10, PAPER, "HST-4-384, CIFAR config: QKTA 32x32 (D=96), QKTA 16x16 (192), "
                              "2 SSA 8x8 (384), 8 heads, T=4", CIFAR),
    "qkformer-4-384-stata": Variant(
        CIFAR10, STATA_PAPER, "qkformer-4-384 + STATA: anchor per timestep, prune both SSA blocks at rho=0.7 "
        "(65->46->33 tokens)", replace(CIFAR, lean_inference=True, stata=replace(STATA, prune_blocks=[1, 2]))),
    "qkformer-10-384": Variant(IMAGENET, PAPER, "HST-10-384, ImageNet config: QKTA 56x56 (96), 2 QKTA 28x28 (192), "
                               "7 SSA 14x14 (384), 6 heads, T=4", _imagenet(384, 6)),
    "qkformer-10-512": Variant(IMAGENET, PAPER, "HST-10-512, ImageNet config: QKTA 56x56 (128), 2 QKTA 28x28 (256), "
                               "7 SSA 14x14 (512), 8 heads, T=4", _imagenet(512, 8)),
    "qkformer-10-768": Variant(IMAGENET, PAPER, "HST-10-768, ImageNet config: QKTA 56x56 (192), 2 QKTA 28x28 (384), "
                               "7 SSA 14x14 (768), 12 heads, T=4", _imagenet(768, 12)),
    "qkformer-2-256-dvs": Variant(CIFAR10_DVS, PAPER, "HST-2-256, CIFAR10-DVS config: QKTA 16x16 (128), SSA 8x8 (256), "
                                  "16 heads, MLP ratio 1, 128px event frames, T=16", DVS),
    "qkformer-tiny": Variant(DIGITS, PAPER, "digits-sized: QKTA 16x16 (D=32), 2 SSA 8x8 (64), 4 heads, "
                             "16px grayscale, T=4", TINY),
    "qkformer-tiny-stata": Variant(
        DIGITS, STATA_PAPER, "qkformer-tiny + STATA: anchor per timestep, prune both SSA blocks at rho=0.5 "
        "(65->33->17 tokens)",
        replace(TINY, lean_inference=True, stata=StataConfig(anchor="per_timestep", prune_blocks=[1, 2], keep_ratio=0.5))),
}

register_variants(QKFormer, VARIANTS, family="qkformer")
