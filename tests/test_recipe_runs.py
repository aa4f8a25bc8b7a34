"""Each paper recipe trains two steps through the engine and writes its cost report (slow)."""

from __future__ import annotations

import pytest
from conftest import ROOT

from efficient.config import load_recipe
from efficient.train.engine import Trainer

TEXT = ["data.num_train=64", "data.num_val=16"]
# recipe, extra overrides, validation metrics the run must report ("acc"-like ones lie in [0, 1])
CASES = [
    ("bilipnet_digits", [], {"acc"}),
    ("interlude_digits", [], {"acc"}),
    ("cca_merge_digits", [], {"acc"}),
    ("pu_digits", [], {"acc"}),
    ("odin_text", ["data.num_train=64", "data.num_val=32"], {"rho_q", "rho_l", "acc"}),
    *[(name, TEXT, {"pref_acc"}) for name in ("dpo_text", "rdpo_text", "ipo_text", "kto_text")],
    *[(name, ["data.train_per_digit=1", "data.val_per_digit=1", "profile.samples=4"], {"acc"})
      for name in ("stata_cluttered", "sdt_stata_cluttered")],
]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,overrides,metrics", CASES, ids=[c[0] for c in CASES])
def test_recipe_runs_end_to_end_with_cost_report(recipe, overrides, metrics, tmp_path):
    r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml", ["train.max_steps=2", "train.progress=false", *overrides])
    summary = Trainer(r, tmp_path / "run").fit()
    assert summary["steps"] == 2 and metrics <= set(summary["val"])
    for key in metrics & {"acc", "pref_acc"}:
        assert 0 <= summary["val"][key] <= 1
    assert summary["cost"]["flops"] > 0 and (tmp_path / "run" / "report.md").exists()
