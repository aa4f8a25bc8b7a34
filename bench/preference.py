"""Preference losses under label noise: DPO vs rDPO (and cDPO, IPO, KTO) on the synthetic task.

KTO trains on the same pairs split into desirable / undesirable examples (twice the rows, so the
same number of steps covers half an epoch of pairs).

Each method trains recipes/dpo_text.yaml (ee-gpt-tiny, 2 layers) through the engine with the same
seed and data; then every policy samples one completion for each of 256 held-out prompts. We report
the held-out preference accuracy, the mean true reward of the samples, and the head-to-head win
rate of each method's samples against DPO's (same prompts, same sampling seed), median over seeds.

    python bench/preference.py --flip 0.2 --seeds 0 1 2 --steps 32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

METHODS = {
    "dpo": ["objective.name=preference", "objective.loss_type=sigmoid"],
    "rdpo": ["objective.name=preference", "objective.loss_type=robust", "objective.eps={flip}"],
    "cdpo": ["objective.name=preference", "objective.loss_type=sigmoid", "objective.label_smoothing={flip}"],
    "ipo": ["objective.name=preference", "objective.loss_type=ipo"],
    "kto": ["objective={{name: kto, beta: 0.1}}", "data.format=unpaired"],
}


def train(method: str, flip: float, seed: int, steps: int, out: str) -> torch.nn.Module:
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    over = [o.format(flip=flip) for o in METHODS[method]]
    if method == "rdpo" and flip == 0:
        over[-1] = "objective.eps=0.0"
    over += [f"data.flip_rate={flip}", f"train.seed={seed}", f"data.seed={seed}", f"train.max_steps={steps}", "train.progress=false", "profile.enabled=false"]
    recipe = load_recipe("recipes/dpo_text.yaml", over)
    trainer = Trainer(recipe, f"{out}/{method}-{flip}-{seed}")
    summary = trainer.fit()
    trainer.model.pref_acc = summary["val"]["pref_acc"]  # type: ignore[attr-defined]
    return trainer.model


def main() -> None:
    from efficient.data.preferences import make_synthetic_pairs, sample_completions, true_reward, win_rate

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--flip", type=float, nargs="+", default=[0.0, 0.2])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = [r["prompt"] for r in make_synthetic_pairs(256, seed=99_999)]
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for flip in args.flip:
            res: dict[str, dict[str, list[float]]] = {m: {"acc": [], "reward": [], "win": []} for m in args.methods}
            for seed in args.seeds:
                rewards = {}
                for m in args.methods:
                    model = train(m, flip, seed, args.steps, out)
                    samples = sample_completions(model, prompts, length=8, seed=seed)
                    rewards[m] = [true_reward(s) for s in samples]
                    res[m]["acc"].append(model.pref_acc)
                    res[m]["reward"].append(sum(rewards[m]) / len(rewards[m]))
                for m in args.methods:
                    res[m]["win"].append(win_rate(rewards[m], rewards["dpo"]))
            for m in args.methods:
                med = {k: statistics.median(v) for k, v in res[m].items()}
                rows.append((flip, m, med["acc"], med["reward"], med["win"]))
    print(f"steps={args.steps} seeds={args.seeds} (medians)")
    print("| flip rate | method | val pref_acc | mean true reward of samples | win rate vs DPO |")
    print("|---|---|---|---|---|")
    for flip, m, acc, rew, win in rows:
        print(f"| {flip} | {m} | {acc:.3f} | {rew:.3f} | {win:.3f} |")


if __name__ == "__main__":
    main()
