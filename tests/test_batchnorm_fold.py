"""BatchNorm folded into the preceding Linear/Conv for inference (`efficient.fold_batchnorm`): the
zoo's eval outputs unchanged (float64, where a spike cannot flip on rounding), the BatchNorm calls
gone, pairs that must not fold left alone, and a folded model that refuses to train."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import efficient
from efficient.batchnorm_fold import FoldedBatchNorm, foldable_pairs
from efficient.errors import ConfigError
from efficient.zoo import create, get_entry

SMALL = {"backend": "torch"}
ZOO = {  # small builds of every zoo family with BatchNorm units
    "spikformer-tiny": SMALL,
    "spikformer-tiny-stata": SMALL,
    "sdt-2-512": {**SMALL, "embed_dim": 64, "num_heads": 4},
    "sdt-v2-tiny": SMALL,
    "qkformer-tiny": SMALL,
    "spikingformer-tiny": SMALL,
    "stable-snn-vgg5": {**SMALL, "fc_dim": 64, "width": 0.25},
    "stable-snn-wrn16": SMALL,
}


class _BatchNormCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += getattr(func, "__name__", "") == "batch_norm"
        return func(*args, **(kwargs or {}))


def _random_statistics(model: nn.Module, seed: int = 0) -> None:
    # fresh BatchNorms are the identity (mean 0, var 1, weight 1, bias 0): a wrong fold would not show
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_((torch.rand(m.num_features, generator=g) - 0.5) * 0.4)


def _input(model: nn.Module, name: str, batch: int) -> torch.Tensor:
    shape = list(get_entry(name).input_spec.shape)
    if hasattr(model, "patch_embed") and hasattr(model.patch_embed, "img_size"):
        shape[-2:] = [model.patch_embed.img_size] * 2
    return torch.rand(batch, *shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2


@pytest.mark.parametrize("name", ZOO)
def test_folding_keeps_the_zoo_eval_outputs_and_removes_the_batchnorm_calls(name: str) -> None:
    torch.manual_seed(0)
    model = create(name, **ZOO[name]).double().eval()
    _random_statistics(model)
    x = _input(model, name, 3)
    calls = _BatchNormCalls()
    with torch.no_grad(), calls:
        want = model(x)
    folded = efficient.fold_batchnorm(model, x[:1])
    assert folded, "nothing folded"
    after = _BatchNormCalls()
    with torch.no_grad(), after:
        got = model(x)
    assert after.n == calls.n - len(folded)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert all(isinstance(model.get_submodule(n), FoldedBatchNorm) for n in folded)


def test_every_batchnorm_of_a_spikformer_folds_and_the_state_dict_loses_them() -> None:
    model = create("spikformer-tiny", **SMALL).eval()
    n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    folded = efficient.fold_batchnorm(model, _input(model, "spikformer-tiny", 1).float())
    assert len(folded) == n_bn
    assert not [k for k in model.state_dict() if "running_mean" in k]


class Residual(nn.Module):
    """conv -> BN, plus the raw conv output: folding would change the second use."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.lin, self.bn1 = nn.Linear(4, 4), nn.BatchNorm1d(2)  # BN1d over dim 1 of a [N, 2, 4] output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        z = self.bn(y) + y
        return z + self.bn1(self.lin(z.flatten(2)[:, :2, :4])).sum()


def test_pairs_that_would_change_the_result_are_left_alone() -> None:
    model = Residual().eval()
    _random_statistics(model)
    x = torch.randn(2, 2, 4, 4)
    assert foldable_pairs(model, x) == []
    with torch.no_grad():
        want = model(x)
    assert efficient.fold_batchnorm(model, x) == []
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_a_layer_called_twice_is_not_folded() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.lin(x)) + self.lin(x)

    model = Twice().eval()
    assert foldable_pairs(model, torch.randn(3, 4)) == []


def test_folding_needs_eval_and_a_folded_model_refuses_to_train() -> None:
    model = create("spikformer-tiny", **SMALL)
    x = _input(model, "spikformer-tiny", 1).float()
    with pytest.raises(ConfigError, match=r"model\.eval\(\)"):
        efficient.fold_batchnorm(model.train(), x)
    folded = efficient.fold_batchnorm(model.eval(), x)
    bn = model.get_submodule(folded[0])
    assert bn.num_features > 0 and bn.running_var.shape == (bn.num_features,)  # reads reach the original
    with pytest.raises(ConfigError, match="load the model again to train it"):
        model.train()(x)
