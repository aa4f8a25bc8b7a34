"""`train.loggers: [jsonl, tensorboard]`: event files read back with TensorBoard's own reader hold the
scalars of metrics.jsonl (losses, metrics, lr, throughput) and the final profile's firing rate per
layer and exit fractions; bad logger lists are recipe errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT

from efficient.config import load_recipe
from efficient.errors import ConfigError
from efficient.train.engine import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("tensorboard", reason="tensorboard is an extra (pip install 'efficient[report]')")

LOGGERS = "train.loggers=[jsonl, tensorboard]"


def _event_lists(run: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar event TensorBoard reads from the run, in file order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _events(run: Path) -> dict[str, dict[int, float]]:
    out = {}
    for tag, events in _event_lists(run).items():
        assert len({s for s, _ in events}) == len(events), f"{tag}: a step logged twice"
        out[tag] = dict(events)
    return out


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_spiking_run_scalars_equal_metrics_jsonl_and_profile(tiny_recipe, tmp_path):
    run = tmp_path / "run"
    Trainer(load_recipe(tiny_recipe, [LOGGERS, "profile.enabled=true", "profile.samples=4"]), run).fit()
    ev = _events(run)
    lines = _lines(run)
    train = [r for r in lines if "lr" in r]
    val = [r for r in lines if r.get("split") == "val"]
    last = train[-1]["step"]
    assert [r["step"] for r in train] == list(range(1, last + 1)) and len(val) == 2  # every step; val after each epoch
    for key in ("loss", "acc", "lr", "samples_per_s"):
        # TensorBoard keeps float32
        assert ev[f"train/{key}"] == {r["step"]: pytest.approx(r[key], rel=1e-6) for r in train}, key
    for key in ("loss", "acc"):
        assert ev[f"val/{key}"] == {r["step"]: pytest.approx(r[key], rel=1e-6) for r in val}, key
    prof = json.loads((run / "profile.json").read_text())
    neurons = [x for x in prof["layers"] if x["neuron"]]
    assert len(neurons) > 5
    for x in neurons:
        assert ev[f"firing_rate/{x['name']}"] == {last: pytest.approx(x["output_firing_rate"], rel=1e-6, abs=1e-12)}
    assert ev["profile/mean_firing_rate"] == {last: pytest.approx(prof["totals"]["mean_firing_rate"], rel=1e-6, abs=1e-12)}
    n = prof["totals"]["batch_size"]
    assert ev["profile/energy_pj_per_sample"] == {last: pytest.approx(prof["totals"]["energy_pj"] / n, rel=1e-6)}


def test_early_exit_run_logs_exit_losses_and_exit_fractions(tmp_path):
    run = tmp_path / "ee"
    r = load_recipe(ROOT / "recipes" / "ee_gpt_text.yaml", [
        LOGGERS, "train.max_steps=3", "train.log_every=1", "train.progress=false", "model.n_embd=32", "model.n_head=2",
        "model.seq_len=32", "data.seq_len=32", "data.max_bytes=20000", "data.batch_size=4", "eval.max_batches=1",
        "profile.samples=2"])
    Trainer(r, run).fit()
    ev = _events(run)
    train = [x for x in _lines(run) if "lr" in x]
    for key in ("loss_exit1", "loss_exit2", "loss_final", "w_exit1", "grad_norm"):
        assert ev[f"train/{key}"] == {x["step"]: pytest.approx(x[key], rel=1e-6) for x in train}, key
    dist = json.loads((run / "profile.json").read_text())["exits"]["distribution"]
    assert {t: v for t, v in ev.items() if t.startswith("exits/")} == {
        f"exits/fraction_at_layer_{k}": {3: pytest.approx(v, rel=1e-6, abs=1e-12)} for k, v in dist.items()}


def test_jsonl_alone_writes_no_event_files(tiny_recipe, tmp_path):
    run = tmp_path / "run"
    Trainer(load_recipe(tiny_recipe, ["train.max_steps=1"]), run).fit()
    assert load_recipe(tiny_recipe).train.loggers == ["jsonl"]
    assert not (run / "tensorboard").exists() and _lines(run)


@pytest.mark.parametrize("value,message", [
    ("[tensorbord]", "Did you mean 'tensorboard'?"),
    ("[tensorboard]", "must include jsonl"),
    ("[jsonl, jsonl]", "lists a logger more than once"),
    ("jsonl", "expected a list of one of 'jsonl', 'tensorboard'"),
])
def test_bad_logger_lists_are_recipe_errors(tiny_recipe, value, message):
    with pytest.raises(ConfigError, match="train.loggers") as e:
        load_recipe(tiny_recipe, [f"train.loggers={value}"])
    assert message in str(e.value)


def test_missing_tensorboard_is_a_recipe_error_saying_how_to_install(tiny_recipe, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tensorboard is not installed; install it with `pip install 'efficient\[report\]'`"):
        load_recipe(tiny_recipe, [LOGGERS])


def test_resume_replaces_the_events_a_killed_run_wrote_after_its_checkpoint(tiny_recipe, tmp_path):
    """A kill between a checkpoint and the next leaves events past it; the resumed run's are the ones read back."""
    from torch.utils.tensorboard import SummaryWriter

    overrides = [LOGGERS, "train.max_steps=6"]
    run = tmp_path / "run"
    trainer = Trainer(load_recipe(tiny_recipe, overrides), run)
    real = trainer.objective.set_progress

    def stop_after_step_3(epoch: float, step: int) -> None:
        real(epoch, step)
        trainer._stop_requested = step + 1 >= 3

    trainer.objective.set_progress = stop_after_step_3
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()  # `last` holds step 3
    stale = SummaryWriter(str(run / "tensorboard"))  # what the killed run had logged after it
    for step in (4, 5):
        stale.add_scalar("train/loss", 1e6, step)
    stale.close()
    Trainer(load_recipe(run / "config.yaml"), run, resume=True).fit()
    train = [r for r in _lines(run) if "lr" in r]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert _event_lists(run)["train/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train]
