"""Early exits on transformers causal LMs (efficient.hf): transformers' own forward is the oracle
for every exit, for skipped layers and for the save round trip; the curricula, the layer-dropout
rates and a short training run through our Trainer and recipes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch import nn

import efficient
from efficient import zoo
from efficient.errors import ArtifactError, ConfigError
from efficient.hf import EarlyExitLM, LayerDropout, LayerDropoutConfig, early_exit
from efficient.hf.dropout import depth_scale, time_scale
from efficient.objectives.exits import ExitLoss

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

V, S = 64, 12
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def tiny(arch: str, dtype: torch.dtype = torch.float64, **kw) -> nn.Module:
    """A random 4-layer model of `arch` (GQA 4/2 heads for the Llama family)."""
    cfgs = {
        "llama": transformers.LlamaConfig(**SMALL),
        "qwen2": transformers.Qwen2Config(**SMALL),
        "mistral": transformers.MistralConfig(**SMALL, sliding_window=5),  # shorter than the sequence: the mask matters
        "gpt2": transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
    }
    cfg = cfgs[arch]
    for k, v in kw.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def ids(b: int = 2, s: int = S, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


ARCHS = ["llama", "qwen2", "mistral", "gpt2"]


# --------------------------------------------------------------------------- the exits against transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_every_exit_is_the_first_k_layers_then_norm_and_head(arch: str) -> None:
    m = tiny(arch)
    ee = early_exit(m, exits=[1, 2, 3]).eval()
    assert ee.exits == ee.exit_layers == [1, 2, 3, 4] and ee.num_layers == 4 and ee.model is m
    x = ids()
    with torch.no_grad():
        ref = m(x, output_hidden_states=True)
        torch.testing.assert_close(ee(x), ref.logits, rtol=0, atol=1e-10)
        for k in (1, 2, 3):  # hidden_states[k] is layer k's output
            want = m.lm_head(ee.final_norm(ref.hidden_states[k]))
            torch.testing.assert_close(ee(x, exit_layer=k), want, rtol=0, atol=1e-10)
            torch.testing.assert_close(ee.exit_head(k)(ref.hidden_states[k]), want, rtol=0, atol=1e-10)
        out = ee.exit_outputs(x, labels=x)
    assert sorted(out.logits) == [1, 2, 3, 4]
    torch.testing.assert_close(out.loss, ref_loss(m, x), rtol=1e-9, atol=0)


def ref_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(x, labels=x).loss


def test_padding_mask_as_transformers() -> None:
    m = tiny("llama")
    ee = early_exit(m, exits=[2]).eval()
    x, mask = ids(), torch.ones(2, S, dtype=torch.long)
    mask[0, :4] = 0  # left padding of the first sample
    with torch.no_grad():
        torch.testing.assert_close(ee(x, attention_mask=mask)[mask.bool()], m(x, attention_mask=mask).logits[mask.bool()], rtol=0, atol=1e-10)


def test_exit_runs_only_the_layers_below_it() -> None:
    ee = early_exit(tiny("llama"), exits=[2]).eval()
    ran: list[int] = []
    for i, layer in enumerate(ee.layers):
        layer.register_forward_hook(lambda mod, a, o, i=i: ran.append(i))
    with torch.no_grad():
        ee(ids(), exit_layer=2)
    assert ran == [0, 1]


def test_own_heads_start_as_the_final_head_and_train_apart() -> None:
    m = tiny("gpt2")
    ee = early_exit(m, exits=[2], head="own").eval()
    x = ids()
    with torch.no_grad():
        shared = early_exit(m, exits=[2]).eval()(x, exit_layer=2)
        torch.testing.assert_close(ee(x, exit_layer=2), shared, rtol=0, atol=1e-10)
        w = ee.heads["2"].proj.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(4), dtype=w.dtype))
        assert not torch.allclose(ee(x, exit_layer=2), shared)
        torch.testing.assert_close(ee(x), m(x).logits, rtol=0, atol=1e-10)  # the final head is the model's
    assert ee.exit_head(2).proj is not m.lm_head and ee.exit_head(4).proj is m.lm_head
    assert {n.split(".")[0] for n, _ in ee.named_parameters()} == {"model", "heads"}


def test_bad_exits_and_heads_are_named() -> None:
    m = tiny("llama")
    with pytest.raises(ConfigError, match="outside 1..4"):
        early_exit(m, exits=[5])
    with pytest.raises(ConfigError, match="'shared'.*'own'"):
        early_exit(m, exits=[2], head="mine")
    with pytest.raises(ValueError, match=r"no exit at layer\(s\) \[3\]; this model.s exits are \[2, 4\]"):
        early_exit(m, exits=[2])(ids(), exit_layer=3)


def test_unsupported_architectures_name_the_supported_ones() -> None:
    cfg = transformers.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4,
                                 word_embed_proj_dim=32, max_position_embeddings=64)
    for model in (AutoModelForCausalLM.from_config(cfg), nn.Linear(2, 2)):
        with pytest.raises(ConfigError) as e:
            early_exit(model, exits=[1])
        msg = str(e.value)
        assert all(n in msg for n in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"))
        assert type(model).__name__ in msg
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        zoo.create("hf", config={"model_type": "opt", "vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2,
                                 "ffn_dim": 48, "num_attention_heads": 4, "word_embed_proj_dim": 32})
    with pytest.raises(ConfigError, match="model_type"):
        zoo.create("hf", config={"vocab_size": V})


# --------------------------------------------------------------------------- save / reload


@pytest.mark.parametrize("arch,head", [("llama", "own"), ("gpt2", "own"), ("qwen2", "shared")])
def test_save_pretrained_round_trip(arch: str, head: str, tmp_path: Path) -> None:
    ee = early_exit(tiny(arch, torch.float32), exits=[1, 3], head=head, layer_dropout={"max": 0.1})
    with torch.no_grad():
        for p in ee.heads.parameters():  # own heads that differ from the final head they started as
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    ee.eval()
    x = ids()
    ee.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "early_exit.json").read_text())
    assert cfg["exits"] == [1, 3, 4] and cfg["head"] == head and cfg["architecture"] == type(ee.model).__name__
    assert cfg["layer_dropout"]["max"] == 0.1
    assert (tmp_path / "ckpt" / "early_exit_heads.safetensors").exists() == (head == "own")

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    with torch.no_grad():
        assert torch.equal(plain(x).logits, ee.model(x).logits)
    back = efficient.load("hf", path=str(tmp_path / "ckpt"))
    assert isinstance(back, EarlyExitLM) and back.exits == [1, 3, 4] and back.head == head and not back.training
    assert back.layer_dropout.config == ee.layer_dropout.config
    with torch.no_grad():
        for k in back.exits:
            assert torch.equal(back(x, exit_layer=k), ee(x, exit_layer=k)), k


def test_reload_errors_and_plain_directories(tmp_path: Path) -> None:
    ee = early_exit(tiny("llama", torch.float32), exits=[2], head="own")
    ee.save_pretrained(tmp_path / "ee")
    f = tmp_path / "ee" / "early_exit_heads.safetensors"
    f.write_bytes(f.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ArtifactError, match="sha256"):
        EarlyExitLM.from_pretrained(tmp_path / "ee")
    ee.model.save_pretrained(tmp_path / "plain")  # no exits recorded
    with pytest.raises(ConfigError, match="exits="):
        EarlyExitLM.from_pretrained(tmp_path / "plain")
    assert efficient.load("hf", path=str(tmp_path / "plain")).exits == [2, 4]  # half depth
    assert efficient.load("hf", path=str(tmp_path / "plain"), exits=[1, 3]).exits == [1, 3, 4]
    with pytest.raises(ConfigError, match="not a directory"):
        zoo.create("hf", path=str(tmp_path / "missing"))


# --------------------------------------------------------------------------- layer dropout


def test_layer_dropout_rates_follow_depth_and_time() -> None:
    ld = LayerDropout(LayerDropoutConfig(max=0.2, scale="exp"), 8)
    assert ld.rates() == pytest.approx([0.2 * (math.exp(math.log(2) * l / 7) - 1) for l in range(8)])
    assert ld.rates()[0] == 0 and ld.rates()[-1] == pytest.approx(0.2)
    lin = LayerDropout(LayerDropoutConfig(max=0.3, scale="linear", time="exp", time_epochs=4.0), 4)
    lin.set_progress(2.0)  # S = 2^(1/2) - 1
    assert lin.rates() == pytest.approx([0.3 * (2**0.5 - 1) * l / 3 for l in range(4)])
    lin.set_progress(10.0)
    assert lin.rates()[-1] == pytest.approx(0.3)
    assert time_scale(1.0, 4.0, "linear") == 0.25 and depth_scale(0, 1, "exp") == 0.0
    for bad, match in (({"max": 1.0}, r"\[0, 1\)"), ({"scale": "cubic"}, "exp, linear"), ({"rate": 0.1}, "valid keys"),
                       ({"time_epochs": 0}, "> 0")):
        with pytest.raises(ConfigError, match=match):
            LayerDropoutConfig.from_dict(bad)


def _without(m: nn.Module, dropped: set[int], x: torch.Tensor) -> torch.Tensor:
    """transformers' own forward with the `dropped` layers taken out of its layer list."""
    base = m.model
    full = base.layers
    base.layers = nn.ModuleList([layer for i, layer in enumerate(full) if i not in dropped])
    try:
        with torch.no_grad():
            return m(x, use_cache=False).logits
    finally:
        base.layers = full


def _draws(cfg: LayerDropoutConfig, n: int, batch: int, seed: int) -> list:
    return LayerDropout(cfg, n, torch.Generator().manual_seed(seed)).draw(batch, torch.device("cpu"))


def test_layer_dropout_per_batch_skips_the_drawn_layers() -> None:
    m = tiny("llama")
    cfg = LayerDropoutConfig(max=0.9, scale="linear", per="batch")
    x = ids()
    seen = set()
    for seed in range(6):
        drops = _draws(cfg, 4, 2, seed)
        dropped = {i for i, d in enumerate(drops) if d is True}
        seen.add(frozenset(dropped))
        ee = early_exit(m, exits=[2], layer_dropout=cfg, generator=torch.Generator().manual_seed(seed)).train()
        with torch.no_grad():
            torch.testing.assert_close(ee(x), _without(m, dropped, x), rtol=0, atol=1e-10)
    assert len(seen) > 1 and any(seen)  # the draws differ and some drop layers


def test_layer_dropout_per_sample_skips_per_sample() -> None:
    m = tiny("llama")
    cfg = LayerDropoutConfig(max=0.9, scale="linear", per="sample")
    x = ids(b=4)
    drops = _draws(cfg, 4, 4, seed=3)
    ee = early_exit(m, exits=[2], layer_dropout=cfg, generator=torch.Generator().manual_seed(3)).train()
    with torch.no_grad():
        out = ee(x)
    dropped_any = False
    for b in range(4):
        dropped = {i for i, d in enumerate(drops) if d is not None and not bool(d[b])}
        dropped_any |= bool(dropped)
        torch.testing.assert_close(out[b : b + 1], _without(m, dropped, x[b : b + 1]), rtol=0, atol=1e-10)
    assert dropped_any


def test_layer_dropout_is_off_in_eval_and_reproducible_under_a_seed() -> None:
    m = tiny("llama")
    ee = early_exit(m, exits=[2], layer_dropout={"max": 0.9, "scale": "linear"})
    x = ids(b=8)
    with torch.no_grad():
        ref = m(x).logits
        torch.testing.assert_close(ee.eval()(x), ref, rtol=0, atol=1e-10)
        ee.train()
        torch.manual_seed(11)  # the trainer seeds torch's generator with train.seed
        a = ee(x)
        torch.manual_seed(11)
        b = ee(x)
        c = ee(x)
    assert torch.equal(a, b) and not torch.allclose(a, ref) and not torch.equal(b, c)


# --------------------------------------------------------------------------- curricula


def _objective(**kw) -> ExitLoss:
    obj = ExitLoss(weights=[0.2, 0.4, 0.6], **kw)
    obj.setup(early_exit(tiny("gpt2"), exits=[1, 2, 3]))
    return obj


def test_rotational_curriculum_trains_one_exit_per_step() -> None:
    obj = _objective(curriculum="rotational")
    assert [obj.active_exits(t) for t in range(5)] == [[1], [2], [3], [1], [2]]
    obj.set_progress(0.0, 4)
    assert obj.weights() == {1: 0.0, 2: 0.4, 3: 0.0}
    model = early_exit(tiny("gpt2"), exits=[1, 2, 3])
    _, logs = obj.loss(model, (ids(), ids(seed=2)))
    assert {k for k in logs if k.startswith("loss_exit")} == {"loss_exit2"}


def test_gradual_curriculum_enables_exits_deep_to_shallow() -> None:
    obj = _objective(curriculum="gradual", curriculum_iters=90)
    assert [obj.active_exits(t) for t in (0, 29, 30, 59, 60, 500)] == [[3], [3], [2, 3], [2, 3], [1, 2, 3], [1, 2, 3]]
    with pytest.raises(ConfigError, match="curriculum_iters"):
        ExitLoss(curriculum="gradual")
    with pytest.raises(ConfigError, match="rotational"):
        ExitLoss(curriculum="spiral")


def test_no_curriculum_keeps_the_ramp() -> None:
    obj = _objective(weight_init=0.0, warmup_iters=10)
    obj.set_progress(0.0, 5)
    assert obj.active_exits(5) == [1, 2, 3]
    assert obj.weights() == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})


# --------------------------------------------------------------------------- profiler and training


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_profiler_counts_each_exit(attn: str) -> None:
    # eager runs Q K^T and P V as matmuls over repeated KV heads; sdpa is one fused call that gets
    # the grouped KV heads themselves: both must give the same count
    ee = early_exit(tiny("llama", torch.float32, _attn_implementation=attn), exits=[1, 2])
    x = ids(b=2)
    rep = efficient.profile(ee, inputs=x)
    per = rep.exits["per_exit"]
    assert sorted(per) == [1, 2, 4]
    d, kv, ff, tokens = 32, 2 * 8, 48, x.numel()
    layer = tokens * (d * d + 2 * d * kv + d * d + 3 * d * ff) + 2 * 2 * 4 * S * S * 8  # projections + QK^T and PV
    assert per[2]["dense_macs"] - per[1]["dense_macs"] == layer
    assert per[4]["dense_macs"] - per[2]["dense_macs"] == 2 * layer
    assert per[1]["dense_macs"] == layer + tokens * d * V  # one layer and the head


SHRINK = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=4",
          "model.exits=[1,2,3]", "objective.weights=[0.2,0.4,0.6]", "data.seq_len=32", "data.batch_size=8",
          "data.max_bytes=60000", "train.progress=false", "train.log_every=1", "eval.max_batches=2", "profile.samples=2"]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss_final"] for r in rows if "loss_final" in r]


def test_recipes_train_then_continue_from_the_saved_directory(tmp_path: Path) -> None:
    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    r = load_recipe(ROOT / "recipes" / "layerskip_text.yaml", [*SHRINK, "train.max_steps=30", "schedule.warmup_epochs=0"])
    summary = Trainer(r, tmp_path / "run").fit()
    losses = _losses(tmp_path / "run")
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert sorted(summary["val"]) == ["loss", "loss_exit1", "loss_exit2", "loss_exit3"]
    prof = json.loads((tmp_path / "run" / "profile.json").read_text())
    macs = [prof["exits"]["per_exit"][str(k)]["dense_macs"] for k in (1, 2, 3, 4)]
    assert macs == sorted(macs) and macs[0] < macs[-1]

    trained = efficient.load(tmp_path / "run")  # the run dir rebuilds the wrapper
    assert isinstance(trained, EarlyExitLM) and trained.exits == [1, 2, 3, 4]
    trained.save_pretrained(tmp_path / "ckpt")
    r2 = load_recipe(ROOT / "recipes" / "layerskip_continue.yaml",
                     [f"model.path={tmp_path / 'ckpt'}", "model.exits=[1,2,3]", "objective.weights=[0.2,0.4,0.6]",
                      "objective.curriculum_iters=4", *SHRINK[5:], "train.max_steps=3"])
    Trainer(r2, tmp_path / "cont").fit()
    assert _losses(tmp_path / "cont")[0] < losses[0] - 0.5  # starts where the first run ended, not from scratch
