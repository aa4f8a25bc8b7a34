"""`efficient profile --convention/--neurobench/--memory-access/--format html`: what each adds to the output."""

from __future__ import annotations

import json

import pytest

from efficient.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["profile", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_convention_neurobench_and_memory_access_flags(capsys):
    rc, out, _ = _run(capsys, "spikformer-tiny", "--input", "1x16x16", "--format", "json", "--convention", "spikformer",
                      "--neurobench", "--memory-access")
    assert rc == 0
    d = json.loads(out)
    # the Spikformer papers' count charges the first layer as MACs and every later one as SOPs: the block names it
    assert d["meta"]["conventions"]["preset"] == "spikformer" and "first_layer" in d["meta"]["conventions"]
    assert d["neurobench"]["synaptic_operations"]["Dense"] > 0
    assert d["totals"]["energy_total_pj"] == pytest.approx(d["totals"]["energy_pj"] + d["totals"]["energy_memory_pj"])


def test_html_and_table_carry_the_conventions(capsys):
    rc, out, _ = _run(capsys, "spikformer-tiny", "--input", "1x16x16", "--format", "html")
    assert rc == 0 and 'id="conventions"' in out and "<!DOCTYPE html>" in out
    rc, out, _ = _run(capsys, "spikformer-tiny", "--input", "1x16x16", "--convention", "spikformer")
    assert rc == 0 and "conventions" in out and "Zhou et al" in out


def test_unknown_convention_and_misplaced_flags(capsys):
    rc, _, err = _run(capsys, "spikformer-tiny", "--convention", "spikeformer")
    assert rc == 2 and "Did you mean 'spikformer'" in err
    rc, _, err = _run(capsys, "spikformer-tiny", "--memory", "--memory-access")
    assert rc == 2 and "--memory-access does not apply with --memory" in err
