"""CCA Merge / permutation matching / averaging (`efficient.merge`) and the `merge` command."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from efficient.commands.merge import add_arguments, run
from efficient.errors import ConfigError
from efficient.merge import cca_transform, hidden_features, merge_models
from efficient.models.mlp import MLP


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: thread hand-offs cost more than the math


def _mlp(seed: int, activation: str = "relu", hidden=(12, 10)) -> MLP:
    torch.manual_seed(seed)
    return MLP(6, list(hidden), 3, activation).double()


def _permuted(model: MLP, seed: int) -> MLP:
    """The same function with every hidden layer's neurons shuffled."""
    g = torch.Generator().manual_seed(seed)
    out = _mlp(0, hidden=[l.out_features for l in model.linears()[:-1]])
    out.load_state_dict(model.state_dict())
    layers = out.linears()
    with torch.no_grad():
        for k in range(len(layers) - 1):
            p = torch.randperm(layers[k].out_features, generator=g)
            layers[k].weight.copy_(layers[k].weight[p])
            layers[k].bias.copy_(layers[k].bias[p])
            layers[k + 1].weight.copy_(layers[k + 1].weight[:, p])
    return out


def _rotated(model: MLP, seed: int) -> MLP:
    """The same function (identity activations) with each hidden space rotated by a random orthogonal Q."""
    g = torch.Generator().manual_seed(seed)
    out = MLP(6, [l.out_features for l in model.linears()[:-1]], 3, "identity").double()
    out.load_state_dict(model.state_dict())
    layers = out.linears()
    with torch.no_grad():
        for k in range(len(layers) - 1):
            q, _ = torch.linalg.qr(torch.randn(layers[k].out_features, layers[k].out_features, generator=g, dtype=torch.float64))
            layers[k].weight.copy_(q @ layers[k].weight)
            layers[k].bias.copy_(q @ layers[k].bias)
            layers[k + 1].weight.copy_(layers[k + 1].weight @ q.T)
    return out


def _batches(n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 6, generator=g, dtype=torch.float64) for _ in range(n)]


X = torch.randn(200, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def test_cca_of_identical_features_is_identity():
    z = torch.randn(300, 8, dtype=torch.float64) @ torch.randn(8, 8, dtype=torch.float64)
    for gamma in (0.0, 0.1):
        T, T_inv = cca_transform(z, z, gamma)
        torch.testing.assert_close(T, torch.eye(8, dtype=torch.float64), atol=1e-8, rtol=0)
        torch.testing.assert_close(T_inv @ T, torch.eye(8, dtype=torch.float64), atol=1e-8, rtol=0)


@pytest.mark.parametrize("method", ["cca", "permute", "average"])
def test_self_merge_returns_the_original_function(method):
    a = _mlp(0)
    merged = merge_models(a, a, _batches(), method)
    torch.testing.assert_close(merged(X), a(X), atol=1e-9, rtol=0)


@pytest.mark.parametrize("gamma", [0.0, 0.1])
def test_cca_recovers_a_neuron_permuted_copy_and_averaging_does_not(gamma):
    a = _mlp(0)
    b = _permuted(a, seed=3)
    torch.testing.assert_close(b(X), a(X))  # same function, different neuron order
    merged = merge_models(a, b, _batches(), "cca", gamma)
    torch.testing.assert_close(merged(X), a(X), atol=1e-8, rtol=0)
    for la, lm in zip(a.linears(), merged.linears()):
        torch.testing.assert_close(lm.weight, la.weight, atol=1e-8, rtol=0)
    torch.testing.assert_close(merge_models(a, b, _batches(), "permute")(X), a(X), atol=1e-9, rtol=0)
    avg = merge_models(a, b, _batches(), "average")
    assert (avg(X) - a(X)).abs().max() > 1e-2


def test_cca_recovers_an_orthogonal_rotation_and_permutation_matching_cannot():
    a = _mlp(0, "identity", hidden=(5, 4))  # widths <= input dim: full-rank hidden features
    b = _rotated(a, seed=5)
    torch.testing.assert_close(b(X), a(X))
    torch.testing.assert_close(merge_models(a, b, _batches(), "cca", 0.0)(X), a(X), atol=1e-8, rtol=0)
    torch.testing.assert_close(merge_models(a, b, _batches(), "cca", 0.1)(X), a(X), atol=1e-8, rtol=0)
    assert (merge_models(a, b, _batches(), "permute")(X) - a(X)).abs().max() > 1e-2


def test_cca_transform_follows_the_formula():
    g = torch.Generator().manual_seed(0)
    za = torch.randn(500, 5, generator=g, dtype=torch.float64)
    zb = za @ torch.randn(5, 5, generator=g, dtype=torch.float64) + 0.3 * torch.randn(500, 5, generator=g, dtype=torch.float64)
    T, T_inv = cca_transform(za, zb, gamma=0.1)
    torch.testing.assert_close(T @ T_inv, torch.eye(5, dtype=torch.float64), atol=1e-9, rtol=0)
    # T^T z_B is the CCA image of B in A's coordinates: closer to z_A than z_B itself
    zc_a, zc_b = za - za.mean(0), zb - zb.mean(0)
    assert (zc_b @ T - zc_a).norm() < 0.5 * (zc_b - zc_a).norm()


def test_hidden_features_are_the_inputs_of_the_next_layers():
    a = _mlp(0)
    feats = hidden_features(a, [X])
    h1 = torch.relu(a.linears()[0](X))
    torch.testing.assert_close(feats[0], h1)
    torch.testing.assert_close(feats[1], torch.relu(a.linears()[1](h1)))


def test_merge_rejects_mismatched_models_and_methods():
    with pytest.raises(ConfigError, match="different layer shapes"):
        merge_models(_mlp(0), _mlp(1, hidden=(12, 9)), _batches(), "cca")
    with pytest.raises(ConfigError, match="unknown method"):
        merge_models(_mlp(0), _mlp(1), _batches(), "zipit")
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="outside the Linear chain"):
        merge_models(conv, conv, [torch.randn(2, 1, 4, 4)], "average")


def _run_dir(tmp_path, name: str, seed: int, steps: int = 40):
    """A run dir as the engine writes it: config.yaml + checkpoint/best/model.safetensors."""
    from efficient.config import validate
    from efficient.data import build_data
    from efficient.zoo import create, save_model

    recipe = validate({"model": {"name": "mlp-small", "hidden": [32, 32]}, "data": {"name": "digits", "image_size": 8, "batch_size": 64}})
    data = build_data(recipe.data)
    torch.manual_seed(seed)
    model = create("mlp-small", hidden=[32, 32], img_size=8)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(data.train, batch_size=64, shuffle=True)
    for step, (x, y) in zip(range(steps), loader):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    d = tmp_path / name
    (d / "checkpoint" / "best").mkdir(parents=True)
    cfg = recipe.to_dict()
    cfg["model"]["img_size"] = 8
    import yaml

    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    save_model(model, d / "checkpoint" / "best" / "model.safetensors")
    return d


def test_merge_command_reports_parents_average_and_merge(tmp_path, capsys):
    a, b = _run_dir(tmp_path, "a", 0), _run_dir(tmp_path, "b", 1)
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "merged.safetensors"
    assert run(p.parse_args([str(a), str(b), "--method", "cca", "--out", str(out), "--json"])) == 0
    rep = json.loads(capsys.readouterr().out)
    acc = rep["val_acc"]
    assert set(acc) == {"A", "B", "average", "cca"}
    assert min(acc["A"], acc["B"]) > 0.8
    assert acc["cca"] > acc["average"]  # independent inits: aligning before averaging matters
    import efficient

    m = efficient.load(out)
    assert type(m).__name__ == "MLP" and m.linears()[0].in_features == 64
