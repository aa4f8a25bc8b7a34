"""Semi-supervised digits with 40 labels: labeled-only vs FixMatch vs InterLUDE (same recipe,
switches off one part at a time); median validation accuracy over seeds.

    python bench/interlude.py --seeds 0 1 --set train.epochs=15
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

VARIANTS = {
    "labeled only": ["objective.delta=0.0", "objective.lambda_rel=0.0", "objective.lambda_u=0.0"],
    "FixMatch": ["objective.delta=0.0", "objective.lambda_rel=0.0"],
    "InterLUDE": [],
}


def main() -> None:
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="recipe overrides, e.g. train.epochs=10")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res: dict[str, list[float]] = {k: [] for k in VARIANTS}
    with tempfile.TemporaryDirectory() as out:
        for s in args.seeds:
            for i, (k, over) in enumerate(VARIANTS.items()):
                recipe = load_recipe("recipes/interlude_digits.yaml", [f"train.seed={s}", f"data.label_seed={s}", *over, *args.overrides, "train.progress=false", "profile.enabled=false"])
                res[k].append(Trainer(recipe, f"{out}/{i}-{s}").fit()["val"]["acc"])
    print(f"seeds={args.seeds} overrides={args.overrides} (median val acc; min-max)")
    print("| method | val acc | range |")
    print("|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {statistics.median(v):.4f} | {min(v):.4f}-{max(v):.4f} |")


if __name__ == "__main__":
    main()
