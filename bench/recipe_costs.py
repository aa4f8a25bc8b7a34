"""Cost of every seed-paper recipe: the profiler's per-sample inference cost of the trained model
and a training-FLOPs estimate for the full recipe.

Training FLOPs ~= (3 + extra) x forward FLOPs per model input x inputs seen, with 3 = forward +
backward (2x forward) of the trained model and `extra` the no-grad forwards the method adds per
input: preference losses 1 (the frozen reference), KTO 3 (reference, plus policy and reference on
the mismatched pairs), the others 0 (the weak teacher of weak-to-strong is a 4-unit MLP: < 1%).
Inputs seen = steps x model inputs per batch (2 rows per pair; 2 (1 + mu) images per SSL item).

    python bench/recipe_costs.py
"""

from __future__ import annotations

import tempfile

import torch

RECIPES = {
    "dpo_text": 1, "rdpo_text": 1, "ipo_text": 1, "kto_text": 3, "odin_text": 0,
    "cca_merge_digits": 0, "pu_digits": 0, "interlude_digits": 0, "w2s_digits": 0, "bilipnet_digits": 0,
}


def main() -> None:
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer
    from pathlib import Path

    from efficient.zoo import create, save_model

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        save_model(create("mlp-tiny", hidden=[4], num_classes=2), Path(out) / "weak.safetensors")
        for name, extra in RECIPES.items():
            over = ["train.max_steps=1", "train.progress=false", "profile.enabled=true"]
            if name == "w2s_digits":
                over.append(f"objective.teacher={out}/weak.safetensors")
            recipe = load_recipe(f"recipes/{name}.yaml", over)
            tr = Trainer(recipe, f"{out}/{name}")
            summary = tr.fit()
            cost = summary["cost"]
            per_input = cost["flops"] / max(1, cost.get("batch_size", 1))
            full = load_recipe(f"recipes/{name}.yaml")
            steps = full.train.epochs * (len(tr.data.train) // full.data["batch_size"])
            if full.train.max_steps:
                steps = min(steps, full.train.max_steps)
            batch = next(iter(tr.train_loader(0, 0)))
            inputs = batch[0].shape[0]
            if name == "interlude_digits":
                inputs = batch[0].shape[0] * 2 * (1 + batch[3].shape[1])
            train_flops = (3 + extra) * per_input * inputs * steps
            rows.append((name, recipe.model["name"], summary["params"], per_input / 2, steps, train_flops))
    print("| recipe | model | params | inference MACs / input | steps | training FLOPs (estimate) |")
    print("|---|---|---|---|---|---|")
    for name, model, params, macs, steps, tf in rows:
        print(f"| {name} | {model} | {params:,} | {macs / 1e6:.3f} M | {steps} | {tf / 1e12:.3f} T |")


if __name__ == "__main__":
    main()
