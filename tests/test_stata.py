"""STATA on Spikformer: the properties of seeds/stata.md section 8 on tiny models (CPU, torch backend)."""

from __future__ import annotations

import math

import pytest
import torch

import efficient
from efficient.errors import ConfigError
from efficient.models.spikformer import Spikformer, kept_count, warmup_keep_ratio
from efficient.objectives.classification import Classification
from efficient.objectives.stata import Stata, alignment_losses, standardize
from efficient.zoo import count_params, create

SMALL = dict(embed_dim=16, num_heads=2, timesteps=2, backend="torch")  # spikformer-tiny geometry: 16px, 8x8 = 64 tokens


def tiny(**kw) -> Spikformer:
    return create("spikformer-tiny-stata", **{**SMALL, **kw})


def digits_like(b: int = 3) -> torch.Tensor:
    return torch.rand(b, 1, 16, 16) * 2


def same_weights(dst: torch.nn.Module, src: torch.nn.Module) -> torch.nn.Module:
    dst.load_state_dict(src.state_dict())
    return dst


# ----------------------------------------------------------------------------- identity (8.1)


@pytest.mark.parametrize("train", [False, True])
def test_keep_ratio_one_is_bitwise_the_unpruned_model(train: bool):
    m = tiny(keep_ratio=1.0)
    ref = same_weights(tiny(prune_blocks=[]), m)
    m.train(train), ref.train(train)
    x = digits_like()
    assert torch.equal(m(x), ref(x))


def test_keep_ratio_one_and_zero_lambdas_give_the_dense_loss():
    m = tiny(keep_ratio=1.0).train()
    ref = same_weights(tiny(prune_blocks=[]), m).train()
    batch = (digits_like(4), torch.tensor([0, 1, 2, 3]))
    loss, logs = Stata(lambda_intra=0.0, lambda_inter=0.0).loss(m, batch)
    loss_ref, _ = Classification().loss(ref, batch)
    assert torch.equal(loss, loss_ref) and "stata/intra" not in logs


def test_anchor_off_without_pruning_is_exactly_the_dense_zoo_model():
    dense = create("spikformer-tiny", **SMALL)
    off = same_weights(tiny(anchor="off", prune_blocks=[]), dense)
    assert count_params(off) == count_params(dense)
    x = digits_like()
    assert torch.equal(off.eval()(x), dense.eval()(x))


def test_published_parameter_counts():
    from efficient.zoo import meta_param_count

    assert round(meta_param_count("spikformer-4-384") / 1e6, 2) == 9.33  # Spikformer paper, CIFAR-10
    # STATA adds only the anchor (T x D)
    assert meta_param_count("spikformer-stata") - meta_param_count("spikformer-4-384") == 4 * 384


# --------------------------------------------------------------------------- token counts (8.2)


def test_default_cifar_schedule_is_65_46_33():
    m = create("spikformer-stata", embed_dim=32, num_heads=2, timesteps=1, backend="torch")
    assert m.token_schedule() == [(65, 65), (65, 46), (46, 33), (33, 33)]
    m.eval()(torch.randn(1, 3, 32, 32))
    assert m.stata_stats["tokens_in"] == [65, 65, 46, 33] and m.stata_stats["tokens_out"] == 33


@pytest.mark.parametrize("fuse, point", [(False, "after_attn"), (True, "after_attn"), (False, "after_block")])
def test_tokens_entering_each_block_follow_the_schedule(fuse: bool, point: str):
    m = tiny(depth=3, prune_blocks=[1, 3], keep_ratio=[0.6, 0.5], fuse_pruned=fuse, prune_point=point).eval()
    m(digits_like(2))
    sched = m.token_schedule()
    assert m.stata_stats["tokens_in"] == [a for a, _ in sched]
    k1 = math.ceil(0.6 * 64)
    assert sched[1][0] == 1 + k1 + fuse  # anchor + kept (+ fused token)
    cand2 = k1 + fuse
    assert m.stata_stats["tokens_out"] == 1 + math.ceil(0.5 * cand2) + fuse


def test_kept_count_is_ceil_without_float_noise():
    assert kept_count(0.7, 64) == 45 and kept_count(0.7, 45) == 32 and kept_count(0.7, 50) == 35


# -------------------------------------------- same set over time, anchor kept, physical gather (8.3, 8.4)


def test_kept_set_is_shared_by_all_timesteps_and_anchor_survives():
    m = tiny(timesteps=3, prune_blocks=[1], keep_ratio=0.5).eval()
    seen = {}
    blk = m.blocks[0]
    h1 = blk.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x_in", args[0]))
    h2 = blk.attn.proj.register_forward_hook(lambda mod, args, out: seen.__setitem__("attn", out))
    h3 = blk.mlp.register_forward_pre_hook(lambda mod, args: seen.__setitem__("kept", args[0]))
    m.forward_features(digits_like(2))  # the full path: every row computed, anchor kept to the end
    for h in (h1, h2, h3):
        h.remove()
    pre = seen["x_in"] + seen["attn"]  # residual stream at the pruning point
    kept = seen["kept"]
    idx = m.stata_stats["kept_idx"][0]  # [B, k], one set per sample
    assert kept.shape[2] == 1 + 32 < pre.shape[2]  # tokens physically removed
    assert torch.equal(kept[:, :, 0], pre[:, :, 0])  # the anchor is never pruned
    for b in range(2):
        assert torch.equal(kept[:, b, 1:], pre[:, b, 1:][:, idx[b]])  # the same tokens at every t
        assert torch.equal(idx[b], idx[b].sort().values)  # original order kept


# The lean inference path runs the block Linears on fewer rows than the full forward (pruned
# queries, the last anchor skipped), and a BLAS may round a row's sum differently for another row
# count. In float64 that is ~1e-17 on logits of ~0.03: a spike could flip only for a membrane that
# close to threshold, so spikes and kept sets agree and logits stay within LEAN_TOL, while a lean-path
# bug (a wrong row kept, the anchor pooled) moves them by orders of magnitude more.
LEAN_TOL = dict(rtol=0, atol=1e-12)


def test_anchor_is_never_pooled():
    m = tiny().double().eval()  # float64: see LEAN_TOL
    x = digits_like().double()
    base = m.forward_head(m.forward_features(x))  # the full path keeps the anchor to the end
    # the lean inference path drops it in the last block: the same logits
    torch.testing.assert_close(m(x), base, **LEAN_TOL)

    def bump(index: int):
        def hook(mod, args, out):
            out = out.clone()
            out[:, :, index] += 100.0
            return out

        return m.blocks[-1].register_forward_hook(hook)

    full = lambda: m.forward_head(m.forward_features(x))  # noqa: E731
    h = bump(0)
    assert torch.equal(full(), base)  # anchor features do not reach the logits
    h.remove()
    h = bump(1)
    assert not torch.allclose(full(), base)  # a patch token does
    h.remove()


# ------------------------------------------------------------------------------ fusion (8.7)


def test_fused_token_is_softmax_z_weighted_sum_of_pruned_tokens():
    m = tiny(fuse_pruned=True).eval()
    T, B, N, D = 2, 2, 10, 4
    x = torch.randn(T, B, N + 1, D)
    s = torch.randn(T, B, N)
    m.stata_stats = {"degenerate": 0}
    out = m._prune(x, s, s, 0.5)
    from efficient.kernels.token_select import select_tokens_ref

    idx, z = select_tokens_ref(s, 5)
    pruned = [sorted(set(range(N)) - set(idx[b].tolist())) for b in range(B)]
    assert out.shape == (T, B, 1 + 5 + 1, D)
    for b in range(B):
        w = torch.softmax(z[b, pruned[b]], 0)
        expect = torch.einsum("n,tnd->td", w, x[:, b, 1:][:, pruned[b]])
        torch.testing.assert_close(out[:, b, -1], expect)


def test_pruned_tokens_get_no_gradient_from_later_blocks():
    m = tiny(prune_blocks=[1], keep_ratio=0.5).train()
    grads = {}

    def keep_grad(mod, args, out):
        out.retain_grad()
        grads["attn_out"] = out
        return out

    h = m.blocks[0].attn.proj.register_forward_hook(keep_grad)
    # gradients that reach the pruning point only through the MLP and later blocks: the loss is the
    # logits, and the attention branch of block 1 feeds the pruning point directly
    m(digits_like(2)).sum().backward()
    h.remove()
    g = grads["attn_out"].grad  # [T, B, 65, D]; residual: grad at x_pre equals grad at attn out
    idx = m.stata_stats["kept_idx"][0]
    for b in range(2):
        pruned = sorted(set(range(64)) - set(idx[b].tolist()))
        assert torch.count_nonzero(g[:, b, 1:][:, pruned]) == 0
        assert torch.count_nonzero(g[:, b, 1:][:, idx[b]]) > 0


# ------------------------------------------------------------------- alignment losses (8.8)


def test_alignment_losses_zero_cases_and_non_negative():
    torch.manual_seed(1)
    s = torch.randn(3, 4, 9)
    intra, inter = alignment_losses(s, s.clone())
    assert intra.item() == pytest.approx(0.0, abs=1e-6)
    same_t = torch.randn(1, 4, 9).expand(3, 4, 9)
    assert alignment_losses(same_t, torch.randn(3, 4, 9))[1].item() == pytest.approx(0.0, abs=1e-6)
    for _ in range(5):
        a, b = alignment_losses(torch.randn(3, 4, 9) * 3, torch.randn(3, 4, 9))
        assert a.item() > 0 and b.item() > 0


def test_constant_timesteps_are_masked_and_gradients_stay_finite():
    s = torch.randn(2, 3, 8, requires_grad=True)
    s_const = torch.cat([s[:1], torch.zeros(1, 3, 8)])  # t=1: anchor silent
    intra, inter = alignment_losses(s_const, torch.randn(2, 3, 8))
    (intra + inter).backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    z, valid = standardize(torch.zeros(2, 5))
    assert torch.equal(z, torch.zeros(2, 5)) and not valid.any()


def test_flat_rows_are_masked_and_counted_exactly():
    """A row of equal non-integer scores is flat whatever its computed variance (the mean of n
    equal floats can round away from them): no gradient flows into it, and a sample flat at every
    t counts as degenerate."""
    from efficient.models.stata import find_pruner

    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 3, 64, generator=g)
    s[1, 2] = 0.3  # one flat (t, sample) row
    x = s.clone().requires_grad_()
    intra, inter = alignment_losses(x, torch.randn(2, 3, 64, generator=g))
    (intra + inter).backward()
    assert torch.count_nonzero(x.grad[1, 2]) == 0 and torch.count_nonzero(x.grad[0, 2]) > 0
    assert not standardize(torch.full((3, 64), 0.3))[1].any()

    pruner = find_pruner(tiny().train())
    pruner.begin()
    s[:, 1] = 0.7  # sample 1 flat at every t
    pruner.select(s, 0.5)
    assert int(pruner.last.stats["degenerate"]) == 1


def test_patch_queries_get_no_gradient_from_intra_loss():
    from efficient.kernels.ssa import scores_ref

    q = (torch.rand(2, 3, 2, 7, 4) < 0.5).float().requires_grad_()
    k = (torch.rand(2, 3, 2, 7, 4) < 0.5).float().requires_grad_()
    s, c = scores_ref(q, k, anchor=True)
    intra, _ = alignment_losses(s, c)
    intra.backward()
    assert torch.count_nonzero(q.grad[..., 1:, :]) == 0
    assert torch.count_nonzero(q.grad[..., 0, :]) > 0 and torch.count_nonzero(k.grad) > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_closed_form_alignment_gradient_equals_the_autograd_composition(dtype):
    # values and the gradient of any weighting of the two terms, with a silent anchor row, a flat
    # mean-query row (masked) and a timestep shared by all samples; the spec is the autograd version
    from efficient.objectives.stata import alignment_losses_reference

    g = torch.Generator().manual_seed(3)
    s = torch.randn(3, 4, 9, generator=g, dtype=torch.float64) * 2
    s[0, 1] = 0.7
    s[2] = s[1]
    c = torch.randn(3, 4, 9, generator=g, dtype=torch.float64)
    c[2, 3] = 1.0
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]
    for tau, (wi, we) in ((1.0, (1.0, 1.0)), (0.5, (0.3, 1.7)), (2.0, (0.0, 1.0))):
        fast, ref = s.to(dtype).requires_grad_(), s.to(dtype).requires_grad_()
        a, b = alignment_losses(fast, c, tau), alignment_losses_reference(ref, c, tau)
        torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=tol, atol=tol)
        (wi * a[0] + we * a[1]).backward()
        (wi * b[0] + we * b[1]).backward()
        assert fast.grad.dtype == dtype
        scale = ref.grad.float().abs().max()
        assert (fast.grad.float() - ref.grad.float()).abs().max() <= tol * scale, (tau, wi, we)


@pytest.mark.slow
def test_compiled_alignment_equals_the_eager_closed_form():
    """The inductor-compiled bodies (what CUDA runs) give the eager closed form's values and
    gradient, for two token counts (one dynamic-shape compile) and with masked rows."""
    from efficient.objectives.stata import _compiled_body

    g = torch.Generator().manual_seed(5)
    for shape in ((3, 4, 9), (2, 5, 13)):
        s = torch.randn(shape, generator=g) * 2
        s[0, 1] = 0.7  # a flat anchor row: masked
        c = torch.randn(shape, generator=g)
        w = torch.rand(2, generator=g)
        outs = []
        for backend in ("loop", "compile"):
            x = s.clone().requires_grad_()
            intra, inter = alignment_losses(x, c, 0.5, backend=backend)
            (w[0] * intra + w[1] * inter).backward()
            outs.append((torch.stack([intra, inter]).detach(), x.grad))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-6)
    assert _compiled_body.cache_info().currsize == 2  # forward and backward, compiled once each


def test_closed_form_alignment_records_one_backward_node():
    s = torch.randn(3, 4, 9, requires_grad=True)
    intra, inter = alignment_losses(s, torch.randn(3, 4, 9))
    assert intra.grad_fn is inter.grad_fn and intra.grad_fn.next_functions[0][0].variable is s


def test_alignment_losses_reach_the_anchor():
    m = tiny().train()
    m(digits_like(4))
    assert len(m.stata_scores) == 2
    intra, inter = Stata().alignment(m)
    (intra + inter).backward()
    assert m.anchor.grad is not None and m.anchor.grad.abs().sum() > 0


def test_stata_objective_logs_and_backward():
    m = tiny().train()
    m.set_progress(0.0)
    loss, logs = Stata(label_smoothing=0.1).loss(m, (digits_like(4), torch.tensor([1, 2, 3, 4])))
    loss.backward()
    assert torch.isfinite(loss)
    assert {"ce", "stata/intra", "stata/inter", "stata/keep_ratio", "stata/tokens_out", "acc"} <= set(logs)
    assert logs["loss"] >= logs["ce"]


# ------------------------------------------------------------------------- schedule (8.9)


def test_keep_ratio_warmup_schedule():
    rhos = [warmup_keep_ratio(0.7, e / 10, start=2.0, span=5.0) for e in range(0, 100)]
    assert all(r == 1.0 for r in rhos[:20])
    assert rhos[-1] == pytest.approx(0.7) and warmup_keep_ratio(0.7, 7.0, 2.0, 5.0) == pytest.approx(0.7)
    assert all(b <= a + 1e-12 for a, b in zip(rhos, rhos[1:]))
    m = tiny(keep_warmup_start=1.0, keep_warmup_epochs=2.0).train()
    m.set_progress(0.5)
    assert m.keep_ratios() == {0: 1.0, 1: 1.0}
    m.set_progress(2.0)
    assert m.keep_ratios()[0] == pytest.approx(0.75)
    m.eval()
    assert m.keep_ratios() == {0: 0.5, 1: 0.5}  # inference uses rho*


def test_warmup_changes_the_token_count_in_training():
    m = tiny(keep_warmup_start=1.0, keep_warmup_epochs=2.0).train()
    m.set_progress(0.0)
    m(digits_like(2))
    assert m.stata_stats["tokens_in"] == [65, 65] and m.stata_stats["tokens_out"] == 65
    m.set_progress(10.0)
    m(digits_like(2))
    assert m.stata_stats["tokens_in"] == [65, 33] and m.stata_stats["tokens_out"] == 17


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(img_size=30), "does not fit the SPS stem"),
        (dict(keep_ratio=0.0), r"keep_ratio must be in \(0, 1\]"),
        (dict(keep_ratio=1.5), r"keep_ratio must be in \(0, 1\]"),
        (dict(prune_blocks=[2, 5]), "at most depth=4"),
        (dict(prune_blocks=[0]), "1-based"),
        (dict(keep_ratio=[0.5]), "one ratio or one per block"),
        (dict(prune_blocks=[1, 2, 3], keep_ratio=0.02), "leaves zero tokens"),
    ],
)
def test_bad_configs_fail_at_build_time(kw, match):
    with pytest.raises(ConfigError, match=match):
        create("spikformer-stata", **{"embed_dim": 16, "num_heads": 2, "backend": "torch", **kw})


def test_bad_keys_fail_in_recipe_validation():
    from efficient.config import validate

    good = {"model": {"name": "spikformer-tiny-stata", "keep_ratio": 0.6, "prune_blocks": [1]}, "data": {"name": "digits"}}
    rec = validate(good)
    assert rec.model["prune_blocks"] == [1]
    with pytest.raises(ConfigError, match="anchor"):
        validate({"model": {"name": "spikformer-tiny-stata", "anchor": "every_step"}, "data": {"name": "digits"}})


def test_wrong_image_at_forward_names_the_expected_shape():
    with pytest.raises(ValueError, match=r"\[B, 3, 32, 32\]"):
        create("spikformer-stata", embed_dim=16, num_heads=2, backend="torch")(torch.randn(1, 3, 28, 28))


# ------------------------------------------------------------------------------------ loading


def test_load_stata_forward_and_pretrained_run_dir(tmp_path):
    m = efficient.load("spikformer-stata", backend="torch")
    assert m(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    # a run dir as the trainer writes it: config.yaml + checkpoint/last/model.safetensors
    import yaml

    from efficient.zoo import save_model

    src = create("spikformer-tiny-stata", keep_ratio=0.6)
    run = tmp_path / "run"
    (run / "checkpoint" / "last").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"name": "spikformer-tiny-stata", "keep_ratio": 0.6}}))
    save_model(src, run / "checkpoint" / "last" / "model.safetensors")
    loaded = efficient.load("spikformer-tiny-stata", pretrained=run, keep_ratio=0.6)
    again = efficient.load(run)
    x = digits_like(2)
    src.eval()
    assert torch.equal(loaded(x), src(x)) and torch.equal(again(x), src(x))
    assert again.token_schedule()[1][0] == 1 + math.ceil(0.6 * 64)


# ------------------------------------------------------------------- neuron backend, whole model


def test_model_neurons_share_the_compiled_path_once_the_largest_one_needs_it(monkeypatch):
    """`auto` picks one LIF path per model: compiled for every neuron once the largest crosses the
    compile threshold (it is compiled anyway), the eager loop otherwise; spikes do not change."""
    import efficient.models.neurons as neurons
    import efficient.models.spikformer as sf
    from efficient.kernels import lif as K

    m = create("spikformer-tiny", embed_dim=16, num_heads=2, timesteps=2)  # backend auto
    lifs = [x for x in m.modules() if isinstance(x, sf.ModelLIF)]
    peak = lifs[0].peak_numel
    assert peak == max(m.patch_embed.neuron_peak(), 64 * 65) and all(x.peak_numel == peak for x in lifs)
    seen = []
    # every neuron call goes through one of the two, with the backend its module chose (bn_lif: a
    # unit's BatchNorm and neuron as one op)
    real, real_bn = neurons.lif, neurons.bn_lif
    monkeypatch.setattr(neurons, "lif", lambda *a, backend, **kw: seen.append(backend) or real(*a, backend="loop", **kw))
    monkeypatch.setattr(neurons, "bn_lif", lambda *a, backend, **kw: seen.append(backend) or real_bn(*a, backend="loop", **kw))
    x = digits_like(2)
    small = m.eval()(x)
    assert set(seen) == {"loop"}  # 2 x 2 x peak is far below the threshold
    seen.clear()
    for n in lifs:
        n.peak_numel = K.COMPILE_MIN_NUMEL  # as if the stem were huge: every neuron takes the compiled path
    assert torch.equal(m(x), small)
    want = "compile" if K.resolve_backend("auto", torch.device("cpu")) == "compile" else "loop"
    assert set(seen) == {want} and len(seen) == len(lifs)


# ------------------------------------------------------------------ lean inference (dead rows)


def lively(m: Spikformer) -> Spikformer:
    """BatchNorm running statistics from one training-mode batch, as after training: with the
    initial ones (mean 0, var 1) an untrained model is silent in eval mode."""
    for mod in m.modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            mod.reset_running_stats()
            mod.momentum = None  # cumulative average: the running stats become this batch's
    with torch.no_grad():
        m.train()(digits_like(4).to(next(m.parameters()).dtype))
    return m.eval()


@pytest.mark.parametrize("kw, b", [({}, 1), ({}, 3), ({"prune_blocks": [1]}, 3), ({"keep_ratio": [0.5, 0.3]}, 3),
                                   ({"anchor": "off"}, 3)])
def test_lean_inference_gives_the_logits_of_the_full_forward(kw, b):
    torch.manual_seed(1)
    m = lively(tiny(**kw).double()).eval()  # float64: see LEAN_TOL
    full = same_weights(tiny(**kw, lean_inference=False).double(), m).eval()
    x = digits_like(b).double()
    assert m.uses_lean_path(m.embed(x)) and not full.uses_lean_path(full.embed(x))
    out = m(x)
    torch.testing.assert_close(out, full(x), **LEAN_TOL)
    torch.testing.assert_close(out, m.forward_head(m.forward_features(x)), **LEAN_TOL)
    assert m.stata_stats["tokens_in"] == full.stata_stats["tokens_in"]
    for a, c in zip(m.stata_stats["kept_idx"], full.stata_stats["kept_idx"]):
        assert torch.equal(a, c)  # the anchor-only score (spike counts) ranks exactly as the fused attention pass
    if b > 1:
        assert not torch.equal(out[0], out[1])  # the neurons fire: a non-trivial comparison
    if kw.get("anchor") != "off":  # the anchor fires: selection is not the index-order fallback
        assert m.stata_stats["degenerate"] < b * len(m.stata_stats["kept_idx"])
        assert any(not torch.equal(i, torch.arange(i.shape[1]).expand_as(i)) for i in m.stata_stats["kept_idx"])


def _linear_rows(m, x) -> dict[str, int]:
    rows = {}
    hooks = [mod.register_forward_hook(lambda mod, a, o, n=n: rows.__setitem__(n, rows.get(n, 0) + a[0].shape[0]))
             for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and n.startswith("blocks.")]
    m(x)
    for h in hooks:
        h.remove()
    return rows


def test_lean_inference_skips_pruned_queries_and_the_last_anchor_only_at_inference():
    m = tiny()  # blocks 1, 2 at rho 0.5: 65 -> 33 -> 17 tokens
    x = digits_like(3)
    tb = 2 * 3  # T * B: the linears see [T * B * tokens, D]
    train_rows = _linear_rows(m.train(), x)
    assert train_rows["blocks.1.attn.q.linear"] == tb * 33 and train_rows["blocks.1.mlp.fc1.linear"] == tb * 17
    rows = _linear_rows(m.eval(), x)
    want = {  # keys/values of every token; queries of the anchor + kept; no anchor after the last attention
        "blocks.0.attn.k.linear": 65, "blocks.0.attn.v.linear": 65, "blocks.0.attn.q.linear": 1 + 32,
        "blocks.0.attn.proj.linear": 33, "blocks.0.mlp.fc1.linear": 33, "blocks.0.mlp.fc2.linear": 33,
        "blocks.1.attn.k.linear": 33, "blocks.1.attn.v.linear": 33, "blocks.1.attn.q.linear": 1 + 16,
        "blocks.1.attn.proj.linear": 16, "blocks.1.mlp.fc1.linear": 16, "blocks.1.mlp.fc2.linear": 16,
    }
    assert rows == {k: tb * v for k, v in want.items()}
    # the profiler counts what runs: block linears = rows x fan-in x fan-out
    D, H = 16, 64
    rep = efficient.profile(m, inputs=x)
    fan = {"fc1": D * H, "fc2": H * D}
    expect = sum(r * fan.get(k.split(".")[-2], D * D) for k, r in rows.items())
    assert sum(l.dense_macs for l in rep.layers if l.name.startswith("blocks.") and l.type == "Linear") == expect


def test_fused_qkv_unit_gives_the_same_spikes_and_running_stats_as_three_units():
    import copy

    torch.manual_seed(0)
    attn = tiny(embed_dim=32).blocks[0].attn.train()
    ref = copy.deepcopy(attn)
    x = torch.randint(0, 4, (2, 3, 17, 32)).float()
    xf, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    fused = attn.qkv_fused(xf)
    sep = (ref.q(xr), ref.k(xr), ref.v(xr))
    # One [3C x C] GEMM and BatchNorm over 3C channels against three of C: a BLAS may block the two
    # widths differently, so pre-activations can differ in the last bit and a membrane within an ulp
    # of threshold fire in one and not the other. Allowed: 2 flipped spikes per unit (of 3264); a
    # unit fed the wrong weight rows or statistics differs in hundreds.
    flipped = 0
    for a, b in zip(fused, sep):
        n = int((a != b).sum())
        assert n <= 2 and 0 < a.mean() < 1, f"{n} of {a.numel()} spikes differ"
        flipped += n
    for (n, a), b in zip(attn.named_buffers(), ref.buffers()):
        if a.is_floating_point():  # running mean / var: the same per-channel sums, maybe in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
        else:
            assert torch.equal(a, b), n  # the batch counters move exactly alike
    if flipped:  # a flipped spike resets its membrane: the gradients below no longer compare
        return
    g = [torch.randn_like(t) for t in sep]
    sum((t * w).sum() for t, w in zip(fused, g)).backward()
    sum((t * w).sum() for t, w in zip(sep, g)).backward()
    torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-5, atol=1e-6)  # the input gradient sums in another order
    for (n, p), q in zip(attn.named_parameters(), ref.parameters()):
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_parameter_concatenation_node_gives_the_cats_values_and_gradients_with_one_split_per_group():
    """The fused Q/K/V unit concatenates its parameters through one autograd node whose backward splits
    each group's gradient once: the values and gradients of a `torch.cat` per group bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from efficient.models.spikformer import concat_parameters

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    groups = [[torch.randn(3, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(5, 4, generator=g)],
              [torch.randn(3, generator=g), torch.randn(2, generator=g), torch.randn(5, generator=g)],
              [torch.randn(1, generator=g)]]  # this group gets no gradient: its parts get None
    ours = [[t.clone().requires_grad_() for t in grp] for grp in groups]
    ref = [[t.clone().requires_grad_() for t in grp] for grp in groups]
    out, want = concat_parameters(ours), [torch.cat(grp) for grp in ref]
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    w = [torch.randn(t.shape, generator=g) for t in want[:2]]
    with Ops() as ops:
        sum((o * v).sum() for o, v in zip(out[:2], w)).backward()
    sum((o * v).sum() for o, v in zip(want[:2], w)).backward()
    for a, b in zip(sum(ours, []), sum(ref, [])):
        assert (a.grad is None) == (b.grad is None)
        assert a.grad is None or torch.equal(a.grad, b.grad)
    assert ops.names.count("aten.split_with_sizes.default") == 2 and "aten.slice.Tensor" not in ops.names
    # nothing to differentiate, or traced by a compiler: plain concatenations
    plain = concat_parameters(groups)
    assert all(torch.equal(a, b) and a.grad_fn is None for a, b in zip(plain, want))


def test_training_through_the_attention_unit_equals_the_plain_path_bit_for_bit(monkeypatch):
    """The scoring blocks run the attention as one op each way
    (`spiking_attention_unit`); eight AdamW steps through the keep-ratio warm-up give the weights,
    running statistics and kept tokens of the plain split/attend/merge path bit for bit."""
    import efficient.models.spikformer as spk

    def train(plain: bool):
        torch.manual_seed(0)
        m = tiny().train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        kept, calls = [], []
        unit = spk.spiking_attention_unit
        monkeypatch.setattr(spk, "spiking_attention_unit", lambda *a, **kw: calls.append(kw["scores"]) or unit(*a, **kw))
        if plain:
            monkeypatch.setattr(spk, "_one_call_allowed", lambda *a: False)
        for step in range(8):
            m.set_progress(step / 8)
            x, y = torch.rand(4, 1, 16, 16, generator=g) * 2, torch.randint(0, 10, (4,), generator=g)
            loss, _ = Stata(label_smoothing=0.1).loss(m, (x, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept += [i.clone() for i in m.stata_stats.get("kept_idx", [])]
        monkeypatch.undo()
        return m.state_dict(), kept, calls

    unit_state, unit_kept, calls = train(plain=False)
    plain_state, plain_kept, plain_calls = train(plain=True)
    assert not plain_calls and True in calls  # the scoring blocks ran the unit
    assert unit_kept and len(unit_kept) == len(plain_kept)
    assert all(torch.equal(a, b) for a, b in zip(unit_kept, plain_kept))
    for name, t in plain_state.items():
        assert torch.equal(unit_state[name], t), name
