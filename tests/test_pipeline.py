"""Pipeline-parallel and FSDP2 early-exit training over gloo give single-process training's losses
and weights: exits on both stages, tied and untied embeddings, temperatures, dynamic token
weights, the weight ramp, the fused linear-CE and gradient clipping on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from efficient.train.optim import build_optimizer
from efficient.train.pipeline import ExitStage, shared_names, split_points, stage_modules

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _pipeline_worker as W  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict]]:
    """Every mode's ranks, forked one group after the other from one worker process (the imports
    once); `runs(mode)` gives that mode's per-rank results, or fails with the worker's stderr."""
    out = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(HERE / "_pipeline_worker.py"), str(out), *W.NPROC],
                       capture_output=True, text=True, env=env, timeout=600)

    def ranks(mode: str) -> list[dict]:
        assert (out / mode / "done").exists(), r.stderr[-3000:]
        return [torch.load(out / mode / f"rank{i}.pt", weights_only=True) for i in range(W.NPROC[mode])]

    return ranks


def reference(case: tuple) -> tuple[list[dict], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process training with the `exits` objective: per-step logs, final and initial weights."""
    model_opts, obj_opts, _, _, clip = case
    model, obj = W.build(model_opts, obj_opts)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = build_optimizer(model, W.OPT)
    logs = []
    for step, (x, y) in enumerate(W.batches()):
        obj.set_progress(0.0, step)
        loss, out = obj.loss(model, (x, y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        logs.append({k: float(v) for k, v in out.items()})  # the objective logs device tensors
    return logs, model.state_dict(), init


def check_against_reference(name: str, case: tuple, ranks: list[dict], data_parallel: bool = False) -> None:
    """Final weights and per-step logs; data-parallel ranks log their share of the batch (averaged here)."""
    ref_logs, ref_w, init = reference(case)
    got = ranks[0][name]["weights"]
    assert set(got) == set(ref_w)
    for k in ref_w:
        torch.testing.assert_close(got[k], ref_w[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
    assert any(not torch.equal(ref_w[k], init[k]) for k in ref_w)  # the steps moved the weights
    for step, ref in enumerate(ref_logs):
        merged: dict[str, float] = {}
        for r in ranks:
            merged.update(r[name]["logs"][step])
        if data_parallel:
            merged = {k: sum(r[name]["logs"][step][k] for r in ranks) / len(ranks) for k in ref}
            merged["grad_norm"] = ranks[0][name]["logs"][step].get("grad_norm", 0.0)
        for k in [k for k in ref if k.startswith("loss_") or k == "grad_norm"]:
            assert merged[k] == pytest.approx(ref[k], rel=1e-5), (name, step, k)


@pytest.fixture(scope="module")
def pipeline_runs(runs: Callable[[str], list[dict]]) -> list[dict]:
    return runs("pipeline")


@pytest.mark.parametrize("name", [*W.PIPELINE_CASES, *W.INTERLEAVED_CASES])
def test_two_stage_pipeline_matches_single_process(pipeline_runs: list[dict], name: str) -> None:
    check_against_reference(name, {**W.PIPELINE_CASES, **W.INTERLEAVED_CASES}[name], pipeline_runs)


def test_pipeline_exit_losses_live_on_their_stage(pipeline_runs: list[dict]) -> None:
    """Exit 1 is computed on stage 0, exit 3 and the final head on stage 1; tied copies stay equal."""
    r0, r1 = (r["1f1b_tied"] for r in pipeline_runs)
    assert set(r0["logs"][0]) >= {"loss_exit1", "busy_s", "step_s"} and "loss_final" not in r0["logs"][0]
    assert set(r1["logs"][0]) >= {"loss_exit3", "loss_final"} and "loss_exit1" not in r1["logs"][0]
    torch.testing.assert_close(r0["shard"]["tok_emb.weight"], r1["shard"]["tok_emb.weight"], rtol=0, atol=0)
    for r in (r0, r1):
        for log in r["logs"]:
            assert 0 <= log["busy_s"] <= log["step_s"]


@pytest.fixture(scope="module")
def fsdp_runs(runs: Callable[[str], list[dict]]) -> list[dict]:
    return runs("fsdp")


@pytest.mark.parametrize("name", list(W.FSDP_CASES))
def test_fsdp2_matches_single_process(fsdp_runs: list[dict], name: str) -> None:
    check_against_reference(name, W.FSDP_CASES[name], fsdp_runs, data_parallel=True)


@pytest.mark.slow
def test_pipeline_times_data_parallel_matches_single_process(runs: Callable[[str], list[dict]]) -> None:
    """2 stages x 2 replicas (4 processes): each replica trains on its half of every batch."""
    ranks = runs("pipeline_dp")
    assert [(r["1f1b_tied"]["dp_rank"], r["1f1b_tied"]["pp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for name in ("1f1b_tied", "gpipe_untied_fused"):
        # the losses each replica logs are of its half-batch; the weights are the full batch's
        ref_logs, ref_w, _ = reference(W.PIPELINE_CASES[name])
        for k in ref_w:
            torch.testing.assert_close(ranks[0][name]["weights"][k], ref_w[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
        for a, b in ((0, 2), (1, 3)):  # replicas hold the same stage weights
            for k, v in ranks[a][name]["shard"].items():
                torch.testing.assert_close(v, ranks[b][name]["shard"][k], rtol=0, atol=0)


def test_split_points() -> None:
    """Stages cover the layers in order, without gaps or overlaps, and differ in size by at most one."""
    assert split_points(4, 2) == [(0, 2), (2, 4)]
    assert split_points(6, 3) == [(0, 2), (2, 4), (4, 6)]
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            ranges = split_points(layers, stages)
            assert len(ranges) == stages
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
            sizes = [stop - start for start, stop in ranges]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, (layers, stages, ranges)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        split_points(2, 3)


def test_stage_parameters_keep_the_full_model_names() -> None:
    """A stage's parameters are named as in the full model; tied weights have a copy on each
    stage that reads them (the embedding on the last stage, the final head on a tied exit's)."""
    model, obj = W.build(dict(tie_embeddings=True, exit_tied=True), {})
    full = dict(model.named_parameters())
    s0, s1 = ExitStage(model, 0, 2, obj), ExitStage(model, 2, 4, obj)
    n0, n1 = dict(s0.named_parameters()), dict(s1.named_parameters())
    assert set(n0) | set(n1) == set(full) and set(n0) & set(n1) == {"tok_emb.weight"}
    assert all(n0[k] is full[k] for k in n0)
    assert shared_names(model, [(0, 2), (2, 4)]) == {"tok_emb.weight": [0, 1]}
    untied, _ = W.build(dict(tie_embeddings=False, exit_tied=True), {})
    assert shared_names(untied, [(0, 2), (2, 4)]) == {"lm_head.weight": [0, 1]}
    assert "lm_head" in stage_modules(untied, 0, 2) and "tok_emb" not in stage_modules(untied, 2, 4)
    untied_exits, _ = W.build(dict(tie_embeddings=False, exit_tied=False), {})
    assert shared_names(untied_exits, [(0, 2), (2, 4)]) == {}
