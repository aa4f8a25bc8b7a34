"""BiLipNet classifier on digits: clean accuracy and certified accuracy (correct and certified
radius >= eps, radius = margin / (sqrt(2) * L)) at several L2 radii of the normalised input.

    python bench/bilipnet.py
"""

from __future__ import annotations

import tempfile

import torch


def main() -> None:
    from torch.utils.data import DataLoader

    from efficient.config import load_recipe
    from efficient.models.bilipnet import certified_radius
    from efficient.train.engine import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        recipe = load_recipe("recipes/bilipnet_digits.yaml", ["train.progress=false", "profile.enabled=false"])
        tr = Trainer(recipe, out)
        tr.fit()
        model = tr.model.eval()
        x, y = next(iter(DataLoader(tr.data.val, batch_size=len(tr.data.val))))
        with torch.no_grad():
            logits = model(x)
        r = certified_radius(logits, model.lipschitz_bound())
        ok = logits.argmax(1) == y
    print(f"certified Lipschitz bound of the logits: {model.lipschitz_bound():.1f}")
    print("| L2 radius (normalised input) | certified accuracy |")
    print("|---|---|")
    for eps in (0.0, 0.05, 0.1, 0.2, 0.5):
        print(f"| {eps} | {(ok & (r >= eps)).float().mean().item():.4f} |")


if __name__ == "__main__":
    main()
