"""Gradient-masking checks (Carlini et al., "On Evaluating Adversarial Robustness", 2019) on a suite result.

Each check compares accuracies an honest evaluation must order one way; a violation beyond `tol`
(accuracy points as a fraction, default 0.02: a few examples of noise) says the gradients the
white-box attacks follow are masked, so their robust accuracy is not to be believed:

1. accuracy under PGD falls monotonically with eps and is about 0 at a large eps (128/255);
2. more iterations never help the model (PGD-N, N the suite's steps, vs PGD-k, k < N);
3. iterative attacks beat single-step ones (PGD-k vs FGSM);
4. black-box (Square) and transfer attacks never beat the white-box ones (the model's own gradient);
5. for SNNs, BPTT through another surrogate never beats the model's own surrogate.

The checks run FGSM at eps and the suite's PGD (`pgd_best`, the suite's step as a fraction of
each eps) for k steps on an eps grid that contains eps, so check 2 compares the same attack run for k
and for N steps (from independent random starts: from the same start, a PGD that keeps its first
misclassifying iterate could never do worse with more steps); the rest come from `worst_case`'s result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from efficient.attacks.suite import OWN_GRADIENT, pgd_accuracy
from efficient.attacks.white_box import AttackSpec, check_eps, robust_accuracy
from efficient.errors import ConfigError


@dataclass(frozen=True)
class CheckConfig:
    """`tol`: allowed violation (fraction of examples); `steps`: k of the short PGD-k; `large_eps`
    and `large_max_acc`: the eps where accuracy must be about 0, and how high 'about 0' may be."""

    tol: float = 0.02
    steps: int = 10
    large_eps: float = 128 / 255
    large_max_acc: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.tol < 1.0:
            raise ConfigError(f"check tol must be in [0, 1), got {self.tol}")
        if self.steps < 1:
            raise ConfigError(f"check steps must be >= 1, got {self.steps}")
        check_eps(self.large_eps, "large_eps")
        if not 0.0 <= self.large_max_acc <= 1.0:
            raise ConfigError(f"check large_max_acc must be in [0, 1], got {self.large_max_acc}")


@dataclass(frozen=True)
class Check:
    """One check: `passed` is None when it does not apply (with the reason in `detail`)."""

    name: str
    passed: bool | None
    detail: str
    values: dict[str, Any]

    @property
    def status(self) -> str:
        return "n/a" if self.passed is None else ("PASS" if self.passed else "FAIL")

    def line(self) -> str:
        return f"{self.status:4}  {self.name}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.name, "status": self.status, "passed": self.passed, "detail": self.detail, "values": self.values}


def eps_grid(eps: float, large: float) -> list[float]:
    """eps/2, eps, 2 eps, 4 eps (those multiples below `large`), eps itself and `large`."""
    return sorted({e for e in (eps / 2, 2 * eps, 4 * eps) if e < large} | {eps, large})


def _pct(a: float) -> str:
    return f"{100 * a:.1f}%"


def _acc(suite: dict[str, Any], label: str) -> float | None:
    for row in suite["attacks"]:
        if row["attack"] == label:
            return row.get("acc")
    return None


def _never_beats(name: str, white: float | None, others: dict[str, float], tol: float, reference: str, missing: str) -> Check:
    """Check that no attack in `others` beats the white-box accuracy `white` by more than `tol`."""
    if white is None or not others:
        return Check(name, None, f"n/a: {missing}", {})
    beaten = {a: v for a, v in others.items() if v < white - tol}
    detail = f"{reference} vs " + ", ".join(f"{a} {_pct(v)}" for a, v in others.items())
    return Check(name, not beaten, detail, {"white_box": white, **others})


def masking_checks(
    model: nn.Module,
    batches: Iterable[Any],
    suite: dict[str, Any],
    config: CheckConfig | None = None,
    device: torch.device | str = "cpu",
    max_batches: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the checks for a `worst_case` result `suite` (same model and batches).

    Returns {"passed": all applicable checks passed, "checks": [Check.as_dict()...], "runs": the
    extra FGSM / PGD-k accuracies}."""
    cfg = config or CheckConfig()
    eps = float(suite["eps"])
    if eps <= 0:
        raise ConfigError("masking checks need eps > 0 (at eps 0 every attack returns the clean input)")
    batches = list(batches)
    grid = eps_grid(eps, cfg.large_eps)
    if max_batches is not None:
        batches = batches[:max_batches]
    frac = float(suite["config"]["pgd_step"])
    runs = robust_accuracy(model, batches, [AttackSpec("fgsm", eps)], device=device)
    if runs["n"] != suite["n"]:
        raise ConfigError(f"the checks saw {runs['n']} examples but the suite {suite['n']}: pass the same batches")
    fgsm_acc = runs["attacks"][0]["acc"]
    sweep = [(e, pgd_accuracy(model, batches, e, cfg.steps, frac * e, seed=seed, device=device)) for e in grid]
    pgd_k = dict(sweep)[eps]
    tol = cfg.tol
    checks: list[Check] = []

    # 1. monotone in eps, ~0 at large eps
    curve = [(0.0, runs["clean"])] + sweep
    rises = [(a, b) for a, b in zip(curve, curve[1:]) if b[1] > a[1] + tol]
    large = curve[-1][1]
    ok = not rises and large <= cfg.large_max_acc
    text = ", ".join(f"{255 * e:.3g}/255: {_pct(a)}" for e, a in curve)
    why = []
    if rises:
        why.append("rises " + "; ".join(f"{255 * a[0]:.3g}->{255 * b[0]:.3g}/255 by {_pct(b[1] - a[1])}" for a, b in rises))
    if large > cfg.large_max_acc:
        why.append(f"{_pct(large)} left at {255 * grid[-1]:.3g}/255 > {_pct(cfg.large_max_acc)}")
    checks.append(Check("accuracy falls with eps to ~0", ok, f"PGD-{cfg.steps} {text}" + (f" ({'; '.join(why)})" if why else ""),
                        {"eps": [e for e, _ in curve], "acc": [a for _, a in curve]}))

    # 2. more iterations never help
    n_steps = suite["config"]["pgd_steps"]
    first = next((r.get("acc_first_restart") for r in suite["attacks"] if r["attack"] == "pgd"), None)
    if first is None or n_steps <= cfg.steps:
        checks.append(Check("more iterations never help", None,
                            "n/a: needs the suite's PGD with more steps than the check's PGD-k", {}))
    else:
        checks.append(Check("more iterations never help", first <= pgd_k + tol,
                            f"PGD-{n_steps} {_pct(first)} vs PGD-{cfg.steps} {_pct(pgd_k)} (independent random starts)",
                            {f"pgd-{n_steps}": first, f"pgd-{cfg.steps}": pgd_k}))

    # 3. iterative beats single-step
    checks.append(Check("iterative beats single-step", pgd_k <= fgsm_acc + tol,
                        f"PGD-{cfg.steps} {_pct(pgd_k)} vs FGSM {_pct(fgsm_acc)}", {f"pgd-{cfg.steps}": pgd_k, "fgsm": fgsm_acc}))

    # 4. black-box and transfer never beat white-box
    own = {a: _acc(suite, a) for a in OWN_GRADIENT}
    own = {a: v for a, v in own.items() if v is not None}
    white = min(own.values()) if own else None
    others = {a: _acc(suite, a) for a in ("square", "transfer")}
    others = {a: v for a, v in others.items() if v is not None}
    checks.append(_never_beats("black-box/transfer never beat white-box", white, others, tol,
                               f"white-box {_pct(white) if white is not None else ''} (min of {', '.join(own)})",
                               "needs an own-gradient attack and Square or transfer in the suite"))

    # 5. other surrogates never beat the model's own
    swapped = {r["attack"]: r["acc"] for r in suite["attacks"] if r["attack"].startswith("bptt-") and r.get("acc") is not None}
    checks.append(_never_beats("other surrogates never beat the own gradient", white, swapped, tol,
                               f"own gradient {_pct(white) if white is not None else ''}",
                               "no spiking neurons (or no other-surrogate attack) in the suite"))

    applicable = [c for c in checks if c.passed is not None]
    return {"passed": all(c.passed for c in applicable), "tol": tol, "checks": [c.as_dict() for c in checks],
            "lines": [c.line() for c in checks],
            "runs": {"fgsm": fgsm_acc, f"pgd-{cfg.steps}": {f"{255 * e:.4g}/255": a for e, a in sweep}}}


__all__ = ["Check", "CheckConfig", "eps_grid", "masking_checks"]
