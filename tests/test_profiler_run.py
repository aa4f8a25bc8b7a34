"""`efficient profile RUN_DIR`: a trained run is profiled as it was trained (its config's input, its
own validation samples), `--compare` of a STATA run and its dense twin, and the shape-mismatch error."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT

from efficient.cli import main
from efficient.config import load_recipe
from efficient.errors import ConfigError
from efficient.profiler import profile_run
from efficient.profiler.run import random_kind
from efficient.train.engine import Trainer

# A few steps of the shipped digits recipes: enough for the neurons to fire, seconds on one core.
TINY = ["train.max_steps=12", "train.progress=false", "eval.max_batches=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A STATA digits run (8 profiled samples) and its dense twin (4 profiled samples)."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, recipe, samples in (("stata", "stata_digits", 8), ("dense", "spikformer_digits", 4)):
        r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml", [*TINY, "profile.enabled=true", f"profile.samples={samples}"])
        Trainer(r, root / name).fit()
        out[name] = root / name
    return out


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["profile", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _cost(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())["cost"]


def test_profile_of_a_run_equals_its_summary_cost(runs, capsys):
    cost = _cost(runs["stata"])
    assert cost["batch_size"] == 8 and cost["sops"] > 0 and cost["mean_firing_rate"] > 0  # a run that fires
    rc, out, _ = _cli(capsys, str(runs["stata"]), "--format", "json")
    assert rc == 0
    d = json.loads(out)
    for key, value in cost.items():
        assert d["totals"][key] == pytest.approx(value, rel=1e-12), key
    assert d["meta"]["input"] == "validation data of the run, first 8 samples [8, 1, 8, 8]"
    assert d["meta"]["weights"].endswith("checkpoint/last/model.safetensors") and d["meta"]["timesteps"] == 4
    # the same from Python, and from the run's checkpoint file
    assert profile_run(runs["stata"]).totals == d["totals"]
    rc, out, _ = _cli(capsys, str(runs["stata"] / "checkpoint" / "last" / "model.safetensors"), "--format", "json")
    assert rc == 0 and json.loads(out)["totals"] == d["totals"]


def test_profile_and_the_run_report_agree(runs, capsys):
    rc, out, _ = _cli(capsys, str(runs["stata"]), "--format", "md")
    assert rc == 0
    report_md = (runs["stata"] / "report.md").read_text()
    rows = [line for line in out.splitlines() if re.match(r"\| (dense MACs|MACs|SOPs|energy|mean firing rate)", line)]
    assert len(rows) == 6  # dense MACs, MACs, SOPs, energy, energy / sample, mean firing rate
    for row in rows:
        assert row in report_md, row


def test_random_inputs_override_the_validation_data(runs, capsys):
    rc, out, _ = _cli(capsys, str(runs["stata"]), "--data", "random", "--format", "json")
    assert rc == 0
    d = json.loads(out)
    cost = _cost(runs["stata"])
    assert d["meta"]["input"] == "random [1, 1, 8, 8]"  # the run's img_size 8, not the zoo's 16
    assert d["totals"]["dense_macs"] == cost["dense_macs"] / cost["batch_size"]  # same model, one sample
    assert d["totals"]["sops"] != cost["sops"] / cost["batch_size"]  # other inputs, other spikes
    assert any("inputs were random" in w for w in d["warnings"])
    rc, out, _ = _cli(capsys, str(runs["stata"]), "--input", "1x8x8", "--batch", "2", "--format", "json")
    assert rc == 0 and json.loads(out)["meta"]["input"] == "random [2, 1, 8, 8]"


def test_compare_stata_run_with_its_dense_twin(runs, capsys, tmp_path):
    dense, stata = _cost(runs["dense"]), _cost(runs["stata"])
    assert dense["batch_size"] == 4 and stata["batch_size"] == 8  # each on its own inputs
    png = tmp_path / "compare.png"
    rc, out, _ = _cli(capsys, str(runs["dense"]), "--compare", str(runs["stata"]), "--plot", str(png))
    assert rc == 0
    text = " ".join(out.split())
    assert "dense vs stata" in text and "ratio = stata / dense" in text
    # both reports are printed in full, then the per-sample comparison with ratios
    assert text.count("top modules at depth 1") == 2 and "tokens entering each block" in text
    for key in ("dense_macs", "energy_pj", "sops"):
        ratio = (stata[key] / stata["batch_size"]) / (dense[key] / dense["batch_size"])
        assert f"{ratio:.3f}x" in text, key
    assert stata["dense_macs"] / 8 < dense["dense_macs"] / 4  # pruned tokens: fewer MACs per sample
    e_ratio = stata["energy_pj_per_sample"] / dense["energy_pj_per_sample"]
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[1] > img.shape[0] and img.shape[1] >= 1000  # two columns side by side (a single plot is ~550 px wide)

    rc, out, _ = _cli(capsys, str(runs["dense"]), "--compare", str(runs["stata"]), "--format", "json")
    d = json.loads(out)
    rows = {r["metric"]: r for r in d["comparison"]["rows"]}
    assert d["report"]["totals"]["batch_size"] == 4 and d["compare"]["totals"]["batch_size"] == 8
    assert rows["energy_pj"]["a"] == pytest.approx(dense["energy_pj_per_sample"])
    assert rows["energy_pj"]["b"] == pytest.approx(stata["energy_pj_per_sample"])
    assert rows["energy_pj"]["ratio"] == pytest.approx(e_ratio)
    assert rows["mean_firing_rate"]["ratio"] == pytest.approx(stata["mean_firing_rate"] / dense["mean_firing_rate"])


def test_compare_run_with_zoo_name_each_on_its_own_input(runs, capsys):
    rc, out, _ = _cli(capsys, str(runs["stata"]), "--compare", "spikformer-tiny", "--format", "json")
    assert rc == 0
    d = json.loads(out)
    assert d["report"]["meta"]["input"].startswith("validation data of the run, first 8 samples [8, 1, 8, 8]")
    assert d["compare"]["meta"]["input"] == "random [1, 1, 16, 16]"


def test_wrong_input_shape_names_the_built_shape(runs, capsys):
    rc, _, err = _cli(capsys, str(runs["stata"]), "--input", "1x16x16")
    assert rc == 2
    assert err.strip().count("\n") == 0  # one error line
    assert "does not fit the model: it is 1x16x16 per sample, but the model was built for 1x8x8 per sample (T=4)" in err
    assert "Pass --input 1x8x8" in err
    assert "16x16, T" not in err and "[4, 1, 1, 16, 16]" not in err  # no zoo default, no second shape


def test_bad_run_options_are_named(runs, capsys):
    rc, _, err = _cli(capsys, str(runs["stata"]), "--input", "1x8x8", "--data", "val")
    assert rc == 2 and "--input sets the shape of a random input" in err
    rc, _, err = _cli(capsys, "spikformer-tiny", "--data", "val")
    assert rc == 2 and "--data val profiles a run dir" in err and "spikformer-tiny is a zoo name" in err
    rc, _, err = _cli(capsys, str(runs["stata"]), "--pretrained", str(runs["dense"]))
    assert rc == 2 and "--pretrained applies to zoo names" in err and "--checkpoint" in err
    with pytest.raises(ConfigError, match="no such run dir"):
        profile_run(runs["stata"] / "missing")


def test_checkpoint_choice(runs, capsys, tmp_path):
    rc, out, _ = _cli(capsys, str(runs["stata"]), "--checkpoint", "best", "--format", "json")
    assert rc == 0 and json.loads(out)["meta"]["weights"].endswith("checkpoint/best/model.safetensors")
    import shutil

    run = tmp_path / "only_last"
    shutil.copytree(runs["stata"], run)
    shutil.rmtree(run / "checkpoint" / "best")
    rc, _, err = _cli(capsys, str(run), "--checkpoint", "best")
    assert rc == 2 and "no best checkpoint" in err and "it has: last (choose with --checkpoint)" in err


def test_random_inputs_follow_the_run_normalisation():
    assert random_kind(SimpleNamespace(data={"name": "digits"})) == "normal"
    assert random_kind(SimpleNamespace(data={"name": "digits", "normalize": False})) == "unit"
