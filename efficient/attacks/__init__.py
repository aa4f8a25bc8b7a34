"""Adversarial evaluation of spiking and conventional classifiers, in three layers that import one way:

- `white_box`: single L-inf attacks (FGSM, PGD, APGD-CE/DLR) and robust accuracy under them;
- `suite`: the worst case over a suite of adaptive attacks (`worst_case`, `SuiteConfig`), built on them;
- `masking`: gradient-masking checks on a suite result (`masking_checks`, `CheckConfig`).

Every public name is importable from `efficient.attacks`.
"""

from efficient.attacks.masking import Check, CheckConfig, eps_grid, masking_checks
from efficient.attacks.suite import OWN_GRADIENT, SUITE_ATTACKS, SuiteConfig, has_spiking_neurons, pgd_accuracy, pgd_best, worst_case
from efficient.attacks.white_box import ATTACKS, AttackSpec, apgd, check_attack, check_eps, default_alpha, eval_mode, fgsm
from efficient.attacks.white_box import input_grad, parse_eps, pgd, pixel_batch, project, robust_accuracy, run_attack

__all__ = [
    "ATTACKS", "OWN_GRADIENT", "SUITE_ATTACKS", "AttackSpec", "Check", "CheckConfig", "SuiteConfig", "apgd", "check_attack",
    "check_eps", "default_alpha", "eps_grid", "eval_mode", "fgsm", "has_spiking_neurons", "input_grad", "masking_checks",
    "parse_eps", "pgd", "pgd_accuracy", "pgd_best", "pixel_batch", "project", "robust_accuracy", "run_attack", "worst_case",
]
