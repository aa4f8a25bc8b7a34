"""Spikingformer (Zhou et al., 2023) with STATA token sparsification as one switch.

Spikingformer is Spikformer with spike-driven residual learning: every branch starts with a LIF
on the residual stream (pre-activation), so the stream adds real-valued BatchNorm outputs and
every conv / matmul of the network reads binary spikes (Spikformer adds spikes onto an
integer-valued stream and fires after its projections). Reference: zhouchenlin2096/Spikingformer.

* Stem (spiking tokenizer): conv-BN on the pixels, then four stages LIF -> [max-pool] -> conv -> BN
  (channels D/8, D/4, D/2, D, D); the pools sit on the last `pool_stages` stages, on the spikes.
  No position embedding. Its output, real-valued, is the residual stream.
* Block: x += SSA(LIF(x)); x += MLP(x), where SSA is Spikformer's spiking self-attention (binary
  Q, K, V, scale * Q K^T V with no softmax, LIF_0.5) with a Linear + BN projection (no LIF after it),
  and the MLP is LIF -> Linear + BN -> LIF -> Linear + BN (the Spike-driven Transformer's `SDTMLP`).
* Head: mean over tokens and time of the real-valued stream -> Linear (as the reference code).

STATA: the attention is Spikformer's, so is the score. The anchor's query row of Q K^T,
s_t(i) = <q_anchor, k_i>, and the mean-query column come out of the same fused attention pass
(`efficient.kernels.ssa.spiking_attention`); the `TokenPruner` standardizes, averages over time and
keeps the top ceil(rho N) tokens. Tensors are time-major `[T, B, N, C]`; neurons always see `[T, B, ...]`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from efficient.models.sdt import SDTMLP, LinearBN
from efficient.models.spiking_transformer import CIFAR_MEAN, CIFAR_STD, SpikingTransformer, SpikingTransformerConfig, _lif, check_stem_grid
from efficient.models.spikformer import DIGITS_MEAN, DIGITS_STD, IMAGENET_MEAN, IMAGENET_STD, SSA, STATA, STATA_PAPER
from efficient.models.stata import PruneStep, StataConfig, residual_block
from efficient.zoo import InputSpec, Variant, config_from_options, register_variants

PAPER = "Spikingformer: Spike-driven Residual Learning for Transformer-based Spiking Neural Network (Zhou et al., arXiv 2023)"


class SpikingTokenizer(nn.Module):
    """The stem: conv-BN on the input, then 4 stages LIF -> [max-pool] -> conv(3x3) -> BN, channels
    D/8 -> D/4 -> D/2 -> D -> D. `pool_stages` max-pools (3x3, stride 2, on the last stages' spikes)
    set the token grid: img_size / 2**pool_stages per side. `[T, B, C, H, W]` -> real-valued `[T, B, N, D]`."""

    recompute_unit = True  # efficient.memory: the stem keeps only its input image and reruns in backward

    def __init__(self, img_size: int, in_chans: int, dim: int, pool_stages: int, lif_cfg: dict) -> None:
        super().__init__()
        stride = check_stem_grid(img_size, dim, pool_stages, "Spikingformer stem")
        chans = [in_chans, dim // 8, dim // 4, dim // 2, dim, dim]
        self.img_size, self.in_chans, self.chans = img_size, in_chans, chans
        self.grid = img_size // stride
        self.convs = nn.ModuleList(nn.Conv2d(chans[i], chans[i + 1], 3, 1, 1, bias=False) for i in range(5))
        self.bns = nn.ModuleList(nn.BatchNorm2d(chans[i + 1]) for i in range(5))
        self.lifs = nn.ModuleList(_lif(lif_cfg) for _ in range(4))
        self.pools = nn.ModuleList(nn.MaxPool2d(3, 2, 1) if i >= 4 - pool_stages else nn.Identity() for i in range(4))

    def neuron_peak(self) -> int:
        """Elements per timestep and sample of the stem's largest neuron input."""
        res, peak = self.img_size, 0
        for c, pool in zip(self.chans[1:5], self.pools):
            peak = max(peak, c * res**2)
            res = res // 2 if isinstance(pool, nn.MaxPool2d) else res
        return peak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B = x.shape[:2]
        x = self.bns[0](self.convs[0](x.flatten(0, 1)))
        for lif, pool, conv, bn in zip(self.lifs, self.pools, self.convs[1:], self.bns[1:]):
            s = lif(x.reshape(T, B, *x.shape[1:])).flatten(0, 1)  # time-major into the neuron
            x = bn(conv(pool(s)))
        return x.flatten(2).transpose(1, 2).reshape(T, B, -1, x.shape[1])


class SpikingformerSSA(SSA):
    """LIF on the residual stream, then Spikformer's SSA (bias-free Q, K, V units, LIF_0.5 on
    scale * Q K^T V) with a Linear + BN projection: the output is real-valued, added to the stream."""

    # efficient.memory: a residual half of its block (the block adds its output to the stream), so the
    # gradient of its output lives through its rerun anyway: it runs as a light region at any size
    recompute_residual = True

    def __init__(self, dim: int, heads: int, lif_cfg: dict, kernel_backend: str = "auto") -> None:
        super().__init__(dim, heads, lif_cfg, qkv_bias=False, kernel_backend=kernel_backend)
        self.pre_lif = _lif(lif_cfg)
        self.proj = LinearBN(dim, dim)  # the reference's proj_conv + proj_bn, no neuron after them

    def forward(self, x: torch.Tensor, anchor: bool = False, scores: bool = False):
        """`[T, B, N, D]` -> (output `[T, B, N, D]`, STATA's anchor scores, mean-query scores) (None, None unless `scores`)."""
        return self.attend(*self.qkv(self.pre_lif(x), split=False), anchor=anchor, scores=scores)


class SpikingformerBlock(nn.Module):
    """x += SSA(LIF(x)); [prune]; x += MLP(x) with the MLP LIF -> Linear-BN -> LIF -> Linear-BN.
    `step` (a `PruneStep` or None) prunes after the attention or after the block."""

    # efficient.memory: recomputed in backward as two units, the attention and the MLP, each keeping only its
    # input (the residual stream), so backward holds one half's rerun at a time
    recompute_unit = True

    def __init__(self, dim: int, heads: int, mlp_ratio: float, lif_cfg: dict, reference_norms: bool = False,
                 kernel_backend: str = "auto") -> None:
        super().__init__()
        self.attn = SpikingformerSSA(dim, heads, lif_cfg, kernel_backend)
        self.mlp = SDTMLP(dim, int(dim * mlp_ratio), lif_cfg)
        if reference_norms:  # built but never called by the reference forward; counted in its published sizes
            self.norm1, self.norm2 = nn.LayerNorm(dim).requires_grad_(False), nn.LayerNorm(dim).requires_grad_(False)

    def recompute_parts(self) -> list[tuple[str, nn.Module]]:
        return [("attn", self.attn), ("mlp", self.mlp)] if type(self).forward is SpikingformerBlock.forward else []

    def forward(self, x: torch.Tensor, step: PruneStep | None = None, anchor: bool = False) -> torch.Tensor:
        a, s, c = self.attn(x, anchor=anchor, scores=step is not None)
        return residual_block(x, a, s, c, self.mlp, step)


@dataclass
class SpikingformerConfig(SpikingTransformerConfig):
    """Spikingformer's options: the shared ones (CIFAR-sized defaults) and `reference_norms`, the
    reference code's two LayerNorms per block that its forward never calls (counted in its sizes)."""

    reference_norms: bool = False


class Spikingformer(SpikingTransformer):
    """Spikingformer classifier with STATA (see `TokenPruner`). Input `[B, C, H, W]` (repeated over
    T) or `[T, B, C, H, W]`; built from a `SpikingformerConfig` or its flat options."""

    def __init__(self, config: SpikingformerConfig | None = None, **options: Any) -> None:
        super().__init__(config_from_options(SpikingformerConfig, options, config))

    def build_stem(self, cfg: SpikingformerConfig, lif_cfg: dict) -> SpikingTokenizer:
        return SpikingTokenizer(cfg.img_size, cfg.in_chans, cfg.embed_dim, cfg.pool_stages, lif_cfg)

    def build_block(self, cfg: SpikingformerConfig, lif_cfg: dict) -> SpikingformerBlock:
        return SpikingformerBlock(cfg.embed_dim, cfg.num_heads, cfg.mlp_ratio, lif_cfg, cfg.reference_norms,
                                  self.kernel_backend)

    def build_head(self, cfg: SpikingformerConfig, lif_cfg: dict) -> None:
        self.head = nn.Linear(cfg.embed_dim, cfg.num_classes)

    def pool_head(self, patches: torch.Tensor) -> torch.Tensor:
        """Patch tokens `[T, B, N, D]` (real-valued) -> mean over tokens, then time -> Linear."""
        return self.head(patches.mean(2).mean(0))


# ---------------------------------------------------------------------------------- variants

CIFAR10 = InputSpec((3, 32, 32), timesteps=4, mean=CIFAR_MEAN, std=CIFAR_STD, num_classes=10)
IMAGENET = InputSpec((3, 224, 224), timesteps=4, mean=IMAGENET_MEAN, std=IMAGENET_STD, num_classes=1000)
DIGITS = InputSpec((1, 16, 16), timesteps=4, mean=DIGITS_MEAN, std=DIGITS_STD, num_classes=10)
DVS128 = InputSpec((2, 128, 128), timesteps=16, num_classes=11)

# the reference configs (cifar10/cifar10.yml, imagenet/imagenet.yml, dvs128-gesture/model.py)
CIFAR = SpikingformerConfig(embed_dim=384, depth=4, num_heads=12, img_size=32, pool_stages=2, num_classes=10,
                            reference_norms=True)


def imagenet(dim: int) -> SpikingformerConfig:
    """Spikingformer-8-`dim` on ImageNet: 224 px, four pooled stem stages (14 x 14 tokens), 8 heads."""
    return SpikingformerConfig(embed_dim=dim, depth=8, num_heads=8, img_size=224, pool_stages=4, num_classes=1000,
                               reference_norms=True)


DVS = SpikingformerConfig(embed_dim=256, depth=2, num_heads=16, img_size=128, in_chans=2, pool_stages=4, num_classes=11,
                          timesteps=16, tau=1.5, reference_norms=True)
TINY = SpikingformerConfig(embed_dim=64, depth=2, num_heads=4, img_size=16, in_chans=1, pool_stages=1, num_classes=10)

VARIANTS: dict[str, Variant] = {
    "spikingformer-4-384": Variant(CIFAR10, PAPER, "CIFAR-10 config: 4 blocks, D=384, 12 heads, T=4, spike-driven residuals",
                                   CIFAR),
    "spikingformer-stata": Variant(
        CIFAR10, STATA_PAPER, "spikingformer-4-384 + STATA: anchor per timestep, prune blocks 2,3 at rho=0.7 (65->46->33 tokens)",
        replace(CIFAR, stata=replace(STATA, prune_blocks=[2, 3]))),
    "spikingformer-8-384": Variant(IMAGENET, PAPER, "ImageNet config: 8 blocks, D=384, 8 heads, 224px, T=4", imagenet(384)),
    "spikingformer-8-512": Variant(IMAGENET, PAPER, "ImageNet config: 8 blocks, D=512, 8 heads, 224px, T=4", imagenet(512)),
    "spikingformer-8-768": Variant(IMAGENET, PAPER, "ImageNet config: 8 blocks, D=768, 8 heads, 224px, T=4", imagenet(768)),
    "spikingformer-2-256-dvs": Variant(DVS128, PAPER, "DVS128 Gesture / CIFAR10-DVS config: 2 blocks, D=256, 16 heads, "
                                       "128px event frames, T=16, tau=1.5", DVS),
    "spikingformer-tiny": Variant(DIGITS, PAPER, "digits-sized: 2 blocks, D=64, 4 heads, 16px grayscale, 8x8 tokens, T=4", TINY),
    "spikingformer-tiny-stata": Variant(
        DIGITS, STATA_PAPER, "spikingformer-tiny + STATA: anchor per timestep, prune blocks 1,2 at rho=0.5 (65->33->17 tokens)",
        replace(TINY, stata=StataConfig(anchor="per_timestep", prune_blocks=[1, 2], keep_ratio=0.5))),
}

register_variants(Spikingformer, VARIANTS, family="spikingformer")
