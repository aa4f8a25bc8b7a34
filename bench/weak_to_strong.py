"""Weak-to-strong on digits (even vs odd): weak teacher, strong ceiling, naive and auxiliary-loss
students, and the performance gap recovered (PGR), median over seeds.

    python bench/weak_to_strong.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch


def fit(recipe_path: str, out: str, overrides: list[str]) -> float:
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    recipe = load_recipe(recipe_path, [*overrides, "train.progress=false", "profile.enabled=false"])
    return Trainer(recipe, out).fit()["val"]["acc"]


def main() -> None:
    from efficient.objectives.weak_to_strong import performance_gap_recovered

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)
    res: dict[str, list[float]] = {k: [] for k in ("weak", "ceiling", "w2s naive", "w2s aux", "PGR naive", "PGR aux")}
    with tempfile.TemporaryDirectory() as out:
        for s in args.seeds:
            weak = fit("recipes/w2s_weak_digits.yaml", f"{out}/weak{s}", [f"train.seed={s}"])
            ceil = fit("recipes/w2s_digits.yaml", f"{out}/ceil{s}", [f"train.seed={s}", "objective={name: classification}"])
            t = f"objective.teacher={out}/weak{s}"
            naive = fit("recipes/w2s_digits.yaml", f"{out}/naive{s}", [f"train.seed={s}", t, "objective.alpha_max=0.0"])
            aux = fit("recipes/w2s_digits.yaml", f"{out}/aux{s}", [f"train.seed={s}", t])
            for k, v in (("weak", weak), ("ceiling", ceil), ("w2s naive", naive), ("w2s aux", aux)):
                res[k].append(v)
            res["PGR naive"].append(performance_gap_recovered(naive, weak, ceil))
            res["PGR aux"].append(performance_gap_recovered(aux, weak, ceil))
    print(f"seeds={args.seeds} (medians; val accuracy, even vs odd digits)")
    print("| | value | range |")
    print("|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {statistics.median(v):.4f} | {min(v):.4f}-{max(v):.4f} |")


if __name__ == "__main__":
    main()
