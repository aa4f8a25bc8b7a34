"""Spikformer (Zhou et al., ICLR 2023) with STATA token sparsification (Zhuge et al., ICML 2024).

Spikformer: SPS conv stem -> blocks of spiking self-attention (binary Q, K, V, no softmax) and a
spiking MLP on an integer-valued residual stream -> mean over tokens, then time -> linear head.
Tensors are time-major `[T, B, N, C]` (tokens last-but-one, as in the CIFAR reference code).

STATA (anchor, keep-ratio schedule, scoring, selection, fusion) is the model's `TokenPruner`
(`efficient.models.stata`); the encoder loop and the options shared with the Spike-driven
Transformer are in `efficient.models.spiking_transformer`. Variants are data: `VARIANTS` below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.kernels.lif import COMPILE_MIN_NUMEL
from efficient.kernels.ssa import attention_ref, spiking_attention, spiking_attention_unit
from efficient.kernels.ssa import resolve_backend as ssa_backend
from efficient.kernels.token_select import gather_tokens
from efficient.memory.conv_backward import plain_conv, region_conv2d
from efficient.memory.spikes import is_neuron, region_max_pool
from efficient.models.neurons import _one_call_allowed, bn_fire, fusable, norm_fire, norm_pooled, pooled_fire
from efficient.models.replay import replays_whole
from efficient.models.spiking_transformer import (  # noqa: F401 - ModelLIF, share_neuron_backend: public here too
    CIFAR_MEAN,
    check_stem_grid,
    CIFAR_STD,
    ModelLIF,
    SpikingTransformer,
    SpikingTransformerConfig,
    _lif,
    share_neuron_backend,
)
from efficient.models.stata import (  # noqa: F401 - the STATA names Spikformer users import from here
    Anchor,
    PruneStep,
    PrunePoint,
    Score,
    StataConfig,
    after_attention,
    anchor_scores,
    kept_count,
    residual_block,
    warmup_keep_ratio,
)
from efficient.zoo import InputSpec, Variant, config_from_options, register_variants

PAPER = "Spikformer: When Spiking Neural Network Meets Transformer (Zhou et al., ICLR 2023)"
STATA_PAPER = "Towards Efficient Spiking Transformer: a Token Sparsification Framework (Zhuge et al., ICML 2024)"
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DIGITS_MEAN, DIGITS_STD = (0.3,), (0.38,)


class LinearBNLIF(nn.Module):
    """Linear -> BatchNorm over channels -> LIF, on `[T, B, N, C]` (the Spikformer 'x_linear/x_bn/x_lif' unit)."""

    recompute_unit = True  # efficient.memory: keeps its input, recomputes the rest in backward

    def __init__(self, d_in: int, d_out: int, lif_cfg: dict, v_threshold: float = 1.0, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=bias)
        self.bn = nn.BatchNorm1d(d_out)
        self.lif = _lif(lif_cfg, v_threshold=v_threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B, N, _ = x.shape
        return norm_fire(self.bn, self.lif, x.flatten(0, 2), (T, B, N, self.bn.num_features), linear=self.linear)


class StemStage(nn.Module):
    """Stage `i` of an SPS stem, conv -> BatchNorm -> LIF (-> max-pool) on `[T*B, C, H, W]` (i = 4:
    the position embedding's conv -> BatchNorm -> LIF). It owns nothing and is not the stem's child:
    it calls the stem's modules as they are at call time (a BatchNorm folded away stays folded), so
    the stem's state dict is unchanged. At memory level `recompute` each stage is a unit of its own:
    backward holds one stage's rerun at a time rather than the whole stem's (the stem was 35 % of a
    `none` step's activations on Spikformer-4-384 at CIFAR size)."""

    recompute_unit = True

    def __init__(self, stem: SPS, i: int) -> None:
        super().__init__()
        object.__setattr__(self, "_stem", stem)  # a back reference, not a child
        self.i = i

    def modules_now(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module | None, bool]:
        st, i = self._stem, self.i
        if i < 4:
            return st.convs[i], st.bns[i], st.lifs[i], st.pools[i], st.pool_first
        return st.rpe_conv, st.rpe_bn, st.rpe_lif, None, False

    def recompute_modules(self) -> list[nn.Module]:
        """The modules the stage calls (efficient.memory: whose buffers a rerun must see as the
        forward saw them, and which a compiled step knows to be inside a recomputed region)."""
        return [m for m in self.modules_now()[:4] if m is not None]

    def recompute_spike_input(self) -> bool:
        """Whether the stage's input is the stage before's spikes (efficient.memory keeps it as bits)."""
        return self.i > 0 and is_neuron(self._stem.lifs[self.i - 1])

    def recompute_input_from_bits(self) -> bool:
        """As the stable-SNN conv unit's (efficient.memory): spikes in, read only through a plain convolution."""
        return self.recompute_spike_input() and plain_conv(self.modules_now()[0])

    def forward(self, x: torch.Tensor, T: int, spike_bits: torch.Tensor | None = None,
                unread: bool = False) -> torch.Tensor:
        """`spike_bits`: x's bits, which a compiled recomputed region keeps (efficient.memory). The first
        stage takes the images `[T, B, C, H, W]` and flattens them itself: a region then keeps a static
        image repeated over T (an expanded view) at the size of one copy, not T. `unread`: the caller's
        rerun reads nothing of the output (the last stage of a `StemStages` rerun)."""
        if x.dim() == 5:
            x = x.flatten(0, 1)
        conv, bn, lif, pool, pool_first = self.modules_now()
        x = region_conv2d(conv, x, spikes=self.recompute_spike_input(), bits=spike_bits)
        if pool_first:  # BatchNorm's output pooled (real values), by chunks of channels in a recomputed region
            x = norm_pooled(bn, pool, x, donate=plain_conv(conv))
            return lif(x.reshape(T, -1, *x.shape[1:])).flatten(0, 1)
        # a plain convolution's output is fresh and read by nothing else: its gradient may take its storage
        # inside a recomputed region the stage's spikes never exist whole; in its rerun, which serves only
        # its backward, nothing reads them (`replays_whole`), and they are not made at all
        unread = not torch.compiler.is_compiling() and (unread or replays_whole(self))
        if pool is not None and (pooled := pooled_fire(bn, lif, pool, x, T, donate=plain_conv(conv),
                                                       spikes=not unread)) is not None:
            return pooled
        x = norm_fire(bn, lif, x, (T, x.shape[0] // T, *x.shape[1:])).flatten(0, 1)
        return x if pool is None else region_max_pool(pool, x)


class StemStages(nn.Module):
    """Consecutive stages of an SPS stem recomputed as one unit (efficient.memory): small early stages
    whose reruns together hold no more than the stem's largest stage does alone, so the step's peak
    is unchanged and only the first stage's input is kept (the others' spike bits are not). Owns
    nothing, like `StemStage`."""

    recompute_unit = True

    def __init__(self, stages: list[StemStage]) -> None:
        super().__init__()
        object.__setattr__(self, "_members", stages)  # not children: the stem owns the modules

    def recompute_modules(self) -> list[nn.Module]:
        return [m for st in self._members for m in st.recompute_modules()]

    def recompute_spike_input(self) -> bool:
        return self._members[0].recompute_spike_input()

    def recompute_input_from_bits(self) -> bool:
        return self._members[0].recompute_input_from_bits()

    def forward(self, x: torch.Tensor, T: int, spike_bits: torch.Tensor | None = None) -> torch.Tensor:
        # its rerun: the last stage's output is unread (no replay state is read while tracing)
        unread = not torch.compiler.is_compiling() and replays_whole(self)
        last = len(self._members) - 1
        for i, st in enumerate(self._members):
            x = st(x, T, spike_bits if i == 0 else None, unread=unread and i == last)
        return x


def group_stages(stages: list[nn.Module], sizes: list[int], peak: int) -> list[nn.Module]:
    """The recompute units for consecutive stem stages: each stage alone, except that a run of stages
    whose rerun sizes (`sizes`, elements per sample and step) sum to at most `peak` (the largest
    stage's, the position embedding's included) becomes one `StemStages`."""
    groups: list[list[nn.Module]] = []
    total = 0
    for st, n in zip(stages, sizes):
        if groups and total + n <= peak:
            groups[-1].append(st)
            total += n
        else:
            groups.append([st])
            total = n
    return [g[0] if len(g) == 1 else StemStages(g) for g in groups]


class SPS(nn.Module):
    """Spiking patch splitting: 4 conv-BN-LIF stages (D/8, D/4, D/2, D) with max-pools, plus a
    conv relative-position embedding added to the tokens. `pool_stages` max-pools (on the last
    stages) set the token grid: img_size / 2**pool_stages per side. `pool_first` max-pools the
    BN output before the stage's LIF instead of its spikes after it (spikingjelly 2.0's Spikformer)."""

    # efficient.memory: the stem is recomputed in backward, stage by stage (`recompute_parts`)
    recompute_unit = True

    def __init__(self, img_size: int, in_chans: int, dim: int, pool_stages: int, lif_cfg: dict, rpe_lif: bool = True,
                 pool_first: bool = False) -> None:
        super().__init__()
        stride = check_stem_grid(img_size, dim, pool_stages, "SPS stem")
        chans = [in_chans, dim // 8, dim // 4, dim // 2, dim]
        self.img_size, self.in_chans = img_size, in_chans
        self.grid = img_size // stride
        self.convs = nn.ModuleList(nn.Conv2d(chans[i], chans[i + 1], 3, 1, 1, bias=False) for i in range(4))
        self.bns = nn.ModuleList(nn.BatchNorm2d(chans[i + 1]) for i in range(4))
        self.lifs = nn.ModuleList(_lif(lif_cfg) for _ in range(4))
        self.pools = nn.ModuleList(
            nn.MaxPool2d(3, 2, 1) if i >= 4 - pool_stages else nn.Identity() for i in range(4)
        )
        self.rpe_conv = nn.Conv2d(dim, dim, 3, 1, 1, bias=False)
        self.rpe_bn = nn.BatchNorm2d(dim)
        if rpe_lif:  # the Spike-driven Transformer's stem adds real-valued features instead
            self.rpe_lif = _lif(lif_cfg)
        self.chans = chans
        self.pool_first = pool_first
        # the stages as callables over the modules above, kept out of the module tree (see StemStage)
        object.__setattr__(self, "_stages", [StemStage(self, i) for i in range(5 if rpe_lif else 4)])
        self._group(4)

    def _group(self, n: int) -> None:
        """The units of the first `n` stages (`group_stages`), within the largest rerun of the stem: of its
        four convolutions (the last one SDT's tail's) and its position embedding."""
        sizes, res = [], self.img_size
        for c, pool in zip(self.chans[1:], self.pools):
            sizes.append(c * res * res)  # the conv output, before its pool
            res = res // 2 if isinstance(pool, nn.MaxPool2d) else res
        peak = max(sizes + [self.chans[-1] * self.grid**2])
        object.__setattr__(self, "_parts", group_stages(self._stages[:n], sizes[:n], peak))

    @staticmethod
    def _part_name(part: nn.Module) -> str:
        if isinstance(part, StemStages):
            return f"stage{part._members[0].i}-{part._members[-1].i}"
        return f"stage{part.i}" if part.i < 4 else "rpe"

    def recompute_parts(self) -> list[tuple[str, nn.Module]]:
        """The recompute units standing in for the whole stem (efficient.memory): its stages, the
        early small ones together (`group_stages`), and the position embedding. A subclass with its own
        forward recomputes as one unit."""
        if type(self).forward is not SPS.forward:
            return []
        return [(self._part_name(p), p) for p in [*self._parts, self._stages[4]]]

    def train(self, mode: bool = True) -> SPS:
        super().train(mode)
        for st in self._stages:  # not children: their mode follows the stem's
            st.training = mode
        return self

    def neuron_peak(self) -> int:
        """Elements per timestep and sample of the stem's largest neuron input (before its pool)."""
        res, peak = self.img_size, 0
        for c, pool in zip(self.chans[1:], self.pools):
            pooled = res // 2 if isinstance(pool, nn.MaxPool2d) else res
            peak = max(peak, c * (pooled if self.pool_first else res) ** 2)
            res = pooled
        return peak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, B, C, H, W]` -> tokens `[T, B, N, D]`."""
        T, B = x.shape[:2]
        for part in self._parts:  # the stages (the first flattens the images itself)
            x = part(x, T)
        x = self._stages[4](x, T) + x  # the spiking position embedding added to the features
        return x.flatten(2).transpose(1, 2).reshape(T, B, -1, x.shape[1])


class _ConcatParameters(torch.autograd.Function):
    """Groups of tensors, each concatenated along dim 0, as one autograd node whose backward splits
    each group's gradient once (`Tensor.split`: one op, views), where a `torch.cat` per group records
    a node per group whose backward slices each part out on its own (one op per part)."""

    @staticmethod
    def forward(ctx, sizes: tuple[tuple[int, ...], ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.sizes = sizes
        ctx.set_materialize_grads(False)
        out, i = [], 0
        for sz in sizes:
            out.append(torch.cat(tensors[i:i + len(sz)]))
            i += len(sz)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        parts: list[torch.Tensor | None] = [None]
        for g, sz in zip(grads, ctx.sizes):
            parts.extend([None] * len(sz) if g is None else g.split(sz))
        return tuple(parts)


def concat_parameters(groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """`[torch.cat(g) for g in groups]` with the same values and gradients; eagerly one autograd node for
    all groups whose backward is one split per group (`_ConcatParameters`). Traced by a compiler, under a
    functorch transform, or with no part needing a gradient, the plain concatenations."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or not (torch.is_grad_enabled() and any(t.requires_grad for g in groups for t in g))):
        return [torch.cat(g) for g in groups]
    sizes = tuple(tuple(t.shape[0] for t in g) for g in groups)
    return list(_ConcatParameters.apply(sizes, *(t for g in groups for t in g)))


class SSA(nn.Module):
    """Spiking self-attention: binary Q, K, V; A = scale * Q K^T with no softmax; LIF_0.5(A V)."""

    def __init__(self, dim: int, heads: int, lif_cfg: dict, scale: float = 0.125, attn_threshold: float = 0.5,
                 qkv_bias: bool = True, kernel_backend: str = "auto") -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"embed_dim {dim} is not divisible by num_heads {heads}")
        self.heads, self.scale, self.kernel_backend = heads, scale, kernel_backend
        self.q = LinearBNLIF(dim, dim, lif_cfg, bias=qkv_bias)
        self.k = LinearBNLIF(dim, dim, lif_cfg, bias=qkv_bias)
        self.v = LinearBNLIF(dim, dim, lif_cfg, bias=qkv_bias)
        self.attn_lif = _lif(lif_cfg, v_threshold=attn_threshold)
        self.proj = LinearBNLIF(dim, dim, lif_cfg)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        T, B, N, C = x.shape
        return x.reshape(T, B, N, self.heads, C // self.heads).transpose(2, 3)  # [T, B, H, N, d]

    def qkv(self, x: torch.Tensor, split: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V spikes `[T, B, H, N, d]`, or with `split=False` `[T, B, N, D]` (what `attend` takes too)."""
        # the fused unit pays off for large inputs only; on small ones the separate units keep the
        # training trajectory bit for bit (the fused backward sums the input gradient in another order)
        if self.training and 3 * x.numel() >= COMPILE_MIN_NUMEL and self._fusable():
            q, k, v = self.qkv_fused(x)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        return (self.split_heads(q), self.split_heads(k), self.split_heads(v)) if split else (q, k, v)

    def _fusable(self) -> bool:
        units = (self.q, self.k, self.v)
        bns, lifs = [u.bn for u in units], [u.lif for u in units]
        return (all(b.track_running_stats and b.affine and b.momentum == bns[0].momentum and b.eps == bns[0].eps for b in bns)
                and all(type(n) is type(lifs[0]) and n.extra_repr() == lifs[0].extra_repr() and not n.store_membrane
                        and getattr(n, "peak_numel", 0) == getattr(lifs[0], "peak_numel", 0) for n in lifs))

    def qkv_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Training: the three Linear -> BatchNorm -> LIF units as one wide unit (one matmul, one
        BatchNorm call over 3C channels, one neuron call). Every output channel is computed exactly
        as by its own unit (per-column dot products, per-channel batch statistics, element-wise
        neurons): the same spikes and running statistics, with fewer and larger kernels."""
        units = (self.q, self.k, self.v)
        T, B, N, C = x.shape
        bns = [u.bn for u in units]
        groups = [[u.linear.weight for u in units], [bn.weight for bn in bns], [bn.bias for bn in bns]]
        if units[0].linear.bias is not None:
            groups.append([u.linear.bias for u in units])
        w, gamma, beta, *b = concat_parameters(groups)
        b = b[0] if b else None
        x2 = x.flatten(0, 2)
        # what BatchNorm.forward does in training before normalizing (one multi-tensor op for the three)
        torch._foreach_add_([bn.num_batches_tracked for bn in bns], 1)
        m0 = bns[0].momentum
        factor = 1.0 / float(bns[0].num_batches_tracked) if m0 is None else m0
        rm = torch.cat([bn.running_mean for bn in bns])
        rv = torch.cat([bn.running_var for bn in bns])
        buffers = [bn.running_mean for bn in bns] + [bn.running_var for bn in bns]
        if fusable(self.q.lif, *bns, *(u.lif for u in units), *(u.linear for u in units)):  # the unit as one op
            # the op's new statistics go straight into each unit's buffers (one multi-tensor copy)
            s = bn_fire(x2, (T, B, N, 3 * C), self.q.lif, gamma, beta, rm, rv, True, factor, bns[0].eps, lin_weight=w,
                        lin_bias=b, running_out=buffers)
        else:
            y = F.batch_norm(F.linear(x2, w, b), rm, rv, gamma, beta, True, factor, bns[0].eps)
            s = self.q.lif(y.reshape(T, B, N, 3 * C))
            with torch.no_grad():  # the updated statistics back into each unit's buffers, one multi-tensor copy
                torch._foreach_copy_(buffers, [*rm.split(C), *rv.split(C)])
        # one split, not three slices: its backward concatenates the three gradients, where slices
        # would each zero-fill a full-width gradient and add them up
        return s.split(C, dim=-1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anchor: bool = False, scores: bool = False):
        """Output `[T, B, N, D]` and, if `scores`, STATA's anchor / mean-query scores (one fused pass), from
        Q, K, V `[T, B, H, N, d]` or `[T, B, N, D]` (`qkv(x, split=False)`)."""
        if q.dim() == 4:
            # one op each way: eager, and compiled on the Triton backend (where the attention is an op
            # anyway); a compiled torch backend gives inductor the plain ops, and a profiler's hooks,
            # autocast's per-op casts and `separate_units()` get them too. On the torch backend the unit
            # computes what the plain path's autograd does, STATA's scores and their gradients included
            backend = ssa_backend(self.kernel_backend, q, "ssa")
            if not (backend == "torch" and torch.compiler.is_compiling()) and _one_call_allowed(self.attn_lif):
                y, s, c = spiking_attention_unit(q, k, v, self.heads, self.scale, anchor=anchor, scores=scores,
                                                 backend=backend)
                return self.proj(self.attn_lif(y)), s, c
            q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        y, s, c = spiking_attention(q, k, v, self.scale, anchor=anchor, scores=scores, backend=self.kernel_backend)
        return self.output(y), s, c

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """Per-head attention `[T, B, H, n, d]` -> LIF_0.5 -> projection unit: `[T, B, n, D]`."""
        T, B, H, n, d = y.shape
        return self.proj(self.attn_lif(y.transpose(2, 3).reshape(T, B, n, H * d)))

    # the pieces of a lean pass, in which some queries attend to every key (`Block.forward_lean`)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        return self.split_heads(self.q(x))

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split_heads(self.k(x)), self.split_heads(self.v(x))

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Output rows `[T, B, n, D]` of the `n` queries `q` over all keys and values (no scores)."""
        return self.output(attention_ref(q, k, v, self.scale))

    def forward(self, x: torch.Tensor, anchor: bool = False, scores: bool = False):
        """`[T, B, N, D]` -> (output `[T, B, N, D]`, STATA's anchor scores, mean-query scores) (None, None
        unless `scores`)."""
        return self.attend(*self.qkv(x, split=False), anchor=anchor, scores=scores)


class MLP(nn.Module):
    """fc1 -> fc2, two Linear -> BatchNorm -> LIF units on tokens `[T, B, N, D]`."""

    # efficient.memory: the second residual half of a `Block` (the block adds its output to the stream), so
    # the gradient of its output lives through its rerun anyway: it runs as a light region at any size
    recompute_residual = True
    recompute_count_bound: int | None = None  # set by `Spikformer`: its input is a count of spikes

    def __init__(self, dim: int, hidden: int, lif_cfg: dict) -> None:
        super().__init__()
        self.fc1 = LinearBNLIF(dim, hidden, lif_cfg)
        self.fc2 = LinearBNLIF(hidden, dim, lif_cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class AttentionHalf(nn.Module):
    """x + SSA(x), with STATA's scores: the first half of a `Block` as the unit memory level `recompute`
    reruns. The residual sum is inside it, so its rerun adds the stream's gradient and the attention's
    units' gradients to x's in the order level none does (x feeds q, k and v separately at small widths):
    the step's gradients stay none's bit for bit. It holds the block's attention without owning it (the
    block's parameter names stay)."""

    recompute_unit = True
    recompute_residual = True
    recompute_count_bound: int | None = None  # the block's

    def __init__(self, attn: SSA) -> None:
        super().__init__()
        object.__setattr__(self, "_attn", attn)

    @property
    def training(self) -> bool:  # type: ignore[override]
        """The attention's mode: the half is no child of the block, so `train()` never reaches it."""
        return self._attn.training

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # `Module.__init__` sets it; the mode is the attention's

    def recompute_modules(self) -> list[nn.Module]:
        return [self._attn]

    def forward(self, x: torch.Tensor, anchor: bool = False, scores: bool = False):
        a, s, c = self._attn(x, anchor=anchor, scores=scores)
        return x + a, s, c


class Block(nn.Module):
    """x += SSA(x); [prune]; x += MLP(x). `step` (a `PruneStep` from the model's pruner, or None)
    gathers the kept tokens after the attention or after the block; `anchor`: token 0 is STATA's anchor."""

    # efficient.memory: recomputed in backward as two units, the attention and the MLP, each keeping only
    # its input (the residual stream), so backward holds one half's rerun at a time and a memory plan can
    # run one half plainly and rerun the other; a subclass with its own forward is one unit, keeping its input
    recompute_unit = True
    recompute_residual = True  # its output's gradient also reaches its input unchanged
    # efficient.memory: the largest count of spikes the block's input can hold when the model's residual
    # stream is a sum of spikes by construction (set by `Spikformer` and `QKFormer`; kept as uint8), else None
    recompute_count_bound: int | None = None

    def __init__(self, dim: int, heads: int, mlp_ratio: float, lif_cfg: dict, qkv_bias: bool = True,
                 reference_norms: bool = False, kernel_backend: str = "auto") -> None:
        super().__init__()
        self.attn = SSA(dim, heads, lif_cfg, qkv_bias=qkv_bias, kernel_backend=kernel_backend)
        self.mlp = MLP(dim, int(dim * mlp_ratio), lif_cfg)
        object.__setattr__(self, "_attn_half", AttentionHalf(self.attn))  # not a child: no parameters of its own
        if reference_norms:
            # The reference code builds two LayerNorms per block that its forward never calls; the
            # published parameter counts (9.33M for 4-384) include them. Frozen, off the compute path.
            self.norm1, self.norm2 = nn.LayerNorm(dim).requires_grad_(False), nn.LayerNorm(dim).requires_grad_(False)

    def forward(self, x: torch.Tensor, step: PruneStep | None = None, anchor: bool = False, lean: bool = False,
                last: bool = False) -> torch.Tensor:
        if lean:
            return self.forward_lean(x, step, int(anchor), last)
        x, s, c = self._attn_half(x, anchor=anchor, scores=step is not None)
        return after_attention(x, s, c, self.mlp, step)

    def recompute_parts(self) -> list[tuple[str, nn.Module]]:
        return [("attn", self._attn_half), ("mlp", self.mlp)] if type(self).forward is Block.forward else []

    def set_count_bound(self, bound: int | None) -> None:
        """The stream's bound at the block's input (`recompute_count_bound`), and at its halves' inputs: the
        attention adds one spike map before the MLP."""
        self.recompute_count_bound = self._attn_half.recompute_count_bound = bound
        self.mlp.recompute_count_bound = None if bound is None else bound + 1

    def forward_lean(self, x: torch.Tensor, step: PruneStep | None = None, p: int = 0, last: bool = False) -> torch.Tensor:
        """Inference (eval-mode BN, no fusion, pruning after attention): compute only the rows some
        later op reads. Keys and values of every token are needed (they are attended to), but the
        queries, attention output and MLP only of the tokens that survive: the kept candidates, plus
        the anchor unless this is the last block (nothing after it reads the anchor). A pruning block
        scores the candidates with the anchor's query alone. Every op left is row-wise in eval mode,
        so the surviving rows are bitwise those of `forward` (which keeps the anchor: drop it,
        `x[:, :, p:]`, to compare after the last block).
        """
        attn = self.attn
        k, v = attn.keys_values(x)
        prefix, cand = x[:, :, :p], x[:, :, p:]
        q_prefix = q_cand = idx = None
        if step is not None:
            if p:  # the anchor's query alone scores the candidates
                q_prefix = attn.queries(prefix)
                s = anchor_scores(q_prefix[..., 0, :], k[..., p:, :])
            else:  # no anchor: the mean patch query scores them, so every query is needed
                q_cand = attn.queries(cand)
                s = step.scores(q_cand, k)[0]
            idx = step.select(s)
        if idx is not None:
            cand = gather_tokens(cand, idx, attn.kernel_backend)
            if q_cand is not None:  # [T, B, H, N, d]: gather on the token axis
                T, B, H, _, d = q_cand.shape
                q_cand = q_cand.gather(3, idx[None, :, None, :, None].expand(T, B, H, idx.shape[1], d))
        if q_cand is None:
            q_cand = attn.queries(cand)
        rows, q = cand, q_cand
        if p and not last:
            if q_prefix is None:
                q_prefix = attn.queries(prefix)
            rows, q = torch.cat([prefix, cand], 2), torch.cat([q_prefix, q_cand], 3)
        rows = rows + attn.attend_rows(q, k, v)
        return rows + self.mlp(rows)


@dataclass
class SpikformerConfig(SpikingTransformerConfig):
    """Spikformer's options: the shared ones, bias-free q/k/v (`qkv_bias=False`, the ImageNet code),
    the reference code's unused LayerNorms (`reference_norms`, counted in its published sizes), and
    `lean_inference` (see `Spikformer`). `stem_pool`: where the stem's max-pools sit, on the spikes
    after each LIF (the paper's code) or on the BN output before it (spikingjelly 2.0's Spikformer,
    whose checkpoints load with it; `efficient.export.checkpoints`)."""

    qkv_bias: bool = True
    reference_norms: bool = False
    lean_inference: bool = False
    stem_pool: Literal["after_neuron", "before_neuron"] = "after_neuron"


class Spikformer(SpikingTransformer):
    """Spikformer classifier. Input `[B, C, H, W]` (repeated over T) or `[T, B, C, H, W]`.

    Built from a `SpikformerConfig`, or from its flat options (`Spikformer(embed_dim=64, keep_ratio=0.5)`).
    `lean_inference` (on in the STATA zoo entries): at inference skip the rows nobody reads --
    pruned tokens' queries and attention outputs, the last block's anchor -- with bitwise the same
    logits (`uses_lean_path`); off, every row is computed as in training (the cost arithmetic of the
    reconstruction).
    """

    def __init__(self, config: SpikformerConfig | None = None, **options: Any) -> None:
        cfg = config_from_options(SpikformerConfig, options, config)
        super().__init__(cfg)
        self.lean_inference = cfg.lean_inference
        for i, blk in enumerate(self.blocks):
            blk.set_count_bound(self.stream_count_bound(i))

    def stream_count_bound(self, i: int) -> int | None:
        """The largest value block `i`'s input can hold when it is a count of spikes by construction:
        the stem adds two spike maps (features and position embedding) and every block two more
        (attention and MLP outputs). None when anything else enters the stream (STATA's anchor or
        fused tokens, another stem or block)."""
        stem, st = self.patch_embed, self.stata
        plain = (type(stem) is SPS and hasattr(stem, "rpe_lif") and all(type(b) is Block for b in self.blocks)
                 and not st.n_prefix and not st.prune_at
                 and all(is_neuron(n) for n in [*stem.lifs, stem.rpe_lif, *(u.lif for b in self.blocks
                                                                            for u in (b.attn.proj, b.mlp.fc2))]))
        return 2 + 2 * i if plain else None

    def build_stem(self, cfg: SpikformerConfig, lif_cfg: dict) -> SPS:
        if cfg.stem_pool not in ("after_neuron", "before_neuron"):
            raise ConfigError(f"stem_pool must be 'after_neuron' or 'before_neuron' (got {cfg.stem_pool!r})")
        return SPS(cfg.img_size, cfg.in_chans, cfg.embed_dim, cfg.pool_stages, lif_cfg,
                   pool_first=cfg.stem_pool == "before_neuron")

    def build_block(self, cfg: SpikformerConfig, lif_cfg: dict) -> Block:
        return Block(cfg.embed_dim, cfg.num_heads, cfg.mlp_ratio, lif_cfg, cfg.qkv_bias, cfg.reference_norms, self.kernel_backend)

    def build_head(self, cfg: SpikformerConfig, lif_cfg: dict) -> None:
        self.head = nn.Linear(cfg.embed_dim, cfg.num_classes)

    def pool_head(self, patches: torch.Tensor) -> torch.Tensor:
        """Patch tokens `[T, B, N, D]` -> logits: mean over tokens, then over time, then the linear classifier."""
        return self.head(patches.mean(2).mean(0))

    def uses_lean_path(self, x: torch.Tensor) -> bool:
        """Whether `forward` skips the rows nobody reads (`Block.forward_lean`): inference only (in
        training, every row enters BatchNorm's batch statistics), without fusion or recorded scores
        (they need every token's query), and when an anchor or a pruning block leaves rows to skip.
        T*B >= 2 keeps every projection a matrix product (a one-row product may round differently)."""
        st = self.stata
        return (self.lean_inference and not self.training and not st.record_scores and not st.cfg.fuse_pruned
                and st.cfg.prune_point == "after_attn" and bool(st.n_prefix or st.prune_at)
                and x.shape[0] * x.shape[1] >= 2)


# ---------------------------------------------------------------------------------- variants

CIFAR10 = InputSpec((3, 32, 32), timesteps=4, mean=CIFAR_MEAN, std=CIFAR_STD, num_classes=10)
DIGITS = InputSpec((1, 16, 16), timesteps=4, mean=DIGITS_MEAN, std=DIGITS_STD, num_classes=10)
IMAGENET = InputSpec((3, 224, 224), timesteps=4, mean=IMAGENET_MEAN, std=IMAGENET_STD, num_classes=1000)

CIFAR = SpikformerConfig(embed_dim=384, depth=4, num_heads=12, img_size=32, pool_stages=2, num_classes=10, reference_norms=True)
# the ImageNet reference code has bias-free q/k/v projections
IMAGENET_CFG = SpikformerConfig(embed_dim=512, depth=8, num_heads=8, img_size=224, pool_stages=4, num_classes=1000,
                                qkv_bias=False, reference_norms=True)
TINY = SpikformerConfig(embed_dim=64, depth=2, num_heads=4, img_size=16, in_chans=1, pool_stages=1, num_classes=10)
# paper-like STATA default (seeds/stata.md): anchor per timestep, EViT's rho = 0.7 and keep-rate warm-up
STATA = StataConfig(anchor="per_timestep", keep_ratio=0.7, keep_warmup_start=10.0, keep_warmup_epochs=60.0)
# DVS128 Gesture / CIFAR10-DVS config: event frames [T=16, 2, 128, 128] are the T steps (binary, no
# repetition of a static image), 4 pooled stem stages -> 8x8 tokens, 2 blocks, D=256, 16 heads
DVS128 = InputSpec((2, 128, 128), timesteps=16, num_classes=11)
DVS = SpikformerConfig(embed_dim=256, depth=2, num_heads=16, img_size=128, in_chans=2, pool_stages=4, num_classes=11,
                       timesteps=16)


def with_stata(cfg: SpikformerConfig, **stata: Any) -> SpikformerConfig:
    """`cfg` with STATA switched on: the paper-like defaults `STATA` updated by `stata`, lean inference."""
    return replace(cfg, lean_inference=True, stata=replace(STATA, **stata))


VARIANTS: dict[str, Variant] = {
    "spikformer-4-384": Variant(CIFAR10, PAPER, "CIFAR-10 config: 4 blocks, D=384, 12 heads, T=4", CIFAR),
    "spikformer-stata": Variant(
        CIFAR10, STATA_PAPER, "spikformer-4-384 + STATA: anchor per timestep, prune blocks 2,3 at rho=0.7 (65->46->33 tokens)",
        with_stata(CIFAR, prune_blocks=[2, 3])),
    "spikformer-8-512": Variant(IMAGENET, PAPER, "ImageNet config: 8 blocks, D=512, 8 heads, 224px, T=4", IMAGENET_CFG),
    "spikformer-8-512-stata": Variant(
        IMAGENET, STATA_PAPER, "spikformer-8-512 + STATA: prune blocks 4,6,8 at rho=0.7 (197->139->98->69 tokens)",
        with_stata(IMAGENET_CFG, prune_blocks=[4, 6, 8])),
    "spikformer-tiny": Variant(DIGITS, PAPER, "digits-sized: 2 blocks, D=64, 4 heads, 16px grayscale, 8x8 tokens, T=4", TINY),
    "spikformer-tiny-stata": Variant(
        DIGITS, STATA_PAPER, "spikformer-tiny + STATA: anchor per timestep, prune blocks 1,2 at rho=0.5 (65->33->17 tokens)",
        replace(TINY, lean_inference=True, stata=StataConfig(anchor="per_timestep", prune_blocks=[1, 2], keep_ratio=0.5))),
    "spikformer-2-256-dvs": Variant(DVS128, PAPER, "DVS128 Gesture / CIFAR10-DVS config: 2 blocks, D=256, 16 heads, "
                                    "128px event frames (2 polarities), T=16", DVS),
    "spikformer-2-256-dvs-stata": Variant(
        DVS128, STATA_PAPER, "spikformer-2-256-dvs + STATA: anchor per timestep, prune blocks 1,2 at rho=0.7 (65->46->33 tokens)",
        with_stata(DVS, prune_blocks=[1, 2])),
}

register_variants(Spikformer, VARIANTS, family="spikformer")
