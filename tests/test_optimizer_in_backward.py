"""`train.optimizer_in_backward` (`efficient.train.optim.InBackwardOptimizer`): each parameter updated
inside backward with the base optimizer's very update, its gradient freed there; schedules, state
dicts and resume as with a plain optimizer; the options it cannot serve refused by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from safetensors.torch import load_file
from test_engine import _interrupt_after
from torch import nn

from efficient.config import load_recipe
from efficient.errors import ConfigError
from efficient.train.engine import Trainer
from efficient.train.optim import InBackwardOptimizer, check_optimizer_in_backward

OPTIMIZERS = {
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.95)),
}


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _groups(net: nn.Module) -> list[dict]:  # the trainer's two groups: decayed matrices, undecayed vectors
    return [{"params": [p for p in net.parameters() if p.ndim > 1]},
            {"params": [p for p in net.parameters() if p.ndim == 1], "weight_decay": 0.0}]


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updates_in_backward_are_the_base_optimizers_bit_for_bit(name: str) -> None:
    """Weights after 6 steps with a decaying LR equal a plain optimizer's exactly; every gradient
    is gone once backward returns."""
    make = OPTIMIZERS[name]
    a, b = _net(), _net()
    oa, ob = make(_groups(a)), InBackwardOptimizer(make(_groups(b)))
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda s: 1 / (1 + s))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda s: 1 / (1 + s))
    for x, y in _batches(6):
        oa.zero_grad(set_to_none=True)
        F.cross_entropy(a(x), y).backward()
        oa.step()
        sa.step()
        ob.zero_grad(set_to_none=True)
        with ob.stepping():
            F.cross_entropy(b(x), y).backward()
        assert all(p.grad is None for p in b.parameters())
        ob.step()  # nothing left to apply
        sb.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert ob.param_groups[0]["lr"] == oa.param_groups[0]["lr"]
    # the undecayed group's setting travelled with its parameters
    assert {g["weight_decay"] for g in ob.param_groups if g["params"][0].ndim == 1} == {0.0}


def test_outside_stepping_backward_accumulates_and_step_applies() -> None:
    """A backward that is not the training step's (an attack's, a measurement's) changes no weight;
    `step()` then applies the gradients as a plain optimizer does."""
    a, b = _net(), _net()
    oa, ob = OPTIMIZERS["adamw"](_groups(a)), InBackwardOptimizer(OPTIMIZERS["adamw"](_groups(b)))
    x, y = _batches(1)[0]
    before = [p.detach().clone() for p in b.parameters()]
    F.cross_entropy(b(x), y).backward()
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))
    assert all(p.grad is not None for p in b.parameters())
    F.cross_entropy(a(x), y).backward()
    oa.step()
    ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_a_frozen_parameter_is_accepted_and_updated_by_step_once_unfrozen() -> None:
    """A parameter that does not require gradients when the optimizer is made (as plain optimizers
    accept) gets no hook; the others update inside backward, and once it is unfrozen `step()`
    applies its gradient after backward: the weights stay a plain optimizer's bit for bit."""
    make = OPTIMIZERS["adamw"]
    a, b = _net(), _net()
    for net in (a, b):
        net[0].bias.requires_grad_(False)
    oa, ob = make(_groups(a)), InBackwardOptimizer(make(_groups(b)))
    for i, (x, y) in enumerate(_batches(4)):
        if i == 2:
            a[0].bias.requires_grad_(True)
            b[0].bias.requires_grad_(True)
        oa.zero_grad(set_to_none=True)
        F.cross_entropy(a(x), y).backward()
        oa.step()
        ob.zero_grad(set_to_none=True)
        with ob.stepping():
            F.cross_entropy(b(x), y).backward()
        assert [n for n, p in b.named_parameters() if p.grad is not None] == (["0.bias"] if i >= 2 else [])
        ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(a[0].bias, _net()[0].bias)  # it did move once unfrozen


def test_state_dict_resumes_the_same_trajectory() -> None:
    """A fresh optimizer loaded from the state dict of step 3 goes on as the uninterrupted one."""
    make = OPTIMIZERS["adamw"]
    a, b = _net(), _net()
    oa, ob = InBackwardOptimizer(make(_groups(a))), InBackwardOptimizer(make(_groups(b)))
    for i, (x, y) in enumerate(_batches(6)):
        if i == 3:
            sd = copy.deepcopy(ob.state_dict())
            ob.remove_hooks()
            ob = InBackwardOptimizer(make(_groups(b)))
            ob.load_state_dict(sd)
        for net, opt in ((a, oa), (b, ob)):
            with opt.stepping():
                F.cross_entropy(net(x), y).backward()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_a_second_accumulation_in_one_backward_is_refused() -> None:
    """Two backward passes into the same parameters inside one `stepping()` would update from a
    partial gradient: the second is refused by name."""
    net = _net()
    opt = InBackwardOptimizer(OPTIMIZERS["sgd-nesterov"](_groups(net)))
    x, y = _batches(1)[0]
    with opt.stepping():
        F.cross_entropy(net(x), y).backward()
        with pytest.raises(RuntimeError, match="accumulated twice in one backward"):
            F.cross_entropy(net(x), y).backward()


def test_the_step_holds_fewer_gradient_bytes() -> None:
    """A model whose parameters outweigh its activations: the step's peak of live tensors drops by
    about its gradients, which never exist all at once."""
    from efficient.memory.measure import step_peak_bytes

    torch.manual_seed(0)
    peaks = {}
    for fused in (False, True):
        net = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        opt = InBackwardOptimizer(opt) if fused else opt
        x = torch.randn(4, 512)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with opt.stepping() if fused else torch.enable_grad():
                net(x).square().mean().backward()
            opt.step()

        step()  # the momentum buffers exist from here on
        peaks[fused] = step_peak_bytes(step)
    grads = 6 * (512 * 512 + 512) * 4
    assert peaks[False] - peaks[True] > 0.8 * grads, (peaks, grads)


DIGITS = ["train.max_steps=8", "train.epochs=1", "data.batch_size=16", "model.keep_warmup_epochs=0.3",
          "profile.enabled=false", "train.progress=false", "eval.batch_size=64", "eval.max_batches=1"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint" / "last" / "model.safetensors"))


@pytest.mark.parametrize("memory", ["none", "recompute"])
def test_the_digits_recipe_trains_as_with_the_plain_optimizer(tmp_path: Path, memory: str) -> None:
    """8 steps of the digits STATA recipe (AdamW, warm-up and cosine LR, STATA's keep ratio warming up),
    also with recomputed units (their reruns hand parameter gradients back inside backward): the same
    weights, BatchNorm statistics and logged losses bit for bit."""
    recipe = ROOT / "recipes" / "stata_digits.yaml"
    Trainer(load_recipe(recipe, [*DIGITS, f"train.memory={memory}"]), tmp_path / "plain").fit()
    Trainer(load_recipe(recipe, [*DIGITS, f"train.memory={memory}", "train.optimizer_in_backward=true"]),
            tmp_path / "fused").fit()
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "fused")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    logs = lambda run: [{k: v for k, v in json.loads(line).items() if k not in ("samples_per_s", "time_s", "elapsed_s")}  # noqa: E731
                        for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logs(tmp_path / "plain") == logs(tmp_path / "fused")


def test_resume_of_a_run_updating_in_backward_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    recipe = ROOT / "recipes" / "stata_digits.yaml"
    overrides = [*DIGITS, "train.max_steps=6", "train.optimizer_in_backward=true"]
    Trainer(load_recipe(recipe, overrides), tmp_path / "straight").fit()
    half = tmp_path / "half"
    with pytest.raises(KeyboardInterrupt, match="resume with --resume"):
        _interrupt_after(Trainer(load_recipe(recipe, overrides), half), 3).fit()
    resumed = Trainer(load_recipe(half / "config.yaml"), half, resume=True)
    assert isinstance(resumed.optimizer, InBackwardOptimizer)
    resumed.fit()
    a, b = _weights(tmp_path / "straight"), _weights(half)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_what_it_cannot_serve_is_refused_by_name() -> None:
    recipe = ROOT / "recipes" / "stata_digits.yaml"
    # the clip is refused when the recipe is read (so `efficient validate` says so too)
    with pytest.raises(ConfigError, match=r"train.optimizer_in_backward .* train.grad_clip=1.0 .* turn one of them off"):
        load_recipe(recipe, ["train.optimizer_in_backward=true", "train.grad_clip=1.0"])
    plain = load_recipe(recipe, ["train.optimizer_in_backward=true"])
    with pytest.raises(ConfigError, match=r"one process only \(here 2\).*set it false for multi-process runs"):
        check_optimizer_in_backward(plain, 2)
    with pytest.raises(ConfigError, match="pipeline stages or FSDP"):
        check_optimizer_in_backward(plain, 1, parallel=True)
    check_optimizer_in_backward(plain, 1)  # one process, no clip: accepted
    check_optimizer_in_backward(load_recipe(recipe, ["train.grad_clip=1.0"]), 4)  # the option off: nothing to check


def test_the_cli_refuses_it_before_anything_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`efficient validate` names the clip; `efficient train --nproc 2` refuses before launching processes."""
    import contextlib
    import io

    from efficient import cli
    from efficient.train import distributed

    def run(*args: str) -> tuple[int, str]:
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
        return code, err.getvalue()

    recipe = str(ROOT / "recipes" / "stata_digits.yaml")
    code, err = run("validate", recipe, "train.optimizer_in_backward=true", "train.grad_clip=1.0")
    assert code != 0 and "turn one of them off" in err
    monkeypatch.setattr(distributed, "launch", lambda *a: pytest.fail("processes were launched"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, err = run("train", recipe, "--out", str(tmp_path / "r"), "--nproc", "2", "train.optimizer_in_backward=true")
    assert code != 0 and "one process only (here 2)" in err
    assert not (tmp_path / "r").exists()
