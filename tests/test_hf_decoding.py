"""Greedy decoding of transformers causal LMs on our engine against transformers itself: full depth,
self-speculation (lossless) and confidence exits (recompute follows the exit rule on the full
model; copy matches a reference built from transformers' own modules and cache)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from efficient.decoding import HFDecodeModel, generate_hf  # noqa: E402
from efficient.errors import ConfigError  # noqa: E402

V, N, NEW = 97, 4, 12
MARGIN = 1e-4  # the reference's top-2 logit gaps must exceed this, so float rounding cannot flip a token


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _llama(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=N, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=0, **kw)
    return _damp(transformers.LlamaForCausalLM(cfg).eval())


def _qwen2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=N, num_attention_heads=4,
                                   num_key_value_heads=1, max_position_embeddings=128, initializer_range=0.2,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=0)
    m = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # Qwen2 has q/k/v biases; make them matter
        for layer in m.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.2)
    return _damp(m)


def _mistral(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.MistralConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=N, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, max_position_embeddings=128, initializer_range=0.2,
                                     sliding_window=64, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return _damp(transformers.MistralForCausalLM(cfg).eval())


def _gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=N, n_head=4, n_positions=128, initializer_range=0.2,
                                  eos_token_id=None, bos_token_id=None)
    return _damp(transformers.GPT2LMHeadModel(cfg).eval())


def _damp(m, k=2, f=0.1):
    """Shrink what layers k+1.. add to the residual, so an exit after layer k often agrees with the
    full model (drafts get accepted) but not always (drafts get rejected)."""
    with torch.no_grad():
        if hasattr(m, "transformer"):
            for b in m.transformer.h[k:]:
                b.attn.c_proj.weight.mul_(f)
                b.mlp.c_proj.weight.mul_(f)
        else:
            for layer in m.model.layers[k:]:
                layer.self_attn.o_proj.weight.mul_(f)
                layer.mlp.down_proj.weight.mul_(f)
    return m


FAMILIES = {"llama-gqa": _llama, "qwen2": _qwen2, "mistral": _mistral, "gpt2": _gpt2}


def _prompts(batch: int, seed: int = 1):
    """Left-padded prompts of different lengths (7, 4, 6, ...), as a left-padding tokenizer returns them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (batch, 7), generator=g)
    mask = torch.ones_like(ids)
    for b, pad in enumerate([0, 3, 1, 2][:batch]):
        mask[b, :pad] = 0
    return ids * mask, mask


def _reference(m, ids, mask, new=NEW, **kw):
    """transformers' greedy generate, with the guard that no step was a near tie."""
    out = m.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                     output_scores=True, return_dict_in_generate=True, **kw)
    for s in out.scores:
        top = s.float().topk(2, dim=-1).values
        assert bool((top[:, 0] - top[:, 1] > MARGIN).all()), "near tie in the reference: pick another seed"
    return out.sequences


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_equals_transformers_greedy(family, batch):
    m = FAMILIES[family]()
    ids, mask = _prompts(batch)
    ref = _reference(m, ids, mask)
    drafted = accepted = 0
    for num_draft in (1, 3, 5):
        out = generate_hf(m, ids, mask, NEW, strategy="speculative", draft_layer=2, num_draft=num_draft)
        assert torch.equal(out.sequences, ref), (family, batch, num_draft)
        # the exit layers say which tokens were accepted drafts
        assert set(out.exit_layers.unique().tolist()) <= {2, N}
        assert ((out.exit_layers == 2).sum(1) == out.stats["accepted"]).all()
        drafted, accepted = drafted + out.stats["drafted"], accepted + out.stats["accepted"]
    assert 0 < accepted < drafted  # both the accept and the reject path ran


@pytest.mark.parametrize("family", FAMILIES)
def test_full_depth_and_never_exiting_equal_transformers_greedy(family):
    m = FAMILIES[family]()
    ids, mask = _prompts(3)
    ref = _reference(m, ids, mask)
    out = generate_hf(m, ids, mask, NEW)
    assert torch.equal(out.sequences, ref)
    assert out.layer_steps == out.full_layer_steps == NEW * N
    for strategy in ("recompute", "copy"):
        out = generate_hf(m, ids, mask, NEW, strategy=strategy, threshold=1.0, exits=[1, 2, 3])
        assert torch.equal(out.sequences, ref), strategy
        assert bool((out.exit_layers == N).all())


def _exit_rule(m, seq, exits, tau):
    """The exit rule on the full model for the last position of `seq` [1, T]: every exit's head is
    the final norm + LM head on that layer's hidden state. Returns (token, exit layer)."""
    out = m(seq, output_hidden_states=True)
    base = m.model if hasattr(m, "model") else m.transformer
    norm = base.norm if hasattr(base, "norm") else base.ln_f
    for e in exits:
        logits = m.lm_head(norm(out.hidden_states[e][:, -1]))[0]
        p = torch.softmax(logits.double(), -1)
        assert abs(float(p.max()) - tau) > MARGIN, "max-prob at the threshold: pick another threshold"
        if float(p.max()) >= tau:
            return int(logits.argmax()), e
    return int(out.logits[0, -1].argmax()), N


@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_follows_the_exit_rule_per_row(family):
    """recompute's deep layers read the full model's keys/values, so each row decodes as the exit rule
    applied to the full model on that row alone, whatever the rest of the batch does."""
    m = FAMILIES[family]()
    ids, mask = _prompts(3)
    exits, tau = [1, 2, 3], 0.13
    out = generate_hf(m, ids, mask, NEW, strategy="recompute", threshold=tau, exits=exits)
    assert bool((out.exit_layers < N).any()) and bool((out.exit_layers == N).any())
    assert out.layer_steps <= out.full_layer_steps  # every (layer, slot) computed at most once
    for b in range(ids.shape[0]):
        seq = ids[b : b + 1, mask[b].bool()]
        for i in range(NEW):
            tok, layer = _exit_rule(m, seq, exits, tau)
            assert (int(out.tokens[b, i]), int(out.exit_layers[b, i])) == (tok, layer), (b, i)
            seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)


def _copy_reference(m, prompt, exits, tau, new):
    """CALM's state copy for one sequence with transformers' own modules and DynamicCache: layers
    run token by token until an exit is sure; the layers after it store keys/values computed from
    the exited hidden state (their attention runs on it and its output is dropped)."""
    base = m.model
    cache = transformers.DynamicCache(config=m.config)
    base(prompt[:, :-1], cache=cache, use_cache=True)
    seq, toks, layers = prompt, [], []
    for _ in range(new):
        pos = torch.tensor([[seq.shape[1] - 1]])
        h = base.embed_tokens(seq[:, -1:])
        pe = base.rotary_emb(h, pos)
        for i, layer in enumerate(base.layers):
            h = layer(h, attention_mask=None, position_ids=pos, cache=cache, use_cache=True, position_embeddings=pe)
            e = i + 1
            logits = m.lm_head(base.norm(h[:, -1]))[0]
            if e == N:
                break
            pmax = float(torch.softmax(logits.double(), -1).max())
            assert abs(pmax - tau) > MARGIN
            if e in exits and pmax >= tau:
                for deeper in base.layers[e:]:
                    deeper.self_attn(hidden_states=deeper.input_layernorm(h), position_embeddings=pe, attention_mask=None, cache=cache)
                break
        toks.append(int(logits.argmax()))
        layers.append(e)
        seq = torch.cat([seq, torch.tensor([[toks[-1]]])], dim=1)
    return toks, layers


def _module_kv(m, i: int, h: torch.Tensor, rope: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values transformers' own layer i computes for hidden states `h` [B, T, C] entering
    it, [B, kv_heads, T, head_dim]: its norm, its projections, rotary in the rotate-half convention."""
    B, T, C = h.shape
    if hasattr(m, "transformer"):  # GPT-2: c_attn gives q, k, v side by side
        b = m.transformer.h[i]
        _, k, v = b.attn.c_attn(b.ln_1(h)).split(C, dim=2)
        heads = m.config.n_head
        return (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (k, v))
    from transformers.models.llama.modeling_llama import rotate_half

    layer = m.model.layers[i]
    a = layer.self_attn
    x = layer.input_layernorm(h)
    k = a.k_proj(x).view(B, T, -1, a.head_dim).transpose(1, 2)
    v = a.v_proj(x).view(B, T, -1, a.head_dim).transpose(1, 2)
    cos, sin = rope
    return k * cos + rotate_half(k) * sin, v


@pytest.mark.parametrize("family", FAMILIES)
def test_key_value_only_rows_store_each_layers_own_projection(family):
    # a copy exit's deferred fill: rows of exited states ride along with the next token's call of a
    # layer, storing transformers' own norm + k/v projection + rotary for them, while the token's own
    # row comes out as if it had run alone
    from efficient.decoding.hf_cache import StaticKV
    from efficient.decoding.hf_model import HFDecodeModel

    m = FAMILIES[family]()
    dm = HFDecodeModel(m)
    with torch.no_grad():  # give every layer its own norm scale (and shift) so a mixed-up layer shows
        g = torch.Generator().manual_seed(3)
        for w in dm.layers:  # views of the model's own parameters: both see the change
            w.n1.copy_(1 + 0.5 * torch.randn(w.n1.shape, generator=g))
            if w.n1b is not None:
                w.n1b.copy_(0.3 * torch.randn(w.n1b.shape, generator=g))
    B, S, C = 2, 7, dm.embed.shape[1]
    h = torch.randn(B, S, C, generator=g) * 3
    pad = torch.zeros(B, dtype=torch.long)
    tables = dm.position_tables(torch.arange(S)[None].expand(B, S))
    for i in (0, N - 1):
        rope = tables if len(tables) == 2 else ()
        at = lambda a, b: tuple(t[:, :, a:b] for t in rope) if rope else ()  # noqa: E731
        both = StaticKV(N, B, dm.heads_kv, dm.head_dim, S, pad, dm.device, dm.dtype)
        alone = StaticKV(N, B, dm.heads_kv, dm.head_dim, S, pad, dm.device, dm.dtype)
        for c in (both, alone):  # slots 0..2 hold earlier tokens
            dm.layer(h[:, :3], i, c.k[i], c.v[i], 0, at(0, 3), c.mask(0, 3))
        out = dm.layer(h[:, 3:], i, both.k[i], both.v[i], 3, at(3, S), both.mask(S - 1, 1), keys_only=S - 4)
        k_i, v_i = _module_kv(m, i, h[:, 3 : S - 1], at(3, S - 1) if rope else ())
        torch.testing.assert_close(both.k[i][:, :, 3 : S - 1], k_i, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(both.v[i][:, :, 3 : S - 1], v_i, rtol=1e-5, atol=1e-5)
        for s in range(3, S - 1):  # the same slots written one call each, then the token alone
            dm.layer(h[:, s : s + 1], i, alone.k[i], alone.v[i], s, at(s, s + 1), alone.mask(s, 1))
        ref = dm.layer(h[:, S - 1 :], i, alone.k[i], alone.v[i], S - 1, at(S - 1, S), alone.mask(S - 1, 1))
        assert out.shape == (B, 1, C)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
def test_copy_matches_transformers_modules_reference(family):
    m = FAMILIES[family]()
    ids, _ = _prompts(1)
    exits, tau = [1, 2, 3], 0.13
    out = generate_hf(m, ids, None, NEW, strategy="copy", threshold=tau, exits=exits)
    toks, layers = _copy_reference(m, ids, exits, tau, NEW)
    assert out.tokens[0].tolist() == toks
    assert out.exit_layers[0].tolist() == layers
    assert any(x < N for x in layers)
    # an exited slot's layer i is stored once a later token runs layer i (never for the last tokens)
    assert out.kv_fills == sum(max(0, max(layers[j + 1 :], default=0) - x) for j, x in enumerate(layers)) > 0


def test_forced_decoding_scores_the_deciding_head():
    m = _llama()
    ids, mask = _prompts(2)
    free = generate_hf(m, ids, mask, NEW)
    forced = free.tokens
    full = generate_hf(m, ids, mask, NEW, forced=forced)
    logits = m(free.sequences, attention_mask=torch.cat([mask, torch.ones_like(forced)], 1)).logits[:, ids.shape[1] - 1 : -1]
    want = torch.log_softmax(logits.double(), -1).gather(-1, forced[..., None])[..., 0]
    torch.testing.assert_close(full.logprobs.double(), want, atol=1e-4, rtol=1e-4)
    rec = generate_hf(m, ids, mask, NEW, strategy="recompute", threshold=0.13, exits=[1, 2, 3], forced=forced)
    assert torch.equal(rec.tokens, forced)
    exited = rec.exit_layers < N
    assert bool(exited.any())
    torch.testing.assert_close(rec.logprobs[~exited].double(), want[~exited], atol=1e-4, rtol=1e-4)
    assert bool((rec.logprobs[exited] != full.logprobs[exited]).all())


@pytest.mark.parametrize("strategy", ["full", "speculative", "recompute"])
def test_eos_ends_rows_as_transformers_does(strategy):
    m = _llama()
    ids, mask = _prompts(3)
    free = _reference(m, ids, mask)
    eos = int(free[0, ids.shape[1] + 2])  # a token row 0 produces third
    ref = _reference(m, ids, mask, eos_token_id=eos)
    kw = {"speculative": dict(draft_layer=2), "recompute": dict(exits=[2], threshold=1.0)}.get(strategy, {})
    out = generate_hf(m, ids, mask, NEW, strategy=strategy, eos_token_id=eos, pad_token_id=0, **kw)
    assert torch.equal(out.sequences, ref)


def test_decode_model_is_reusable():
    m = _gpt2()
    dm = HFDecodeModel(m)
    ids, mask = _prompts(2)
    a = generate_hf(dm, ids, mask, NEW, strategy="speculative", draft_layer=2)
    b = generate_hf(dm, ids, mask, NEW, strategy="speculative", draft_layer=2)
    assert torch.equal(a.sequences, b.sequences)


def test_unsupported_models_and_bad_requests_fail_clearly():
    cfg = transformers.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2, max_position_embeddings=64)
    with pytest.raises(ConfigError, match="OPTForCausalLM is not supported.*LlamaForCausalLM.*Qwen2ForCausalLM.*GPT2LMHeadModel"):
        generate_hf(transformers.OPTForCausalLM(cfg), torch.tensor([[1, 2]]), max_new_tokens=2)
    m = _llama()
    ids, mask = _prompts(2)
    with pytest.raises(ConfigError, match="left-padded"):
        generate_hf(m, ids, mask.flip(1), 4)
    with pytest.raises(ConfigError, match="draft_layer must lie in 1..3"):
        generate_hf(m, ids, mask, 4, strategy="speculative", draft_layer=4)
    with pytest.raises(ConfigError, match="needs `draft_layer`"):
        generate_hf(m, ids, mask, 4, strategy="speculative")
    with pytest.raises(ConfigError, match="needs `exits`"):
        generate_hf(m, ids, mask, 4, strategy="copy", threshold=0.5)
    with pytest.raises(ConfigError, match="strategy must be one of"):
        generate_hf(m, ids, mask, 4, strategy="beam")
    with pytest.raises(ConfigError, match="exceeds the model's 128 positions"):
        generate_hf(m, ids, mask, 200)
    with pytest.raises(ConfigError, match="sliding window"):
        generate_hf(_llama_sliding(), ids, mask, 20)
    with pytest.raises(ConfigError, match="rotary scaling 'dynamic'"):
        generate_hf(_llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), ids, mask, 4)


def _llama_sliding():
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=128, sliding_window=16)
    return transformers.MistralForCausalLM(cfg).eval()


def _own_heads(m, exits):
    """`efficient.early_exit` with own exit heads, moved away from the final head so they decide differently."""
    from efficient.hf import early_exit

    ee = early_exit(m, exits=exits, head="own")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for k in exits:
            proj = ee.exit_head(k).proj.weight
            proj.add_(0.05 * torch.randn(proj.shape, generator=g))
    return ee


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2"])
def test_wrapped_model_own_heads(family):
    """Through `efficient.early_exit(head="own")`: its exits are the defaults, speculation with its
    own head still gives the full model's greedy tokens, recompute follows its heads' confidences."""
    m = FAMILIES[family]()
    ee = _own_heads(m, [1, 2])
    ids, mask = _prompts(3)
    ref = _reference(m, ids, mask)
    spec = generate_hf(ee, ids, mask, NEW, strategy="speculative", num_draft=3)
    assert torch.equal(spec.sequences, ref)
    assert set(spec.exit_layers.unique().tolist()) <= {1, N}  # drafted by the first exit
    assert ee.training and not m.training  # each module's mode as it was (the wrapper's train() would reset the model's)
    tau = 0.13
    out = generate_hf(ee, ids, mask, NEW, strategy="recompute", threshold=tau)
    assert bool((out.exit_layers < N).any())
    for b in range(ids.shape[0]):
        seq = ids[b : b + 1, mask[b].bool()]
        for i in range(NEW):
            for e in (1, 2, N):
                logits = ee(seq, exit_layer=e)[0, -1]
                pmax = float(torch.softmax(logits.double(), -1).max())
                if e == N or pmax >= tau:
                    break
                assert abs(pmax - tau) > MARGIN
            assert (int(out.tokens[b, i]), int(out.exit_layers[b, i])) == (int(logits.argmax()), e), (b, i)
            seq = torch.cat([seq, out.tokens[b : b + 1, i : i + 1]], dim=1)
    with pytest.raises(ConfigError, match=r"no exit head after layer 3; this model's own exit heads are after layers \[1, 2\]"):
        generate_hf(ee, ids, mask, 4, strategy="copy", threshold=0.5, exits=[3])
