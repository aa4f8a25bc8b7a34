"""Profiles of spiking models warn when the network is (nearly) silent, naming its layers and what to
do; a trained digits network gets no such warning; the profile tables fit an 80-column terminal."""

from __future__ import annotations

import pytest
from conftest import ROOT

import efficient
from efficient.cli import main
from efficient.config import load_recipe
from efficient.profiler import profile
from efficient.profiler.api import SILENT_FIRING_RATE, silent_network_warning
from efficient.train.engine import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _silence(warnings: list[str]) -> list[str]:
    return [w for w in warnings if "silent" in w or "never fired" in w]


def test_zoo_name_warns_that_the_network_is_nearly_silent(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["profile", "spikformer-stata", "--layers", "12"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80  # tables, captions and warnings
    text = " ".join(out.split())
    assert "the network is nearly silent: mean firing rate" in text and f"below {SILENT_FIRING_RATE:g}" in text
    assert "patch_embed.lifs.1" in text and "and 24 more" in text  # the layers that never fired, named
    assert "`efficient profile RUN_DIR`" in text and "`--data NAME`" in text
    for name in ("patch_embed.convs.0", "patch_embed.lifs.0", "blocks.0.attn.q.linear"):
        assert name in out  # whole layer names, not cut to fit


def test_warning_names_silent_layers_and_the_quietest_when_none_is_fully_silent():
    model = efficient.zoo.create("spikformer-tiny")
    r = profile(model, input_shape=(1, 16, 16))
    w = silent_network_warning(r)
    rate = r.totals["mean_firing_rate"]
    assert rate < SILENT_FIRING_RATE and w is not None and f"{rate:.2g}" in w
    silent = [n.name for n in r.neurons if not n.output_firing_rate]
    assert all(name in w for name in silent[:8])
    for n in r.neurons:  # make every layer fire a little, still under the threshold: the quietest are named
        n.output_firing_rate = SILENT_FIRING_RATE / 2
    r.totals["mean_firing_rate"] = SILENT_FIRING_RATE / 2
    w = silent_network_warning(r)
    assert "Quietest layers" in w and r.neurons[0].name in w and "Never fired" not in w
    r.totals["mean_firing_rate"] = 0.2  # fires well overall
    assert silent_network_warning(r) is None


def test_shipped_trained_digits_weights_get_no_silence_warning(capsys):
    # spikformer-tiny --pretrained: trained with `efficient train recipes/spikformer_digits.yaml`, profiled on digits
    assert main(["profile", "spikformer-tiny", "--pretrained", "--format", "json"]) == 0
    import json

    d = json.loads(capsys.readouterr().out)
    assert d["totals"]["mean_firing_rate"] > SILENT_FIRING_RATE
    assert _silence(d["warnings"]) == []


@pytest.mark.slow
def test_a_digits_run_warns_untrained_and_not_once_trained(tmp_path, capsys):
    """The same recipe: 2 steps leave the network nearly silent (warned); 150 steps train it (no warning)."""
    import json

    reports = {}
    for steps in (2, 150):
        run = tmp_path / f"run{steps}"
        r = load_recipe(ROOT / "recipes" / "spikformer_digits.yaml", [f"train.max_steps={steps}", "train.progress=false"])
        summary = Trainer(r, run).fit()
        assert main(["profile", str(run), "--format", "json"]) == 0
        reports[steps] = (summary, json.loads(capsys.readouterr().out))
    short, trained = reports[2][1], reports[150][1]
    assert reports[150][0]["val"]["acc"] > 0.5  # it learned
    assert len(_silence(short["warnings"])) == 1 and "nearly silent" in _silence(short["warnings"])[0]
    assert trained["totals"]["mean_firing_rate"] > SILENT_FIRING_RATE and _silence(trained["warnings"]) == []


def test_tables_fit_80_columns_for_a_comparison_with_exits():
    from rich.console import Console

    a = profile(efficient.zoo.create("spikformer-stata"))
    b = profile(efficient.zoo.create("ee-gpt-tiny"))
    console = Console(width=80, record=True)
    for rep in (a, b):
        for t in rep.to_table(max_layers=len(rep.layers)):
            console.print(t)
    console.print(a.compare(b).to_table())
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    assert all(layer.name in text for layer in a.layers + b.layers)
    assert "energy = 4.6 pJ x MACs + 0.9 pJ x SOPs (45nm-fp32); FLOPs = 2 x dense MACs" in text  # one line
