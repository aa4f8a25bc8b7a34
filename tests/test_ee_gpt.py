"""EE-GPT model: zoo entries, exits, forced exits, exit distribution, pre/post exits, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import efficient
from efficient.config import load_recipe
from efficient.models.ee_gpt import EEGPT
from efficient.objectives import build_objective
from efficient.profiler.exits import exit_distribution
from efficient.zoo import meta_param_count

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def tiny(**kw) -> EEGPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, n_layer=4, n_embd=32, n_head=2, seq_len=64, exit_layers=[1, 2], init_std=0.3)
    return EEGPT(**{**cfg, **kw}).double().eval()


def test_zoo_tiny_is_byte_level_and_trains_with_lm_objective():
    m = efficient.load("ee-gpt-tiny")
    assert m.vocab_size == 256 and m.exit_layers == [1, 2, 4] and m.num_layers == 4
    m.train()
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    obj = build_objective({"name": "lm"})
    loss, logs = obj.loss(m, (x, y))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1  # near-uniform at init
    loss.backward()
    assert m.layers[0].attn.wqkv.weight.grad.abs().sum() > 0


def test_paper_configs_count_on_meta():
    # 24 x (4*2048^2 + 3*2048*5504) + 32000*2048 (tied, minimal exits add nothing)
    assert meta_param_count("ee-gpt-1.3b") == 24 * (4 * 2048**2 + 3 * 2048 * 5504 + 2 * 2048) + 32000 * 2048 + 2048
    # untied: embedding + final head + two exit heads of 32000 x 4096 each
    n7 = meta_param_count("ee-gpt-7b")
    assert n7 == 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4 * 32000 * 4096 + 4096
    with torch.device("meta"):
        m = efficient.zoo.create("ee-gpt-7b")
    assert m.exit_layers == [8, 16, 32] and all(e.proj is not None for e in m.exits.values())


def test_plain_call_returns_final_logits_and_all_logits_agree():
    m = tiny()
    x = torch.randint(0, 64, (2, 10))
    logits = m.all_logits(x)
    assert set(logits) == {1, 2, 4}
    torch.testing.assert_close(m(x), logits[4])
    for k in (1, 2, 4):
        torch.testing.assert_close(m(x, exit_layer=k), logits[k])


def test_forced_exit_computes_only_k_layers_and_that_head():
    m = tiny(exit_layers=[1, 2, 3])
    calls: list[str] = []
    for i, layer in enumerate(m.layers):
        layer.register_forward_hook(lambda *a, i=i: calls.append(f"layer{i + 1}"))
    for k, head in m.exits.items():
        head.norm.register_forward_hook(lambda *a, k=k: calls.append(f"exit{k}"))
    m.norm_f.register_forward_hook(lambda *a: calls.append("final"))
    m(torch.randint(0, 64, (1, 5)), exit_layer=2)
    assert calls == ["layer1", "layer2", "exit2"]
    calls.clear()
    m(torch.randint(0, 64, (1, 5)))  # no exit_layer: full depth again
    assert calls == ["layer1", "layer2", "layer3", "layer4", "final"]


def test_pre_exit_at_k_equals_post_exit_at_k_minus_1():
    pre, post = tiny(exit_layers=[2, 3], exit_position="pre"), tiny(exit_layers=[1, 2], exit_position="post")
    assert pre.exit_layers == post.exit_layers == [1, 2, 4]
    post.load_state_dict(pre.state_dict())
    x = torch.randint(0, 64, (2, 9))
    a, b = pre.all_logits(x), post.all_logits(x)
    for k in a:
        torch.testing.assert_close(a[k], b[k])


@pytest.mark.parametrize("head", ["minimal", "norm", "norm_mlp", "norm_block"])
@pytest.mark.parametrize("tied", [True, False])
def test_head_variants_build_and_causal(head, tied):
    m = tiny(exit_head=head, exit_tied=tied)
    x = torch.randint(0, 64, (1, 12))
    full = m.all_logits(x)
    prefix = m.all_logits(x[:, :7])
    for k in full:  # causal: a prefix's logits do not depend on later tokens
        torch.testing.assert_close(full[k][:, :7], prefix[k])
    assert (m.exits["1"].proj is None) == tied
    if tied:
        assert m.head_weight(1) is m.head_weight(4)


def test_exit_mlp_shares_layer_attention_and_norm():
    m = tiny(exit_head="norm_mlp")
    x = torch.randint(0, 64, (1, 6))
    h = m.tok_emb(x)
    cos, sin = m.rope_cos[:6], m.rope_sin[:6]
    mid = h + m.layers[0].attn(m.layers[0].norm1(h), cos, sin)
    e = m.exits["1"]
    expect = e.norm(mid + e.mlp(m.layers[0].norm2(mid))) @ m.tok_emb.weight.T
    torch.testing.assert_close(m.all_logits(x)[1], expect)


@pytest.mark.parametrize("head", ["norm_mlp", "norm_block"])
def test_ee_tuning_init_copies_backbone(head):
    m = tiny(exit_head=head, exit_tied=False)
    m.init_exits_from_backbone()
    x = torch.randint(0, 64, (1, 8))
    h, cos, sin = m.tok_emb(x), m.rope_cos[:8], m.rope_sin[:8]
    h1, _ = m.layers[0](h, cos, sin)
    h2, _ = m.layers[1](h1, cos, sin)
    lg = m.all_logits(x)
    W = m.head_weight(4)
    if head == "norm_mlp":  # the branch MLP is layer 1's own MLP, so exit 1 = final head on layer 1's output
        torch.testing.assert_close(lg[1], m.norm_f(h1) @ W.T)
    else:  # the exit block is a copy of the last layer
        torch.testing.assert_close(lg[2], m.norm_f(m.layers[3](h2, cos, sin)[0]) @ W.T)
    assert torch.equal(m.exits["1"].proj.weight, W) and m.exits["1"].proj.weight is not W


def test_exit_distribution():
    m = tiny()
    batches = [torch.randint(0, 64, (2, 16)) for _ in range(2)]
    # tau >= 1 disables exits; tau <= 0 takes the first exit for every token
    assert exit_distribution(m, batches, 1.0) == {1: 0.0, 2: 0.0, 4: 1.0}
    assert exit_distribution(m, batches, 0.0) == {1: 1.0, 2: 0.0, 4: 0.0}
    # mid threshold: recount by hand from the exits' max-probs
    tau = 0.4
    d = exit_distribution(m, batches, tau)
    assert abs(sum(d.values()) - 1) < 1e-12
    counts = {1: 0, 2: 0, 4: 0}
    for b in batches:
        lg = m.all_logits(b)
        p1, p2 = (F.softmax(lg[k], -1).amax(-1) for k in (1, 2))
        counts[1] += int((p1 >= tau).sum())
        counts[2] += int(((p1 < tau) & (p2 >= tau)).sum())
        counts[4] += int(((p1 < tau) & (p2 < tau)).sum())
    assert 0 < counts[1] < 64 and counts[4] > 0  # a real mix, so the check bites
    assert d == {k: v / 64 for k, v in counts.items()}


def test_bad_input_errors():
    with pytest.raises(ValueError, match="outside 1..4"):
        tiny(exit_layers=[0])
    with pytest.raises(ValueError, match="outside 2..4"):
        tiny(exit_layers=[1], exit_position="pre")
    with pytest.raises(ValueError, match="needs exit_position='post'"):
        tiny(exit_head="norm_mlp", exit_position="pre")
    with pytest.raises(ValueError, match="duplicates"):
        tiny(exit_layers=[2, 2])
    with pytest.raises(ValueError, match="n_head"):
        tiny(n_embd=30, n_head=4)
    m = tiny()
    with pytest.raises(ValueError, match="no exit at layer 3"):
        m(torch.zeros(1, 5, dtype=torch.long), exit_layer=3)
    with pytest.raises(ValueError, match="seq_len=64"):
        m(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids"):
        m(torch.zeros(1, 5))
    with pytest.raises(efficient.ConfigError, match="exit_layer"):
        efficient.zoo.create("ee-gpt-tiny", exit_layer=[1])


def test_recipes_validate():
    r = load_recipe(RECIPES / "ee_gpt_text.yaml")
    assert r.model["name"] == "ee-gpt-tiny" and r.objective["weights"] == [0.25, 0.5] and r.data["name"] == "text"
    assert load_recipe(RECIPES / "ee_gpt_small.yaml").objective["fused"] is True
    with pytest.raises(efficient.ConfigError, match="exit_head"):
        load_recipe(RECIPES / "ee_gpt_text.yaml", ["model.exit_head=mlp"])
