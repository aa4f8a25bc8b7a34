"""Spiking VGG and Wide-ResNet for robust stable SNNs (Ding et al., ICML 2024), LIF or DLIF neurons.

Images `[B, C, H, W]` in [0, 1] are normalised inside the model (so attacks work in pixel space),
repeated over T (direct encoding) and run time-major `[T, B, ...]`; conv/BN see `[T*B, ...]`.
The logits are averaged over T. Architectures follow the paper's code: VGG convs with bias,
BN and avg-pool, two spiking FC layers; WRN pre-activation blocks with a learnable convex
combination of shortcut and residual. Variants are data: `VARIANTS` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from efficient.memory.conv_backward import plain_conv, region_conv2d
from efficient.memory.spikes import is_neuron
from efficient.models import neurons
from efficient.models.replay import replays_whole
from efficient.zoo import InputSpec, Variant, register_variants

PAPER = "Robust Stable Spiking Neural Networks (Ding et al., ICML 2024)"
# The paper code's CIFAR statistics (std differs from the torchvision-usual 0.247/0.243/0.261).
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
DIGITS_MEAN, DIGITS_STD = (0.3,), (0.38,)

NeuronKind = Literal["lif", "dlif"]

# Per-layer plans: ints are 3x3 conv-BN-neuron units, "A" a 2x2 average pool.
VGG_CFGS: dict[str, list[Union[int, str]]] = {
    "vgg5": [64, "A", 128, 128, "A"],
    "vgg11": [64, "A", 128, 256, "A", 512, 512, 512, "A", 512, 512],
    "tiny": [16, "A", 32, "A"],
}


def make_neuron(kind: str, timesteps: int, leak: float, v_threshold: float, width: float, backend: str) -> nn.Module:
    """The paper's neurons: V[t] = leak*V[t-1]*(1-S[t-1]) + a[t]*I[t], hard reset to 0 (not
    detached), triangle surrogate of half-width `width`. LIF is DLIF with a[t] fixed at 1."""
    if not width > 0:
        raise ValueError(f"surrogate width must be > 0, got {width}")
    if kind == "dlif":
        return neurons.DLIF(timesteps, leak=leak, v_threshold=v_threshold, width=width, backend=backend)
    if kind == "lif":
        # V = V - V/tau + X (decay_input=False) is V*leak + X with tau = 1/(1-leak).
        return neurons.LIF(
            tau=1.0 / (1.0 - leak), v_threshold=v_threshold, v_reset=0.0, detach_reset=False,
            decay_input=False, surrogate="triangle", alpha=1.0 / width, backend=backend,
        )
    raise ValueError(f"neuron must be 'lif' or 'dlif', got {kind!r}")


def _per_sample(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a stateless layer to time-major `[T, B, ...]` by merging T into the batch."""
    return fn(x.flatten(0, 1)).unflatten(0, x.shape[:2])


class Normalize(nn.Module):
    """(x - mean) / std per channel, as a buffer so attacks see raw [0, 1] pixels."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        super().__init__()
        if len(mean) != len(std) or any(s <= 0 for s in std):
            raise ValueError(f"mean/std must have one entry per channel and std > 0, got mean={mean}, std={std}")
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def _norm_fire(bn: nn.Module, neuron: nn.Module, z: torch.Tensor, shape: tuple[int, ...],
               made_by: nn.Module | None = None, unit: nn.Module | None = None) -> torch.Tensor:
    """`neuron(bn(z).view(shape))` for z [T*B, C, ...] and the neuron's time-major `shape`; inside a
    recomputed region a DLIF's BatchNorm, gain and neuron run by chunks of channels (`gain_fire`).
    `made_by`: the convolution z is the fresh output of; where it is a plain one (no hook could keep
    z), backward writes z's gradient into z (`gain_fire(donate=True)`). `unit`: the module whose output these spikes
    are; its rerun in backward reads nothing of them, so there they are not computed."""
    rerun = unit is not None and not torch.compiler.is_compiling() and replays_whole(unit)
    s = neurons.gain_fire(bn, neuron, z, shape, donate=made_by is not None and plain_conv(made_by),
                          spikes=not rerun)
    return neuron(bn(z).view(shape)) if s is None else s


class ConvUnit(nn.Module):
    """3x3 conv -> BN -> spiking neuron on `[T, B, C, H, W]`."""

    recompute_unit = True  # efficient.memory: keeps its input, recomputes the rest in backward

    def __init__(self, c_in: int, c_out: int, neuron: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)
        self.neuron = neuron

    def recompute_spike_input(self) -> bool:
        """Whether the unit's input is a spiking conv unit's output: the layer before it in the
        sequence it was placed in (`placed`) is one, read at each call, so a layer swapped since
        counts as what it is now. efficient.memory then keeps the input as bits."""
        seq, i = self.__dict__.get("_placed", (None, 0))
        if seq is None or i == 0 or i >= len(seq) or seq[i] is not self:
            return False
        before = seq[i - 1]
        return isinstance(before, ConvUnit) and is_neuron(before.neuron)

    def recompute_input_from_bits(self) -> bool:
        """Whether a recomputed region may keep this unit's input as bits only and rerun it on a placeholder
        (efficient.memory): the input is spikes, and the unit reads its values only through its convolution,
        which reads `spike_bits` when given (`region_conv2d`; a plain conv, nothing watching it)."""
        return self.recompute_spike_input() and plain_conv(self.conv)

    def placed(self, seq: nn.ModuleList, i: int) -> None:
        """Say that this unit is layer `i` of `seq`, the layers its model calls in order (not a submodule)."""
        self.__dict__["_placed"] = (seq, i)

    def forward(self, x: torch.Tensor, spike_bits: torch.Tensor | None = None) -> torch.Tensor:
        """`spike_bits`: x's bits, which a compiled recomputed region keeps (efficient.memory)."""
        z = region_conv2d(self.conv, x.flatten(0, 1), spikes=self.recompute_spike_input(), bits=spike_bits)
        return _norm_fire(self.bn, self.neuron, z, (*x.shape[:2], *z.shape[1:]), made_by=self.conv, unit=self)


class ConvexCombination(nn.Module):
    """sum_i w_i * inputs_i with learnable weights initialised to 1/n (kept on the simplex by AT+Reg)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.comb = nn.Parameter(torch.full((n,), 1.0 / n))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if len(xs) != self.n:
            raise ValueError(f"ConvexCombination({self.n}) got {len(xs)} inputs")
        return sum(w * x for w, x in zip(self.comb, xs))  # type: ignore[return-value]


@dataclass
class StableSNNConfig:
    """The options every stable-SNN takes (recipe keys of the same names): the neuron kind and its
    dynamics (`make_neuron`), T, the task's classes and images, the normalisation inside the model
    (None: the CIFAR statistics for 3 input channels, the digits' otherwise) and the neuron backend."""

    neuron: NeuronKind = "dlif"
    timesteps: int = 8
    num_classes: int = 10
    in_chans: int = 3
    img_size: int = 32
    leak: float = 0.99
    v_threshold: float = 1.0
    width: float = 1.0
    mean: list[float] | None = None
    std: list[float] | None = None
    backend: str = "auto"


@dataclass
class SpikingVGGConfig(StableSNNConfig):
    """A spiking VGG's options: the shared ones and the width of its two spiking FC layers."""

    fc_dim: int = 4096


@dataclass
class SpikingWRNConfig(StableSNNConfig):
    """A spiking WRN-depth-widen's options: the shared ones, depth (6n+4), widening factor and the
    dropout inside its blocks."""

    depth: int = 16
    widen: int = 4
    drop: float = 0.0


def _stats(mean: list[float] | None, std: list[float] | None, in_chans: int) -> tuple[list[float], list[float]]:
    if mean is None or std is None:
        m, s = (CIFAR_MEAN, CIFAR_STD) if in_chans == 3 else (DIGITS_MEAN * in_chans, DIGITS_STD * in_chans)
        mean, std = list(mean or m), list(std or s)
    if len(mean) != in_chans or len(std) != in_chans:
        raise ValueError(f"mean/std need {in_chans} entries (one per input channel), got {len(mean)} and {len(std)}")
    return mean, std


def _check(cfg: StableSNNConfig) -> None:
    if cfg.timesteps < 1:
        raise ValueError(f"timesteps must be >= 1, got {cfg.timesteps}")
    if not 0.0 <= cfg.leak < 1.0:
        raise ValueError(f"leak must be in [0, 1), got {cfg.leak}")
    if cfg.neuron not in ("lif", "dlif"):
        raise ValueError(f"neuron must be 'lif' or 'dlif', got {cfg.neuron!r}")


class _SpikingNet(nn.Module):
    """Shared by the VGG and the WRN: the options' checks, input handling (check shape, normalise,
    repeat over T), the neurons of the config, the paper code's init and the time average."""

    def __init__(self, cfg: StableSNNConfig) -> None:
        super().__init__()
        _check(cfg)
        mean, std = _stats(cfg.mean, cfg.std, cfg.in_chans)
        self.timesteps, self.in_chans, self.img_size, self.num_classes = cfg.timesteps, cfg.in_chans, cfg.img_size, cfg.num_classes
        self.normalize = Normalize(mean, std)

    @staticmethod
    def neuron_fn(cfg: StableSNNConfig) -> Callable[[], nn.Module]:
        """A new neuron of the config's kind and dynamics per call."""
        return lambda: make_neuron(cfg.neuron, cfg.timesteps, cfg.leak, cfg.v_threshold, cfg.width, cfg.backend)

    def init_weights(self) -> None:
        """Kaiming-normal convs (fan out), BN at identity, zero linear biases (the paper's code)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_chans or tuple(x.shape[-2:]) != (self.img_size, self.img_size):
            raise ValueError(
                f"{type(self).__name__} expects images [B, {self.in_chans}, {self.img_size}, {self.img_size}] "
                f"in [0, 1]; got {list(x.shape)}"
            )
        x = self.normalize(x)
        return x.unsqueeze(0).expand(self.timesteps, *x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits `[B, num_classes]`, averaged over T."""
        return self.forward_time(x).mean(0)


class SpikingVGG(_SpikingNet):
    """VGG plan of conv units and pools, then Linear-neuron-Linear-neuron-Linear (the last neuron
    is the 'last spiking layer' whose input current the stability objective compares)."""

    def __init__(self, plan: Sequence[Union[int, str]], config: SpikingVGGConfig) -> None:
        super().__init__(config)
        neuron_fn, fc_dim, img_size = self.neuron_fn(config), config.fc_dim, config.img_size
        layers: list[nn.Module] = []
        c, side = config.in_chans, img_size
        for item in plan:
            if item == "A":
                if side % 2:
                    raise ValueError(f"img_size {img_size} is not divisible by 2 at every average pool of the VGG plan")
                layers.append(nn.AvgPool2d(2))
                side //= 2
            else:
                layers.append(ConvUnit(c, int(item), neuron_fn()))
                c = int(item)
        self.features = nn.ModuleList(layers)
        for i, layer in enumerate(self.features):
            if isinstance(layer, ConvUnit):
                layer.placed(self.features, i)
        self.fc1 = nn.Linear(c * side * side, fc_dim)
        self.neuron1 = neuron_fn()
        self.fc2 = nn.Linear(fc_dim, fc_dim)
        self.neuron2 = neuron_fn()
        self.head = nn.Linear(fc_dim, config.num_classes)
        self.init_weights()

    def forward_time(self, x: torch.Tensor) -> torch.Tensor:
        """Per-timestep logits `[T, B, num_classes]`."""
        x = self.encode(x)
        for layer in self.features:
            x = _per_sample(layer, x) if isinstance(layer, nn.AvgPool2d) else layer(x)
        x = x.flatten(2)
        x = self.neuron1(self.fc1(x))
        x = self.neuron2(self.fc2(x))
        return self.head(x)


def vgg(plan: str) -> Callable[[SpikingVGGConfig], SpikingVGG]:
    """What builds the spiking VGG of layer plan `VGG_CFGS[plan]` from a config."""
    return lambda config: SpikingVGG(VGG_CFGS[plan], config)


class WideBlock(nn.Module):
    """Pre-activation wide basic block: BN-neuron-conv-BN-neuron-conv, then a convex
    combination of the shortcut and the residual branch."""

    recompute_unit = True  # efficient.memory: a block keeps only its input and reruns in backward

    def __init__(self, c_in: int, c_out: int, stride: int, neuron_fn: Callable[[], nn.Module], drop: float) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.neuron1 = neuron_fn()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.neuron2 = neuron_fn()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.drop = drop
        self.equal = c_in == c_out and stride == 1
        self.shortcut = None if self.equal else nn.Conv2d(c_in, c_out, 1, stride, 0, bias=False)
        self.convex = ConvexCombination(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = _norm_fire(self.bn1, self.neuron1, x.flatten(0, 1), x.shape)
        # Equal shapes: identity on the raw input; otherwise a 1x1 conv on the activated input.
        skip = x if self.shortcut is None else _per_sample(self.shortcut, a)
        z = self.conv1(a.flatten(0, 1))
        h = _norm_fire(self.bn2, self.neuron2, z, (*a.shape[:2], *z.shape[1:]), made_by=self.conv1)
        if self.drop > 0:
            h = F.dropout(h, p=self.drop, training=self.training)
        h = _per_sample(self.conv2, h)
        return self.convex(skip, h)


class SpikingWRN(_SpikingNet):
    """WRN-depth-k: 3x3 stem, three groups of (depth-4)/6 wide blocks (16k, 32k, 64k channels),
    final BN-neuron (the last spiking layer), global average pool, linear head."""

    def __init__(self, config: SpikingWRNConfig) -> None:
        super().__init__(config)
        depth, widen = config.depth, config.widen
        if (depth - 4) % 6:
            raise ValueError(f"WRN depth must be 6n+4 (16, 22, 28, ...), got {depth}")
        if config.img_size % 4:
            raise ValueError(f"WRN img_size must be divisible by 4 (two stride-2 groups), got {config.img_size}")
        neuron_fn = self.neuron_fn(config)
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.stem = nn.Conv2d(config.in_chans, widths[0], 3, 1, 1, bias=False)
        blocks: list[nn.Module] = []
        c = widths[0]
        for g, stride in zip(range(3), (1, 2, 2)):
            for i in range(n):
                blocks.append(WideBlock(c, widths[g + 1], stride if i == 0 else 1, neuron_fn, config.drop))
                c = widths[g + 1]
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(c)
        self.neuron = neuron_fn()
        self.head = nn.Linear(c, config.num_classes)
        self.init_weights()

    def forward_time(self, x: torch.Tensor) -> torch.Tensor:
        x = _per_sample(self.stem, self.encode(x))
        for blk in self.blocks:
            x = blk(x)
        x = self.neuron(_per_sample(self.bn, x))
        return self.head(x.mean((-2, -1)))


CIFAR10 = InputSpec((3, 32, 32), timesteps=8, mean=CIFAR_MEAN, std=CIFAR_STD, num_classes=10)
DIGITS = InputSpec((1, 8, 8), timesteps=8, mean=DIGITS_MEAN, std=DIGITS_STD, num_classes=10)

# The zoo entries. A VGG names the builder of its layer plan; the WRN is the family's model.
VARIANTS: dict[str, Variant] = {
    "stable-snn-vgg11": Variant(CIFAR10, PAPER, "spiking VGG-11 (8 convs, two 4096 spiking FC), DLIF, T=8; 61.4M params",
                                SpikingVGGConfig(), model=vgg("vgg11")),
    "stable-snn-vgg5": Variant(CIFAR10, PAPER, "spiking VGG-5 of the paper's ablations (3 convs, two 4096 spiking FC), DLIF, T=8",
                               SpikingVGGConfig(), model=vgg("vgg5")),
    "stable-snn-digits": Variant(DIGITS, PAPER, "digits-sized spiking VGG (convs 16-32, two 128 spiking FC), 1x8x8, DLIF, T=8",
                                 SpikingVGGConfig(in_chans=1, img_size=8, fc_dim=128), model=vgg("tiny")),
    "stable-snn-wrn16": Variant(CIFAR10, PAPER, "spiking WRN-16-4 with convex-combination residuals, DLIF, T=8; 2.75M params",
                                SpikingWRNConfig()),
}

register_variants(SpikingWRN, VARIANTS, family="stable-snn")
