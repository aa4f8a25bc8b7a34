"""Crash safety: SIGKILL at any moment resumes to exactly the uninterrupted weights; corrupted
checkpoints fall back to the previous one; pickled checkpoints are refused unless opted in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import efficient
from efficient import zoo
from efficient.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

RECIPE = """
model: {name: mlp-small, hidden: [32]}
data: {name: digits, batch_size: 64, augment: basic}
objective: {name: classification}
optim: {name: adamw, lr: 0.003}
train: {epochs: 2, max_steps: 30, seed: 0, threads: 1, log_every: 1, checkpoint_every: 1, progress: false, deterministic: true}
profile: {enabled: false}
"""


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "efficient", *args]


def _last_step(run: Path) -> int:
    f = run / "metrics.jsonl"
    if not f.exists():
        return 0
    steps = [json.loads(l).get("step", 0) for l in f.read_text().splitlines() if l.strip().endswith("}")]
    return max(steps, default=0)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint" / "last" / "model.safetensors"))


def test_sigkill_at_several_points_then_resume_is_exact(tmp_path: Path) -> None:
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = tmp_path / "killed"
    proc = subprocess.Popen(_cmd("train", str(recipe), "--out", str(run)), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kills = 0
    # an epoch is 22 steps: one kill early in the first process, one in a resumed process near the
    # epoch's end, so the last resume carries the run across the boundary (validation, reshuffle)
    for target in (4, 22):
        deadline = time.time() + 600
        while _last_step(run) < target and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "training ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        proc = subprocess.Popen(_cmd("train", "--resume", str(run)), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # the uninterrupted reference trains in this process while the resumed one runs: the same
    # seeded, single-threaded, deterministic run, so its weights are bit for bit a fresh process's
    straight = tmp_path / "straight"
    Trainer(load_recipe(recipe), straight).fit()
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-2000:]
    assert kills == 2
    a, b = _weights(straight), _weights(run)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if "lr" in json.loads(l)]
    assert steps == list(range(1, 31))


def test_corrupted_last_checkpoint_falls_back_to_previous(tiny_recipe: Path, tmp_path: Path) -> None:
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    run = tmp_path / "run"
    Trainer(load_recipe(tiny_recipe, ["train.max_steps=3", "train.checkpoint_every=1"]), run).fit()
    target = run / "checkpoint" / "last" / "model.safetensors"
    target.write_bytes(target.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.warns(UserWarning, match="corrupted.*falling back to the previous"):
        t = Trainer(load_recipe(run / "config.yaml", ["train.max_steps=4"]), run, resume=True)
    assert t.state.global_step == 3  # `previous` holds the step-3 checkpoint written before the final save


def test_pickled_checkpoint_refused_unless_opted_in(tmp_path: Path) -> None:
    m = zoo.create("mlp-small", hidden=[8])
    plain = tmp_path / "plain.pt"
    torch.save(m.state_dict(), plain)
    efficient.load("mlp-small", pretrained=plain, hidden=[8])  # a tensors-only state dict is fine
    pickled = tmp_path / "pickled.pt"
    torch.save({"state_dict": m.state_dict(), "note": ConfigError("an arbitrary Python object")}, pickled)
    with pytest.raises(ConfigError, match="pickled Python objects.*allow_pickle=True"):
        efficient.load("mlp-small", pretrained=pickled, hidden=[8])
    loaded = efficient.load("mlp-small", pretrained=pickled, hidden=[8], allow_pickle=True)
    x = torch.rand(2, 1, 16, 16)
    m.eval()
    assert torch.equal(loaded(x), m(x))


def test_sigint_saves_and_exits_cleanly(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.replace("max_steps: 30", "max_steps: 400").replace("checkpoint_every: 1", "checkpoint_every: 1000"))
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_cmd("train", str(recipe), "--out", str(run)), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while _last_step(run) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130
    assert "resume with --resume" in err and "Traceback" not in err
    meta = json.loads((run / "checkpoint" / "last" / "meta.json").read_text())
    assert meta["global_step"] >= 3  # the interrupt saved where it stopped, mid-epoch


def test_atomic_writes_get_the_mode_a_plain_open_gives(tmp_path: Path) -> None:
    """Artifacts are shared between users and tools: an atomic write must not leave them owner-only."""
    import os

    from efficient.io import write_text

    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.txt", "x")
        with open(tmp_path / "b.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == (tmp_path / "b.txt").stat().st_mode & 0o777 == 0o644
