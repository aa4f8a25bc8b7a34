"""White-box L-inf attacks (FGSM, PGD, APGD-CE/DLR) and robust-accuracy evaluation for SNNs.

Models take images in [0, 1] (normalisation inside the model) and return logits averaged over
time; gradients flow back through time with the model's own surrogate (BPTT). Every attack runs
the model in eval mode (BN running statistics) and restores its mode afterwards. APGD comes from
torchattacks. Robust accuracy counts a sample as robust only if it is classified correctly both
clean and under attack, so it never exceeds clean accuracy (APGD attacks only correct samples).
The worst case over a suite of adaptive attacks (`worst_case`, `SuiteConfig`) builds on these in
`efficient.attacks.suite`, the gradient-masking checks (`masking_checks`) in `efficient.attacks.masking`.
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ConfigError

ATTACKS = ("fgsm", "pgd", "apgd-ce", "apgd-dlr")
# PGD step sizes of the paper's evaluation (eps 8/255), as fractions of eps: PGD-7 uses 2.55/255.
# Other step counts use Madry et al.'s 2.5 * eps / steps (which also gives 10, 20 and 40 steps' sizes).
_PGD_ALPHA_FRACTION = {7: 2.55 / 8}


def parse_eps(text: str | float, name: str = "--eps") -> float:
    """`"8/255"`, `"0.03"` or a number -> float in [0, 1]."""
    if isinstance(text, (int, float)):
        return check_eps(float(text), name)
    try:
        value = float(Fraction(text.strip())) if "/" in text else float(text)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{name} {text!r}: expected a number or a fraction such as 8/255") from None
    return check_eps(value, name)


def check_eps(eps: float, name: str = "eps") -> float:
    if not (0.0 <= eps <= 1.0):
        raise ConfigError(f"{name}={eps!r} is outside [0, 1]: attacks work on images in [0, 1], so give e.g. 8/255")
    return eps


def check_attack(name: str) -> str:
    if name not in ATTACKS:
        hint = difflib.get_close_matches(name, ATTACKS, n=1, cutoff=0.4)
        raise ConfigError(
            f"unknown attack {name!r}." + (f" Did you mean {hint[0]!r}?" if hint else "") + f" Choose from {', '.join(ATTACKS)}."
        )
    return name


def default_alpha(eps: float, steps: int) -> float:
    """PGD step size: the paper's table at 7 steps, else 2.5 * eps / steps."""
    return eps * _PGD_ALPHA_FRACTION.get(steps, 2.5 / steps)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run `model` in eval mode inside the block; restore its previous mode after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def project(x_adv: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Clip into the L-inf ball of radius eps around x, then into [0, 1]."""
    return torch.min(torch.max(x_adv, x - eps), x + eps).clamp(0.0, 1.0)


def input_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """d CE(model(x), y) / dx, without touching parameter gradients."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        loss = F.cross_entropy(model(x).float(), y, reduction=reduction)
        (g,) = torch.autograd.grad(loss, [x])
    return g.detach()


def fgsm(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    """x + eps * sign(grad), clipped to [0, 1] (Goodfellow et al., 2015)."""
    check_eps(eps)
    with eval_mode(model):
        g = input_grad(model, x, y)
    return project(x + eps * g.sign(), x, eps).detach()


def pgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    eps: float,
    steps: int = 10,
    alpha: float | None = None,
    random_start: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """L-inf PGD (Madry et al., 2018): optional uniform start in the ball, `steps` signed-gradient
    steps of size `alpha`, each projected back into the ball and [0, 1]."""
    check_eps(eps)
    if steps < 1:
        raise ConfigError(f"PGD needs steps >= 1, got {steps}")
    alpha = default_alpha(eps, steps) if alpha is None else alpha
    if alpha < 0:
        raise ConfigError(f"PGD step size alpha must be >= 0, got {alpha}")
    x = x.detach()
    x_adv = x
    if random_start:
        u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        x_adv = project(x + (2 * u - 1) * eps, x, eps)
    with eval_mode(model):
        for _ in range(steps):
            g = input_grad(model, x_adv, y)
            x_adv = project(x_adv + alpha * g.sign(), x, eps)
    return x_adv.detach()


def apgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    eps: float,
    steps: int = 10,
    loss: str = "ce",
    seed: int = 0,
    n_restarts: int = 1,
    rho: float = 0.75,
) -> torch.Tensor:
    """Auto-PGD (Croce & Hein, 2020) from torchattacks: initial step 2*eps, checkpoint decay rho,
    one EOT sample; only correctly classified inputs are attacked. The global RNG is left as found."""
    check_eps(eps)
    if loss not in ("ce", "dlr"):
        raise ConfigError(f"APGD loss must be 'ce' or 'dlr', got {loss!r}")
    import torchattacks

    atk = torchattacks.APGD(model, norm="Linf", eps=eps, steps=steps, n_restarts=n_restarts, seed=seed, loss=loss, eot_iter=1, rho=rho)
    devices = [x.device] if x.device.type == "cuda" else []
    # torchattacks reseeds the global generator and switches the model to eval internally.
    with torch.random.fork_rng(devices=devices), eval_mode(model):
        out = atk(x.detach(), y)
    return project(out.detach(), x, eps)


@dataclass(frozen=True)
class AttackSpec:
    """One attack configuration of an evaluation: name, eps, steps, step size, random start."""

    name: str
    eps: float
    steps: int | None = None
    alpha: float | None = None
    random_start: bool = True

    def __post_init__(self) -> None:
        check_attack(self.name)
        check_eps(self.eps)
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"{self.name}: steps must be >= 1, got {self.steps}")

    @property
    def n_steps(self) -> int:
        return 1 if self.name == "fgsm" else (self.steps or 10)

    @property
    def step_size(self) -> float | None:
        if self.name == "fgsm":
            return self.eps
        if self.name == "pgd":
            return default_alpha(self.eps, self.n_steps) if self.alpha is None else self.alpha
        return None  # APGD adapts its own step size

    @property
    def label(self) -> str:
        return "fgsm" if self.name == "fgsm" else f"{self.name}-{self.n_steps}"


def run_attack(model: nn.Module, x: torch.Tensor, y: torch.Tensor, spec: AttackSpec, seed: int = 0) -> torch.Tensor:
    """Adversarial inputs for one `AttackSpec`."""
    if spec.name == "fgsm":
        return fgsm(model, x, y, spec.eps)
    if spec.name == "pgd":
        g = torch.Generator(device=x.device).manual_seed(seed)
        return pgd(model, x, y, spec.eps, spec.n_steps, spec.step_size, spec.random_start, generator=g)
    if spec.name == "apgd-dlr" and getattr(model, "num_classes", 3) < 3:
        raise ConfigError("apgd-dlr needs at least 3 classes (its loss uses the third-largest logit); use apgd-ce")
    return apgd(model, x, y, spec.eps, spec.n_steps, loss=spec.name.split("-")[1], seed=seed)


@torch.no_grad()
def _predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).argmax(-1)


def pixel_batch(x: torch.Tensor, y: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) on `device`, refusing inputs outside [0, 1]: the attacks' eps are in pixel units."""
    x, y = x.to(device), y.to(device)
    if x.min() < 0 or x.max() > 1:
        raise ConfigError(
            f"attack inputs must be images in [0, 1], got values in [{x.min().item():.3g}, {x.max().item():.3g}]; "
            "load the data with normalize: false (the model normalises inside)"
        )
    return x, y


def robust_accuracy(
    model: nn.Module,
    batches: Iterable[Any],
    specs: list[AttackSpec],
    device: torch.device | str = "cpu",
    max_batches: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Clean and robust accuracy over `batches` of (images in [0, 1], labels).

    Returns {"n", "clean", "attacks": [{attack, eps, steps, alpha, acc}, ...]} with accuracies in [0, 1]."""
    correct = [0] * len(specs)
    clean, n = 0, 0
    with eval_mode(model):
        for i, (x, y) in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            x, y = pixel_batch(x, y, device)
            ok = _predict(model, x) == y
            clean += int(ok.sum())
            n += len(y)
            for j, spec in enumerate(specs):
                x_adv = run_attack(model, x, y, spec, seed=seed + i)
                correct[j] += int((ok & (_predict(model, x_adv) == y)).sum())
    if n == 0:
        raise ConfigError("no samples to evaluate: the data split is empty")
    rows = [
        {"attack": s.label, "eps": s.eps, "steps": s.n_steps, "alpha": s.step_size, "random_start": s.random_start if s.name == "pgd" else None, "acc": c / n}
        for s, c in zip(specs, correct)
    ]
    return {"n": n, "clean": clean / n, "attacks": rows}


__all__ = [
    "ATTACKS", "AttackSpec", "apgd", "check_attack", "check_eps", "default_alpha", "eval_mode", "fgsm",
    "input_grad", "parse_eps", "pgd", "project", "robust_accuracy", "run_attack",
]
