"""Stable-SNN digits ablation: train the Gaussian and FGSM-AT digits recipes at rho = 1 and rho = 0,
then report clean / FGSM / PGD-10 accuracy on the validation split as a markdown table.

    .venv/bin/python bench/stable_snn.py [--out runs] [--eps 8/255 32/255] [--epochs N]

Existing run dirs under --out are reused (delete them to retrain). Numbers go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RUNS = {
    "ssnn_digits_rho1": ("recipes/stable_snn_digits.yaml", []),
    "ssnn_digits_rho0": ("recipes/stable_snn_digits.yaml", ["objective.rho=0"]),
    "ssnn_digits_at_rho1": ("recipes/stable_snn_digits_at.yaml", []),
    "ssnn_digits_at_rho0": ("recipes/stable_snn_digits_at.yaml", ["objective.rho=0"]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs")
    ap.add_argument("--eps", nargs="+", default=["8/255", "32/255"])
    ap.add_argument("--epochs", type=int, help="override train.epochs (default: the recipe's)")
    args = ap.parse_args()

    import torch
    from torch.utils.data import DataLoader

    from efficient import zoo
    from efficient.attacks import AttackSpec, parse_eps, robust_accuracy
    from efficient.config import load_recipe
    from efficient.data import build_data
    from efficient.train.engine import Trainer

    rows = []
    for name, (recipe_path, overrides) in RUNS.items():
        run_dir = Path(args.out) / name
        extra = [f"train.epochs={args.epochs}"] if args.epochs else []
        recipe = load_recipe(recipe_path, [*overrides, *extra, "train.progress=false"])
        train_s = None
        if not (run_dir / "checkpoint").exists():
            t0 = time.perf_counter()
            Trainer(recipe, run_dir).fit()
            train_s = time.perf_counter() - t0
        model = zoo.load(run_dir)
        data = build_data(recipe.data)
        loader = DataLoader(data.val, batch_size=128, shuffle=False)
        specs = [AttackSpec(a, parse_eps(e), 10) for e in args.eps for a in ("fgsm", "pgd")]
        torch.manual_seed(0)
        res = robust_accuracy(model, loader, specs)
        rows.append({"run": name, "train_s": train_s, **res})
        print(json.dumps(rows[-1]))
    head = "| run | clean | " + " | ".join(f"{r['attack']} @ {round(255 * r['eps'])}/255" for r in rows[0]["attacks"]) + " |"
    print(head)
    print("|" + "---|" * (2 + len(rows[0]["attacks"])))
    for r in rows:
        print(f"| {r['run']} | {100 * r['clean']:.1f} | " + " | ".join(f"{100 * a['acc']:.1f}" for a in r["attacks"]) + " |")


if __name__ == "__main__":
    main()
