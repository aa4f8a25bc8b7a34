"""Zoo: names, published sizes, timm registration, and load() from names, run dirs and files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import efficient
from efficient import zoo
from efficient.errors import ConfigError


def test_list_models_and_patterns() -> None:
    names = efficient.list_models()
    assert {"spikformer-4-384", "spikformer-tiny", "spikformer-8-512"} <= set(names)
    assert names == sorted(names)
    assert all(n.startswith("spikformer") for n in efficient.list_models("spikformer*"))


def test_spikformer_4_384_size_and_config() -> None:
    entry = zoo.get_entry("spikformer-4-384")
    cfg = entry.resolved_cfg()
    assert (cfg["depth"], cfg["embed_dim"], cfg["num_heads"], cfg["mlp_ratio"], cfg["timesteps"], cfg["tau"]) == (4, 384, 12, 4.0, 4, 2.0)
    assert abs(zoo.meta_param_count("spikformer-4-384") / 1e6 - 9.33) < 0.02


def test_unknown_name_suggests_closest() -> None:
    with pytest.raises(ConfigError, match="Did you mean: spikformer-tiny"):
        efficient.load("spikformer-tin")
    with pytest.raises(ConfigError, match="no such file"):
        efficient.load("runs/does-not-exist")


def test_timm_create_model_reaches_the_zoo() -> None:
    import timm

    m = timm.create_model("spikformer_tiny", num_classes=3)
    assert m.head.out_features == 3
    assert "spikformer_tiny" in timm.list_models("spikformer*")


TIMM_LATE = """
import sys, efficient
efficient.list_models()
heavy = [m for m in ("timm", "torchvision", "torch._dynamo") if m in sys.modules]
assert not heavy, heavy
import timm
assert timm.create_model("spikformer_tiny", num_classes=3).head.out_features == 3
print("TIMM-OK")
"""


def test_the_zoo_loads_without_timm_and_reaches_it_once_imported() -> None:
    """`import efficient` and the zoo do not import timm (it loads torchvision and dynamo: seconds
    per process); importing timm afterwards still finds every zoo model."""
    proc = subprocess.run([sys.executable, "-c", TIMM_LATE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "TIMM-OK" in proc.stdout, proc.stderr[-3000:]


def test_load_with_overrides_and_bad_override() -> None:
    m = efficient.load("spikformer-tiny", num_classes=4)
    assert m.head.out_features == 4 and not m.training
    with pytest.raises(ConfigError, match="Did you mean 'embed_dim'"):
        efficient.load("spikformer-tiny", embed_dims=8)


def test_safetensors_round_trip_with_metadata(tmp_path: Path) -> None:
    m = zoo.create("spikformer-tiny", embed_dim=16, depth=1, num_heads=2)
    f = tmp_path / "w.safetensors"
    zoo.save_model(m, f)
    m2 = efficient.load(f)
    x = torch.rand(2, 1, 16, 16)
    m.eval()
    assert torch.equal(m(x), m2(x))
    m3 = efficient.load("spikformer-tiny", pretrained=f, embed_dim=16, depth=1, num_heads=2)
    assert torch.equal(m(x), m3(x))


def test_weights_for_another_architecture_name_the_keys(tmp_path: Path) -> None:
    m = zoo.create("spikformer-tiny", embed_dim=16, depth=1, num_heads=2)
    f = tmp_path / "w.safetensors"
    zoo.save_model(m, f)
    with pytest.raises(ConfigError, match="weights do not fit.*(missing|shape mismatch)"):
        efficient.load("spikformer-tiny", pretrained=f)


def test_tied_weights_are_saved_once_and_restored(tmp_path: Path) -> None:
    from torch import nn

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

    t = Tied()
    f = tmp_path / "tied.safetensors"
    zoo.save_model(t, f, name="tied")
    from safetensors.torch import load_file

    assert "b.weight" not in load_file(str(f))  # stored once
    t2 = Tied()
    zoo.load_weights(t2, f)
    assert torch.equal(t2.a.weight, t.a.weight) and t2.b.weight is t2.a.weight
