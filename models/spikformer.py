"""Spikformer (Zhou et al., ICLR 2023): SPS stem, spiking self-attention without softmax, spiking MLP.

Tensors are time-major `[T, B, N, C]` (tokens last-but-one, as in the CIFAR reference code).
The input image `[B, C, H, W]` is repeated over T (direct encoding); the head averages tokens,
then time, then applies a linear classifier.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from efficient.models.neurons import LIF
from efficient.zoo import InputSpec, register_model

PAPER = "Spikformer: When Spiking Neural Network Meets Transformer (Zhou et al., ICLR 2023)"
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DIGITS_MEAN, DIGITS_STD = (0.3,), (0.38,)


def _lif(cfg: dict, **kw) -> LIF:
    return LIF(**{**cfg, **kw})


class LinearBNLIF(nn.Module):
    """Linear -> BatchNorm over channels -> LIF, on `[T, B, N, C]` (the Spikformer 'x_linear/x_bn/x_lif' unit)."""

    def __init__(self, d_in: int, d_out: int, lif_cfg: dict, v_threshold: float = 1.0) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.bn = nn.BatchNorm1d(d_out)
        self.lif = _lif(lif_cfg, v_threshold=v_threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B, N, _ = x.shape
        y = self.bn(self.linear(x.flatten(0, 2)))
        return self.lif(y.reshape(T, B, N, -1))


class SPS(nn.Module):
    """Spiking patch splitting: 4 conv-BN-LIF stages (D/8, D/4, D/2, D) with max-pools, plus a
    conv relative-position embedding added to the tokens. `pool_stages` max-pools (on the last
    stages) set the token grid: img_size / 2**pool_stages per side."""

    def __init__(self, img_size: int, in_chans: int, dim: int, pool_stages: int, lif_cfg: dict) -> None:
        super().__init__()
        if not 1 <= pool_stages <= 4:
            raise ValueError(f"pool_stages must be in 1..4 (got {pool_stages})")
        if img_size % (2**pool_stages):
            raise ValueError(f"img_size {img_size} is not divisible by 2**pool_stages = {2**pool_stages}")
        chans = [in_chans, dim // 8, dim // 4, dim // 2, dim]
        self.img_size, self.in_chans = img_size, in_chans
        self.grid = img_size // 2**pool_stages
        self.convs = nn.ModuleList(nn.Conv2d(chans[i], chans[i + 1], 3, 1, 1, bias=False) for i in range(4))
        self.bns = nn.ModuleList(nn.BatchNorm2d(chans[i + 1]) for i in range(4))
        self.lifs = nn.ModuleList(_lif(lif_cfg) for _ in range(4))
        self.pools = nn.ModuleList(
            nn.MaxPool2d(3, 2, 1) if i >= 4 - pool_stages else nn.Identity() for i in range(4)
        )
        self.rpe_conv = nn.Conv2d(dim, dim, 3, 1, 1, bias=False)
        self.rpe_bn = nn.BatchNorm2d(dim)
        self.rpe_lif = _lif(lif_cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, B, C, H, W]` -> tokens `[T, B, N, D]`."""
        T, B = x.shape[:2]
        x = x.flatten(0, 1)
        for conv, bn, lif, pool in zip(self.convs, self.bns, self.lifs, self.pools):
            x = bn(conv(x))
            x = lif(x.reshape(T, B, *x.shape[1:])).flatten(0, 1)
            x = pool(x)
        feat = x
        x = self.rpe_bn(self.rpe_conv(x))
        x = self.rpe_lif(x.reshape(T, B, *x.shape[1:])).flatten(0, 1)
        x = x + feat
        return x.flatten(2).transpose(1, 2).reshape(T, B, -1, x.shape[1])


class SSA(nn.Module):
    """Spiking self-attention: binary Q, K, V; A = scale * Q K^T with no softmax; LIF_0.5(A V)."""

    def __init__(self, dim: int, heads: int, lif_cfg: dict, scale: float = 0.125, attn_threshold: float = 0.5) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads, self.scale = heads, scale
        self.q = LinearBNLIF(dim, dim, lif_cfg)
        self.k = LinearBNLIF(dim, dim, lif_cfg)
        self.v = LinearBNLIF(dim, dim, lif_cfg)
        self.attn_lif = _lif(lif_cfg, v_threshold=attn_threshold)
        self.proj = LinearBNLIF(dim, dim, lif_cfg)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        T, B, N, C = x.shape
        return x.reshape(T, B, N, self.heads, C // self.heads).transpose(2, 3)  # [T, B, H, N, d]

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T, B, H, N, d = q.shape
        # (Q K^T) V order, as the CIFAR reference; same result as Q (K^T V) up to float rounding.
        y = (q @ k.transpose(-2, -1)) @ v * self.scale
        y = y.transpose(2, 3).reshape(T, B, N, H * d)
        return self.proj(self.attn_lif(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.qkv(x))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, lif_cfg: dict) -> None:
        super().__init__()
        self.fc1 = LinearBNLIF(dim, hidden, lif_cfg)
        self.fc2 = LinearBNLIF(hidden, dim, lif_cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, lif_cfg: dict) -> None:
        super().__init__()
        self.attn = SSA(dim, heads, lif_cfg)
        self.mlp = MLP(dim, int(dim * mlp_ratio), lif_cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Spikformer(nn.Module):
    """Spikformer classifier. Input `[B, C, H, W]` (repeated over T) or `[T, B, C, H, W]`."""

    def __init__(
        self,
        img_size: int = 32,
        in_chans: int = 3,
        num_classes: int = 10,
        embed_dim: int = 384,
        depth: int = 4,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        timesteps: int = 4,
        pool_stages: int = 2,
        tau: float = 2.0,
        surrogate: str = "sigmoid",
        alpha: float = 4.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if timesteps < 1:
            raise ValueError(f"timesteps must be >= 1 (got {timesteps})")
        lif_cfg = dict(tau=tau, v_reset=0.0, detach_reset=True, surrogate=surrogate, alpha=alpha, backend=backend)
        self.timesteps, self.num_classes, self.embed_dim = timesteps, num_classes, embed_dim
        self.patch_embed = SPS(img_size, in_chans, embed_dim, pool_stages, lif_cfg)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, lif_cfg) for _ in range(depth))
        self.head = nn.Linear(embed_dim, num_classes)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def encode_input(self, x: torch.Tensor) -> torch.Tensor:
        sps = self.patch_embed
        if x.dim() == 4:
            x = x.unsqueeze(0).expand(self.timesteps, *x.shape)
        if x.dim() != 5 or x.shape[2] != sps.in_chans or x.shape[-2:] != (sps.img_size, sps.img_size):
            raise ValueError(
                f"Spikformer expects images [B, {sps.in_chans}, {sps.img_size}, {sps.img_size}] "
                f"(or [T, B, ...]); got {list(x.shape)}"
            )
        return x

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(self.encode_input(x))
        for blk in self.blocks:
            x = blk(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        return self.head(x.mean(2).mean(0))


def _spikformer(**kw) -> Spikformer:
    return Spikformer(**kw)


CIFAR10 = InputSpec((3, 32, 32), timesteps=4, mean=CIFAR_MEAN, std=CIFAR_STD, num_classes=10)
DIGITS = InputSpec((1, 16, 16), timesteps=4, mean=DIGITS_MEAN, std=DIGITS_STD, num_classes=10)
IMAGENET = InputSpec((3, 224, 224), timesteps=4, mean=IMAGENET_MEAN, std=IMAGENET_STD, num_classes=1000)


@register_model(
    "spikformer-4-384",
    input_spec=CIFAR10,
    paper=PAPER,
    description="CIFAR-10 config: 4 blocks, D=384, 12 heads, T=4",
    family="spikformer",
    embed_dim=384, depth=4, num_heads=12, img_size=32, pool_stages=2, num_classes=10,
)
def spikformer_4_384(**kw) -> Spikformer:
    return _spikformer(**kw)


@register_model(
    "spikformer-8-512",
    input_spec=IMAGENET,
    paper=PAPER,
    description="ImageNet config: 8 blocks, D=512, 8 heads, 224px, T=4",
    family="spikformer",
    embed_dim=512, depth=8, num_heads=8, img_size=224, pool_stages=4, num_classes=1000,
)
def spikformer_8_512(**kw) -> Spikformer:
    return _spikformer(**kw)


@register_model(
    "spikformer-tiny",
    input_spec=DIGITS,
    paper=PAPER,
    description="digits-sized: 2 blocks, D=64, 4 heads, 16px grayscale, 8x8 tokens, T=4",
    family="spikformer",
    embed_dim=64, depth=2, num_heads=4, img_size=16, in_chans=1, pool_stages=1, num_classes=10,
)
def spikformer_tiny(**kw) -> Spikformer:
    return _spikformer(**kw)
