"""Spike-driven Transformer (Yao et al., NeurIPS 2023) with STATA token sparsification.

Differences from Spikformer that matter here (reference: BICLab/Spike-Driven-Transformer):
* membrane shortcut: the residual stream is real-valued and every branch starts with a LIF on it
  (x + f(LIF(x))), so the neuron sits after the residual add, not before it;
* spike-driven self-attention (SDSA): y = Q * LIF_0.5(sum_N K * V), masks and sums only, no N x N
  map; the projection is Linear + BN with no LIF (the next branch's LIF fires on the sum);
* the stem pools before its last LIF and adds the pre-spike features back (real-valued tokens);
* head: mean over tokens -> LIF -> Linear per timestep -> mean over time.

It shares the encoder loop, options and `TokenPruner` with Spikformer (`spiking_transformer.py`).
STATA scores: SDSA never forms Q K^T, so each pruning block computes them explicitly from its
binary Q and K (anchor row s_t(i) = <q_anchor, k_i>, mean-query column c_t), O(N D) per timestep.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from efficient.errors import ConfigError
from efficient.kernels.ssa import scores_ref
from efficient.memory.conv_backward import plain_conv, region_conv2d
from efficient.memory.region_linear import region_linear
from efficient.memory.spikes import is_neuron
from efficient.models.neurons import fusable, norm_fire, norm_pooled
from efficient.models.spiking_transformer import CIFAR_MEAN, CIFAR_STD, SpikingTransformer, SpikingTransformerConfig, _lif
from efficient.models.spikformer import SPS, STATA, STATA_PAPER, LinearBNLIF
from efficient.models.stata import PruneStep, residual_block
from efficient.zoo import InputSpec, Variant, config_from_options, register_variants

PAPER = "Spike-driven Transformer (Yao et al., NeurIPS 2023)"


class MSSPSTail(nn.Module):
    """The last stage of the MS-SPS stem and its position embedding: conv-BN(-pool) to real-valued
    features, spiked for the embedding's conv-BN and added back to it. Like `StemStage`, it owns
    nothing and calls the stem's modules, so at memory level `recompute` it is a unit of its own."""

    recompute_unit = True

    def __init__(self, stem: MSSPS) -> None:
        super().__init__()
        object.__setattr__(self, "_stem", stem)  # a back reference, not a child

    def recompute_modules(self) -> list[nn.Module]:
        """The modules the tail calls (efficient.memory, as `StemStage.recompute_modules`)."""
        st = self._stem
        return [st.convs[3], st.bns[3], st.pools[3], st.lifs[3], st.rpe_conv, st.rpe_bn]

    def recompute_spike_input(self) -> bool:
        """Whether the tail's input is the stage before's spikes (efficient.memory keeps it as bits)."""
        return is_neuron(self._stem.lifs[2])

    def recompute_input_from_bits(self) -> bool:
        """As the stable-SNN conv unit's (efficient.memory): spikes in, read only through a plain convolution."""
        return self.recompute_spike_input() and plain_conv(self._stem.convs[3])

    def forward(self, x: torch.Tensor, T: int, spike_bits: torch.Tensor | None = None) -> torch.Tensor:
        """`spike_bits`: x's bits, which a compiled recomputed region keeps (efficient.memory)."""
        st = self._stem
        conv_in = region_conv2d(st.convs[3], x, spikes=self.recompute_spike_input(), bits=spike_bits)
        # real-valued; in a recomputed region by chunks of channels, keeping neither BatchNorm's output nor int64 indices
        feat = norm_pooled(st.bns[3], st.pools[3], conv_in, donate=plain_conv(st.convs[3]))
        s = st.lifs[3](feat.reshape(T, -1, *feat.shape[1:])).flatten(0, 1)
        return st.rpe_bn(region_conv2d(st.rpe_conv, s, spikes=is_neuron(st.lifs[3]))) + feat


class MSSPS(SPS):
    """Stem: SPS's conv-BN-LIF x3 (+ max-pools on the last `pool_stages` stages), then conv-BN(-pool)
    whose real-valued output is both spiked for the conv position embedding and added back to it."""

    def __init__(self, img_size: int, in_chans: int, dim: int, pool_stages: int, lif_cfg: dict) -> None:
        super().__init__(img_size, in_chans, dim, pool_stages, lif_cfg, rpe_lif=False)
        # recomputed stage by stage (efficient.memory): SPS's first three stages, then the tail
        object.__setattr__(self, "_stages", [*self._stages[:3], MSSPSTail(self)])
        self._group(3)

    def recompute_parts(self) -> list[tuple[str, nn.Module]]:
        if type(self).forward is not MSSPS.forward:
            return []
        return [*((self._part_name(p), p) for p in self._parts), ("tail", self._stages[3])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B = x.shape[:2]
        for part in self._parts:  # the first three stages (the first flattens the images itself)
            x = part(x, T)
        x = self._stages[3](x, T)
        return x.flatten(2).transpose(1, 2).reshape(T, B, -1, x.shape[1])


class LinearBN(nn.Module):
    """Linear -> BatchNorm over channels on `[T, B, N, C]` (a 1x1 conv + BN in the reference)."""

    recompute_unit = True  # efficient.memory: keeps its input, recomputes the rest in backward

    def __init__(self, d_in: int, d_out: int, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=bias)
        self.bn = nn.BatchNorm1d(d_out)

    def forward(self, x: torch.Tensor, spikes: bool = False) -> torch.Tensor:
        """`spikes`: x is a neuron's spikes, which a recomputed region's rerun keeps as bits (`region_linear`;
        a region may also keep the Linear's output for its rerun)."""
        T, B, N, _ = x.shape
        return self.bn(region_linear(self.linear, x.flatten(0, 2), spikes=spikes)).reshape(T, B, N, -1)


class SDSA(nn.Module):
    """Spike-driven self-attention on LIF(x): Q * LIF_0.5(sum over tokens of K * V), then Linear + BN."""

    # efficient.memory: a residual half of its block (the block adds its output to the stream), so the
    # gradient of its output lives through its rerun anyway: it runs as a light region at any size
    recompute_residual = True

    def __init__(self, dim: int, heads: int, lif_cfg: dict, reference_params: bool = False) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"embed_dim {dim} is not divisible by num_heads {heads}")
        self.shortcut_lif = _lif(lif_cfg)
        self.q = LinearBNLIF(dim, dim, lif_cfg, bias=False)
        self.k = LinearBNLIF(dim, dim, lif_cfg, bias=False)
        self.v = LinearBNLIF(dim, dim, lif_cfg, bias=False)
        self.kv_lif = _lif(lif_cfg, v_threshold=0.5)
        self.proj = LinearBN(dim, dim)
        if reference_params:  # built but never called by the reference forward; counted in its params
            self.talking_heads = nn.Conv1d(heads, heads, 1, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor, anchor: bool = False, scores: bool = False):
        x = self.shortcut_lif(x)
        q, k, v = self.q(x), self.k(x), self.v(x)
        # q and the gate are spikes, so is their product
        y = self.proj(q * self.kv_lif((k * v).sum(2, keepdim=True)), spikes=is_neuron(self.q.lif) and is_neuron(self.kv_lif))
        if not scores:
            return y, None, None
        s, c = scores_ref(q.unsqueeze(2), k.unsqueeze(2), anchor)  # one "head" = the full dot product
        return y, s, c


class SDTMLP(nn.Module):
    """LIF -> Linear + BN -> LIF -> Linear + BN on tokens `[T, B, N, C]` (the membrane shortcut's order)."""

    # efficient.memory: a residual half of its block (the block adds its output to the stream), so the
    # gradient of its output lives through its rerun anyway: it runs as a light region at any size
    recompute_residual = True

    def __init__(self, dim: int, hidden: int, lif_cfg: dict) -> None:
        super().__init__()
        self.lif1, self.fc1 = _lif(lif_cfg), LinearBN(dim, hidden)
        self.lif2, self.fc2 = _lif(lif_cfg), LinearBN(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.hidden(self.lif1(x)), spikes=is_neuron(self.lif2))

    def hidden(self, s: torch.Tensor) -> torch.Tensor:
        """lif2(fc1(s)): fc1's Linear -> BatchNorm and lif2 are a Linear -> BatchNorm -> LIF unit
        (`LinearBNLIF`'s) split across the membrane shortcut's module order, so they run as one fused
        op where `norm_fire` allows it. Not when fc1 or lif2 is watched or wrapped on its own (a hook
        or a recompute wrap on fc1 must see fc1 called)."""
        fc1, lif2 = self.fc1, self.lif2
        own = "forward" not in vars(fc1) and "forward" not in vars(lif2) and type(fc1).forward is LinearBN.forward
        if not (own and fusable(lif2, fc1)):
            return lif2(fc1(s))
        T, B, N, _ = s.shape
        return norm_fire(fc1.bn, lif2, s.flatten(0, 2), (T, B, N, fc1.bn.num_features), linear=fc1.linear)


class SDTBlock(nn.Module):
    """x += SDSA(LIF(x)); [prune]; x += MLP(LIF(x)) -- the pruning interface of `spikformer.Block`."""

    # efficient.memory: a block is recomputed in backward as two units, its attention and its MLP, each
    # keeping only its input (the real-valued residual stream), so backward holds one half's rerun at a time
    recompute_unit = True

    def __init__(self, dim: int, heads: int, mlp_ratio: float, lif_cfg: dict, reference_params: bool = False) -> None:
        super().__init__()
        self.attn = SDSA(dim, heads, lif_cfg, reference_params)
        self.mlp = SDTMLP(dim, int(dim * mlp_ratio), lif_cfg)

    def recompute_parts(self) -> list[tuple[str, nn.Module]]:
        return [("attn", self.attn), ("mlp", self.mlp)] if type(self).forward is SDTBlock.forward else []

    def forward(self, x: torch.Tensor, step: PruneStep | None = None, anchor: bool = False) -> torch.Tensor:
        a, s, c = self.attn(x, anchor=anchor, scores=step is not None)
        return residual_block(x, a, s, c, self.mlp, step)


@dataclass
class SDTConfig(SpikingTransformerConfig):
    """The Spike-driven Transformer's options: the shared ones (CIFAR-sized defaults) and
    `reference_params` (the reference code's unused talking-heads convs, counted in its sizes)."""

    embed_dim: int = 512
    depth: int = 2
    num_heads: int = 8
    reference_params: bool = False


class SpikeDrivenTransformer(SpikingTransformer):
    """SDT classifier with STATA (see `TokenPruner`). Input `[B, C, H, W]` (repeated over T) or
    `[T, B, C, H, W]`; built from an `SDTConfig` or its flat options."""

    def __init__(self, config: SDTConfig | None = None, **options: Any) -> None:
        super().__init__(config_from_options(SDTConfig, options, config))

    def build_stem(self, cfg: SDTConfig, lif_cfg: dict) -> MSSPS:
        return MSSPS(cfg.img_size, cfg.in_chans, cfg.embed_dim, cfg.pool_stages, lif_cfg)

    def build_block(self, cfg: SDTConfig, lif_cfg: dict) -> SDTBlock:
        return SDTBlock(cfg.embed_dim, cfg.num_heads, cfg.mlp_ratio, lif_cfg, cfg.reference_params)

    def build_head(self, cfg: SDTConfig, lif_cfg: dict) -> None:
        self.head_lif = _lif(lif_cfg)
        self.head = nn.Linear(cfg.embed_dim, cfg.num_classes)

    def pool_head(self, patches: torch.Tensor) -> torch.Tensor:
        """Mean over tokens -> LIF -> Linear at every timestep -> mean over time."""
        return self.head(self.head_lif(patches.mean(2))).mean(0)


CIFAR10 = InputSpec((3, 32, 32), timesteps=4, mean=CIFAR_MEAN, std=CIFAR_STD, num_classes=10)
DVS128 = InputSpec((2, 128, 128), timesteps=16, num_classes=11)
SDT_DVS = SDTConfig(embed_dim=256, depth=2, num_heads=16, img_size=128, in_chans=2, pool_stages=4, num_classes=11, timesteps=16)
SDT_CIFAR = SDTConfig(embed_dim=512, depth=2, num_heads=8, img_size=32, pool_stages=2, num_classes=10, reference_params=True)

VARIANTS: dict[str, Variant] = {
    "sdt-2-512": Variant(CIFAR10, PAPER, "CIFAR-10 config: 2 blocks, D=512, 8 heads, T=4, membrane shortcut, SDSA", SDT_CIFAR),
    "sdt-stata": Variant(
        CIFAR10, STATA_PAPER, "sdt-2-512 + STATA: anchor per timestep, prune blocks 1,2 at rho=0.7 (65->46->33 tokens)",
        replace(SDT_CIFAR, stata=replace(STATA, prune_blocks=[1, 2]))),
    "sdt-2-256-dvs": Variant(DVS128, PAPER, "DVS128 Gesture / CIFAR10-DVS config: 2 blocks, D=256, 16 heads, "
                             "128px event frames (2 polarities), T=16", SDT_DVS),
    "sdt-2-256-dvs-stata": Variant(
        DVS128, STATA_PAPER, "sdt-2-256-dvs + STATA: anchor per timestep, prune blocks 1,2 at rho=0.7 (65->46->33 tokens)",
        replace(SDT_DVS, stata=replace(STATA, prune_blocks=[1, 2]))),
}

register_variants(SpikeDrivenTransformer, VARIANTS, family="sdt")
