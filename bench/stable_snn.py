"""Stable-SNN digits ablation: train the Gaussian and FGSM-AT digits recipes at rho = 1 and rho = 0,
then report clean / FGSM / PGD-10 accuracy on the validation split as a markdown table.

    .venv/bin/python bench/stable_snn.py [--out runs] [--eps 8/255 32/255] [--epochs N]
    .venv/bin/python bench/stable_snn.py --seeds 42 43 44 [--epochs N]   # seed study, see below
    .venv/bin/python bench/stable_snn.py --seeds 42 43 44 --recipe recipes/stable_snn_digits_eps32.yaml \
        --eps 32/255 --set data.val_fraction=0.4 --out runs/seeds_eps32

`--seeds` switches to the seed study: natural training (plain `classification` objective, clean
images only), perturbed training at rho = 0 and at rho = 1 (`--recipe`, default the Gaussian
`stable_snn_digits` recipe; `--set` overrides apply to every arm), one run per seed each, then
mean and sample std over seeds per arm and attack, and the paired per-seed differences
rho = 1 minus rho = 0. `--arms` runs a subset (a screen: `--arms rho0 rho1`).
Existing run dirs under --out are reused (delete them to retrain), and so are their cached attack
results for the same attacks. Numbers go to BENCHMARKS.md.
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
# Seed-study arms: overrides of the study's recipe; None swaps the objective for plain classification.
SEED_ARMS: dict[str, list[str] | None] = {
    "natural": None,
    "rho0": ["objective.rho=0"],
    "rho1": ["objective.rho=1"],
}


def build_recipe(path: str, overrides: list[str] | None, extra: list[str]):
    """The recipe with overrides; `overrides=None` swaps the objective for plain classification."""
    from efficient.config import apply_overrides, load_yaml, validate

    data = load_yaml(path)
    if overrides is None:  # natural training: objective options of the perturbed recipe do not apply
        data["objective"] = {"name": "classification"}
        overrides, extra = [], [e for e in extra if not e.startswith("objective.")]
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
        (run_dir / "bench_train_s.json").write_text(json.dumps(train_s))
    elif (run_dir / "bench_train_s.json").exists():
        train_s = json.loads((run_dir / "bench_train_s.json").read_text())
    torch.set_num_threads(1)
    cache = run_dir / f"bench_attacks_{'_'.join(e.replace('/', '-') for e in eps)}.json"
    if cache.exists():
        res = json.loads(cache.read_text())
    else:
        model = zoo.load(run_dir)
        data = build_data(recipe.data)
        loader = DataLoader(data.val, batch_size=128, shuffle=False)
        specs = [AttackSpec(a, parse_eps(e), 10) for e in eps for a in ("fgsm", "pgd")]
        torch.manual_seed(0)
        res = robust_accuracy(model, loader, specs)
        cache.write_text(json.dumps(res))
    row = {"run": name, "train_s": train_s, **res}
    print(json.dumps(row), flush=True)
    return row


def cols(row: dict) -> list[str]:
    return ["clean"] + [f"{a['attack']} @ {round(255 * a['eps'])}/255" for a in row["attacks"]]


def values(row: dict) -> list[float]:
    return [100 * row["clean"]] + [100 * a["acc"] for a in row["attacks"]]


def fmt_stats(v: list[float]) -> str:
    sd = statistics.stdev(v) if len(v) > 1 else 0.0
    return f"{statistics.mean(v):.1f} +- {sd:.1f} ({', '.join(f'{x:.1f}' for x in v)})"


def seed_study(args) -> None:
    extra = [f"train.epochs={args.epochs}"] if args.epochs else []
    arms = args.arms or list(SEED_ARMS)
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in args.seeds:  # seed-major, so an interrupted study still has every arm at the first seeds
        for arm in arms:
            recipe = build_recipe(args.recipe, SEED_ARMS[arm], [*args.set, *extra, f"train.seed={seed}"])
            rows[arm].append(train_and_attack(f"{arm}_s{seed}", recipe, Path(args.out), args.eps))
    first = rows[arms[0]][0]
    print(f"\nrecipe {args.recipe} {' '.join(args.set + extra)}; seeds {args.seeds}; n = {first['n']} validation images")
    print("mean +- sample std over seeds; per-seed values in brackets")
    print("| training | " + " | ".join(cols(first)) + " | train time |")
    print("|" + "---|" * (2 + len(cols(first))))
    for arm, rs in rows.items():
        per = list(zip(*(values(r) for r in rs)))
        ts = [r["train_s"] for r in rs if r["train_s"] is not None]
        t = f"{statistics.median(ts):.0f} s" if ts else "reused"
        print(f"| {arm} | " + " | ".join(fmt_stats(list(v)) for v in per) + f" | {t} |")
    if "rho0" in rows and "rho1" in rows:
        # Paired by seed: same seed = same init, data order and noise stream up to the rho term.
        d = [[a - b for a, b in zip(values(r1), values(r0))] for r1, r0 in zip(rows["rho1"], rows["rho0"])]
        print("| rho1 - rho0 (paired) | " + " | ".join(fmt_stats(list(v)) for v in zip(*d)) + " | |")
        if len(args.seeds) > 1:
            print("\nmargin vs seed spread (mean paired difference vs the larger per-arm std):")
            for j, c in enumerate(cols(first)):
                diff = [x[j] for x in d]
                sd = max(statistics.stdev([values(r)[j] for r in rows[a]]) for a in ("rho0", "rho1"))
                verdict = "exceeds" if statistics.mean(diff) > sd else "does not exceed"
                print(f"  {c}: {statistics.mean(diff):+.1f} vs {sd:.1f} -> {verdict}; min paired {min(diff):+.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs")
    ap.add_argument("--eps", nargs="+", default=["8/255", "32/255"])
    ap.add_argument("--epochs", type=int, help="override train.epochs (default: the recipe's)")
    ap.add_argument("--seeds", type=int, nargs="+", help="run the natural / rho=0 / rho=1 seed study with these seeds")
    ap.add_argument("--recipe", default="recipes/stable_snn_digits.yaml", help="seed study: the perturbed-training recipe")
    ap.add_argument("--arms", nargs="+", choices=list(SEED_ARMS), help="seed study: run only these arms")
    ap.add_argument("--set", nargs="*", default=[], help="seed study: recipe overrides for every arm (key=value)")
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
