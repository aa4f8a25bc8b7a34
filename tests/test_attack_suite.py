"""Worst-case attack suite and gradient-masking checks: the worst case is never above any attack,
eps 0 is clean accuracy, the checks pass on a plain CNN and fail on models built to mask gradients
(a hard input step with zero gradient; an SNN whose surrogate is narrowed to ~0 after training),
the surrogate override restores the model, and the CLI reports it all."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from efficient.attacks import CheckConfig, SuiteConfig, masking_checks, worst_case
from efficient.errors import ConfigError
from efficient.models.neurons import DLIF, override_surrogate
from efficient.zoo import create

EPS = 32 / 255
# small but real: more PGD steps than the checks' PGD-10, so "more iterations" is tested
SMALL = SuiteConfig(apgd_steps=20, apgd_restarts=1, pgd_steps=40, pgd_restarts=2, transfer_steps=20, square_queries=300)


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(d.target)
    return (images[:1200], labels[:1200]), (images[-120:], labels[-120:])


class HardStep(torch.autograd.Function):
    """Binarise pixels at 0.5 with a zero gradient: the textbook gradient-masking defence."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return (x > 0.5).to(x.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return torch.zeros_like(g)


class Binarise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return HardStep.apply(x)


def small_cnn() -> nn.Module:
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16, 10),
    )
    net.num_classes = 10
    return net


def fit(model: nn.Module, data, steps: int = 150, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    xt, yt = data
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        idx = torch.randint(0, len(yt), (64,))
        loss = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def cnn(digits):
    torch.manual_seed(0)  # initial weights independent of the tests that ran before
    return fit(small_cnn(), digits[0])


@pytest.fixture(scope="module")
def cnn_source(digits):
    torch.manual_seed(1)
    return fit(small_cnn(), digits[0], seed=1)


@pytest.fixture(scope="module")
def masked_cnn(digits):
    torch.manual_seed(2)
    net = nn.Sequential(Binarise(), small_cnn())
    net.num_classes = 10
    return fit(net, digits[0])


@pytest.fixture(scope="module")
def snn(digits):
    torch.manual_seed(3)
    # threshold 0.5: at 1 a fresh two-step net is silent for some inits and never trains
    model = create("stable-snn-digits", timesteps=2, fc_dim=32, v_threshold=0.5, backend="torch")
    return fit(model, digits[0], steps=60)


def check(res: dict, name: str) -> bool | None:
    return next(c["passed"] for c in res["checks"] if c["check"] == name)


def test_worst_case_is_never_above_any_attack(cnn, cnn_source, snn, digits):
    x, y = digits[1]
    for model, source in ((cnn, cnn_source), (snn, cnn)):
        res = worst_case(model, [(x[:60], y[:60]), (x[60:], y[60:])], EPS, SMALL, source=source, per_example=True)
        ran = [r for r in res["attacks"] if r["acc"] is not None]
        assert {r["attack"] for r in ran} >= {"apgd-ce", "apgd-dlr", "pgd", "transfer", "square"}
        assert res["n"] == 120 and res["clean"] > 0.7
        for r in ran:
            assert res["worst_case"] <= r["acc"] <= res["clean"], r
        # the per-example masks agree with the summary numbers
        clean = torch.tensor(res["per_example"]["clean"])
        survived = {k: torch.tensor(v) for k, v in res["per_example"]["survived"].items()}
        assert set(survived) == {r["attack"] for r in ran} and len(clean) == 120
        assert res["clean"] == pytest.approx(clean.float().mean().item())
        robust = clean.clone()
        for k, s in survived.items():
            assert not (s & ~clean).any(), f"{k} left an example correct that was wrong without attack"
            robust &= s
        # the worst case is exactly the fraction that no attack broke ...
        assert res["worst_case"] == pytest.approx(robust.float().mean().item())
        for r in ran:
            assert r["acc"] == pytest.approx(survived[r["attack"]].float().mean().item())
            others = clean.clone()
            for k, s in survived.items():
                if k != r["attack"]:
                    others &= s
            assert r["unique_breaks"] == int((others & ~survived[r["attack"]]).sum())
        # ... so it is strictly below the strongest single attack exactly when some example survived
        # that attack but fell to another one (ties for strongest give the same answer)
        strongest = min(ran, key=lambda r: r["acc"])
        fell_elsewhere = bool((survived[strongest["attack"]] & ~robust).any())
        assert (res["worst_case"] < strongest["acc"]) == fell_elsewhere
        assert res["seconds"] > 0 and res["seconds_per_image"] == pytest.approx(res["seconds"] / 120)


def test_spiking_models_get_the_other_surrogate_attacks_and_plain_ones_say_why_not(cnn, snn, digits):
    x, y = digits[1]
    cfg = SuiteConfig(apgd_steps=5, apgd_restarts=1, pgd_steps=5, pgd_restarts=1, square_queries=20, only=("bptt",))
    rows = {r["attack"]: r for r in worst_case(snn, [(x[:32], y[:32])], EPS, cfg)["attacks"]}
    assert set(rows) == {"bptt-sigmoid", "bptt-ste"} and all(r["acc"] is not None for r in rows.values())
    with pytest.raises(ConfigError, match="ran no attack"):
        worst_case(cnn, [(x[:32], y[:32])], EPS, cfg)
    rows = worst_case(cnn, [(x[:32], y[:32])], EPS, SuiteConfig(apgd_steps=2, apgd_restarts=1, pgd_steps=2, pgd_restarts=1,
                                                                  square_queries=5, only=("bptt", "pgd")))["attacks"]
    assert [r.get("skipped") for r in rows if r["attack"].startswith("bptt")] == ["the model has no spiking neurons to give another surrogate"] * 2


def test_pgd_best_breaks_whatever_the_same_plain_pgd_run_breaks(snn, digits):
    from efficient.attacks import pgd_best
    from efficient.attacks import pgd

    x, y = digits[1]
    alpha = EPS / 4
    best = pgd_best(snn, x, y, EPS, 20, alpha, torch.Generator().manual_seed(5))
    last = pgd(snn, x, y, EPS, 20, alpha, generator=torch.Generator().manual_seed(5))
    assert (best - x).abs().max() <= EPS + 1e-6 and best.min() >= 0 and best.max() <= 1
    with torch.no_grad():
        ok_best, ok_last = snn(best).argmax(-1) == y, snn(last).argmax(-1) == y
    assert not (ok_best & ~ok_last).any()  # same start, same steps: a superset of the breaks


def test_eps_zero_gives_clean_accuracy(snn, cnn, digits):
    x, y = digits[1]
    cfg = SuiteConfig(apgd_steps=3, apgd_restarts=1, pgd_steps=3, pgd_restarts=2, transfer_steps=3, square_queries=10)
    res = worst_case(snn, [(x, y)], 0.0, cfg, source=cnn)
    assert res["clean"] > 0.7
    for r in res["attacks"]:
        assert r["acc"] == res["clean"], r
    assert res["worst_case"] == res["clean"]


def test_checks_pass_on_a_plain_cnn(cnn, cnn_source, digits):
    x, y = digits[1]
    res = worst_case(cnn, [(x, y)], EPS, SMALL, source=cnn_source)
    checks = masking_checks(cnn, [(x, y)], res)
    assert checks["passed"], checks["lines"]
    statuses = {c["check"]: c["status"] for c in checks["checks"]}
    assert list(statuses.values()) == ["PASS"] * 4 + ["n/a"], statuses  # no spiking neurons: no other surrogate


def test_checks_fail_on_a_hard_step_with_zero_gradient(masked_cnn, cnn, digits):
    x, y = digits[1]
    res = worst_case(masked_cnn, [(x, y)], EPS, SMALL, source=cnn)
    assert res["clean"] > 0.7
    rows = {r["attack"]: r["acc"] for r in res["attacks"]}
    # zero gradients: the own-gradient attacks barely move it, Square and transfer do
    assert min(rows["square"], rows["transfer"]) < min(rows["apgd-ce"], rows["pgd"]) - 0.1
    checks = masking_checks(masked_cnn, [(x, y)], res)
    assert not checks["passed"]
    assert check(checks, "black-box/transfer never beat white-box") is False
    assert check(checks, "accuracy falls with eps to ~0") is False  # random starts alone cannot reach ~0


def test_checks_fail_on_an_snn_whose_surrogate_is_narrowed_after_training(snn, digits):
    """A triangle of half-width 1e-4 is zero almost everywhere: the own gradient vanishes while the
    spikes stay the same; the smoother and straight-through attacks must see through it."""
    x, y = digits[1]
    neuron = next(m for m in snn.modules() if isinstance(m, DLIF))
    with override_surrogate(snn, "triangle", 1e4):
        res = worst_case(snn, [(x, y)], EPS, SMALL)
        assert (neuron.surrogate, neuron.alpha) == ("triangle", 1e4)  # the suite restored the narrowed one
        checks = masking_checks(snn, [(x, y)], res)
    assert (neuron.surrogate, neuron.alpha) == ("triangle", 1.0)
    rows = {r["attack"]: r["acc"] for r in res["attacks"]}
    assert min(rows["bptt-sigmoid"], rows["bptt-ste"]) < min(rows["apgd-ce"], rows["pgd"]) - 0.2
    assert check(checks, "other surrogates never beat the own gradient") is False
    assert not checks["passed"]


def test_override_surrogate_changes_gradients_not_spikes_and_restores_on_error(snn, digits):
    x, y = digits[1][0][:16], digits[1][1][:16]

    def grad():
        xs = x.clone().requires_grad_()
        out = snn(xs)
        nn.functional.cross_entropy(out, y).backward()
        return out.detach(), xs.grad

    base_out, base_g = grad()
    neurons = [m for m in snn.modules() if isinstance(m, DLIF)]
    with override_surrogate(snn, "ste") as count:
        assert count == len(neurons) == 4 and all(m.surrogate == "ste" and m.alpha == 1.0 for m in neurons)
        out, g = grad()
    assert torch.equal(out, base_out) and not torch.allclose(g, base_g)
    with pytest.raises(RuntimeError, match="boom"):
        with override_surrogate(snn, "sigmoid", 0.5):
            raise RuntimeError("boom")
    assert all((m.surrogate, m.alpha) == ("triangle", 1.0) for m in neurons)
    torch.testing.assert_close(grad()[1], base_g)
    with pytest.raises(ValueError, match="no efficient spiking neurons"):
        with override_surrogate(nn.Linear(2, 2), "ste"):
            pass
    with pytest.raises(ValueError, match="surrogate='relu'"):
        with override_surrogate(snn, "relu"):
            pass


def test_config_errors():
    with pytest.raises(ConfigError, match="pgd_restarts must be >= 1"):
        SuiteConfig(pgd_restarts=0)
    with pytest.raises(ConfigError, match="surrogate 'relu' is unknown"):
        SuiteConfig(surrogates=(("relu", 1.0),))
    with pytest.raises(ConfigError, match="suite attack 'cw' is unknown"):
        SuiteConfig(only=("cw",))
    with pytest.raises(ConfigError, match="tol must be in"):
        CheckConfig(tol=1.5)
    model = small_cnn().eval()
    with pytest.raises(ConfigError, match="eps > 0"):
        masking_checks(model, [], {"eps": 0.0})
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        worst_case(model, [(torch.full((2, 1, 8, 8), 2.0), torch.tensor([0, 1]))], EPS, SMALL)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    from pathlib import Path

    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    root = tmp_path_factory.mktemp("runs")
    recipe_path = Path(__file__).resolve().parents[1] / "recipes" / "stable_snn_digits.yaml"
    for seed in (1, 2):
        recipe = load_recipe(recipe_path, ["train.max_steps=2", "train.progress=false", "objective.eval_attack=none",
                                           "eval.max_batches=1", "model.timesteps=2", "data.batch_size=16", f"train.seed={seed}"])
        Trainer(recipe, root / f"run{seed}").fit()
    return root / "run1", root / "run2"


def test_cli_suite_with_source_and_checks(two_runs, capsys, monkeypatch):
    from efficient.cli import main

    monkeypatch.setenv("EFFICIENT_BACKEND", "torch")
    capsys.readouterr()
    rc = main(["attack", str(two_runs[0]), "--attack", "suite", "--eps", "32/255", "--source", str(two_runs[1]), "--checks",
               "--apgd-steps", "2", "--apgd-restarts", "1", "--pgd-steps", "12", "--pgd-restarts", "1", "--transfer-steps", "2",
               "--square-queries", "5", "--checkpoint", "last", "--max-batches", "1", "--batch-size", "16", "--format", "json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    suite = out["suite"]
    assert suite["n"] == 16 and out["source"] == str(two_runs[1])
    assert [r["attack"] for r in suite["attacks"]] == ["apgd-ce", "apgd-dlr", "pgd", "bptt-sigmoid", "bptt-ste", "transfer", "square"]
    assert all(suite["worst_case"] <= r["acc"] <= suite["clean"] for r in suite["attacks"])
    assert all("seconds" in r for r in suite["attacks"])
    assert [c["check"] for c in out["checks"]["checks"]] == [
        "accuracy falls with eps to ~0", "more iterations never help", "iterative beats single-step",
        "black-box/transfer never beat white-box", "other surrogates never beat the own gradient"]
    rc = main(["attack", str(two_runs[0]), "--attack", "suite", "--eps", "32/255", "--checks", "--suite-attacks", "pgd,square",
               "--pgd-steps", "12", "--pgd-restarts", "1", "--square-queries", "5", "--checkpoint", "last",
               "--max-batches", "1", "--batch-size", "8"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "worst case" in text and "iterative beats single-step" in text and ("PASS" in text or "FAIL" in text)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--attack", "suite,pgd"], "runs alone"),
        (["--attack", "pgd", "--checks"], "--checks belongs to --attack suite"),
        (["--attack", "suite", "--steps", "3"], "--pgd-steps"),
        (["--attack", "suite", "--source", "nowhere"], "--source nowhere: not a run dir"),
        (["--attack", "suite", "--surrogate", "sigmoid:x"], "NAME:ALPHA"),
        (["--attack", "suite", "--pgd-restarts", "0"], "pgd_restarts must be >= 1"),
        (["--attack", "suite", "--suite-attacks", "cw"], "'cw' is unknown"),
    ],
)
def test_cli_suite_bad_input(capsys, monkeypatch, argv, message):
    from efficient.cli import main

    monkeypatch.setenv("EFFICIENT_BACKEND", "torch")
    rc = main(["attack", "stable-snn-digits", "--data", "digits", "--max-batches", "1", "--batch-size", "4", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err
