"""Stable-SNN digits ablation: train the Gaussian and FGSM-AT digits recipes at rho = 1 and rho = 0,
then report clean / FGSM / PGD-10 accuracy on the validation split as a markdown table.

    .venv/bin/python bench/stable_snn.py [--out runs] [--eps 8/255 32/255] [--epochs N]
    .venv/bin/python bench/stable_snn.py --seeds 42 43 44 [--epochs N]   # seed study, see below

`--seeds` switches to the seed study: natural training (plain `classification` objective, clean
images only), Gaussian-perturbed training at rho = 0 and at rho = 1 (the `stable_snn_digits`
recipe), one run per seed each, then mean and sample std over seeds per arm and attack.
Existing run dirs under --out are reused (delete them to retrain). Numbers go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

RUNS = {
    "ssnn_digits_rho1": ("recipes/stable_snn_digits.yaml", []),
    "ssnn_digits_rho0": ("recipes/stable_snn_digits.yaml", ["objective.rho=0"]),
    "ssnn_digits_at_rho1": ("recipes/stable_snn_digits_at.yaml", []),
    "ssnn_digits_at_rho0": ("recipes/stable_snn_digits_at.yaml", ["objective.rho=0"]),
}
# Seed-study arms: (recipe, overrides); None as the objective means plain classification.
SEED_ARMS = {
    "natural": ("recipes/stable_snn_digits.yaml", None),
    "gauss_rho0": ("recipes/stable_snn_digits.yaml", ["objective.rho=0"]),
    "gauss_rho1": ("recipes/stable_snn_digits.yaml", []),
}


def build_recipe(path: str, overrides: list[str] | None, extra: list[str]):
    """The recipe with overrides; `overrides=None` swaps the objective for plain classification."""
    from efficient.config import apply_overrides, load_yaml, validate

    data = load_yaml(path)
    if overrides is None:
        data["objective"] = {"name": "classification"}
        overrides = []
    return validate(apply_overrides(data, [*overrides, *extra, "train.progress=false"]), path)


def train_and_attack(name: str, recipe, out: Path, eps: list[str]) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from efficient import zoo
    from efficient.attacks import AttackSpec, parse_eps, robust_accuracy
    from efficient.data import build_data
    from efficient.train.engine import Trainer

    run_dir = out / name
    train_s = None
    if not (run_dir / "checkpoint").exists():
        t0 = time.perf_counter()
        Trainer(recipe, run_dir).fit()
        train_s = time.perf_counter() - t0
    model = zoo.load(run_dir)
    data = build_data(recipe.data)
    loader = DataLoader(data.val, batch_size=128, shuffle=False)
    specs = [AttackSpec(a, parse_eps(e), 10) for e in eps for a in ("fgsm", "pgd")]
    torch.manual_seed(0)
    res = robust_accuracy(model, loader, specs)
    row = {"run": name, "train_s": train_s, **res}
    print(json.dumps(row), flush=True)
    return row


def cols(row: dict) -> list[str]:
    return ["clean"] + [f"{a['attack']} @ {round(255 * a['eps'])}/255" for a in row["attacks"]]


def values(row: dict) -> list[float]:
    return [100 * row["clean"]] + [100 * a["acc"] for a in row["attacks"]]


def seed_study(args) -> None:
    extra = [f"train.epochs={args.epochs}"] if args.epochs else []
    rows: dict[str, list[dict]] = {arm: [] for arm in SEED_ARMS}
    for seed in args.seeds:  # seed-major, so an interrupted study still has every arm at the first seeds
        for arm, (path, overrides) in SEED_ARMS.items():
            recipe = build_recipe(path, overrides, [*extra, f"train.seed={seed}"])
            rows[arm].append(train_and_attack(f"ssnn_digits_{arm}_s{seed}", recipe, Path(args.out), args.eps))
    first = rows[next(iter(SEED_ARMS))][0]
    print(f"\nseeds {args.seeds}; mean +- sample std over seeds; per-seed values in brackets")
    print("| training | " + " | ".join(cols(first)) + " | train time |")
    print("|" + "---|" * (2 + len(cols(first))))
    for arm, rs in rows.items():
        per = list(zip(*(values(r) for r in rs)))
        cells = []
        for v in per:
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            cells.append(f"{statistics.mean(v):.1f} +- {sd:.1f} ({', '.join(f'{x:.1f}' for x in v)})")
        ts = [r["train_s"] for r in rs if r["train_s"] is not None]
        t = f"{statistics.median(ts):.0f} s" if ts else "reused"
        print(f"| {arm} | " + " | ".join(cells) + f" | {t} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs")
    ap.add_argument("--eps", nargs="+", default=["8/255", "32/255"])
    ap.add_argument("--epochs", type=int, help="override train.epochs (default: the recipe's)")
    ap.add_argument("--seeds", type=int, nargs="+", help="run the natural / rho=0 / rho=1 seed study with these seeds")
    args = ap.parse_args()
    if args.seeds:
        seed_study(args)
        return

    rows = []
    for name, (recipe_path, overrides) in RUNS.items():
        extra = [f"train.epochs={args.epochs}"] if args.epochs else []
        recipe = build_recipe(recipe_path, overrides, extra)
        rows.append(train_and_attack(name, recipe, Path(args.out), args.eps))
    head = "| run | " + " | ".join(cols(rows[0])) + " |"
    print(head)
    print("|" + "---|" * (1 + len(cols(rows[0]))))
    for r in rows:
        print(f"| {r['run']} | " + " | ".join(f"{v:.1f}" for v in values(r)) + " |")


if __name__ == "__main__":
    main()
