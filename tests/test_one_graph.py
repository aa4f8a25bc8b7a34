"""A training step the device never waits on: every zoo model family's training forward + loss, as
its recipe builds it, traces to one graph (`torch._dynamo.explain`: no graph break). A break is where
a step would read a value back to the host (`.item()`, `.tolist()`, a data-dependent shape or a
branch on a tensor), so zero breaks is also the no-sync assertion; and one graph is what CUDA-graph
replay (`train.compile: reduce-overhead`) needs. STATA models are checked before, during and after
their keep-ratio warm-up, and in eval mode."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from efficient.config import load_recipe
from efficient.models.progress import inform_progress
from efficient.train.engine import Trainer

# recipe -> the training progress (fractional epochs) at which its step is traced
RECIPES = {
    "stata_digits": (0.0, 0.3, 5.0),          # spikformer-tiny-stata: before / mid / after the warm-up
    "spikformer_digits": (0.0,),
    "sdt_stata_cluttered": (0.5,),
    "stable_snn_digits": (0.0,),              # MPD stability objective (perturbation draws inside)
    "ee_gpt_text": (0.0,),                    # exit objective with its ramp
    "qkformer_digits": (0.0,),
    "spikingformer_digits": (0.0,),
    "sdt_v2_digits": (0.0,),
}


def _breaks(fn, *args) -> list[str]:
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = torch._dynamo.explain(fn)(*args)
    return [f"{r.reason.splitlines()[0]} at {r.user_stack[-1].filename.rsplit('/', 1)[-1]}:{r.user_stack[-1].lineno}"
            if r.user_stack else r.reason.splitlines()[0] for r in ex.break_reasons]


def _trainer(recipe: str, tmp: Path) -> tuple[Trainer, object]:
    over = ["data.batch_size=4", "train.progress=false", "profile.enabled=false"]
    if recipe == "ee_gpt_text":
        over += ["model.n_embd=32", "model.n_head=2", "model.mlp_hidden=64"]
    tr = Trainer(load_recipe(ROOT / "recipes" / f"{recipe}.yaml", over), tmp / recipe)
    batch = next(iter(tr.train_loader(0, 0)))
    return tr, batch


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_training_step_is_one_graph(recipe: str, tmp_path: Path) -> None:
    tr, batch = _trainer(recipe, tmp_path)
    for progress in RECIPES[recipe]:
        inform_progress(tr.model, progress)
        tr.objective.set_progress(progress, 0)
        breaks = _breaks(lambda b: tr.objective.loss(tr.forward_model, b)[0], batch)
        assert not breaks, f"{recipe} at epoch {progress}: {len(breaks)} graph breaks: {breaks[:5]}"


@pytest.mark.slow
def test_eval_forward_is_one_graph(tmp_path: Path) -> None:
    tr, batch = _trainer("stata_digits", tmp_path)
    inform_progress(tr.model, 5.0)
    tr.model.eval()
    with torch.no_grad():
        breaks = _breaks(tr.model, batch[0])
    assert not breaks, breaks[:5]


def test_a_host_read_in_the_step_is_found(tmp_path: Path) -> None:
    """The check itself: a loss that reads a value back breaks the graph, and the test says where."""
    def step(x: torch.Tensor) -> torch.Tensor:
        y = x.square().sum()
        return y * 2 if y.item() > 0 else y
    breaks = _breaks(step, torch.ones(3))
    assert breaks and "item" in breaks[0].lower() and "test_one_graph.py" in breaks[0]


# --------------------------------------------------------------------------- compiled training

def _losses(run: Path) -> list[float]:
    import json

    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
            and '"val"' not in line]


@pytest.mark.slow
def test_compiled_training_equals_eager_over_20_steps(tmp_path: Path) -> None:
    """train.compile: default on the digits STATA recipe, through the keep-ratio warm-up (the keep
    count changes mid-run): every step's loss agrees with eager within rounding (inductor fuses and
    reorders sums), and the trained models give the same eval logits and keep the same tokens.

    The models are compared as functions, not weight by weight: a Linear bias feeding BatchNorm has
    a gradient that is zero up to rounding, which Adam turns into full-size steps of noise, so such
    biases (and the running means that absorb them) differ between any two summation orders."""
    over = ["train.max_steps=20", "train.epochs=1", "data.batch_size=16", "model.keep_warmup_epochs=0.3", "train.log_every=1",
            "profile.enabled=false", "train.progress=false", "eval.batch_size=64", "eval.max_batches=1"]
    runs = {}
    for mode in ("false", "default"):
        tr = Trainer(load_recipe(ROOT / "recipes" / "stata_digits.yaml", [*over, f"train.compile={mode}"]), tmp_path / mode)
        summary = tr.fit()
        assert summary["compile"] == (False if mode == "false" else "default")
        x = next(iter(tr.train_loader(0, 0)))[0]
        tr.model.eval()
        with torch.no_grad():
            logits = tr.model(x)
        runs[mode] = (_losses(tmp_path / mode), logits, [i.clone() for i in tr.model.stata_stats.get("kept_idx", [])])
    eager, compiled = runs["false"], runs["default"]
    assert len(eager[0]) == len(compiled[0]) == 20
    assert compiled[0] == pytest.approx(eager[0], rel=1e-4, abs=1e-5)
    assert (compiled[1] - eager[1]).abs().max() <= 1e-3 * eager[1].abs().max()
    assert eager[2] and all(torch.equal(a, b) for a, b in zip(eager[2], compiled[2]))


def test_cuda_graph_modes_off_cuda_fall_back_and_say_so(tmp_path: Path) -> None:
    from rich.console import Console

    from efficient.train.engine import compile_mode

    console = Console(record=True, width=200)
    assert compile_mode("reduce-overhead", torch.device("cpu"), console) == "default"
    assert compile_mode("max-autotune", torch.device("cpu"), console) == "max-autotune-no-cudagraphs"
    text = console.export_text()
    assert "need a CUDA device" in text and "mode default instead" in text
    assert compile_mode(True, torch.device("cpu")) == "default" and compile_mode(False, torch.device("cpu")) is None
    assert compile_mode("reduce-overhead", torch.device("cuda")) == "reduce-overhead"
    with pytest.raises(Exception, match="train.compile"):
        load_recipe(ROOT / "recipes" / "stata_digits.yaml", ["train.compile=overhead"])
