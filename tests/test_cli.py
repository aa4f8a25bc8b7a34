"""The `efficient` command through a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def efficient(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "efficient", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def test_help_lists_commands() -> None:
    r = efficient("--help")
    assert r.returncode == 0
    for cmd in ("train", "eval", "validate", "zoo"):
        assert cmd in r.stdout


def test_zoo_table_and_show() -> None:
    r = efficient("zoo", "--format", "json")
    assert r.returncode == 0
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["spikformer-4-384"]["input"] == "3x32x32, T=4"
    assert abs(rows["spikformer-4-384"]["params"] / 1e6 - 9.33) < 0.02
    r = efficient("zoo", "show", "spikformer-tiny")
    assert r.returncode == 0 and "embed_dim" in r.stdout
    r = efficient("zoo", "show", "spikformer-tinyy")
    assert r.returncode == 2 and "Did you mean: spikformer-tiny" in r.stderr and "Traceback" not in r.stderr


def test_validate_ok_and_errors(tiny_recipe: Path) -> None:
    r = efficient("validate", str(tiny_recipe))
    assert r.returncode == 0 and "ok" in r.stdout
    r = efficient("validate", str(tiny_recipe), "optim.lrr=3")
    assert r.returncode == 2 and "optim.lrr: unknown key. Did you mean 'lr'?" in r.stderr and "Traceback" not in r.stderr
    r = efficient("validate", str(tiny_recipe), "model.num_heads=5")
    assert r.returncode == 2 and "not divisible" in r.stderr


def test_train_eval_resume_through_the_cli(tiny_recipe: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = efficient("train", str(tiny_recipe), "--out", str(out), "train.max_steps=3")
    assert r.returncode == 0, r.stderr
    assert "val acc" in r.stdout and "params" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    r = efficient("eval", str(out), "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["acc"] == pytest.approx(summary["val"]["acc"])
    r = efficient("train", str(tiny_recipe), "--out", str(out))
    assert r.returncode == 2 and "already holds a run" in r.stderr
    r = efficient("train", "--resume", str(out), "train.max_steps=5")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 5
