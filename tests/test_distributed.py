"""Multi-process training: `--nproc 2` (DDP over gloo) equals one process with the same global batch."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]

MLP_RECIPE = """
model: {name: mlp-small, hidden: [32, 32]}
data: {name: digits, batch_size: 32}
objective: {name: classification}
optim: {name: adamw, lr: 0.003}
train: {epochs: 1, max_steps: 6, seed: 0, threads: 1, log_every: 1, progress: false}
profile: {enabled: false}
"""


def efficient(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "efficient", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)


def efficient_here(*args: str) -> tuple[int, str]:
    """`efficient ARGS` in this process (a fresh interpreter spends seconds of CPU on imports
    alone): exit code and stderr. The torch globals it sets are undone by the conftest."""
    from efficient import cli

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, err.getvalue()


def efficient_model_init(recipe: Path) -> dict[str, torch.Tensor]:
    """The recipe's model as the trainer builds it before the first step (same seed)."""
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    with tempfile.TemporaryDirectory() as d:
        return {k: v.clone() for k, v in Trainer(load_recipe(recipe), Path(d) / "r").model.state_dict().items()}


def test_two_processes_match_one(tmp_path: Path) -> None:
    recipe = tmp_path / "mlp.yaml"
    recipe.write_text(MLP_RECIPE)
    single, multi = tmp_path / "single", tmp_path / "multi"
    code, err = efficient_here("train", str(recipe), "--out", str(single))  # one process either way
    assert code == 0, err
    r2 = efficient("train", str(recipe), "--out", str(multi), "--nproc", "2")
    assert r2.returncode == 0, r2.stderr[-3000:]
    a = load_file(str(single / "checkpoint" / "last" / "model.safetensors"))
    b = load_file(str(multi / "checkpoint" / "last" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # rank 0 alone wrote the metrics: one line per step, no duplicates
    steps = [json.loads(l)["step"] for l in (multi / "metrics.jsonl").read_text().splitlines() if "lr" in l]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert json.loads((multi / "summary.json").read_text())["steps"] == 6


def test_global_batch_must_split_across_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from efficient.train import distributed

    def no_launch(*a: object) -> int:
        raise AssertionError("processes were launched")

    monkeypatch.setattr(distributed, "launch", no_launch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    recipe = tmp_path / "mlp.yaml"
    recipe.write_text(MLP_RECIPE)
    code, err = efficient_here("train", str(recipe), "--out", str(tmp_path / "r"), "--nproc", "2", "data.batch_size=33")
    assert code != 0 and "must be divisible by the 2 processes" in err


@pytest.mark.slow
def test_spiking_model_with_custom_ops_under_ddp_and_compile(tiny_recipe: Path, tmp_path: Path) -> None:
    """A Spikformer (LIF custom ops) trains with 2 processes and `train.compile: true`: the same
    weights and validation loss as the same 2 processes in eager mode. (Not one process: each rank's
    BatchNorm sees its half of the batch. SGD, because Adam turns rounding-level gradient differences
    of near-zero gradients into full-size steps of either sign.)"""
    runs = {}
    for mode, extra in (("compiled", ["train.compile=true"]), ("eager", [])):
        out = tmp_path / mode
        r = efficient("train", str(tiny_recipe), "--out", str(out), "--nproc", "2", "train.max_steps=2", "optim.name=sgd", "optim.lr=0.5", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[mode] = (json.loads((out / "summary.json").read_text()), load_file(str(out / "checkpoint" / "last" / "model.safetensors")))
    (summary, a), (expected, b) = runs["compiled"], runs["eager"]
    assert summary["steps"] == expected["steps"] == 2
    assert math.isfinite(summary["val"]["loss"])
    assert summary["val"]["loss"] == pytest.approx(expected["val"]["loss"], rel=1e-4)
    init = efficient_model_init(tiny_recipe)
    assert any(not torch.equal(b[k], init[k]) for k in b), "the eager run did not train"
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
