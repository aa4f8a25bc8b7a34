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
