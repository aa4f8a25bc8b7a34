"""Training engine: run dir contents, exact resume, zoo round trip, schedules, failure modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import efficient
from efficient.config import ScheduleConfig, load_recipe
from efficient.errors import ConfigError
from efficient.train.engine import EpochSampler, Trainer, TrainingError
from efficient.train.optim import lr_at


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint" / "last" / "model.safetensors"))


def test_run_dir_contents_and_zoo_round_trip(tiny_recipe: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = Trainer(load_recipe(tiny_recipe, ["train.max_steps=2"]), run).fit()
    assert summary["steps"] == 2 and summary["params"] > 0
    for f in ("config.yaml", "metrics.jsonl", "summary.json", "report.md", "checkpoint/last/model.safetensors",
              "checkpoint/last/trainer.pt", "checkpoint/best/model.safetensors"):
        assert (run / f).exists(), f
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "lr" in l] == [1, 2]
    assert any(l.get("split") == "val" and "acc" in l for l in lines)
    # the run dir rebuilds the model: identical outputs to the trained weights
    model = efficient.load(run)
    trained = efficient.load("spikformer-tiny", pretrained=run / "checkpoint" / "best" / "model.safetensors",
                             embed_dim=16, depth=1, num_heads=2, timesteps=2, num_classes=3)
    x = torch.rand(4, 1, 16, 16)
    assert torch.equal(model(x), trained(x))
    assert model.head.out_features == 3  # num_classes followed the dataset


def _interrupt_after(trainer: Trainer, step: int) -> Trainer:
    """Ask the trainer to stop (as SIGINT does) once `step` optimizer steps are done."""
    real = trainer.objective.set_progress

    def set_progress(epoch: float, s: int) -> None:
        real(epoch, s)
        if s + 1 >= step:  # step s+1 runs to completion, then the loop stops
            trainer._stop_requested = True

    trainer.objective.set_progress = set_progress
    return trainer


@pytest.mark.parametrize("stop_at", [2, 4, 6])
def test_interrupt_then_resume_is_exact(tiny_recipe: Path, tmp_path: Path, stop_at: int) -> None:
    # digits with random-crop augmentation: it draws from the global RNG, which resume must restore
    text = tiny_recipe.read_text()
    data = text[text.index("data:"):text.index("objective:")]
    tiny_recipe.write_text(text.replace(data, "data:\n  name: digits\n  augment: basic\n  batch_size: 8\n"))
    overrides = ["train.max_steps=8"]
    recipe = load_recipe(tiny_recipe, overrides)
    straight = tmp_path / "straight"
    Trainer(recipe, straight).fit()
    half = tmp_path / "half"
    with pytest.raises(KeyboardInterrupt, match="resume with --resume"):
        _interrupt_after(Trainer(load_recipe(tiny_recipe, overrides), half), stop_at).fit()
    resumed = Trainer(load_recipe(half / "config.yaml"), half, resume=True)
    assert resumed.state.global_step == stop_at
    resumed.fit()
    a, b = _weights(straight), _weights(half)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(l)["step"] for l in (half / "metrics.jsonl").read_text().splitlines() if "lr" in l]
    assert steps == list(range(1, 9))


def test_epoch_sampler_resumes_mid_epoch() -> None:
    full = list(EpochSampler(20, seed=3, epoch=2))
    assert sorted(full) == list(range(20))
    assert list(EpochSampler(20, seed=3, epoch=2, start=8)) == full[8:]
    assert full != list(EpochSampler(20, seed=3, epoch=3))


def test_cosine_schedule_with_warmup() -> None:
    cfg = ScheduleConfig(name="cosine", warmup_epochs=2, warmup_lr=0.0, min_lr=0.1, cooldown_epochs=1)
    lrs = [lr_at(s, 100, 10, 1.0, cfg) for s in range(100)]
    assert lrs[0] == 0.0 and abs(lrs[10] - 0.5) < 1e-9 and lrs[20] == 1.0
    assert all(a >= b for a, b in zip(lrs[20:], lrs[21:]))
    assert lrs[-1] == pytest.approx(0.1) and lrs[92] == pytest.approx(0.1)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tiny_recipe: Path, tmp_path: Path, monkeypatch) -> None:
    from efficient.objectives.classification import Classification

    real = Classification.loss

    def loss(self, model, batch):
        value, logs = real(self, model, batch)
        return (value * float("nan") if self.step == 7 else value), logs

    monkeypatch.setattr(Classification, "loss", loss)
    run = tmp_path / "r"
    with pytest.raises(TrainingError, match="loss became nan at step 7 .*last good checkpoint"):
        Trainer(load_recipe(tiny_recipe, ["train.epochs=3"]), run).fit()
    meta = json.loads((run / "checkpoint" / "last" / "meta.json").read_text())
    assert meta["global_step"] == 4  # the end-of-epoch checkpoint before the bad step survives


def test_batch_larger_than_dataset(tiny_recipe: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="larger than the training set"):
        Trainer(load_recipe(tiny_recipe, ["data.batch_size=500"]), tmp_path / "r")


def test_resume_without_checkpoint(tmp_path: Path) -> None:
    from efficient.train.checkpoint import find_resumable

    with pytest.raises(ConfigError, match="no intact checkpoint"):
        find_resumable(tmp_path)


def test_training_time_measures_are_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = tmp_path / "m.yaml"
    recipe.write_text("model: {name: mlp-small, hidden: [16]}\ndata: {name: digits, batch_size: 64}\n"
                      "train: {max_steps: 4, measures: [local_complexity], measure_every: 2, progress: false, threads: 1}\n"
                      "profile: {enabled: false}\n")
    run = tmp_path / "run"
    import efficient.metrics
    from efficient.metrics.local_complexity import local_complexity

    seen: list[tuple[dict, object]] = []  # (weights, batch) at each measuring step, recorded independently
    real_measure = efficient.metrics.measure

    def spy(names, model, batch):
        seen.append(({k: v.clone() for k, v in model.state_dict().items()}, batch))
        return real_measure(names, model, batch)

    monkeypatch.setattr(efficient.metrics, "measure", spy)
    trainer = Trainer(load_recipe(recipe), run)
    trainer.fit()
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "measures" in r]
    assert [r["step"] for r in logged] == [2, 4]
    # each logged value is the measure of the model as it was at that step, on that step's batch
    assert len(seen) == 2 and not all(torch.equal(seen[0][0][k], seen[1][0][k]) for k in seen[0][0])
    model = trainer.model
    for row, (weights, batch) in zip(logged, seen):
        model.load_state_dict(weights)
        expected = local_complexity(model, batch)
        assert row["measures"] == pytest.approx(expected, rel=1e-6), row
        assert 0 < row["measures"]["lc"] <= 16  # sign-changing neurons among the 16 hidden units
    with pytest.raises(ConfigError, match="train.measures: unknown measure 'local_complexty'"):
        Trainer(load_recipe(recipe, ["train.measures=[local_complexty]"]), tmp_path / "r2")


@pytest.mark.parametrize("tf32", [True, False])
def test_fp32_precision_sets_matmuls_and_convolutions_alike_on_cuda_only(tf32: bool) -> None:
    """train.tf32: torch allows TF32 in cuDNN convolutions but not in matmuls by default, so a model
    of nn.Linear trained strict fp32 beside a peer of 1x1 convolutions on TF32. The setting makes
    both flags the same on CUDA (the flags are plain attributes: no GPU needed to read them) and
    leaves them alone for a CPU run."""
    from efficient.train.engine import set_fp32_precision

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # torch's defaults
        set_fp32_precision(torch.device("cpu"), tf32)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, True)
        set_fp32_precision(torch.device("cuda"), tf32)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (tf32, tf32)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_train_tf32_is_a_recipe_key_defaulting_on(tiny_recipe: Path) -> None:
    assert load_recipe(tiny_recipe).train.tf32 is True
    assert load_recipe(tiny_recipe, ["train.tf32=false"]).train.tf32 is False
    with pytest.raises(ConfigError, match="tf32"):
        load_recipe(tiny_recipe, ["train.tf32=fast"])
