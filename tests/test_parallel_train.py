"""`efficient train` with `train.parallel`: bad layouts fail before any process starts; a pipelined
run loads and generates like a single-process one; a run killed with SIGKILL resumes to the
weights of an uninterrupted run."""

from __future__ import annotations

import contextlib
import io
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

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "ee_gpt_text.yaml")
# eval.batch_size: the whole validation split in a few batches (per-batch collectives dominate at batch 8)
TINY = ["model.n_embd=32", "model.n_head=2", "model.seq_len=64", "data.seq_len=32", "data.batch_size=8", "train.log_every=1",
        "train.progress=false", "profile.samples=2", "train.threads=1", "eval.batch_size=128"]


def efficient(*args: str, wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "efficient", *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)


def efficient_here(*args: str) -> tuple[int, str, str]:
    """`efficient ARGS` in this process, on one torch thread as the subprocesses run (a fresh
    interpreter spends seconds of CPU on imports alone): exit code, stdout, stderr."""
    from efficient import cli

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    out, err = io.StringIO(), io.StringIO()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("overrides, nproc, message", [
    (["train.parallel.pipeline_stages=8"], 8, "train.parallel.pipeline_stages: 8 pipeline stages for a 4-layer model; use at most 4"),
    (["train.parallel.pipeline_stages=2", "train.parallel.schedule=interleaved_1f1b", "train.parallel.microbatches=4"], 2,
     "4 pipeline stages (2 x 2 chunks for interleaved_1f1b) for a 2-layer model"),
    (["train.parallel.pipeline_stages=2", "train.parallel.microbatches=3"], 2, "data.batch_size: 16 does not split into 3 micro-batches"),
    (["train.parallel.pipeline_stages=2", "train.parallel.microbatches=4", "data.batch_size=4"], 4,
     "4 (the global batch) does not split into 2 data-parallel replica(s) x 4 micro-batches; use a multiple of 8"),
    (["train.parallel.pipeline_stages=2"], 3, "--nproc 3 is not a multiple of 2 stages"),
    (["train.parallel.pipeline_stages=2", "train.parallel.microbatches=1"], 2, "1 micro-batches cannot fill 2 stages"),
    (["train.parallel.fsdp=true", "train.parallel.pipeline_stages=2"], 2, "fsdp: true and pipeline_stages > 1 cannot be combined"),
    (["train.parallel.fsdp=true"], 1, "sharding needs at least 2 processes"),
    (["train.parallel.microbatches=4"], 2, "only applies to pipeline training"),
    (["train.parallel.schedule=zigzag"], 2, "expected one of '1f1b', 'gpipe', 'interleaved_1f1b'"),
])
def test_bad_layouts_fail_before_any_process_starts(tmp_path: Path, overrides: list[str], nproc: int, message: str,
                                                   monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from efficient import cli
    from efficient.train import distributed

    def no_launch(*a: object) -> int:
        raise AssertionError("processes were launched")

    monkeypatch.setattr(distributed, "launch", no_launch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    extra = ["model.n_layer=2"] if "interleaved_1f1b" in " ".join(overrides) else []
    code = cli.main(["train", RECIPE, *overrides, *extra, "train.max_steps=1", "--nproc", str(nproc), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "run").exists()


def test_fsdp_with_a_model_that_cannot_shard() -> None:
    code, _, err = efficient_here("validate", str(ROOT / "recipes" / "stata_digits.yaml"), "train.parallel.fsdp=true")
    assert code == 2 and "cannot be split into transformer blocks" in err and "Traceback" not in err


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint" / "last" / "model.safetensors"))


def generated(run: Path) -> str:
    """`efficient generate` output: the text and every token's exit layer (the timing line dropped)."""
    code, out, err = efficient_here("generate", str(run), "--prompt", "The ", "--max-new-tokens", "24", "--exit-threshold", "0.01")
    assert code == 0, err[-2000:]
    return "\n".join(line for line in out.splitlines() if not line.startswith("summary:"))


STEPS = ["train.max_steps=8", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run every layout must reproduce (in this process: one process either way)."""
    out = tmp_path_factory.mktemp("single") / "run"
    code, _, err = efficient_here("train", RECIPE, *TINY, *STEPS, "--out", str(out))
    assert code == 0, err[-3000:]
    return out


def assert_same_weights(run: Path, reference: Path) -> None:
    a, b = weights(run), weights(reference)
    assert set(a) == set(b)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_pipelined_run_loads_and_generates_like_single_process(tmp_path: Path, single_run: Path) -> None:
    """`efficient train RECIPE --nproc 2 train.parallel.pipeline_stages=2` runs to completion; its run
    dir loads with `efficient.load`, holds the single-process run's weights and generates its text."""
    import efficient as package

    pp = tmp_path / "pp"
    r = efficient("train", RECIPE, *TINY, *STEPS, "--nproc", "2", "train.parallel.pipeline_stages=2", "--out", str(pp))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_weights(pp, single_run)
    assert package.load(str(pp)).exit_layers == [1, 2, 4]
    rows = [json.loads(line) for line in (pp / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "split" not in row]
    assert [row["step"] for row in train] == list(range(1, 9))
    assert {"loss_final", "loss_exit1", "loss_exit2", "bubble_stage0", "bubble_stage1", "bubble"} <= set(train[0])
    assert all(0 <= row["bubble"] < 1 for row in train)
    single_rows = [json.loads(line) for line in (single_run / "metrics.jsonl").read_text().splitlines()]
    for got, ref in zip(train, single_rows):
        for k in ("loss", "loss_final", "loss_exit1", "loss_exit2"):
            assert got[k] == pytest.approx(ref[k], rel=1e-5), (got["step"], k)
    assert json.loads((pp / "summary.json").read_text())["steps"] == 8
    assert generated(pp) == generated(single_run)


def worker_pids(parent: int) -> list[int]:
    """Children of the launching process (the training workers)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(d.name))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker processes through /proc")
@pytest.mark.parametrize("layout", [["train.parallel.pipeline_stages=2", "train.parallel.schedule=gpipe"], ["train.parallel.fsdp=true"]],
                         ids=["pipeline", "fsdp"])
def test_kill_one_rank_then_resume_gives_the_uninterrupted_weights(tmp_path: Path, layout: list[str], single_run: Path) -> None:
    """SIGKILL of one rank mid-run, then `--resume`: the weights of an uninterrupted run (which,
    for either layout, are the single-process run's)."""
    import efficient as package

    run_args = [*TINY, *STEPS, "--nproc", "2", *layout]
    killed = tmp_path / "killed"

    p = efficient("train", RECIPE, *run_args, "--out", str(killed), wait=False)
    meta = killed / "checkpoint" / "last" / "meta.json"
    deadline = time.time() + 300
    while not meta.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    workers = worker_pids(p.pid)
    for w in workers:  # freeze the run at its first checkpoint, then SIGKILL one rank
        os.kill(w, signal.SIGSTOP)
    assert p.poll() is None and len(workers) == 2, "the run ended before it could be killed"
    step = json.loads(meta.read_text())["global_step"]
    assert 2 <= step < 8
    os.kill(max(workers), signal.SIGKILL)
    os.kill(min(workers), signal.SIGCONT)
    p.wait(timeout=120)
    assert p.returncode != 0

    r = efficient("train", "--resume", str(killed), "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_weights(killed, single_run)
    assert package.load(str(killed)).exit_layers == [1, 2, 4]
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "split" not in row] == list(range(1, 9))
    val, ref = (next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"val"' in line)
                for run in (killed, single_run))
    assert val["loss"] == pytest.approx(ref["loss"], rel=1e-5) and val["loss_exit1"] == pytest.approx(ref["loss_exit1"], rel=1e-5)


def test_resume_on_another_layout_fails_before_any_process_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Sharded trainer state belongs to the layout that wrote it: --resume with another --nproc is refused."""
    from efficient import cli
    from efficient.config import load_recipe
    from efficient.train import checkpoint as ckpt
    from efficient.train import distributed
    from efficient.train.parallel import layout_meta

    recipe = load_recipe(RECIPE, ["train.parallel.pipeline_stages=2"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(recipe.to_yaml())
    last = run / "checkpoint" / "last"
    tmp = ckpt.begin_checkpoint(last)
    torch.save({"scheduler": {}, "rng": [], "param_groups": [], "progress": {}}, tmp / ckpt.STATE_FILE)
    ckpt.commit_checkpoint(tmp, last, {"global_step": 2, "layout": layout_meta(recipe, 2)})

    def no_launch(*a: object) -> int:
        raise AssertionError("processes were launched")

    monkeypatch.setattr(distributed, "launch", no_launch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["train", "--resume", str(run), "--nproc", "4"]) == 2
    err = capsys.readouterr().err
    assert "'world_size': 2" in err and "'world_size': 4" in err and "resume with the --nproc" in err
