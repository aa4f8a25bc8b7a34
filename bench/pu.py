"""PU learning on digits (even = positive, 20% of positives labeled): the fence + stochastic-label
recipe vs the naive baseline (unlabeled = negative) vs the fully supervised ceiling; median
validation accuracy and F1 over seeds.

    python bench/pu.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch


def fit(out: str, overrides: list[str]) -> tuple[float, float]:
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    recipe = load_recipe("recipes/pu_digits.yaml", [*overrides, "train.progress=false", "profile.enabled=false"])
    val = Trainer(recipe, out).fit()["val"]
    if "tp" not in val:  # the supervised ceiling reports accuracy only
        return val["acc"], float("nan")
    return val["acc"], 2 * val["tp"] / max(1e-9, val["pos_pred"] + val["pos_true"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = {
        "naive (U = negative)": ["objective.naive=true"],
        "PULCPBF fence + stochastic labels": [],
        "supervised ceiling": ["data={name: digits, binary_positive: [0, 2, 4, 6, 8], batch_size: 64}", "objective={name: classification}"],
    }
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    with tempfile.TemporaryDirectory() as out:
        for s in args.seeds:
            for i, (k, over) in enumerate(runs.items()):
                res[k].append(fit(f"{out}/{i}-{s}", [f"train.seed={s}", f"data.label_seed={s}" if "data=" not in " ".join(over) else f"train.seed={s}", *over]))
    print(f"seeds={args.seeds} (medians over seeds)")
    print("| method | val acc | val F1 (positive class) |")
    print("|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {statistics.median(a for a, _ in v):.4f} | {statistics.median(f for _, f in v):.4f} |")


if __name__ == "__main__":
    main()
