"""Early-exit decoding: exactness of KV recomputation and self-speculation, the exit rule, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from efficient.decoding import DecodeEngine
from efficient.decoding import Sampler, generate, generate_reference, new_cache, run_layers, should_exit, speculative_accept
from efficient.errors import ConfigError
from efficient.models.ee_gpt import EEGPT

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9]]
N = 10  # new tokens per generation: tiny, the machine running CI is small
FIRST = 1e-6  # below 1/V: every token leaves at the first exit


def tiny(**kw) -> EEGPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, n_layer=4, n_embd=32, n_head=2, seq_len=64, exit_layers=[1, 2], init_std=0.3)
    return EEGPT(**{**cfg, **kw}).double().eval()


def full_greedy(m: EEGPT, prompt: list[int], n: int) -> list[int]:
    """The full model without exits, greedy, no cache: argmax of the final head, prefix re-run each step."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@torch.no_grad()
def mixing_tau(m: EEGPT) -> float:
    """A threshold at which about half the tokens exit early: the median over positions of the
    best early-exit max-prob, teacher-forced on a prompt plus random continuation."""
    g = torch.Generator().manual_seed(5)
    seq = torch.tensor([PROMPTS[1] + torch.randint(0, 64, (N,), generator=g).tolist()])
    lg = m.all_logits(seq)
    best = torch.stack([torch.softmax(lg[k][0], -1).amax(-1) for k in m.exit_layers[:-1]]).amax(0)
    return float(best.median())


@pytest.fixture(scope="module")
def model() -> EEGPT:
    return tiny()


@pytest.fixture(scope="module")
def references(model):
    return [full_greedy(model, p, N) for p in PROMPTS]


@pytest.mark.parametrize("strategy", ["recompute", "copy", "speculative"])
def test_threshold_one_is_the_full_model(model, references, strategy):
    for p, ref in zip(PROMPTS, references):
        g = generate(model, p, N, threshold=1.0, strategy=strategy)
        assert g.tokens == ref
        if strategy != "speculative":
            assert g.exit_layers == [4] * N and g.summary()["mac_saving"] == 0.0


@pytest.mark.parametrize("threshold,num_draft", [(FIRST, 1), (0.5, 3)])
def test_speculative_greedy_is_lossless(model, references, threshold, num_draft):
    accepted = 0
    for p, ref in zip(PROMPTS, references):
        g = generate(model, p, N, threshold=threshold, strategy="speculative", num_draft=num_draft)
        assert g.tokens == ref
        accepted += g.exit_layers.count(1)
    assert accepted > 0  # some drafts were kept, so the acceptance path ran


@pytest.mark.parametrize("head", ["norm", "norm_mlp", "norm_block", "minimal"])
def test_recompute_equals_no_cache_reference(head):
    m = tiny(exit_head=head)
    tau = mixing_tau(m)
    ref_tokens, ref_exits = generate_reference(m, PROMPTS[1], N, threshold=tau)
    g = generate(m, PROMPTS[1], N, threshold=tau, strategy="recompute")
    assert g.tokens == ref_tokens and g.exit_layers == ref_exits
    assert set(g.exit_layers) & {1, 2} and 4 in g.exit_layers  # early and full-depth tokens both occur, so recomputation happened


@pytest.mark.parametrize("head", ["norm", "norm_block"])
def test_recompute_cache_equals_full_forward_cache(head):
    m = tiny(exit_head=head)
    prompt = PROMPTS[1]
    g = generate(m, prompt, N, threshold=mixing_tau(m), strategy="recompute")
    c = g.committed
    seq = torch.tensor([prompt + g.tokens])
    # tokens at positions < c that exited early had their deep KV filled by a later chunk
    early = [i for i, e in enumerate(g.exit_layers) if e < 4 and len(prompt) + i < c]
    assert early, "no early exit before the last full-depth step; the check would be vacuous"
    ref = new_cache(m, 1, seq.shape[1])
    h, mid, depth = m.tok_emb(seq[:, :c]), None, 0
    for e in m.exit_layers:
        h, mid = run_layers(m, h, depth, e, ref, 0)
        depth = e
        if e < 4:
            m.exit_hidden(e, h, mid, ref, 0)
    slots = range(len(ref.k)) if head == "norm_block" else range(m.num_layers)
    for s in slots:
        torch.testing.assert_close(g.cache.k[s][:, :, :c], ref.k[s][:, :, :c], atol=1e-5, rtol=0)
        torch.testing.assert_close(g.cache.v[s][:, :, :c], ref.v[s][:, :, :c], atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["modules", "engine"])
@pytest.mark.parametrize("head", ["norm", "norm_block"])
def test_recompute_runs_each_layer_once_per_position(head, impl, monkeypatch):
    """Pending tokens resume from their stored exit states: layer l processes each position once,
    at prefill or in the step that first needs it (no shallow layer is re-run)."""
    m = tiny(exit_head=head)
    prompt, seen, tau = PROMPTS[1], [0] * m.num_layers, mixing_tau(m)
    hooks = [layer.register_forward_hook(lambda mod, a, out, i=i: seen.__setitem__(i, seen[i] + a[0].shape[1])) for i, layer in enumerate(m.layers)]
    # the engine runs fused weights, not the modules: count the layers of its segment calls
    step, chunk = DecodeEngine.step, DecodeEngine.chunk

    def count(start, stop, T):
        for i in range(start, stop):
            seen[i] += T

    monkeypatch.setattr(DecodeEngine, "step", lambda self, x, pos, a, b, head: (count(a, b, 1), step(self, x, pos, a, b, head))[1])
    monkeypatch.setattr(DecodeEngine, "chunk", lambda self, h, pos, a, b, *r, **k: (count(a, b, h.shape[1]), chunk(self, h, pos, a, b, *r, **k))[1])
    try:
        g = generate(m, prompt, N, threshold=tau, strategy="recompute", impl=impl)
    finally:
        for hk in hooks:
            hk.remove()
    first = len(prompt) - 1  # position the first generated step feeds
    # a committed position has full depth; a pending one stands at the deepest exit of any later step
    depth = [m.num_layers if first + i < g.committed else max(g.exit_layers[i:]) for i in range(N)]
    assert any(d < m.num_layers for d in depth) and any(first + i < g.committed and e < 4 for i, e in enumerate(g.exit_layers))
    assert seen == [first + sum(d > i for d in depth) for i in range(m.num_layers)]


def test_threshold_zero_takes_first_exit_with_its_head(model):
    p = PROMPTS[0]
    g = generate(model, p, 8, threshold=FIRST, strategy="recompute")
    assert g.exit_layers == [1] * 8
    # each token is the argmax of exit 1's head applied to the layer-1 state of the whole sequence
    lg = model.all_logits(torch.tensor([p + g.tokens]))[1][0]
    assert g.tokens == [int(lg[len(p) - 1 + i].argmax()) for i in range(8)]


def test_raising_threshold_never_turns_continue_into_exit(model):
    torch.manual_seed(1)
    taus = torch.linspace(-0.1, 1.1, 25).tolist()
    for pmax in torch.rand(200).tolist() + [0.0, 1.0]:
        decisions = [should_exit(pmax, t) for t in taus]
        assert all(a or not b for a, b in zip(decisions, decisions[1:]))  # exit at tau2 => exit at tau1 < tau2
    # through the model: the first token's exit layer is non-decreasing in tau
    layers = [generate_reference(model, PROMPTS[0], 1, t)[1][0] for t in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)]
    assert layers == sorted(layers) and layers[0] == 1 and layers[-1] == 4


def test_copy_strategy_exits_and_fills_deep_kv(model):
    g = generate(model, PROMPTS[1], N, threshold=mixing_tau(model), strategy="copy")
    i = next(i for i, e in enumerate(g.exit_layers) if e < 4)
    e, n = g.exit_layers[i], len(PROMPTS[1]) - 1 + i  # first early exit and the position it was fed at
    # its layer-3 key is the projection of the exited state (output of layer e), as CALM propagates it;
    # the full-depth prefix is exact, so a no-cache run of layers 1..e reproduces that state
    seq = torch.tensor([PROMPTS[1] + g.tokens])
    h = model.tok_emb(seq[:, : n + 1])
    cos, sin = model.rope_cos[: n + 1], model.rope_sin[: n + 1]
    for layer in model.layers[:e]:
        h, _ = layer(h, cos, sin)
    _, k, _ = model.layers[2].attn.qkv(model.layers[2].norm1(h), cos, sin)
    torch.testing.assert_close(g.cache.k[2][:, :, n], k[:, :, n])


def test_recompute_max_pending_forces_full_depth(model):
    g = generate(model, PROMPTS[0], 10, threshold=FIRST, strategy="recompute", max_pending=3)
    assert g.exit_layers == [1, 1, 1, 4] * 2 + [1, 1]


def test_speculative_sampling_keeps_target_distribution():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    s = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(4)
    for _ in range(3000):
        d = s.draw(q)
        counts[speculative_accept(p, q, d, s)[1]] += 1
    assert torch.allclose(counts / 3000, p, atol=0.03)  # ~3 sigma of a 3000-draw frequency


def test_sampled_generation_is_seeded(model):
    a = generate(model, PROMPTS[0], 6, threshold=0.4, strategy="speculative", temperature=1.0, top_k=20, seed=3)
    b = generate(model, PROMPTS[0], 6, threshold=0.4, strategy="speculative", temperature=1.0, top_k=20, seed=3)
    c = generate(model, PROMPTS[0], 6, threshold=0.4, strategy="recompute", temperature=0.8, top_p=0.9, seed=3)
    assert a.tokens == b.tokens and len(c.tokens) == 6 and all(0 <= t < 64 for t in c.tokens)


def test_sampler_top_k_top_p():
    s = Sampler(temperature=1.0, top_k=2)
    assert (s.probs(torch.tensor([3.0, 1.0, 2.0, 0.0])) > 0).tolist() == [True, False, True, False]
    s = Sampler(temperature=1.0, top_p=0.5)
    assert (s.probs(torch.tensor([3.0, 1.0, 2.0, 0.0])) > 0).tolist() == [True, False, False, False]


def test_generate_errors(model):
    with pytest.raises(ConfigError, match="strategy"):
        generate(model, [1], 2, strategy="skip")
    with pytest.raises(ConfigError, match="seq_len 64"):
        generate(model, [1] * 60, 5)
    with pytest.raises(ConfigError, match=r"\[0, 64\)"):
        generate(model, [70], 2)
    with pytest.raises(ConfigError, match="non-empty"):
        generate(model, [], 2)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        generate(model, [1], 0)
    with pytest.raises(ConfigError, match="has none"):
        generate(tiny(exit_layers=[]), [1], 2, strategy="speculative")
    for bad in (0.0, -0.2, 1.5):
        with pytest.raises(ConfigError, match=r"in \(0, 1\]"):
            generate(model, [1], 2, threshold=bad)


def test_no_threshold_is_the_full_model_with_its_kv_cache(model, references):
    """threshold=None (CLI `--exit-threshold none`): full greedy output, and the cache holds the
    keys/values a plain forward over prompt + output computes."""
    p = PROMPTS[1]
    g = generate(model, p, N, threshold=None)
    assert g.tokens == references[1] and g.exit_layers == [4] * N and g.committed == len(p) + N - 1
    seq = torch.tensor([p + g.tokens])[:, : g.committed]
    cos, sin = model._rope(0, seq.shape[1])
    h = model.tok_emb(seq)
    for i, layer in enumerate(model.layers):
        _, k, v = layer.attn.qkv(layer.norm1(h), cos, sin)
        torch.testing.assert_close(g.cache.k[i][:, :, : g.committed], k, atol=1e-10, rtol=0)
        torch.testing.assert_close(g.cache.v[i][:, :, : g.committed], v, atol=1e-10, rtol=0)
        h, _ = layer(h, cos, sin)


def test_generate_cli(capsys):
    from efficient.cli import main

    rc = main(["generate", "ee-gpt-tiny", "--prompt", "ab", "--max-new-tokens", "3", "--exit-threshold", "0.001", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["exit_layers"] == [1, 1, 1] and out["summary"]["tokens"] == 3
    assert out["summary"]["mean_exit_depth"] == 0.25 and out["summary"]["expected_mac_saving"] > 0.5
    assert main(["generate", "ee-gpt-1.3b", "--prompt", "a"]) == 2  # no tokenizer for a 32k vocab
    rc = main(["generate", "ee-gpt-tiny", "--prompt", "ab", "--max-new-tokens", "2", "--exit-threshold", "none", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["exit_layers"] == [4, 4]
    for bad in ("0", "1.5", "high"):
        with pytest.raises(SystemExit):
            main(["generate", "ee-gpt-tiny", "--prompt", "ab", "--exit-threshold", bad])
        assert "(0, 1]" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the decode engine
# The engine (fused weights, one call per segment between exits) runs the same strategies as the
# module-by-module path: greedy tokens, exit layers and MAC counts must be identical.


def same_generation(a, b) -> None:
    assert a.tokens == b.tokens and a.exit_layers == b.exit_layers
    assert (a.macs, a.expected_macs, a.committed, a.stats) == (b.macs, b.expected_macs, b.committed, b.stats)


def taus(m: EEGPT) -> list[float]:
    """Never exit, rarely, about half the tokens, and always at the first exit."""
    return [1.0, 0.95, mixing_tau(m), FIRST]


@pytest.mark.parametrize("strategy", ["recompute", "copy", "speculative"])
@pytest.mark.parametrize("head,dtype", [("norm", torch.float32), ("norm", torch.float64), ("norm_mlp", torch.float64),
                                        ("norm_block", torch.float64), ("minimal", torch.float32)])
def test_engine_greedy_equals_module_path(strategy, head, dtype):
    m = tiny(exit_head=head).to(dtype)
    engine = DecodeEngine(m)
    early = 0
    for tau in taus(m):
        for p in PROMPTS:
            ref = generate(m, p, N, threshold=tau, strategy=strategy, impl="modules")
            same_generation(generate(m, p, N, threshold=tau, strategy=strategy, engine=engine), ref)
            early += sum(e < m.num_layers for e in ref.exit_layers)
    # early exits (accepted drafts) happened, so the exit paths ran; a random exit block's drafts
    # are all rejected, which runs the rejection path
    assert early > 0 or (strategy, head) == ("speculative", "norm_block")


@pytest.mark.parametrize("strategy", ["recompute", "speculative"])
def test_engine_sampling_equals_module_path(model, strategy):
    kw = dict(threshold=0.4, strategy=strategy, temperature=1.0, top_k=20, seed=3)
    same_generation(generate(model, PROMPTS[1], N, impl="engine", **kw), generate(model, PROMPTS[1], N, impl="modules", **kw))


@pytest.mark.parametrize("head", ["norm", "norm_block"])
def test_engine_kv_cache_equals_module_path(head):
    m = tiny(exit_head=head)
    tau = mixing_tau(m)
    a = generate(m, PROMPTS[1], N, threshold=tau, strategy="recompute", impl="engine")
    b = generate(m, PROMPTS[1], N, threshold=tau, strategy="recompute", impl="modules")
    c = b.committed
    for s in range(len(b.cache.k)):
        torch.testing.assert_close(a.cache.k[s][:, :, :c], b.cache.k[s][:, :, :c], atol=1e-12, rtol=0)
        torch.testing.assert_close(a.cache.v[s][:, :, :c], b.cache.v[s][:, :, :c], atol=1e-12, rtol=0)


def test_engine_leaves_the_model_alone(model):
    """Fusion happens in the engine: the model's parameters and checkpoint keys are unchanged."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = DecodeEngine(model)
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    mlp = model.layers[1].mlp
    assert torch.equal(engine.layers[1].w13, torch.cat([mlp.w_gate.weight, mlp.w_up.weight]))
    assert engine.layers[1].wqkv.data_ptr() == model.layers[1].attn.wqkv.weight.data_ptr()  # shared, not copied


def test_engine_errors(model):
    with pytest.raises(ConfigError, match="impl"):
        generate(model, [1], 2, impl="fast")
    with pytest.raises(ConfigError, match="built from this model"):
        generate(model, [1], 2, engine=DecodeEngine(tiny()))
    with pytest.raises(ConfigError, match="built from this model"):
        generate(model, [1], 2, impl="modules", engine=DecodeEngine(model))
    with pytest.raises(ConfigError, match="chunk_lengths"):
        DecodeEngine(model, chunk_lengths=(8, 4))


@pytest.mark.parametrize("head", ["norm", "norm_block"])
def test_forced_recompute_loss_is_the_teacher_forced_exit_loss(head):
    """Forced decoding with recompute (exact KV) decides the same exits as one teacher-forced
    forward under the exit rule, and scores each fed token with that exit's log-prob."""
    m = tiny(exit_head=head)
    tau = mixing_tau(m)
    g = torch.Generator().manual_seed(7)
    seq = PROMPTS[1] + torch.randint(0, 64, (N,), generator=g).tolist()
    P = len(PROMPTS[1])
    out = generate(m, seq[:P], N, threshold=tau, strategy="recompute", forced=seq[P:])
    with torch.no_grad():
        logp = {k: torch.log_softmax(v[0], -1) for k, v in m.all_logits(torch.tensor([seq])).items()}
    exits, lp = [], []
    for t in range(P - 1, len(seq) - 1):  # position t predicts token t + 1
        k = next(k for k in m.exit_layers if k == m.num_layers or float(logp[k][t].exp().max()) >= tau)
        exits.append(k)
        lp.append(float(logp[k][t, seq[t + 1]]))
    assert out.tokens == seq[P:] and out.exit_layers == exits and set(exits) != {m.num_layers}
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(lp), atol=1e-9, rtol=0)
    with pytest.raises(ConfigError, match="speculative is lossless"):
        generate(m, seq[:P], N, threshold=tau, strategy="speculative", forced=seq[P:])
    with pytest.raises(ConfigError, match="must be equal"):
        generate(m, seq[:P], N - 1, threshold=tau, forced=seq[P:])


@pytest.mark.slow
def test_compiled_engine_equals_module_path():
    """torch.compile(dynamic=False) one-token steps and padded chunks: the same greedy tokens and
    exits; every step is compiled by `warm_up`, so generating afterwards compiles nothing. Chunks
    of 2-4 tokens are padded to 4 and compiled, longer ones run eagerly: both paths occur."""
    m = tiny().float()
    engine = DecodeEngine(m, compile=True, chunk_lengths=(4,))
    total = len(PROMPTS[1]) + N
    assert engine.warm_up(total) > 0
    torch._dynamo.utils.counters.clear()
    calls = {"padded": 0, "eager": 0}
    padded, eager = engine._chunk_static, engine._chunk

    def counted(kind, fn):
        return lambda *a: (calls.__setitem__(kind, calls[kind] + 1), fn(*a))[1]

    engine._chunk_static, engine._chunk = counted("padded", padded), counted("eager", eager)
    for strategy in ("recompute", "copy", "speculative"):
        for tau in (1.0, mixing_tau(m), FIRST):
            ref = generate(m, PROMPTS[1], N, threshold=tau, strategy=strategy, impl="modules")
            same_generation(generate(m, PROMPTS[1], N, threshold=tau, strategy=strategy, engine=engine), ref)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    assert calls["padded"] > 0 and calls["eager"] > 0


@pytest.mark.slow
def test_generate_cli_compile(capsys):
    from efficient.cli import main

    rc = main(["generate", "ee-gpt-tiny", "--prompt", "ab", "--max-new-tokens", "3", "--exit-threshold", "none", "--compile", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["exit_layers"] == [4, 4, 4] and out["summary"]["tokens"] == 3 and out["summary"]["compile_warmup_s"] > 0
