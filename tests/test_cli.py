"""The `efficient` command as a user runs it: one real `python -m efficient` process for each of the
process-level exits (0 on success, 2 and no traceback on bad input); the rest through `cli.main`,
the same entry point, in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from efficient.cli import main

ROOT = Path(__file__).resolve().parents[1]


def efficient(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "efficient", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """`cli(*args) -> (exit code, stdout, stderr)` through `efficient.cli.main`, as `python -m efficient` runs it."""
    monkeypatch.delenv("EFFICIENT_DEBUG", raising=False)  # it turns the exit-2 error into a raise

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's --help / usage errors
            code = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_help_lists_commands() -> None:
    r = efficient("--help")
    assert r.returncode == 0
    for cmd in ("train", "eval", "validate", "zoo"):
        assert cmd in r.stdout


def test_bad_input_exits_2_without_a_traceback(tmp_path: Path) -> None:
    # a ConfigError that fails before the zoo loads: the exit-2 path is the same for every bad input
    r = efficient("train", "--resume", str(tmp_path))
    assert r.returncode == 2 and "not a run dir" in r.stderr and "Traceback" not in r.stderr


def test_zoo_table_and_show(cli) -> None:
    code, out, _ = cli("zoo", "--format", "json")
    assert code == 0
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["spikformer-4-384"]["input"] == "3x32x32, T=4"
    assert abs(rows["spikformer-4-384"]["params"] / 1e6 - 9.33) < 0.02
    code, out, _ = cli("zoo", "show", "spikformer-tiny")
    assert code == 0 and "embed_dim" in out
    code, _, err = cli("zoo", "show", "spikformer-tinyy")
    assert code == 2 and "Did you mean: spikformer-tiny" in err and "Traceback" not in err


def test_validate_ok_and_errors(tiny_recipe: Path, cli) -> None:
    code, out, _ = cli("validate", str(tiny_recipe))
    assert code == 0 and "ok" in out
    code, _, err = cli("validate", str(tiny_recipe), "optim.lrr=3")
    assert code == 2 and "optim.lrr: unknown key. Did you mean 'lr'?" in err and "Traceback" not in err
    code, _, err = cli("validate", str(tiny_recipe), "model.num_heads=5")
    assert code == 2 and "not divisible" in err


def test_train_eval_resume_through_the_cli(tiny_recipe: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "run"
    code, stdout, err = cli("train", str(tiny_recipe), "--out", str(out), "train.max_steps=3")
    assert code == 0, err
    assert "val acc" in stdout and "params" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    code, stdout, err = cli("eval", str(out), "--format", "json")
    assert code == 0, err
    assert json.loads(stdout)["acc"] == pytest.approx(summary["val"]["acc"])
    code, _, err = cli("train", str(tiny_recipe), "--out", str(out))
    assert code == 2 and "already holds a run" in err
    code, _, err = cli("train", "--resume", str(out), "train.max_steps=5")
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["steps"] == 5
