"""Meta-SpikeFormer, the Spike-driven Transformer V2 (Yao et al., ICLR 2024), with STATA as one switch.

Reference: BICLab/Spike-Driven-Transformer-V2 (`classification/models.py`); zoo names `sdt-v2-*`
(the widths in a name are the transformer stages', as in the reference's `metaspikformer_8_512`).
Four stages:

* conv stages (the stem, `MetaStem`): a 7x7 downsampling conv on the pixels, then spiking conv
  blocks at widths C0/2, C0, C1, C1 with a LIF -> conv -> BN downsampling before each width, and a
  last downsampling to the transformer width C2. A conv block is x += SepConv(x) (LIF, 1x1 conv
  x2, BN, LIF, 7x7 depthwise, 1x1 conv, BN), then x += BN(conv3x3(LIF(BN(conv3x3(LIF(x)))))).
* transformer stages: blocks x += SDSA(x); x += MLP(x) at width C2, then a LIF -> 3x3 conv -> BN
  to C3 (stride 1) and more blocks at C3. The attention is spike-driven self-attention with
  re-parameterisable conv projections: q, k, v = LIF(BN(RepConv(LIF(x)))), y = LIF_0.5(scale *
  Q (K^T V)), output BN(RepConv(y)); RepConv = 1x1 conv -> BN -> 3x3 depthwise -> 1x1 conv -> BN.
  The MLP is the Spike-driven Transformer's (LIF -> Linear-BN -> LIF -> Linear-BN, `SDTMLP`).
* head: mean over tokens -> LIF -> Linear at every timestep -> mean over time (and, with
  `distill_head`, the average with a second, distillation head as the reference's `kd` models).

The residual stream is real-valued and every conv / matmul reads spikes except the depthwise
convs of RepConv and SepConv's second 1x1 conv (as in the reference). Widths follow the
reference: C0 = C2/4, C1 = C2/2; `embed_dim` is C2, `last_dim` C3.

Tokens and STATA. The transformer stages run on tokens `[T, B, N, C]` that know where they sit on
the patch grid (`TokenGrid`); the depthwise and downsampling convs scatter them onto the grid and
read back their own rows. STATA's anchor has no grid position and the tokens a block prunes leave
holes: both read what the reference code reads outside the image (the BN-of-zero value that
RepConv pads with; zero spikes for the downsampling conv), so pruning a token is, to the convs,
moving it off the image. The attention is Spikformer's SSA algebra (binary Q, K, V, no softmax),
so STATA scores as in Spikformer: the anchor's row of Q K^T (and the mean-query column), computed
in the same pass as the attention by `efficient.kernels.ssa.spiking_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.kernels.ssa import spiking_attention
from efficient.models.sdt import SDTMLP
from efficient.models.spiking_transformer import (
    CIFAR_MEAN,
    check_stem_grid,
    CIFAR_STD,
    SpikingTransformer,
    SpikingTransformerConfig,
    _lif,
    share_neuron_backend,
)
from efficient.models.spikformer import DIGITS_MEAN, DIGITS_STD, IMAGENET_MEAN, IMAGENET_STD, STATA, STATA_PAPER
from efficient.models.stata import PruneStep, StataConfig, residual_block
from efficient.zoo import InputSpec, Variant, config_from_options, register_variants

PAPER = ("Spike-driven Transformer V2: Meta Spiking Neural Network Architecture Inspiring the Design of "
         "Next-generation Neuromorphic Chips (Yao et al., ICLR 2024)")


# ------------------------------------------------------------------------------ tokens on a grid


@dataclass(frozen=True)
class TokenGrid:
    """Where tokens `[T, B, n, C]` sit on the `h x w` patch grid: `prefix` leading tokens without a
    position (STATA's anchor), then the candidates, in raster order (`pos` None: all h*w of them) or
    at `pos` `[B, n - prefix]` (after pruning; -1 marks a token without a position, EViT's fused
    token, possible only when `holes`). Convs read cells nobody occupies as outside the image."""

    h: int
    w: int
    prefix: int = 0
    pos: torch.Tensor | None = None
    holes: bool = False

    def keep(self, idx: torch.Tensor, fused: bool) -> TokenGrid:
        """The grid after a pruning step kept candidates `idx` `[B, k]` (and appended a fused token)."""
        pos = idx if self.pos is None else self.pos.gather(1, idx)
        if fused:
            pos = torch.cat([pos, pos.new_full((pos.shape[0], 1), -1)], 1)
        return replace(self, pos=pos, holes=self.holes or fused)

    def _cells(self, T: int) -> torch.Tensor:
        """`[T*B, n]` cell of every candidate; a token without a position gets the spare cell h*w."""
        pos = torch.where(self.pos >= 0, self.pos, self.h * self.w) if self.holes else self.pos
        return pos.unsqueeze(0).expand(T, *pos.shape).flatten(0, 1)

    def to_map(self, x: torch.Tensor) -> torch.Tensor:
        """Candidates `[T, B, n, C]` -> `[T*B, C, h, w]`, cells nobody occupies zero."""
        T, B, n, C = x.shape
        if self.pos is None:
            return x.reshape(T * B, self.h, self.w, C).permute(0, 3, 1, 2)
        cells = self._cells(T)[..., None].expand(T * B, n, C)
        m = x.new_zeros(T * B, self.h * self.w + self.holes, C).scatter(1, cells, x.flatten(0, 1))
        return m[:, :self.h * self.w].reshape(T * B, self.h, self.w, C).permute(0, 3, 1, 2)

    def from_map(self, m: torch.Tensor, T: int) -> torch.Tensor:
        """`[T*B, C, h, w]` -> each candidate's own cell `[T, B, n, C]` (a token without a position: garbage)."""
        TB, C = m.shape[:2]
        rows = m.flatten(2).transpose(1, 2)
        if self.pos is not None:
            cells = self._cells(T).clamp_max(self.h * self.w - 1)
            rows = rows.gather(1, cells[..., None].expand(*cells.shape, C))
        return rows.reshape(T, TB // T, -1, C)

    def _off_grid(self, y: torch.Tensor, x: torch.Tensor, alone: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The candidates' outputs `y` with the tokens without a position, the prefix and any fused
        token, computed by `alone` from their inputs in `x` (all tokens)."""
        p = self.prefix
        if self.holes:
            y = torch.where((self.pos < 0)[None, :, :, None], alone(x[:, :, p:]), y)
        return torch.cat([alone(x[:, :, :p]), y], 2) if p else y

    def depthwise(self, u: torch.Tensor, weight: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """3x3 depthwise conv (`weight` `[C, 1, 3, 3]`, no bias) of `u` `[T, B, n, C]` over the grid,
        every empty cell and the border reading `fill` `[C]`. By linearity: the conv of (u - fill)
        with zero padding, plus fill * sum(weight); a token alone sees only its centre tap."""
        d = u - fill
        p = self.prefix
        y = self.from_map(F.conv2d(self.to_map(d[:, :, p:]), weight, padding=1, groups=weight.shape[0]), u.shape[0])
        if p or self.holes:
            y = self._off_grid(y, d, lambda t: t * weight[:, 0, 1, 1])
        return y + fill * weight.sum((1, 2, 3))

    def conv3x3(self, s: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
        """3x3 conv (stride 1, padding 1) of spikes `s` `[T, B, n, C_in]` over the grid, empty cells
        zero: `[T, B, n, C_out]`. After pruning only the occupied cells' outputs are computed."""
        T, B = s.shape[:2]
        p, w, b = self.prefix, conv.weight, conv.bias
        cand = s[:, :, p:]
        if self.pos is None:
            y = self.from_map(F.conv2d(self.to_map(cand), w, b, padding=1), T)
        else:  # im2col of the occupied cells only: the MACs scale with the tokens kept
            cols = F.unfold(self.to_map(cand), 3, padding=1)
            cells = self._cells(T).clamp_max(self.h * self.w - 1)
            cols = cols.gather(2, cells[:, None, :].expand(-1, cols.shape[1], -1))
            y = F.linear(cols.transpose(1, 2), w.flatten(1), b).reshape(T, B, cand.shape[2], -1)
        if p or self.holes:
            y = self._off_grid(y, s, lambda t: F.linear(t, w[:, :, 1, 1], b))
        return y


# ----------------------------------------------------------------------------------- conv stages


class SpikeDownsample(nn.Module):
    """[LIF] -> conv -> BN on `[T, B, C, H, W]` (the reference's `MS_DownSampling`; the first one,
    on pixels, has no neuron)."""

    recompute_unit = True  # efficient.memory: keeps its input, recomputes the rest in backward

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, lif_cfg: dict, first: bool = False) -> None:
        super().__init__()
        if not first:
            self.lif = _lif(lif_cfg)
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B = x.shape[:2]
        if hasattr(self, "lif"):
            x = self.lif(x)
        y = self.bn(self.conv(x.flatten(0, 1)))
        return y.reshape(T, B, *y.shape[1:])


class SepConv(nn.Module):
    """MobileNetV2's inverted separable conv, spiking: LIF -> 1x1 (x2) -> BN -> LIF -> 7x7 depthwise -> 1x1 -> BN."""

    def __init__(self, dim: int, lif_cfg: dict, expansion: int = 2, kernel: int = 7) -> None:
        super().__init__()
        med = expansion * dim
        self.lif1, self.pwconv1, self.bn1 = _lif(lif_cfg), nn.Conv2d(dim, med, 1, bias=False), nn.BatchNorm2d(med)
        self.lif2 = _lif(lif_cfg)
        self.dwconv = nn.Conv2d(med, med, kernel, padding=kernel // 2, groups=med, bias=False)
        self.pwconv2, self.bn2 = nn.Conv2d(med, dim, 1, bias=False), nn.BatchNorm2d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B, C, H, W = x.shape
        y = self.bn1(self.pwconv1(self.lif1(x).flatten(0, 1)))
        y = self.lif2(y.reshape(T, B, -1, H, W)).flatten(0, 1)
        return self.bn2(self.pwconv2(self.dwconv(y))).reshape(T, B, C, H, W)


class ConvBlock(nn.Module):
    """x += SepConv(x); x += BN(conv3x3(LIF(BN(conv3x3(LIF(x)))))), hidden width `mlp_ratio` x C."""

    recompute_unit = True  # efficient.memory: a block keeps only its input and reruns in backward

    def __init__(self, dim: int, mlp_ratio: float, lif_cfg: dict) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.sep = SepConv(dim, lif_cfg)
        self.lif1, self.conv1, self.bn1 = _lif(lif_cfg), nn.Conv2d(dim, hidden, 3, padding=1, bias=False), nn.BatchNorm2d(hidden)
        self.lif2, self.conv2, self.bn2 = _lif(lif_cfg), nn.Conv2d(hidden, dim, 3, padding=1, bias=False), nn.BatchNorm2d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.sep(x)
        T, B, C, H, W = x.shape
        y = self.bn1(self.conv1(self.lif1(x).flatten(0, 1)))
        y = self.bn2(self.conv2(self.lif2(y.reshape(T, B, -1, H, W)).flatten(0, 1)))
        return x + y.reshape(T, B, C, H, W)


class MetaStem(nn.Module):
    """The conv stages: downsample -> block (C0/2) -> downsample -> block (C0) -> downsample -> 2
    blocks (C1) -> downsample to C2, then tokens `[T, B, N, C2]`. Of the four downsamplings the first
    `pool_stages` have stride 2 (all four in the reference, 224 px -> 14 x 14 tokens); on small
    images the later ones keep the resolution, so the token grid is img_size / 2**pool_stages."""

    def __init__(self, img_size: int, in_chans: int, dim: int, pool_stages: int, mlp_ratio: float, lif_cfg: dict) -> None:
        super().__init__()
        stride = check_stem_grid(img_size, dim, pool_stages, "Meta-SpikeFormer conv stages")
        widths = [dim // 8, dim // 4, dim // 2, dim]
        strides = [2 if i < pool_stages else 1 for i in range(4)]
        self.img_size, self.in_chans, self.grid = img_size, in_chans, img_size // stride
        ins = [in_chans, *widths[:3]]
        self.down = nn.ModuleList(SpikeDownsample(ins[i], widths[i], 7 if i == 0 else 3, strides[i], lif_cfg, first=i == 0)
                                  for i in range(4))
        self.blocks = nn.ModuleList(ConvBlock(c, mlp_ratio, lif_cfg) for c in widths[:2] + [widths[2]] * 2)
        self._peak = self._neuron_peak(widths, strides, mlp_ratio)

    def _neuron_peak(self, widths: list[int], strides: list[int], mlp_ratio: float) -> int:
        res, peak = self.img_size, 0
        for i in range(3):
            peak = max(peak, widths[i] * res**2)  # the next downsampling's neuron
            res //= strides[i]
            peak = max(peak, int(max(mlp_ratio, 2) * widths[i] * res**2))  # a conv block's widest neuron
        return max(peak, widths[2] * res**2)

    def neuron_peak(self) -> int:
        """Elements per timestep and sample of the largest neuron input of the conv stages."""
        return self._peak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, B, C, H, W]` -> real-valued tokens `[T, B, N, C2]`."""
        d, b = self.down, self.blocks
        x = b[1](d[1](b[0](d[0](x))))
        x = d[3](b[3](b[2](d[2](x))))
        return x.flatten(3).transpose(2, 3)


# ------------------------------------------------------------------------------ transformer stages


class RepConvBN(nn.Module):
    """The reference's `RepConv` + BatchNorm on grid tokens: 1x1 conv -> BN -> 3x3 depthwise -> 1x1
    conv -> BN -> BN. The depthwise conv's border, and any empty cell, reads what the BN gives a
    zero input under its running statistics, read after this step's update (the reference's
    `BNAndPadLayer`), without gradient. A block recomputed in backward (`efficient.memory`) reruns
    from the buffers its forward started with, so it pads with the same value."""

    # efficient.memory: its output reads bn1's running statistics after this step's update, which a compiled
    # checkpoint's rerun would read updated once more, so a compiled step does not rerun a unit holding it
    reads_updated_buffers = True

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Linear(dim, dim, bias=False), nn.BatchNorm1d(dim)
        self.dw = nn.Conv2d(dim, dim, 3, groups=dim, bias=False)
        self.conv2, self.bn2 = nn.Linear(dim, dim, bias=False), nn.BatchNorm1d(dim)
        self.bn = nn.BatchNorm1d(dim)

    def pad_value(self, pre: torch.Tensor | None = None) -> torch.Tensor:
        """`[C]`: what `bn1` gives a zero input, no gradient. Without running statistics (a BN
        built with `track_running_stats=False`) it normalizes with those of its input `pre` `[M, C]`."""
        bn = self.bn1
        if bn.track_running_stats:
            mean, var = bn.running_mean, bn.running_var
        elif pre is not None:
            pre = pre.detach()
            mean, var = pre.mean(0), pre.var(0, correction=0)
        else:
            raise ValueError("pad_value needs the BN input `pre` when the BN keeps no running statistics")
        return (bn.bias - mean * bn.weight / torch.sqrt(var + bn.eps)).detach()

    def forward(self, x: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        T, B, n, C = x.shape
        pre = self.conv1(x.flatten(0, 2))
        u = self.bn1(pre).reshape(T, B, n, C)
        d = grid.depthwise(u, self.dw.weight, self.pad_value(pre))
        return self.bn(self.bn2(self.conv2(d.flatten(0, 2)))).reshape(T, B, n, -1)


class MetaSDSA(nn.Module):
    """Spike-driven self-attention with RepConv projections, on LIF(x): binary Q, K, V; LIF_0.5 of
    scale * Q K^T V (computed as Q (K^T V) when that is cheaper: identical for spikes); then
    RepConv + BN. Returns STATA's scores from the same pass when asked."""

    # efficient.memory: a residual half of its block (the block adds its output to the stream), so the
    # gradient of its output lives through its rerun anyway: it runs as a light region at any size
    recompute_residual = True

    def __init__(self, dim: int, heads: int, lif_cfg: dict, kernel_backend: str = "auto", scale: float = 0.125) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"width {dim} is not divisible by num_heads {heads}")
        self.heads, self.scale, self.kernel_backend = heads, scale, kernel_backend
        self.pre_lif = _lif(lif_cfg)
        self.q, self.k, self.v = RepConvBN(dim), RepConvBN(dim), RepConvBN(dim)
        self.q_lif, self.k_lif, self.v_lif = _lif(lif_cfg), _lif(lif_cfg), _lif(lif_cfg)
        self.attn_lif = _lif(lif_cfg, v_threshold=0.5)
        self.proj = RepConvBN(dim)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        T, B, N, C = x.shape
        return x.reshape(T, B, N, self.heads, C // self.heads).transpose(2, 3)  # [T, B, H, N, d]

    def forward(self, x: torch.Tensor, grid: TokenGrid, anchor: bool = False, scores: bool = False):
        s = self.pre_lif(x)
        q = self.split_heads(self.q_lif(self.q(s, grid)))
        k = self.split_heads(self.k_lif(self.k(s, grid)))
        v = self.split_heads(self.v_lif(self.v(s, grid)))
        y, sc, c = spiking_attention(q, k, v, self.scale, anchor=anchor, scores=scores, backend=self.kernel_backend)
        T, B, H, n, d = y.shape
        return self.proj(self.attn_lif(y.transpose(2, 3).reshape(T, B, n, H * d)), grid), sc, c


class GridDownsample(nn.Module):
    """LIF -> 3x3 conv (stride 1, bias) -> BN between the transformer stages, on grid tokens."""

    def __init__(self, c_in: int, c_out: int, lif_cfg: dict) -> None:
        super().__init__()
        self.lif = _lif(lif_cfg)
        self.conv = nn.Conv2d(c_in, c_out, 3, 1, 1)
        self.bn = nn.BatchNorm1d(c_out)

    def forward(self, x: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        y = grid.conv3x3(self.lif(x), self.conv)
        T, B, n, C = y.shape
        return self.bn(y.flatten(0, 2)).reshape(T, B, n, C)


class MetaBlock(nn.Module):
    """[downsample, opening the last stage]; x += SDSA(x); [prune]; x += MLP(x). `grid` says where
    the tokens sit; `step` (a `PruneStep` or None) prunes after the attention or after the block."""

    # efficient.memory: recomputed in backward as its parts (the downsample where there is one, the attention,
    # the MLP), each keeping only its input, so backward holds one part's rerun at a time
    recompute_unit = True

    def __init__(self, dim: int, heads: int, mlp_ratio: float, lif_cfg: dict, kernel_backend: str = "auto",
                 in_dim: int | None = None) -> None:
        super().__init__()
        if in_dim is not None:
            self.down = GridDownsample(in_dim, dim, lif_cfg)
        self.attn = MetaSDSA(dim, heads, lif_cfg, kernel_backend)
        self.mlp = SDTMLP(dim, int(dim * mlp_ratio), lif_cfg)

    def recompute_parts(self) -> list[tuple[str, nn.Module]]:
        if type(self).forward is not MetaBlock.forward:
            return []
        return [*([("down", self.down)] if hasattr(self, "down") else []), ("attn", self.attn), ("mlp", self.mlp)]

    def forward(self, x: torch.Tensor, step: PruneStep | None = None, anchor: bool = False,
                grid: TokenGrid | None = None) -> torch.Tensor:
        if grid is None:
            raise ValueError("MetaBlock needs the token grid (grid=TokenGrid(...)); run it through MetaSpikeFormer")
        if hasattr(self, "down"):
            x = self.down(x, grid)
        a, s, c = self.attn(x, grid, anchor=anchor, scores=step is not None)
        return residual_block(x, a, s, c, self.mlp, step)


# ------------------------------------------------------------------------------------------ model


@dataclass
class MetaSpikeFormerConfig(SpikingTransformerConfig):
    """Meta-SpikeFormer's options (defaults: the 55 M ImageNet model). `embed_dim` is the first
    transformer stage's width C2 (the conv stages are C2/8 .. C2/2 wide), `last_dim` the last
    stage's C3; `depth` transformer blocks of which the last `last_depth` run at C3 (the reference:
    6 + 2). `pool_stages`: stride-2 downsamplings among the conv stages' four (see `MetaStem`).
    `distill_head`: the reference's second (distillation) head; logits are the mean of both."""

    img_size: int = 224
    num_classes: int = 1000
    embed_dim: int = 512
    last_dim: int = 640
    depth: int = 8
    last_depth: int = 2
    num_heads: int = 8
    pool_stages: int = 4
    distill_head: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.last_depth <= self.depth:
            raise ConfigError(f"last_depth must be in 0..depth={self.depth} (got {self.last_depth})")


class MetaSpikeFormer(SpikingTransformer):
    """Meta-SpikeFormer classifier with STATA (see `TokenPruner`). Input `[B, C, H, W]` (repeated
    over T) or `[T, B, C, H, W]`; built from a `MetaSpikeFormerConfig` or its flat options."""

    def __init__(self, config: MetaSpikeFormerConfig | None = None, **options: Any) -> None:
        cfg = config_from_options(MetaSpikeFormerConfig, options, config)
        super().__init__(cfg)
        del self._next_block
        tokens = self.patch_embed.grid**2 + 1
        share_neuron_backend(self, max(self.patch_embed.neuron_peak(),
                                       int(max(cfg.embed_dim, self.out_dim) * cfg.mlp_ratio) * tokens))

    def build_stem(self, cfg: MetaSpikeFormerConfig, lif_cfg: dict) -> MetaStem:
        self._next_block = 0
        self.out_dim = cfg.last_dim if cfg.last_depth else cfg.embed_dim
        return MetaStem(cfg.img_size, cfg.in_chans, cfg.embed_dim, cfg.pool_stages, cfg.mlp_ratio, lif_cfg)

    def build_block(self, cfg: MetaSpikeFormerConfig, lif_cfg: dict) -> MetaBlock:
        i, first_last = self._next_block, cfg.depth - cfg.last_depth
        self._next_block += 1
        dim = cfg.embed_dim if i < first_last else cfg.last_dim
        return MetaBlock(dim, cfg.num_heads, cfg.mlp_ratio, lif_cfg, self.kernel_backend,
                         in_dim=cfg.embed_dim if i == first_last else None)

    def build_head(self, cfg: MetaSpikeFormerConfig, lif_cfg: dict) -> None:
        self.head_lif = _lif(lif_cfg)
        self.head = nn.Linear(self.out_dim, cfg.num_classes)
        if cfg.distill_head:
            self.head_kd = nn.Linear(self.out_dim, cfg.num_classes)

    def pool_head(self, patches: torch.Tensor) -> torch.Tensor:
        """Mean over tokens -> LIF -> Linear at every timestep -> mean over time (averaged with the distillation head)."""
        s = self.head_lif(patches.mean(2))
        y = self.head(s).mean(0)
        if hasattr(self, "head_kd"):
            y = (y + self.head_kd(s).mean(0)) / 2
        return y

    def forward_blocks(self, x: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """The transformer stages, pruning where the schedule says; each block is told where its
        tokens sit, and a pruning step moves the grid to the kept tokens."""
        st = self.stata
        steps = st.begin()
        p = st.n_prefix
        grid = TokenGrid(self.patch_embed.grid, self.patch_embed.grid, p)
        for i, blk in enumerate(self.blocks):
            st.enter_block(x)
            step = steps.get(i)
            kept = st.last.stats.get("kept_idx", [])
            before = len(kept)
            x = blk(x, step, anchor=p == 1, grid=grid)
            kept = st.last.stats.get("kept_idx", [])
            if len(kept) > before:  # this block pruned: its kept set is the last one recorded
                grid = grid.keep(kept[before], st.cfg.fuse_pruned)
        st.end(x.shape[2])
        return x


# ---------------------------------------------------------------------------------- variants

IMAGENET = InputSpec((3, 224, 224), timesteps=4, mean=IMAGENET_MEAN, std=IMAGENET_STD, num_classes=1000)
CIFAR10 = InputSpec((3, 32, 32), timesteps=4, mean=CIFAR_MEAN, std=CIFAR_STD, num_classes=10)
DVS128 = InputSpec((2, 128, 128), timesteps=16, num_classes=11)
DIGITS = InputSpec((1, 16, 16), timesteps=4, mean=DIGITS_MEAN, std=DIGITS_STD, num_classes=10)


def imagenet(dim: int, last: int) -> MetaSpikeFormerConfig:
    """The reference's `metaspikformer_8_<dim>`: 224 px, conv stages to 14 x 14 tokens, 6 + 2 blocks, 8 heads."""
    return MetaSpikeFormerConfig(embed_dim=dim, last_dim=last)


# the 15.1 M model's widths (the reference repositories' `*_8_15M` / 64-128-256-360 configs) at CIFAR
# and DVS scale: two (CIFAR, 32 px) or four (DVS, 128 px) strided downsamplings -> 8 x 8 tokens
CIFAR = MetaSpikeFormerConfig(embed_dim=256, last_dim=360, img_size=32, pool_stages=2, num_classes=10)
DVS = MetaSpikeFormerConfig(embed_dim=256, last_dim=360, img_size=128, in_chans=2, pool_stages=4, num_classes=11,
                            timesteps=16)
TINY = MetaSpikeFormerConfig(embed_dim=64, last_dim=80, depth=2, last_depth=1, num_heads=4, img_size=16, in_chans=1,
                             pool_stages=1, num_classes=10)

VARIANTS: dict[str, Variant] = {
    "sdt-v2-8-256": Variant(IMAGENET, PAPER, "ImageNet, 15.1M: conv stages 32-64-128, 6+2 SDSA blocks at "
                                      "256/360, 8 heads, 224px, T=4", imagenet(256, 360)),
    "sdt-v2-8-384": Variant(IMAGENET, PAPER, "ImageNet, 31.3M: conv stages 48-96-192, 6+2 SDSA blocks at "
                                      "384/480, 8 heads, 224px, T=4", imagenet(384, 480)),
    "sdt-v2-8-512": Variant(IMAGENET, PAPER, "ImageNet, 55.4M: conv stages 64-128-256, 6+2 SDSA blocks at "
                                      "512/640, 8 heads, 224px, T=4", imagenet(512, 640)),
    "sdt-v2-cifar": Variant(CIFAR10, PAPER, "CIFAR-10 (not in the paper): the 15.1M widths, 32px, 8x8 tokens, "
                                      "T=4", CIFAR),
    "sdt-v2-stata": Variant(
        CIFAR10, STATA_PAPER, "sdt-v2-cifar + STATA: anchor per timestep, prune blocks 4,6,8 at rho=0.7 "
        "(65->46->33->24 tokens)", replace(CIFAR, stata=replace(STATA, prune_blocks=[4, 6, 8]))),
    "sdt-v2-dvs": Variant(DVS128, PAPER, "DVS128 Gesture (not in the paper): the 15.1M widths, 128px event "
                                    "frames, 8x8 tokens, T=16", DVS),
    "sdt-v2-tiny": Variant(DIGITS, PAPER, "digits-sized: conv stages 8-16-32, 1+1 SDSA blocks at 64/80, 4 heads, "
                                     "16px grayscale, 8x8 tokens, T=4", TINY),
    "sdt-v2-tiny-stata": Variant(
        DIGITS, STATA_PAPER, "sdt-v2-tiny + STATA: anchor per timestep, prune blocks 1,2 at rho=0.5 "
        "(65->33->17 tokens)", replace(TINY, stata=StataConfig(anchor="per_timestep", prune_blocks=[1, 2], keep_ratio=0.5))),
}

register_variants(MetaSpikeFormer, VARIANTS, family="sdt-v2")
