"""`efficient profile`: formats, comparison, checkpoints and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from efficient.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["profile", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output_has_totals_and_layers(capsys):
    rc, out, _ = _run(capsys, "spikformer-tiny", "--format", "json", "--batch", "2", "--timesteps", "2")
    assert rc == 0
    d = json.loads(out)
    t = d["totals"]
    assert t["batch_size"] == 2 and d["meta"]["timesteps"] == 2
    assert t["flops"] == 2 * t["dense_macs"] and t["e_mac_pj"] == 4.6
    assert any(layer["name"] == "patch_embed.convs.0" for layer in d["layers"])


def test_table_with_compare_and_plot(capsys, tmp_path):
    png = tmp_path / "energy.png"
    rc, out, _ = _run(capsys, "spikformer-tiny", "--compare", "spikformer-tiny", "--input", "1x16x16",
                      "--plot", str(png), "--energy", "45nm-fp16")
    assert rc == 0
    assert "top modules" in out and "dense MACs" in out and "change" in out
    assert "+0.0%" in out  # a model compared with itself: every column unchanged
    assert "1.5 pJ x MACs + 0.4 pJ x SOPs" in out.replace("\n", " ").replace("  ", " ") or "45nm-fp16" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_md_and_csv_to_file(capsys, tmp_path):
    md = tmp_path / "r.md"
    assert _run(capsys, "spikformer-tiny", "--format", "md", "-o", str(md))[0] == 0
    assert md.read_text().startswith("## Cost profile: spikformer-tiny")
    rc, out, _ = _run(capsys, "spikformer-tiny", "--format", "csv")
    assert rc == 0 and out.splitlines()[0].startswith("name,type,dense_macs,macs,sops")


def test_checkpoint_file_is_profiled(capsys, tmp_path):
    from efficient.zoo import create, save_model

    model = create("spikformer-tiny", embed_dim=32)
    ckpt = tmp_path / "tiny.safetensors"
    save_model(model, ckpt)
    rc, out, _ = _run(capsys, str(ckpt), "--format", "json")
    assert rc == 0
    assert json.loads(out)["totals"]["params"] == sum(p.numel() for p in model.parameters())


def test_unknown_model_suggests_closest(capsys):
    rc, _, err = _run(capsys, "spikformer-4-38")
    assert rc == 2 and "unknown model 'spikformer-4-38'" in err and "spikformer-4-384" in err


def test_unknown_energy_preset(capsys):
    rc, _, err = _run(capsys, "spikformer-tiny", "--energy", "7nm")
    assert rc == 2 and "unknown energy preset '7nm'" in err and "45nm-fp32" in err


def test_input_shape_that_does_not_fit(capsys):
    rc, _, err = _run(capsys, "spikformer-tiny", "--input", "3x32x32")
    assert rc == 2 and "does not fit the model: it is 3x32x32 per sample, but the model was built for 1x16x16 per sample" in err
    assert "--input 1x16x16" in err
    rc, _, err = _run(capsys, "spikformer-tiny", "--input", "3xabc")
    assert rc == 2 and "expected sizes like 3x32x32" in err


def test_unknown_dataset_for_data(capsys):
    rc, _, err = _run(capsys, "spikformer-tiny", "--data", "digitz")
    assert rc == 2 and "unknown dataset 'digitz'" in err


@pytest.mark.slow
def test_data_from_dataset_name(capsys):
    rc, out, _ = _run(capsys, "spikformer-tiny", "--data", "digits", "--batch", "4", "--data-batches", "2", "--format", "json")
    assert rc == 0
    d = json.loads(out)
    assert d["totals"]["batch_size"] == 8 and d["meta"]["input"].startswith("inputs: [8, 1, 16, 16]")
