"""Exit-weighted training objective: reduction to plain LM, weight schedule, pipeline-stage loss,
dynamic token weights, fused vs unfused, bad options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from efficient.errors import ConfigError
from efficient.models.ee_gpt import EEGPT
from efficient.objectives import build_objective
from efficient.objectives.exits import exit_weight, stage_aux_loss, token_ce


def tiny(**kw) -> EEGPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, n_layer=4, n_embd=32, n_head=2, seq_len=32, exit_layers=[1, 2])
    return EEGPT(**{**cfg, **kw}).double().train()


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 12), generator=g), torch.randint(0, 64, (2, 12), generator=g)


def grads(m) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_zero_weights_equal_plain_lm(tied):
    m = tiny(exit_tied=tied)
    x, y = batch()
    obj = build_objective({"name": "exits", "weights": [0.0, 0.0]})
    loss, logs = obj.loss(m, (x, y))
    loss.backward()
    g_exit = grads(m)
    m.zero_grad()
    plain = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
    plain.backward()
    g_lm = grads(m)
    assert loss.item() == plain.item() and set(logs) == {"loss", "loss_final"}
    for n in g_lm:
        torch.testing.assert_close(g_exit[n], g_lm[n], atol=0, rtol=0)
    if not tied:
        assert all(g_exit[f"exits.{k}.proj.weight"].abs().sum() == 0 for k in ("1", "2"))


def test_loss_is_final_plus_weighted_exits():
    m = tiny()
    x, y = batch()
    obj = build_objective({"name": "exits", "weights": [0.25, 0.5]})
    loss, logs = obj.loss(m, (x, y))
    lg = m.all_logits(x)
    ce = {k: F.cross_entropy(v.flatten(0, 1), y.flatten()) for k, v in lg.items()}
    torch.testing.assert_close(loss, ce[4] + 0.25 * ce[1] + 0.5 * ce[2])
    assert logs["w_exit1"] == 0.25 and abs(logs["loss_exit2"] - ce[2].item()) < 1e-9


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_schedule(style):
    W = 10
    assert exit_weight(0, 0.1, 0.9, W, style) == 0.1
    assert exit_weight(W, 0.1, 0.9, W, style) == pytest.approx(0.9)
    assert exit_weight(3 * W, 0.1, 0.9, W, style) == pytest.approx(0.9)
    ws = [exit_weight(i, 0.1, 0.9, W, style) for i in range(W + 1)]
    assert all(a <= b for a, b in zip(ws, ws[1:]))
    down = [exit_weight(i, 1.0, 0.2, W, style) for i in range(W + 1)]  # init above target: cool-down
    assert all(a >= b for a, b in zip(down, down[1:]))
    assert exit_weight(0, 0.0, 0.7, 0, style) == 0.7  # W = 0: target from step 0
    mid = exit_weight(W / 2, 0.0, 1.0, W, style)
    assert mid == pytest.approx(0.5)  # both ramps pass the midpoint half-way
    assert exit_weight(W / 4, 0.0, 1.0, W, style) == pytest.approx(0.25 if style == "linear" else 0.5 * (1 - math.cos(math.pi / 4)))


def test_objective_follows_progress_steps():
    m = tiny()
    obj = build_objective({"name": "exits", "weights": [0.4, 0.8], "weight_init": [0.0, 0.2], "warmup_iters": 4})
    obj.setup(m)
    obj.set_progress(0.0, 0)
    assert obj.weights() == {1: 0.0, 2: 0.2}
    obj.set_progress(0.5, 2)
    assert obj.weights() == pytest.approx({1: 0.2, 2: 0.5})
    obj.set_progress(1.0, 9)
    assert obj.weights() == pytest.approx({1: 0.4, 2: 0.8})


def test_pipeline_stage_aux_loss_gives_total_gradients():
    """Stage 1 = embedding + layers 1..2 (+ exit 1, 2); stage 2 = layers 3..4 + final head."""
    m = tiny(exit_tied=False, tie_embeddings=False)
    x, y = batch()
    w = {1: 0.3, 2: 0.6}

    def exit_loss(k, h):
        s = m.exit_hidden(k, h, None)
        return F.cross_entropy((s @ m.head_weight(k).T).flatten(0, 1), y.flatten())

    cos, sin = m.rope_cos[:12], m.rope_sin[:12]
    h = m.tok_emb(x)
    h1, _ = m.layers[0](h, cos, sin)
    h2, _ = m.layers[1](h1, cos, sin)
    total = w[1] * exit_loss(1, h1) + w[2] * exit_loss(2, h2)
    h4, _ = m.layers[3](m.layers[2](h2, cos, sin)[0], cos, sin)
    total = total + exit_loss(4, h4)
    total.backward()
    g_ref = grads(m)
    m.zero_grad()
    # stage 2 first: its loss and the gradient it sends back to stage 1's output
    h = m.tok_emb(x)
    h1, _ = m.layers[0](h, cos, sin)
    h2, _ = m.layers[1](h1, cos, sin)
    x2 = h2.detach().requires_grad_()
    h4, _ = m.layers[3](m.layers[2](x2, cos, sin)[0], cos, sin)
    exit_loss(4, h4).backward()
    stage_aux_loss(w[1] * exit_loss(1, h1) + w[2] * exit_loss(2, h2), h2, x2.grad).backward()
    g_pp = grads(m)
    for n in g_ref:
        torch.testing.assert_close(g_pp[n], g_ref[n])


@pytest.mark.parametrize("fused", [False, True])
def test_dynamic_token_weights_carry_no_gradient(fused):
    torch.manual_seed(0)
    h = torch.randn(10, 8, dtype=torch.double, requires_grad=True)
    W = torch.randn(16, 8, dtype=torch.double, requires_grad=True)
    t = torch.randint(0, 16, (10,))
    loss = token_ce(h, W, t, dynamic=True, fused=fused, chunk_size=4)
    gh, gw = torch.autograd.grad(loss, (h, W))
    logp = F.log_softmax(h @ W.T, -1)
    ce = -logp.gather(-1, t[:, None])[:, 0]
    detached = (ce * logp.amax(-1).exp().detach()).mean()
    attached = (ce * logp.amax(-1).exp()).mean()
    torch.testing.assert_close(loss, detached)
    rh, rw = torch.autograd.grad(detached, (h, W), retain_graph=True)
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)
    ah, _ = torch.autograd.grad(attached, (h, W))
    assert (ah - rh).abs().max() > 1e-4  # the difference the detach makes is real


def test_fused_objective_matches_unfused():
    x, y = batch(1)
    results = []
    for fused in (False, True):
        m = tiny()
        obj = build_objective({"name": "exits", "weights": [0.25, 0.5], "temperatures": [2.0, 1.0], "fused": fused, "chunk_size": 7})
        loss, _ = obj.loss(m, (x, y))
        loss.backward()
        results.append((loss.detach(), grads(m)))
    torch.testing.assert_close(results[0][0], results[1][0])
    for n in results[0][1]:
        torch.testing.assert_close(results[0][1][n], results[1][1][n])


def test_evaluate_reports_every_exit():
    m = tiny().eval()
    x, y = batch()
    out = build_objective({"name": "exits"}).evaluate(m, (x, y))
    assert set(out) == {"n", "loss", "loss_exit1", "loss_exit2"} and out["n"] == 24
    assert out["loss"] == pytest.approx(F.cross_entropy(m(x).flatten(0, 1), y.flatten(), reduction="sum").item())


def test_bad_options():
    m = tiny()
    with pytest.raises(ConfigError, match=r"weights: expected one value per early exit \(2\)"):
        build_objective({"name": "exits", "weights": [0.1, 0.2, 0.3]}).setup(m)
    with pytest.raises(ConfigError, match="temperatures must be > 0"):
        build_objective({"name": "exits", "temperatures": 0.0}).setup(m)
    with pytest.raises(ConfigError, match="warmup_iters"):
        build_objective({"name": "exits", "warmup_iters": -1})
    with pytest.raises(ConfigError, match="early-exit model"):
        build_objective({"name": "exits"}).setup(torch.nn.Linear(2, 2))
