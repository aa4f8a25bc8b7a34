"""Worst-case robust accuracy over a suite of adaptive L-inf attacks (`efficient.attacks.worst_case`).

Spiking networks can mask gradients (non-differentiable spikes, a surrogate that differs from the
true dynamics), so one white-box attack through the training surrogate can overstate robustness.
The suite attacks every correctly classified example with: APGD-CE and APGD-DLR (torchattacks,
with restarts), PGD with several random restarts, BPTT attacks through other surrogates than the
model's own (a smooth sigmoid and the straight-through estimator, swapped in at attack time only),
a transfer attack from an independently trained model, and the gradient-free Square attack
(torchattacks). An example counts as robust only if it is classified correctly clean and under
every attack, so the worst case is never above any single attack's accuracy.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from efficient.attacks.white_box import apgd, check_eps, eval_mode, pgd, pixel_batch, project
from efficient.errors import ConfigError

# Suite members in the order they run (and are reported).
SUITE_ATTACKS = ("apgd-ce", "apgd-dlr", "pgd", "bptt", "transfer", "square")
# Attacks that use the model's own gradient (its training surrogate): the white-box reference the
# masking checks compare black-box, transfer and other-surrogate attacks against.
OWN_GRADIENT = ("apgd-ce", "apgd-dlr", "pgd")


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes of the suite's attacks. Defaults follow AutoAttack (APGD 100 steps, Square's schedule)
    with restarts cut to fit a CPU: every gradient attack gets 100 steps, APGD 2 restarts, PGD 3
    random starts, Square 1000 queries (AutoAttack's 5000 is sized for 3072-pixel CIFAR; digits
    have 64). PGD's step is `pgd_step` * eps (0.25: the paper's PGD-10 step, 2/255 at 8/255), so
    PGD-100 is the usual PGD-10 run ten times longer; Madry's 2.5 * eps / 100 left more examples
    standing than PGD-10 on a digits SNN (its steps are too short to leave the flat regions spikes make). `surrogates`: (name, alpha)
    pairs for the other-surrogate BPTT attacks (APGD-CE with `apgd_steps` through that surrogate);
    sigmoid with alpha 1 is far smoother than the training triangle, ste passes gradients straight
    through. `only`: run a subset of `SUITE_ATTACKS` (None: all)."""

    apgd_steps: int = 100
    apgd_restarts: int = 2
    pgd_steps: int = 100
    pgd_restarts: int = 3
    pgd_step: float = 0.25
    surrogates: tuple[tuple[str, float], ...] = (("sigmoid", 1.0), ("ste", 1.0))
    transfer_steps: int = 100
    square_queries: int = 1000
    square_p_init: float = 0.8
    only: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("apgd_steps", "apgd_restarts", "pgd_steps", "pgd_restarts", "transfer_steps", "square_queries"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"suite {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.pgd_step <= 1.0:
            raise ConfigError(f"suite pgd_step (a fraction of eps) must be in (0, 1], got {self.pgd_step}")
        if not 0.0 < self.square_p_init <= 1.0:
            raise ConfigError(f"suite square_p_init must be in (0, 1], got {self.square_p_init}")
        from efficient.kernels.lif import SURROGATES

        for sg, alpha in self.surrogates:
            if sg not in SURROGATES:
                raise ConfigError(f"suite surrogate {sg!r} is unknown; choose from {', '.join(sorted(SURROGATES))}")
            if not alpha > 0:
                raise ConfigError(f"suite surrogate {sg}: alpha must be > 0, got {alpha}")
        for name in self.only or ():
            if name not in SUITE_ATTACKS:
                raise ConfigError(f"suite attack {name!r} is unknown; choose from {', '.join(SUITE_ATTACKS)}")

    def runs(self, name: str) -> bool:
        return self.only is None or name in self.only


def has_spiking_neurons(model: nn.Module) -> bool:
    from efficient.models.neurons import SpikingNeuron

    return any(isinstance(m, SpikingNeuron) for m in model.modules())


@torch.no_grad()
def _correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x).argmax(-1) == y


def _square(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, queries: int, p_init: float, seed: int) -> torch.Tensor:
    """torchattacks' Square (margin loss, one restart); the global RNG is left as found."""
    import torchattacks

    atk = torchattacks.Square(model, norm="Linf", eps=eps, n_queries=queries, n_restarts=1, p_init=p_init, loss="margin", seed=seed)
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), eval_mode(model):
        out = atk(x.detach(), y)
    return project(out.detach(), x, eps)


@dataclass
class _Member:
    """One suite attack: `run(x, y) -> survived mask` on correctly classified examples."""

    label: str
    params: dict[str, Any]
    run: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None
    skipped: str | None = None
    survived: list[torch.Tensor] = field(default_factory=list)
    first_restart: list[torch.Tensor] = field(default_factory=list)
    seconds: float = 0.0


def _members(model: nn.Module, eps: float, cfg: SuiteConfig, source: nn.Module | None) -> list[_Member]:
    from efficient.models.neurons import override_surrogate

    out: list[_Member] = []
    n_classes = getattr(model, "num_classes", None)
    for loss in ("ce", "dlr"):
        name = f"apgd-{loss}"
        if not cfg.runs(name):
            continue
        params = {"steps": cfg.apgd_steps, "restarts": cfg.apgd_restarts}
        if loss == "dlr" and n_classes is not None and n_classes < 3:
            out.append(_Member(name, params, None, skipped="APGD-DLR needs at least 3 classes"))
            continue
        out.append(_Member(name, params, lambda x, y, s, loss=loss: _correct(
            model, apgd(model, x, y, eps, cfg.apgd_steps, loss=loss, seed=s, n_restarts=cfg.apgd_restarts), y)))
    if cfg.runs("pgd"):
        out.append(_Member("pgd", {"steps": cfg.pgd_steps, "restarts": cfg.pgd_restarts, "step": f"{cfg.pgd_step} eps"}, None))  # run by worst_case
    if cfg.runs("bptt"):
        spiking = has_spiking_neurons(model)
        for sg, alpha in cfg.surrogates:
            params = {"steps": cfg.apgd_steps, "surrogate": sg, "alpha": alpha, "via": "apgd-ce"}
            if not spiking:
                out.append(_Member(f"bptt-{sg}", params, None, skipped="the model has no spiking neurons to give another surrogate"))
                continue

            def run(x: torch.Tensor, y: torch.Tensor, s: int, sg: str = sg, alpha: float = alpha) -> torch.Tensor:
                with override_surrogate(model, sg, alpha):
                    x_adv = apgd(model, x, y, eps, cfg.apgd_steps, loss="ce", seed=s)
                return _correct(model, x_adv, y)  # spikes do not depend on the surrogate; judged as restored

            out.append(_Member(f"bptt-{sg}", params, run))
    if cfg.runs("transfer"):
        params = {"steps": cfg.transfer_steps, "via": "pgd on the source model"}
        if source is None:
            out.append(_Member("transfer", params, None, skipped="no source model given (--source RUN)"))
        else:
            def run_transfer(x: torch.Tensor, y: torch.Tensor, s: int) -> torch.Tensor:
                g = torch.Generator(device=x.device).manual_seed(s)
                return _correct(model, pgd(source, x, y, eps, cfg.transfer_steps, cfg.pgd_step * eps, generator=g), y)

            out.append(_Member("transfer", params, run_transfer))
    if cfg.runs("square"):
        out.append(_Member("square", {"queries": cfg.square_queries, "p_init": cfg.square_p_init}, lambda x, y, s: _correct(
            model, _square(model, x, y, eps, cfg.square_queries, cfg.square_p_init, s), y)))
    return out


def pgd_best(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, steps: int, alpha: float,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """L-inf PGD from a uniform random start that keeps, per example, the first iterate the model
    misclassifies (else the last). Plain PGD returns its last iterate, and with a fixed step an
    example broken at step 10 can be classified right again at step 100; an evaluation must count
    it as broken. The predictions come from the forward passes the gradients need (one extra
    forward for the last iterate). Call in eval mode."""
    x = x.detach()
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    x_adv = project(x + (2 * u - 1) * eps, x, eps)
    best = x_adv.clone()
    done = torch.zeros(len(y), dtype=torch.bool, device=y.device)
    for _ in range(steps):
        with torch.enable_grad():
            xa = x_adv.detach().requires_grad_(True)
            logits = model(xa)
            (g,) = torch.autograd.grad(F.cross_entropy(logits.float(), y, reduction="sum"), [xa])
        wrong = (logits.detach().argmax(-1) != y) & ~done
        best[wrong], done = x_adv[wrong], done | wrong
        x_adv = project(x_adv + alpha * g.sign(), x, eps)
    keep = done.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, best, x_adv).detach()


def pgd_accuracy(model: nn.Module, batches: list[Any], eps: float, steps: int, alpha: float, seed: int = 0,
                 device: torch.device | str = "cpu") -> float:
    """Fraction of all examples classified right clean and under `pgd_best` (one random start)."""
    ok_total, n = 0, 0
    with eval_mode(model):
        for i, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            ok = _correct(model, x, y)
            n += len(y)
            if ok.any():
                # a start of its own (the suite's restarts use offsets 101 * r), so a check comparing
                # this with the suite's PGD compares two runs, not a prefix of one run with the run
                g = torch.Generator(device=x.device).manual_seed((seed + i) * 1009 + 50)
                ok_total += int(_correct(model, pgd_best(model, x[ok], y[ok], eps, steps, alpha, g), y[ok]).sum())
    if n == 0:
        raise ConfigError("no samples to evaluate: the data split is empty")
    return ok_total / n


def _pgd_restarts(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, cfg: SuiteConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pgd_best` from `pgd_restarts` random starts; later starts attack only the survivors (the
    result per example is the same). Returns (survived all starts, survived the first)."""
    alive = torch.ones(len(y), dtype=torch.bool, device=y.device)
    first = alive
    for r in range(cfg.pgd_restarts):
        idx = alive.nonzero().flatten()
        if len(idx) == 0:
            break
        g = torch.Generator(device=x.device).manual_seed(seed * 1009 + 101 * r)
        ok = _correct(model, pgd_best(model, x[idx], y[idx], eps, cfg.pgd_steps, cfg.pgd_step * eps, g), y[idx])
        alive = alive.clone()
        alive[idx] = ok
        if r == 0:
            first = alive.clone()
    return alive, first


def worst_case(
    model: nn.Module,
    batches: Iterable[Any],
    eps: float,
    config: SuiteConfig | None = None,
    source: nn.Module | None = None,
    device: torch.device | str = "cpu",
    max_batches: int | None = None,
    seed: int = 0,
    per_example: bool = False,
) -> dict[str, Any]:
    """Per-example worst case of the suite over `batches` of (images in [0, 1], labels).

    Returns {"n", "eps", "clean", "worst_case", "attacks": [{attack, acc, seconds, unique_breaks,
    ...params} or {attack, skipped}], "seconds", "seconds_per_image", "config"}; accuracies are
    fractions of all n examples. `unique_breaks` counts examples only that attack broke.
    `source` (optional) is an independently trained model for the transfer attack. With
    `per_example`, the result also holds {"per_example": {"clean": [bool] * n, "survived": {attack:
    [bool] * n}}}: which examples were classified correctly, and which of those each attack left
    correct (the masks the worst case and `unique_breaks` are computed from).
    """
    check_eps(eps)
    cfg = config or SuiteConfig()
    members = _members(model, eps, cfg, source)
    clean_ok: list[torch.Tensor] = []
    n = 0
    ctx = eval_mode(source) if source is not None else contextlib.nullcontext()
    with eval_mode(model), ctx:
        for i, (x, y) in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            x, y = pixel_batch(x, y, device)
            ok = _correct(model, x, y)
            clean_ok.append(ok)
            n += len(y)
            xc, yc = x[ok], y[ok]
            for m in members:
                if m.skipped is not None:
                    continue
                t0 = time.perf_counter()
                if len(yc) == 0:
                    alive = first = torch.zeros(0, dtype=torch.bool, device=y.device)
                elif m.label == "pgd":
                    alive, first = _pgd_restarts(model, xc, yc, eps, cfg, seed + i)
                else:
                    alive = first = m.run(xc, yc, seed + i)
                m.seconds += time.perf_counter() - t0
                full = torch.zeros_like(ok)
                full[ok] = alive
                m.survived.append(full)
                if m.label == "pgd":
                    full_first = torch.zeros_like(ok)
                    full_first[ok] = first
                    m.first_restart.append(full_first)
    if n == 0:
        raise ConfigError("no samples to evaluate: the data split is empty")
    clean = torch.cat(clean_ok)
    ran = [m for m in members if m.skipped is None]
    if not ran:
        raise ConfigError("the suite ran no attack (all were skipped or left out by `only`); nothing to take the worst case of")
    masks = {m.label: torch.cat(m.survived) for m in ran}
    robust = clean.clone()
    for mask in masks.values():
        robust &= mask
    rows: list[dict[str, Any]] = []
    for m in members:
        if m.skipped is not None:
            rows.append({"attack": m.label, **m.params, "acc": None, "skipped": m.skipped})
            continue
        others = clean.clone()
        for label, mask in masks.items():
            if label != m.label:
                others &= mask
        row = {"attack": m.label, **m.params, "acc": masks[m.label].float().mean().item(),
               "seconds": m.seconds, "unique_breaks": int((others & ~masks[m.label]).sum())}
        if m.first_restart:
            row["acc_first_restart"] = torch.cat(m.first_restart).float().mean().item()
        rows.append(row)
    seconds = sum(m.seconds for m in ran)
    out = {
        "n": n, "eps": eps, "clean": clean.float().mean().item(), "worst_case": robust.float().mean().item(),
        "attacks": rows, "seconds": seconds, "seconds_per_image": seconds / n, "config": asdict(cfg),
    }
    if per_example:
        out["per_example"] = {"clean": clean.tolist(), "survived": {k: v.tolist() for k, v in masks.items()}}
    return out


__all__ = ["OWN_GRADIENT", "SUITE_ATTACKS", "SuiteConfig", "has_spiking_neurons", "pgd_accuracy", "pgd_best", "worst_case"]
