"""Pipeline-parallel early-exit training: 2 stages over gloo give the single-process loss and grads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from efficient import zoo
from efficient.train.pipeline import ExitStage, split_points

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _pipeline_worker import CFG  # noqa: E402


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


def test_tied_heads_are_rejected() -> None:
    with pytest.raises(ValueError, match="untied heads"):
        ExitStage(zoo.create("ee-gpt-tiny", n_layer=2, n_embd=16, n_head=2, exit_layers=[1]), 0, 1, {1: 1.0})


def test_two_stage_pipeline_matches_single_process(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(HERE / "_pipeline_worker.py"), str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in range(2))
    # single process, same model and batch
    torch.manual_seed(0)
    model = zoo.create("ee-gpt-tiny", **CFG)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (4, 16), generator=g)
    tgt = torch.randint(0, 256, (4, 16), generator=g)
    logits = model.all_logits(idx)
    ce = {k: F.cross_entropy(v.float().flatten(0, 1), tgt.flatten()) for k, v in logits.items()}
    total = ce[4] + 0.5 * ce[1] + 0.25 * ce[3]
    total.backward()
    torch.testing.assert_close(torch.tensor(r1["loss"]), ce[4].detach(), rtol=1e-5, atol=1e-6)
    # each exit loss was computed on its own stage (layer 1 on stage 0, layer 3 on stage 1)
    assert len(r0["exit_losses"]) == 2 and len(r1["exit_losses"]) == 2
    grads = {**r0["grads"], **r1["grads"]}
    own = dict(model.named_parameters())
    assert set(grads) == {k for k, p in own.items() if p.grad is not None}
    for k, gk in grads.items():
        torch.testing.assert_close(gk, own[k].grad, rtol=1e-4, atol=1e-6, msg=k)
