"""LayerSkip's layer dropout (Elhoushi et al. 2024, arXiv 2404.16710): during training, decoder
layer l (0-based, of L) is skipped (its output is its input) with probability

    p_l(t) = p_max * S(t) * D(l)
    D(l) = 2^(l / (L-1)) - 1   (scale: exp, the paper's)   or   l / (L-1)   (scale: linear)
    S(t) = 1 (time: constant, the paper's for continual pre-training and fine-tuning),
           min(t/T, 1) (linear)  or  2^min(t/T, 1) - 1 (exp, the paper's for pre-training)

so the first layer is never dropped and the last at p_max * S(t); t is training progress in
epochs and T = `time_epochs`. `per: sample` draws one decision per sample and layer (the layer
still runs; dropped samples keep their input), `per: batch` one per layer and step (a dropped layer
does not run at all). Draws come from torch's CPU generator (or `generator`), which the trainer
seeds with `train.seed` and stores in its checkpoints: a run and its resume drop the same layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch

from efficient.errors import ConfigError


@dataclass(frozen=True)
class LayerDropoutConfig:
    """`model.layer_dropout` of an `hf` recipe: {max, scale, time, time_epochs, per}."""

    max: float = 0.0
    scale: Literal["exp", "linear"] = "exp"
    time: Literal["constant", "linear", "exp"] = "constant"
    time_epochs: float = 1.0
    per: Literal["sample", "batch"] = "sample"

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "LayerDropoutConfig":
        """Validated config from a recipe mapping; errors name the key and the accepted values."""
        d = dict(d or {})
        names = [f.name for f in fields(cls)]
        for k in d:
            if k not in names:
                raise ConfigError(f"model.layer_dropout.{k}: unknown key; valid keys: {', '.join(names)}")
        cfg = cls(**d)
        if not isinstance(cfg.max, (int, float)) or not 0 <= cfg.max < 1:
            raise ConfigError(f"model.layer_dropout.max must be in [0, 1), got {cfg.max!r}")
        for key, allowed in (("scale", ("exp", "linear")), ("time", ("constant", "linear", "exp")), ("per", ("sample", "batch"))):
            if getattr(cfg, key) not in allowed:
                raise ConfigError(f"model.layer_dropout.{key} must be one of {', '.join(allowed)}; got {getattr(cfg, key)!r}")
        if not isinstance(cfg.time_epochs, (int, float)) or cfg.time_epochs <= 0:
            raise ConfigError(f"model.layer_dropout.time_epochs must be > 0 (epochs over which S(t) rises to 1), got {cfg.time_epochs!r}")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def depth_scale(l: int, num_layers: int, scale: str) -> float:
    """D(l) for 0-based layer l of `num_layers`: 0 at the first layer, 1 at the last."""
    if num_layers <= 1:
        return 0.0
    u = l / (num_layers - 1)
    return 2.0**u - 1.0 if scale == "exp" else u


def time_scale(epoch: float, time_epochs: float, time: str) -> float:
    """S(t) at training progress `epoch` (fractional epochs)."""
    if time == "constant":
        return 1.0
    u = min(max(epoch, 0.0) / time_epochs, 1.0)
    return 2.0**u - 1.0 if time == "exp" else u


class LayerDropout:
    """Rates and draws for one model's decoder layers; `set_progress` moves S(t)."""

    def __init__(self, config: LayerDropoutConfig, num_layers: int, generator: torch.Generator | None = None) -> None:
        self.config, self.num_layers, self.generator = config, num_layers, generator
        self.epoch = 0.0

    @property
    def active(self) -> bool:
        return self.config.max > 0

    def set_progress(self, epoch: float) -> None:
        self.epoch = float(epoch)

    def rates(self) -> list[float]:
        """p_l(t) for every layer at the current progress."""
        c = self.config
        s = time_scale(self.epoch, c.time_epochs, c.time)
        return [c.max * s * depth_scale(l, self.num_layers, c.scale) for l in range(self.num_layers)]

    def draw(self, batch: int, device: torch.device) -> list[torch.Tensor | bool | None]:
        """Per layer: None (kept for every sample), True (dropped for the whole batch, `per: batch`),
        or a bool [B] keep-mask on `device` (`per: sample`). Drawn on the CPU, so the step never
        waits for the device."""
        rates = self.rates()
        u = torch.rand(self.num_layers, batch if self.config.per == "sample" else 1, generator=self.generator)
        out: list[torch.Tensor | bool | None] = []
        for l, p in enumerate(rates):
            if p <= 0:
                out.append(None)
            elif self.config.per == "batch":
                out.append(True if float(u[l, 0]) < p else None)
            else:
                out.append((u[l] >= p).to(device, non_blocking=True))
        return out
