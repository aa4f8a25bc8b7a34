"""Attacks: eps=0 is clean, PGD-1 equals FGSM, robust <= clean, the eps-ball holds, FGSM on a
linear classifier moves the margin by exactly eps*||w||_1, bad input fails loudly, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from efficient import attacks
from efficient.attacks import AttackSpec, fgsm, pgd, robust_accuracy
from efficient.errors import ConfigError
from efficient.zoo import create

EPS = 8 / 255


@pytest.fixture(scope="module")
def snn_and_data():
    """A digits-sized spiking VGG fitted for a few steps, so some samples are classified right."""
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(d.target)
    x, y = images[-24:], labels[-24:]
    xt, yt = images[:128], labels[:128]
    model = create("stable-snn-digits", timesteps=2, fc_dim=32, backend="torch")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(15):
        loss = nn.functional.cross_entropy(model(xt), yt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, x, y


def test_eps_zero_returns_clean_accuracy(snn_and_data):
    model, x, y = snn_and_data
    specs = [AttackSpec(a, 0.0, steps=2) for a in attacks.ATTACKS]
    res = robust_accuracy(model, [(x, y)], specs)
    assert res["clean"] > 0.3  # the fixture model learned something, so the property is not vacuous
    for row in res["attacks"]:
        assert row["acc"] == res["clean"], row
    for spec in specs[:2]:
        assert torch.equal(attacks.run_attack(model, x, y, spec), x)


def test_pgd_one_step_without_random_start_equals_fgsm(snn_and_data):
    model, x, y = snn_and_data
    a = fgsm(model, x, y, EPS)
    b = pgd(model, x, y, EPS, steps=1, alpha=EPS, random_start=False)
    assert torch.equal(a, b)
    assert not torch.equal(a, x)


@pytest.mark.parametrize("name", attacks.ATTACKS)
def test_adversarial_inputs_stay_in_ball_and_box(snn_and_data, name):
    model, x, y = snn_and_data
    x_adv = attacks.run_attack(model, x, y, AttackSpec(name, EPS, steps=2))
    assert x_adv.shape == x.shape
    assert (x_adv - x).abs().max() <= EPS + 1e-6
    assert x_adv.min() >= 0 and x_adv.max() <= 1


def test_robust_never_exceeds_clean_and_attacks_bite(snn_and_data):
    model, x, y = snn_and_data
    specs = [AttackSpec("fgsm", 0.1), AttackSpec("pgd", 0.1, steps=3), AttackSpec("apgd-ce", 0.1, steps=3), AttackSpec("apgd-dlr", 0.1, steps=3)]
    res = robust_accuracy(model, [(x[:12], y[:12]), (x[12:], y[12:])], specs)
    assert res["n"] == 24
    for row in res["attacks"]:
        assert row["acc"] <= res["clean"]
    # at eps 0.1 on 8x8 digits the multi-step attacks must find something
    assert min(r["acc"] for r in res["attacks"][1:]) < res["clean"]


def test_fgsm_on_linear_binary_classifier_moves_margin_by_eps_l1():
    torch.manual_seed(1)
    d = 20
    w = torch.randn(d, dtype=torch.float64)
    model = nn.Linear(d, 2, bias=True).double()
    with torch.no_grad():
        model.weight.copy_(torch.stack([-w / 2, w / 2]))
        model.bias.zero_()
    x = 0.1 + 0.8 * torch.rand(6, d, dtype=torch.float64)  # >= eps from the [0, 1] bounds
    y = torch.randint(0, 2, (6,))
    eps = 0.05

    def margin(z):
        logits = model(z)
        return logits.gather(1, y[:, None])[:, 0] - logits.gather(1, 1 - y[:, None])[:, 0]

    x_adv = fgsm(model, x, y, eps)
    drop = margin(x) - margin(x_adv)
    torch.testing.assert_close(drop, torch.full_like(drop, eps * w.abs().sum().item()), rtol=0, atol=1e-10)


def test_attacks_restore_mode_and_global_rng(snn_and_data):
    model, x, y = snn_and_data
    model.train()
    try:
        state = torch.get_rng_state()
        attacks.apgd(model, x[:8], y[:8], EPS, steps=2, seed=123)
        assert model.training
        assert torch.equal(torch.get_rng_state(), state)
        pgd(model, x[:8], y[:8], EPS, steps=1, generator=torch.Generator().manual_seed(0))
        assert model.training
    finally:
        model.eval()


def test_pgd_default_step_sizes_follow_the_paper_table():
    for steps, alpha in ((7, 2.55), (10, 2.0), (20, 1.0), (40, 0.5)):
        assert attacks.default_alpha(EPS, steps) == pytest.approx(alpha / 255)
    assert attacks.default_alpha(0.1, 4) == pytest.approx(2.5 * 0.1 / 4)


def test_bad_input_errors():
    assert attacks.parse_eps("8/255") == pytest.approx(8 / 255)
    assert attacks.parse_eps("0.1") == pytest.approx(0.1)
    with pytest.raises(ConfigError, match=r"outside \[0, 1\]"):
        attacks.parse_eps("8")
    with pytest.raises(ConfigError, match=r"outside \[0, 1\]"):
        AttackSpec("pgd", -0.1)
    with pytest.raises(ConfigError, match="fraction"):
        attacks.parse_eps("eight")
    with pytest.raises(ConfigError, match="unknown attack 'pgdd'. Did you mean 'pgd'"):
        AttackSpec("pgdd", EPS)
    model = nn.Linear(4, 2)
    x, y = torch.full((2, 4), 0.5), torch.tensor([0, 1])
    with pytest.raises(ConfigError, match="outside"):
        fgsm(model, x, y, 1.5)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        robust_accuracy(model, [(x * 4, y)], [AttackSpec("fgsm", EPS)])
    with pytest.raises(ConfigError, match="3 classes"):
        model.num_classes = 2
        attacks.run_attack(model, x, y, AttackSpec("apgd-dlr", EPS))


def test_cli_json_on_a_zoo_model(capsys, monkeypatch):
    from efficient.cli import main

    monkeypatch.setenv("EFFICIENT_BACKEND", "torch")  # skip the compiled CPU path's warm-up

    rc = main(["attack", "stable-snn-digits", "--data", "digits", "--data-opt", "image_size=8", "--attack", "fgsm,pgd",
               "--steps", "2", "--max-batches", "1", "--batch-size", "16", "--format", "json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 16 and [r["attack"] for r in out["attacks"]] == ["fgsm", "pgd-2"]
    assert all(0 <= r["acc"] <= out["clean"] for r in out["attacks"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--attack", "cw"], "unknown attack 'cw'"),
        (["--eps", "2"], r"--eps=2.0 is outside \[0, 1\]"),
        (["--eps", "8/255"], "pass --data"),
    ],
)
def test_cli_bad_input(capsys, monkeypatch, argv, message):
    from efficient.cli import main

    monkeypatch.setenv("EFFICIENT_BACKEND", "torch")
    extra = [] if "pass --data" in message else ["--data", "digits"]
    rc = main(["attack", "stable-snn-digits", *extra, *argv])
    assert rc == 2
    import re

    assert re.search(message, capsys.readouterr().err)


def test_cli_on_a_trained_run_dir(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from efficient.cli import main
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    monkeypatch.setenv("EFFICIENT_BACKEND", "torch")
    recipe = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes" / "stable_snn_digits_at.yaml",
        ["train.max_steps=2", "train.progress=false", "objective.eval_attack=none", "eval.max_batches=1",
         "model.timesteps=2", "data.batch_size=16"],
    )
    Trainer(recipe, tmp_path / "run").fit()
    capsys.readouterr()
    rc = main(["attack", str(tmp_path / "run"), "--attack", "pgd", "--steps", "1", "--checkpoint", "last",
               "--max-batches", "1", "--batch-size", "8", "--format", "json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "stable-snn-digits" and out["data"] == "digits" and out["n"] == 8
    assert out["attacks"][0]["attack"] == "pgd-1" and out["attacks"][0]["acc"] <= out["clean"]


def test_pixel_data_for_a_run_trained_on_normalised_inputs():
    from efficient.commands.attack import load_pixel_data

    bundle, stats = load_pixel_data({"name": "digits", "image_size": 8})  # normalize defaults to true
    assert stats == ([0.3], [0.38])  # the model gets wrapped with these
    x = torch.stack([bundle.val[i][0] for i in range(16)])
    assert x.min() >= 0 and x.max() <= 1
    _, none = load_pixel_data({"name": "digits", "image_size": 8, "normalize": False})
    assert none is None
