"""CCA Merge vs permutation matching vs plain averaging on digits MLPs.

Trains pairs of parents with recipes/cca_merge_digits.yaml through the engine (seeds 2k, 2k+1),
merges each pair with every method on 8 calibration batches, and reports validation accuracy
(median over pairs) next to the parents'.

    python bench/merge.py --pairs 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch


def main() -> None:
    from torch.utils.data import DataLoader

    from efficient.config import load_recipe
    from efficient.data import build_data
    from efficient.merge import accuracy, merge_models
    from efficient.train.engine import Trainer

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="recipe overrides, e.g. train.epochs=10")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res: dict[str, list[float]] = {k: [] for k in ("parent A", "parent B", "average", "permute", "cca")}
    with tempfile.TemporaryDirectory() as out:
        for k in range(args.pairs):
            models = []
            for s in (2 * k, 2 * k + 1):
                recipe = load_recipe("recipes/cca_merge_digits.yaml", [f"train.seed={s}", f"train.epochs={args.epochs}", "train.progress=false", "profile.enabled=false", *args.overrides])
                tr = Trainer(recipe, f"{out}/p{s}")
                tr.fit()
                models.append(tr.model.eval().cpu())
            data = build_data(recipe.data)
            g = torch.Generator().manual_seed(0)
            calib = [x for (x, _), _ in zip(DataLoader(data.train, batch_size=64, shuffle=True, generator=g), range(8))]
            val = list(DataLoader(data.val, batch_size=256))
            a, b = models
            res["parent A"].append(accuracy(a, val))
            res["parent B"].append(accuracy(b, val))
            for m in ("average", "permute", "cca"):
                res[m].append(accuracy(merge_models(a, b, calib, m), val))
    print(f"pairs={args.pairs} epochs={args.epochs} overrides={args.overrides} (median val acc; min-max)")
    print("| model | val acc | range |")
    print("|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {statistics.median(v):.4f} | {min(v):.4f}-{max(v):.4f} |")


if __name__ == "__main__":
    main()
