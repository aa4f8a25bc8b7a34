"""Spikformer (Zhou et al., ICLR 2023) with STATA token sparsification (Zhuge et al., ICML 2024).

Spikformer: SPS conv stem -> blocks of spiking self-attention (binary Q, K, V, no softmax) and a
spiking MLP on an integer-valued residual stream -> mean over tokens, then time -> linear head.
Tensors are time-major `[T, B, N, C]` (tokens last-but-one, as in the CIFAR reference code).

STATA (our reconstruction, see seeds/stata.md): a learnable anchor token per timestep sits at token
index 0; in each pruning block the anchor's query scores the patch tokens (s_t(i) = <q_anchor,
k_i>), the scores are standardized per timestep and averaged over time, and the top ceil(rho*N)
tokens -- one set for every t, so membrane state stays aligned -- are physically gathered, so the
following layers run on fewer tokens. The anchor is never pruned and never pooled. The last
forward's scores are kept on the model (`stata_scores`) for the alignment losses in
`efficient.objectives.stata`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError
from efficient.kernels.ssa import attention_ref, scores_ref, spiking_attention
from efficient.kernels.token_select import gather_tokens, select_tokens
from efficient.kernels.lif import COMPILE_MIN_NUMEL, resolve_backend
from efficient.models.neurons import LIF
from efficient.zoo import InputSpec, register_model

PAPER = "Spikformer: When Spiking Neural Network Meets Transformer (Zhou et al., ICLR 2023)"
STATA_PAPER = "Towards Efficient Spiking Transformer: a Token Sparsification Framework (Zhuge et al., ICML 2024)"
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DIGITS_MEAN, DIGITS_STD = (0.3,), (0.38,)

Anchor = Literal["per_timestep", "shared", "off"]
PrunePoint = Literal["after_attn", "after_block"]
Score = Literal["standardized", "raw"]


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

    def _backend_for(self, x: torch.Tensor) -> str:
        if self.backend != "auto" or self.store_membrane or self.peak_numel <= 0 or x.dim() < 2:
            return self.backend
        return resolve_backend("auto", x.device, max(x.numel(), x.shape[0] * x.shape[1] * self.peak_numel))


def _lif(cfg: dict, **kw) -> ModelLIF:
    return ModelLIF(**{**cfg, **kw})


def share_neuron_backend(model: nn.Module, peak_numel: int) -> None:
    """Tell every `ModelLIF` of `model` the size of its largest neuron input (per timestep and sample)."""
    for m in model.modules():
        if isinstance(m, ModelLIF):
            m.peak_numel = int(peak_numel)


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


class LinearBNLIF(nn.Module):
    """Linear -> BatchNorm over channels -> LIF, on `[T, B, N, C]` (the Spikformer 'x_linear/x_bn/x_lif' unit)."""

    def __init__(self, d_in: int, d_out: int, lif_cfg: dict, v_threshold: float = 1.0, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=bias)
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

    def __init__(self, img_size: int, in_chans: int, dim: int, pool_stages: int, lif_cfg: dict, rpe_lif: bool = True) -> None:
        super().__init__()
        if not 1 <= pool_stages <= 4:
            raise ConfigError(f"pool_stages must be in 1..4 (got {pool_stages})")
        stride = 2**pool_stages
        if img_size < stride or img_size % stride:
            raise ConfigError(
                f"img_size {img_size} does not fit the SPS stem: with pool_stages={pool_stages} it must be a "
                f"positive multiple of {stride} (the token grid is img_size/{stride} per side); "
                f"resize the images or change pool_stages"
            )
        if dim % 8:
            raise ConfigError(f"embed_dim must be divisible by 8 for the SPS stem (D/8 .. D channels), got {dim}")
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

    def neuron_peak(self) -> int:
        """Elements per timestep and sample of the stem's largest neuron input (before its pool)."""
        res, peak = self.img_size, 0
        for c, pool in zip(self.chans[1:], self.pools):
            peak = max(peak, c * res * res)
            res = res // 2 if isinstance(pool, nn.MaxPool2d) else res
        return peak

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

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the fused unit pays off for large inputs only; on small ones the separate units keep the
        # training trajectory bit for bit (the fused backward sums the input gradient in another order)
        if self.training and 3 * x.numel() >= COMPILE_MIN_NUMEL and self._fusable():
            return tuple(self.split_heads(t) for t in self.qkv_fused(x))
        return self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))

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
        w = torch.cat([u.linear.weight for u in units])
        b = None if units[0].linear.bias is None else torch.cat([u.linear.bias for u in units])
        y = F.linear(x.flatten(0, 2), w, b)
        bns = [u.bn for u in units]
        for bn in bns:  # what BatchNorm.forward does in training before normalizing
            bn.num_batches_tracked.add_(1)
        m0 = bns[0].momentum
        factor = 1.0 / float(bns[0].num_batches_tracked) if m0 is None else m0
        rm = torch.cat([bn.running_mean for bn in bns])
        rv = torch.cat([bn.running_var for bn in bns])
        y = F.batch_norm(y, rm, rv, torch.cat([bn.weight for bn in bns]), torch.cat([bn.bias for bn in bns]),
                         True, factor, bns[0].eps)
        with torch.no_grad():
            for i, bn in enumerate(bns):
                bn.running_mean.copy_(rm[i * C:(i + 1) * C])
                bn.running_var.copy_(rv[i * C:(i + 1) * C])
        s = self.q.lif(y.reshape(T, B, N, 3 * C))
        # one split, not three slices: its backward concatenates the three gradients, where slices
        # would each zero-fill a full-width gradient and add them up
        return s.split(C, dim=-1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anchor: bool = False, scores: bool = False):
        """Output `[T, B, N, D]` and, if `scores`, STATA's anchor / mean-query scores (one fused pass)."""
        T, B, H, N, d = q.shape
        y, s, c = spiking_attention(q, k, v, self.scale, anchor=anchor, scores=scores, backend=self.kernel_backend)
        y = y.transpose(2, 3).reshape(T, B, N, H * d)
        return self.proj(self.attn_lif(y)), s, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.qkv(x))[0]


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, lif_cfg: dict) -> None:
        super().__init__()
        self.fc1 = LinearBNLIF(dim, hidden, lif_cfg)
        self.fc2 = LinearBNLIF(hidden, dim, lif_cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class Block(nn.Module):
    """x += SSA(x); [prune]; x += MLP(x). `prune(x, s, c)` (from the model) gathers the kept tokens."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, lif_cfg: dict, qkv_bias: bool = True,
                 reference_norms: bool = False, kernel_backend: str = "auto") -> None:
        super().__init__()
        self.attn = SSA(dim, heads, lif_cfg, qkv_bias=qkv_bias, kernel_backend=kernel_backend)
        self.mlp = MLP(dim, int(dim * mlp_ratio), lif_cfg)
        if reference_norms:
            # The reference code builds two LayerNorms per block that its forward never calls; the
            # published parameter counts (9.33M for 4-384) include them. Frozen, off the compute path.
            self.norm1, self.norm2 = nn.LayerNorm(dim).requires_grad_(False), nn.LayerNorm(dim).requires_grad_(False)

    def forward(self, x: torch.Tensor, prune=None, anchor: bool = False, point: str = "after_attn",
                lean: bool = False, last: bool = False) -> torch.Tensor:
        if lean:
            return self.forward_lean(x, prune, int(anchor), last)
        q, k, v = self.attn.qkv(x)
        a, s, c = self.attn.attend(q, k, v, anchor=anchor, scores=prune is not None)
        x = x + a
        if prune is not None and point == "after_attn":
            x = prune(x, s, c)
        x = x + self.mlp(x)
        if prune is not None and point == "after_block":
            x = prune(x, s, c)
        return x

    def forward_lean(self, x: torch.Tensor, select=None, p: int = 0, last: bool = False) -> torch.Tensor:
        """Inference (eval-mode BN, no fusion, pruning after attention): compute only the rows some
        later op reads. Keys and values of every token are needed (they are attended to), but the
        queries, attention output and MLP only of the tokens that survive: the kept candidates, plus
        the anchor unless this is the last block (nothing after it reads the anchor). A pruning block
        scores the candidates with the anchor's query alone (`select(s)` -> kept indices `[B, k]`, or
        None to keep all). Every op left is row-wise in eval mode, so the surviving rows are bitwise
        those of `forward` (which keeps the anchor: drop it, `x[:, :, p:]`, to compare after the last block).
        """
        attn = self.attn
        k, v = attn.split_heads(attn.k(x)), attn.split_heads(attn.v(x))
        prefix, cand = x[:, :, :p], x[:, :, p:]
        q_prefix = q_cand = idx = None
        if select is not None:
            if p:  # the anchor's query alone scores the candidates: s_t(i) = sum_h <q_anchor, k_i>
                q_prefix = attn.split_heads(attn.q(prefix))
                s = torch.einsum("tbhd,tbhmd->tbm", q_prefix[..., 0, :], k[..., p:, :])
            else:  # no anchor: the mean patch query scores them, so every query is needed
                q_cand = attn.split_heads(attn.q(cand))
                s = scores_ref(q_cand, k, False)[0]
            idx = select(s)
        if idx is not None:
            cand = gather_tokens(cand, idx, attn.kernel_backend)
            if q_cand is not None:  # [T, B, H, N, d]: gather on the token axis
                T, B, H, _, d = q_cand.shape
                q_cand = q_cand.gather(3, idx[None, :, None, :, None].expand(T, B, H, idx.shape[1], d))
        if q_cand is None:
            q_cand = attn.split_heads(attn.q(cand))
        rows, q = cand, q_cand
        if p and not last:
            if q_prefix is None:
                q_prefix = attn.split_heads(attn.q(prefix))
            rows, q = torch.cat([prefix, cand], 2), torch.cat([q_prefix, q_cand], 3)
        T, B, H, n, d = q.shape
        y = attention_ref(q, k, v, attn.scale).transpose(2, 3).reshape(T, B, n, H * d)
        rows = rows + attn.proj(attn.attn_lif(y))
        return rows + self.mlp(rows)


class Spikformer(nn.Module):
    """Spikformer classifier. Input `[B, C, H, W]` (repeated over T) or `[T, B, C, H, W]`.

    STATA switches: `anchor` (per_timestep | shared | off), `prune_blocks` (1-based block indices),
    `keep_ratio` (one rho for every pruning block, or one per block), `prune_point`, `fuse_pruned`
    (EViT-style fused token), `keep_warmup_start` / `keep_warmup_epochs` (cosine warm-up of rho,
    driven by `set_progress`), `score` (standardized | raw, for ablation), `std_eps`, `anchor_init_std`.
    With `anchor="off"` the mean patch query scores the tokens. `lean_inference` (on in the STATA zoo
    entries): at inference skip the rows nobody reads -- pruned tokens' queries and attention outputs,
    the last block's anchor -- with bitwise the same logits (`uses_lean_path`); off, every row is
    computed as in training (the cost arithmetic of the reconstruction).
    """

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
        qkv_bias: bool = True,
        reference_norms: bool = False,
        anchor: Anchor = "off",
        prune_blocks: list[int] | None = None,
        keep_ratio: float | list[float] = 1.0,
        prune_point: PrunePoint = "after_attn",
        fuse_pruned: bool = False,
        keep_warmup_start: float = 0.0,
        keep_warmup_epochs: float = 0.0,
        score: Score = "standardized",
        std_eps: float = 1e-6,
        anchor_init_std: float = 1.0,
        lean_inference: bool = False,
    ) -> None:
        super().__init__()
        self.lean_inference = bool(lean_inference)
        lif_cfg, kb = self._init_core(timesteps, depth, num_classes, embed_dim, tau, surrogate, alpha, backend)
        self.patch_embed = SPS(img_size, in_chans, embed_dim, pool_stages, lif_cfg)
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, lif_cfg, qkv_bias, reference_norms, kb) for _ in range(depth)
        )
        self.head = nn.Linear(embed_dim, num_classes)
        self.apply(self._init_weights)
        self._share_neuron_peak(mlp_ratio)

        self.init_stata(kb, anchor, prune_blocks, keep_ratio, prune_point, fuse_pruned, keep_warmup_start,
                        keep_warmup_epochs, score, std_eps, anchor_init_std)

    def _init_core(self, timesteps: int, depth: int, num_classes: int, embed_dim: int, tau: float, surrogate: str,
                   alpha: float, backend: str) -> tuple[dict, str]:
        """Checks and sizes shared with the Spike-driven Transformer; returns the neurons' config and
        the attention / token-selection kernels' backend (they have no compiled-loop variant)."""
        if timesteps < 1:
            raise ConfigError(f"timesteps must be >= 1 (got {timesteps})")
        if depth < 1:
            raise ConfigError(f"depth must be >= 1 (got {depth})")
        self.timesteps, self.num_classes, self.embed_dim = timesteps, num_classes, embed_dim
        lif_cfg = dict(tau=tau, v_reset=0.0, detach_reset=True, surrogate=surrogate, alpha=alpha, backend=backend)
        return lif_cfg, backend if backend in ("auto", "triton", "torch") else "auto"

    def _share_neuron_peak(self, mlp_ratio: float) -> None:
        """Every neuron learns the model's largest neuron input per timestep and sample: the stem's
        widest stage, or the MLP's hidden layer over every token plus one prefix token."""
        hidden = int(self.embed_dim * mlp_ratio) * (self.patch_embed.grid**2 + 1)
        share_neuron_backend(self, max(self.patch_embed.neuron_peak(), hidden))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def init_stata(self, kernel_backend: str, anchor: str, prune_blocks, keep_ratio, prune_point: str, fuse_pruned: bool,
                   keep_warmup_start: float, keep_warmup_epochs: float, score: str, std_eps: float, anchor_init_std: float) -> None:
        """Validate the STATA switches and create the anchor (shared with the Spike-driven Transformer)."""
        depth, timesteps, embed_dim, kb = len(self.blocks), self.timesteps, self.embed_dim, kernel_backend
        self.kernel_backend, self.prune_point, self.fuse_pruned = kb, prune_point, fuse_pruned
        self.standardize, self.std_eps = score == "standardized", std_eps
        self.warmup = (float(keep_warmup_start), float(keep_warmup_epochs))
        if keep_warmup_start < 0 or keep_warmup_epochs < 0:
            raise ConfigError("keep_warmup_start and keep_warmup_epochs must be >= 0")
        blocks = sorted(prune_blocks or [])
        bad = [b for b in blocks if not 1 <= b <= depth]
        if bad or len(set(blocks)) != len(blocks):
            raise ConfigError(
                f"prune_blocks {list(prune_blocks or [])}: block indices are 1-based, distinct and at most depth={depth}"
                + (f"; {bad} is out of range" if bad else "")
            )
        ratios = list(keep_ratio) if isinstance(keep_ratio, (list, tuple)) else [keep_ratio] * len(blocks)
        if isinstance(keep_ratio, (list, tuple)) and len(ratios) != len(blocks):
            raise ConfigError(f"keep_ratio has {len(ratios)} values for {len(blocks)} prune_blocks; give one ratio or one per block")
        for r in ratios if ratios else [keep_ratio]:
            if not (isinstance(r, (int, float)) and 0 < r <= 1):
                raise ConfigError(f"keep_ratio must be in (0, 1] (the fraction of tokens a pruning block keeps), got {r}")
        self.prune_at = {b - 1: r for b, r in zip(blocks, ratios)}  # 0-based block -> target rho
        self.anchor_mode = anchor
        self.n_prefix = 0 if anchor == "off" else 1
        self.n_patches = self.patch_embed.grid**2
        self.token_schedule()  # validates: raises if a block would keep zero tokens
        if anchor != "off":
            self.anchor = nn.Parameter(torch.zeros(timesteps if anchor == "per_timestep" else 1, embed_dim))
            # unit scale, like the spike-count residual stream: a 0.02-scale anchor (ViT's CLS init) never
            # makes its query fire, so every timestep abstains and selection degenerates to index order
            nn.init.trunc_normal_(self.anchor, std=anchor_init_std, a=-2 * anchor_init_std, b=2 * anchor_init_std)
        self._epoch: float | None = None
        self.record_scores = False  # also keep scores in eval mode (training always keeps them)
        self.stata_scores: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stata_stats: dict = {}


    # ------------------------------------------------------------------ keep-ratio schedule

    def set_progress(self, epoch: float) -> None:
        """Called by the trainer before every step (fractional epoch): drives the keep-ratio warm-up."""
        self._epoch = float(epoch)

    def keep_ratios(self) -> dict[int, float]:
        """Current rho per pruning block (0-based): the warm-up value while training, rho* in eval."""
        if not self.training or self._epoch is None:
            return dict(self.prune_at)
        start, span = self.warmup
        return {b: warmup_keep_ratio(r, self._epoch, start, span) for b, r in self.prune_at.items()}

    def token_schedule(self, ratios: dict[int, float] | None = None) -> list[tuple[int, int]]:
        """(tokens into attention, tokens into the MLP) per block, anchor and fused token included."""
        ratios = self.prune_at if ratios is None else ratios
        p = self.n_prefix
        cand, out = self.n_patches, []
        for i in range(len(self.blocks)):
            n_attn = cand + p
            if i in ratios:
                if ratios[i] * cand < 1:
                    raise ConfigError(
                        f"keep schedule leaves zero tokens: block {i + 1} keeps {ratios[i]:g} x {cand} candidate tokens "
                        f"= {ratios[i] * cand:.2f} < 1; raise keep_ratio or prune in fewer blocks"
                    )
                k = kept_count(ratios[i], cand)
                cand = k + (1 if self.fuse_pruned and k < cand else 0)
            n_mlp = cand + p if self.prune_point == "after_attn" else n_attn
            out.append((n_attn, n_mlp))
        return out

    # ---------------------------------------------------------------------------- forward

    def encode_input(self, x: torch.Tensor) -> torch.Tensor:
        sps = self.patch_embed
        if x.dim() == 4:
            x = x.unsqueeze(0).expand(self.timesteps, *x.shape)
        if x.dim() != 5 or x.shape[2] != sps.in_chans or x.shape[-2:] != (sps.img_size, sps.img_size):
            raise ValueError(
                f"Spikformer expects images [B, {sps.in_chans}, {sps.img_size}, {sps.img_size}] "
                f"(or [T, B, ...]); got {list(x.shape)}"
            )
        if self.anchor_mode == "per_timestep" and x.shape[0] != self.timesteps:
            raise ValueError(f"this model has one anchor per timestep (T={self.timesteps}); got T={x.shape[0]}")
        return x

    def _select(self, s: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(kept indices `[B, k]`, selection score `[B, N]`) of the top ceil(ratio*N) candidates by
        standardized score, the same set at every t; None when every candidate is kept."""
        n = s.shape[2]
        k = kept_count(ratio, n)
        self.stata_stats["degenerate"] += int((s.detach().float().std(-1, correction=0) == 0).all(0).sum())
        if k == n:  # nothing to prune: keep order and shape exactly (identity at rho = 1)
            return None
        idx, z = select_tokens(s, k, self.std_eps, self.standardize, self.kernel_backend)
        self.stata_stats.setdefault("kept_idx", []).append(idx)
        return idx, z

    def _select_idx(self, s: torch.Tensor, ratio: float) -> torch.Tensor | None:
        sel = self._select(s, ratio)
        return None if sel is None else sel[0]

    def _prune(self, x: torch.Tensor, s: torch.Tensor, c: torch.Tensor, ratio: float) -> torch.Tensor:
        """Keep the top ceil(ratio*N) candidates by standardized anchor score, the same set at every t."""
        p = self.n_prefix
        cand = x[:, :, p:]
        if self.training or self.record_scores:
            self.stata_scores.append((s, c))
        sel = self._select(s, ratio)
        if sel is None:
            return x
        idx, z = sel
        if p:  # one gather of the anchor and the kept tokens: no concatenation copy (nor its backward)
            idx_all = torch.cat([torch.arange(p, device=idx.device).expand(idx.shape[0], p), idx + p], 1)
            kept = gather_tokens(x, idx_all, self.kernel_backend)
        else:
            kept = gather_tokens(cand, idx, self.kernel_backend)
        if not self.fuse_pruned:
            return kept
        # EViT: one token = softmax(z)-weighted sum of the pruned tokens
        w = z.scatter(1, idx, float("-inf")).softmax(-1).to(x.dtype)  # [B, N], zero on kept tokens
        return torch.cat([kept, torch.einsum("bn,tbnd->tbd", w, cand).unsqueeze(2)], 2)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> tokens `[T, B, N, D]` from the SPS stem, with the anchor at index 0 if enabled."""
        x = self.patch_embed(self.encode_input(x))
        T, B, _, D = x.shape
        if self.n_prefix:
            x = torch.cat([self.anchor[:, None, None, :].expand(T, B, 1, D).to(x.dtype), x], 2)
        return x

    def uses_lean_path(self, x: torch.Tensor) -> bool:
        """Whether `forward` skips the rows nobody reads (`Block.forward_lean`): inference only (in
        training, every row enters BatchNorm's batch statistics), without fusion or recorded scores
        (they need every token's query), and when an anchor or a pruning block leaves rows to skip.
        T*B >= 2 keeps every projection a matrix product (a one-row product may round differently)."""
        return (self.lean_inference and not self.training and not self.record_scores and not self.fuse_pruned
                and self.prune_point == "after_attn" and bool(self.n_prefix or self.prune_at)
                and x.shape[0] * x.shape[1] >= 2)

    def forward_blocks(self, x: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """The encoder: tokens through every block, pruning where the schedule says. With `lean`
        (see `uses_lean_path`) the last block returns the patch tokens only (no anchor)."""
        self.stata_scores = []
        self.stata_stats = {"tokens_in": [], "degenerate": 0}
        ratios = self.keep_ratios()
        self.stata_stats["keep_ratio"] = min(ratios.values(), default=1.0)
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            self.stata_stats["tokens_in"].append(x.shape[2])
            prune = None
            if i in ratios:
                r = ratios[i]
                if lean:
                    prune = lambda s_, r=r: self._select_idx(s_, r)  # noqa: E731
                else:
                    prune = lambda x_, s_, c_, r=r: self._prune(x_, s_, c_, r)  # noqa: E731
            if lean and (prune is not None or i == last):
                x = blk(x, prune, anchor=self.n_prefix == 1, lean=True, last=i == last)
            else:
                x = blk(x, prune, anchor=self.n_prefix == 1, point=self.prune_point)
        self.stata_stats["tokens_out"] = x.shape[2] + (self.n_prefix if lean else 0)
        return x

    def pool_head(self, patches: torch.Tensor) -> torch.Tensor:
        """Patch tokens `[T, B, N, D]` -> logits: mean over tokens, then over time, then the linear classifier."""
        return self.head(patches.mean(2).mean(0))

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """Mean over tokens (anchor excluded), then over time, then the linear classifier."""
        return self.pool_head(x[:, :, self.n_prefix:])

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Token features `[T, B, N', D]` after the last block (anchor at index 0 if present)."""
        return self.forward_blocks(self.embed(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x)
        if self.uses_lean_path(tokens):
            return self.pool_head(self.forward_blocks(tokens, lean=True))
        return self.forward_head(self.forward_blocks(tokens))


def _spikformer(**kw) -> Spikformer:
    return Spikformer(**kw)


CIFAR10 = InputSpec((3, 32, 32), timesteps=4, mean=CIFAR_MEAN, std=CIFAR_STD, num_classes=10)
DIGITS = InputSpec((1, 16, 16), timesteps=4, mean=DIGITS_MEAN, std=DIGITS_STD, num_classes=10)
IMAGENET = InputSpec((3, 224, 224), timesteps=4, mean=IMAGENET_MEAN, std=IMAGENET_STD, num_classes=1000)

CIFAR_CFG = dict(embed_dim=384, depth=4, num_heads=12, img_size=32, pool_stages=2, num_classes=10, reference_norms=True)
# the ImageNet reference code has bias-free q/k/v projections
IMAGENET_CFG = dict(embed_dim=512, depth=8, num_heads=8, img_size=224, pool_stages=4, num_classes=1000,
                    qkv_bias=False, reference_norms=True)
TINY_CFG = dict(embed_dim=64, depth=2, num_heads=4, img_size=16, in_chans=1, pool_stages=1, num_classes=10)
# paper-like STATA default (seeds/stata.md): anchor per timestep, EViT's rho = 0.7 and keep-rate warm-up
STATA_CFG = dict(anchor="per_timestep", keep_ratio=0.7, keep_warmup_start=10.0, keep_warmup_epochs=60.0)


@register_model(
    "spikformer-4-384",
    input_spec=CIFAR10,
    paper=PAPER,
    description="CIFAR-10 config: 4 blocks, D=384, 12 heads, T=4",
    family="spikformer",
    **CIFAR_CFG,
)
def spikformer_4_384(**kw) -> Spikformer:
    return _spikformer(**kw)


@register_model(
    "spikformer-stata",
    input_spec=CIFAR10,
    paper=STATA_PAPER,
    description="spikformer-4-384 + STATA: anchor per timestep, prune blocks 2,3 at rho=0.7 (65->46->33 tokens)",
    family="spikformer",
    **CIFAR_CFG, **STATA_CFG, prune_blocks=[2, 3], lean_inference=True,
)
def spikformer_stata(**kw) -> Spikformer:
    return _spikformer(**kw)


@register_model(
    "spikformer-8-512",
    input_spec=IMAGENET,
    paper=PAPER,
    description="ImageNet config: 8 blocks, D=512, 8 heads, 224px, T=4",
    family="spikformer",
    **IMAGENET_CFG,
)
def spikformer_8_512(**kw) -> Spikformer:
    return _spikformer(**kw)


@register_model(
    "spikformer-8-512-stata",
    input_spec=IMAGENET,
    paper=STATA_PAPER,
    description="spikformer-8-512 + STATA: prune blocks 4,6,8 at rho=0.7 (197->139->98->69 tokens)",
    family="spikformer",
    **IMAGENET_CFG, **STATA_CFG, prune_blocks=[4, 6, 8], lean_inference=True,
)
def spikformer_8_512_stata(**kw) -> Spikformer:
    return _spikformer(**kw)


@register_model(
    "spikformer-tiny",
    input_spec=DIGITS,
    paper=PAPER,
    description="digits-sized: 2 blocks, D=64, 4 heads, 16px grayscale, 8x8 tokens, T=4",
    family="spikformer",
    **TINY_CFG,
)
def spikformer_tiny(**kw) -> Spikformer:
    return _spikformer(**kw)


@register_model(
    "spikformer-tiny-stata",
    input_spec=DIGITS,
    paper=STATA_PAPER,
    description="spikformer-tiny + STATA: anchor per timestep, prune blocks 1,2 at rho=0.5 (65->33->17 tokens)",
    family="spikformer",
    **TINY_CFG, anchor="per_timestep", prune_blocks=[1, 2], keep_ratio=0.5, lean_inference=True,
)
def spikformer_tiny_stata(**kw) -> Spikformer:
    return _spikformer(**kw)
