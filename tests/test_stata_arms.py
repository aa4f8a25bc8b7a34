"""The ablation arms of STATA (bench/stata_ablation.py): raw scores, no anchor (mean received
attention), one shared anchor, random selection, and the alignment terms one at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from efficient.config import validate
from efficient.errors import ConfigError
from efficient.models.stata import StataConfig, TokenPruner
from efficient.objectives.stata import Stata
from efficient.zoo import create

SMALL = dict(embed_dim=16, num_heads=2, timesteps=2, backend="torch")


def tiny(**kw):
    return create("spikformer-tiny-stata", **{**SMALL, **kw})


def pruner(**kw) -> TokenPruner:
    cfg = StataConfig(**{"anchor": "per_timestep", "prune_blocks": [1], "keep_ratio": 0.5, **kw})
    p = TokenPruner(cfg, depth=2, timesteps=2, embed_dim=8, n_patches=8, kernel_backend="torch")
    p.begin()  # a forward's record, which `select` adds to
    return p


def numpy_topk(z: np.ndarray, k: int) -> np.ndarray:
    """k largest per row, ties to the lower index, ascending (the reference of seeds/stata.md 8.5)."""
    return np.sort(np.argsort(-z, axis=-1, kind="stable")[:, :k], axis=-1)


# ------------------------------------------------------------------------------ random selection


def test_random_selection_ignores_the_scores_and_is_uniform():
    p = pruner(score="random").train()
    s = torch.arange(8.0).expand(2, 4000, 8).contiguous()  # any criterion would keep tokens 4..7
    torch.manual_seed(0)
    idx, _ = p.select(s, 0.5)
    assert idx.shape == (4000, 4)
    assert all(len(set(r.tolist())) == 4 for r in idx[:50])  # k distinct tokens per sample
    freq = torch.bincount(idx.flatten(), minlength=8).float() / 4000
    assert torch.allclose(freq, torch.full((8,), 0.5), atol=0.04)  # each token kept with probability k/N
    pairs = (torch.zeros(4000, 8).scatter_(1, idx, 1.0)[:, :, None] * torch.zeros(4000, 8).scatter_(1, idx, 1.0)[:, None]).mean(0)
    off = pairs[~torch.eye(8, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, 4 * 3 / (8 * 7)), atol=0.04)  # pairs too: a uniform k-subset


def test_random_selection_is_seeded_in_training_and_repeatable_at_inference():
    p = pruner(score="random").train()
    s = torch.randn(2, 64, 8)
    torch.manual_seed(3)
    a = p.select(s, 0.5)[0]
    torch.manual_seed(3)
    assert torch.equal(a, p.select(s, 0.5)[0])  # the run's seed decides the draws
    assert not torch.equal(a, p.select(s, 0.5)[0])  # and they change from step to step
    p.eval()
    e1, e2 = p.select(s, 0.5)[0], p.select(s, 0.5)[0]
    p.eval()
    assert torch.equal(p.select(s, 0.5)[0], e1)  # every inference pass starts from random_seed
    assert not torch.equal(e1, e2)
    other = pruner(score="random", random_seed=1).eval()
    assert not torch.equal(other.select(s, 0.5)[0], e1)


def test_random_selection_in_a_model_keeps_the_scheduled_count_and_the_anchor():
    m = tiny(score="random").eval()
    out = m.forward_features(torch.rand(3, 1, 16, 16) * 2)
    assert m.stata_stats["tokens_in"] == [65, 33] and out.shape[2] == 17
    assert m(torch.rand(3, 1, 16, 16)).shape == (3, 10)


# ------------------------------------------------------------------------------ raw vs standardized


def test_raw_scores_rank_by_the_plain_time_mean():
    # timestep 0 has a large scale and ranks tokens 0..3 first; timestep 1 ranks 4..7 first on a
    # small scale: the raw mean follows t=0 alone, the standardized mean weighs both timesteps alike
    s0 = torch.tensor([140.0, 130, 120, 110, 100, 100, 100, 100])
    s1 = torch.tensor([0.0, 0, 0, 0, 1, 1, 1, 2])
    s = torch.stack([s0, s1])[:, None]
    raw = pruner(score="raw").select(s, 0.5)[0]
    std = pruner().select(s, 0.5)[0]
    assert raw.tolist() == [[0, 1, 2, 3]] == numpy_topk(s.mean(0).numpy(), 4).tolist()
    assert std.tolist() == [[0, 1, 4, 7]]
    # the standardized criterion is invariant to a per-timestep affine change; the raw one is not
    scaled = s * torch.tensor([0.01, 1.0])[:, None, None] + torch.tensor([5.0, 0.0])[:, None, None]
    assert torch.equal(pruner().select(scaled, 0.5)[0], std)
    assert not torch.equal(pruner(score="raw").select(scaled, 0.5)[0], raw)


# ------------------------------------------------------------------------------ anchor variants


def test_shared_anchor_is_one_vector_at_every_timestep():
    m = tiny(anchor="shared", timesteps=3)
    assert m.anchor.shape == (1, 16)
    tokens = m.embed(torch.rand(2, 1, 16, 16))
    assert tokens.shape[2] == 65
    for t in range(3):
        assert torch.equal(tokens[t, :, 0], m.anchor[0].expand(2, 16))
    per_t = tiny(timesteps=3)
    assert per_t.anchor.shape == (3, 16)
    assert not torch.equal(per_t.anchor[0], per_t.anchor[1])


def test_no_anchor_ranks_tokens_by_their_mean_received_attention():
    m = tiny(anchor="off", prune_blocks=[1], keep_ratio=0.5, timesteps=3).train()
    seen = {}
    attn = m.blocks[0].attn
    hooks = [attn.q.register_forward_hook(lambda mod, a, out: seen.__setitem__("q", out)),
             attn.k.register_forward_hook(lambda mod, a, out: seen.__setitem__("k", out))]
    torch.manual_seed(0)
    m(torch.rand(4, 1, 16, 16) * 3)
    for h in hooks:
        h.remove()
    assert m.n_prefix == 0 and m.stata_stats["tokens_in"] == [64, 32]
    q, k = seen["q"].detach().double(), seen["k"].detach().double()  # [T, B, N, D] binary spikes
    assert set(q.unique().tolist()) <= {0.0, 1.0} and q.sum() > 0 and k.sum() > 0
    attn_map = torch.einsum("tbnd,tbmd->tbnm", q, k)  # Q K^T summed over heads (= the full dot product)
    received = attn_map.mean(2)  # column mean over the queries: the attention each token receives
    z = (received - received.mean(-1, keepdim=True)) / (received.std(-1, correction=0, keepdim=True) + 1e-6)
    expect = numpy_topk(z.mean(0).float().numpy(), 32)
    assert all(row != list(range(32)) for row in expect.tolist())  # a real ranking, not index order
    assert m.stata_stats["kept_idx"][0].tolist() == expect.tolist()


# ------------------------------------------------------------------------------ alignment arms


@pytest.mark.parametrize("li, le", [(0.0, 0.0), (0.1, 0.0), (0.0, 0.1), (0.1, 0.1)])
def test_alignment_weights_switch_each_term_on_and_off(li, le):
    m = tiny().train()
    m.set_progress(0.0)
    batch = (torch.rand(4, 1, 16, 16) * 2, torch.tensor([1, 2, 3, 4]))
    torch.manual_seed(0)
    loss, logs = Stata(lambda_intra=li, lambda_inter=le).loss(m, batch)
    logs = {k: float(v) for k, v in logs.items()}
    if li == le == 0:
        assert "stata/intra" not in logs and loss.item() == pytest.approx(logs["ce"])
    else:
        expect = logs["ce"] + li * logs["stata/intra"] + le * logs["stata/inter"]
        assert logs["stata/intra"] > 0 and logs["stata/inter"] > 0
        assert loss.item() == pytest.approx(expect, rel=1e-6)


def test_arm_keys_are_validated_in_recipes():
    base = {"data": {"name": "digits"}}
    rec = validate({"model": {"name": "spikformer-tiny-stata", "score": "random", "random_seed": 4}, **base})
    assert rec.model["score"] == "random"
    with pytest.raises(ConfigError, match=r"model\.score: expected one of 'standardized', 'raw', 'random'"):
        validate({"model": {"name": "spikformer-tiny-stata", "score": "uniform"}, **base})
    with pytest.raises(ConfigError, match=r"model\.random_seed: expected an integer"):
        validate({"model": {"name": "spikformer-tiny-stata", "random_seed": 0.5}, **base})
    with pytest.raises(ConfigError, match=r"model\.anchor: expected one of 'per_timestep', 'shared', 'off'"):
        validate({"model": {"name": "spikformer-tiny-stata", "anchor": "none"}, **base})


# ------------------------------------------------------------------------------ surviving patches


def test_surviving_patches_compose_the_kept_sets_of_every_block():
    from efficient.models.stata import surviving_patches

    stats = {"kept_idx": [torch.tensor([[0, 2, 5, 7], [1, 3, 4, 6]]), torch.tensor([[1, 3], [0, 2]])]}
    assert surviving_patches(stats).tolist() == [[2, 7], [1, 4]]
    fused = {"kept_idx": [torch.tensor([[0, 2, 5]]), torch.tensor([[1, 3]])]}  # candidate 3 = the fused token
    assert surviving_patches(fused).tolist() == [[2, -1]]
    assert surviving_patches({"kept_idx": []}) is None
    m = tiny(keep_ratio=[0.5, 0.25]).eval()
    m(torch.rand(3, 1, 16, 16) * 2)
    kept = surviving_patches(m.stata_stats)
    first = m.stata_stats["kept_idx"][0]
    assert kept.shape == (3, 8)  # 64 -> 32 -> 8 patches
    for b in range(3):
        assert len(set(kept[b].tolist())) == 8 and set(kept[b].tolist()) <= set(first[b].tolist())
        assert kept[b].tolist() == sorted(kept[b].tolist())


def test_anchor_off_reads_as_the_string_in_recipes_and_overrides():
    from efficient.config import apply_overrides, parse_yaml

    data = parse_yaml("model:\n  name: spikformer-tiny-stata\n  anchor: off\n  lean_inference: true\ndata:\n  name: digits\n")
    assert data["model"]["anchor"] == "off" and data["model"]["lean_inference"] is True
    assert validate(data).model["anchor"] == "off"
    over = apply_overrides({"model": {"name": "spikformer-tiny-stata"}, "data": {"name": "digits"}}, ["model.anchor=off", "train.amp=false"])
    assert over["model"]["anchor"] == "off" and over["train"]["amp"] is False
    assert parse_yaml("a: yes\nb: No\nc: FALSE\n") == {"a": "yes", "b": "No", "c": False}


# ------------------------------------------------------------------ the ablation study's pairing


def _ablation():
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("stata_ablation", Path(__file__).resolve().parents[1] / "bench" / "stata_ablation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("stata_ablation", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_criterion_pairs_stata_with_random_at_the_same_schedule_by_seed():
    ab = _ablation()
    run = lambda acc, rec: {"acc": acc, "digit_recall": rec}  # noqa: E731
    res = {"stata": {"s0": run(97.0, 0.6), "s1": run(96.0, 0.7), "s2": run(95.0, 0.5)},
           "random": {"s0": run(95.0, 0.25), "s1": run(95.5, 0.25), "s3": run(10.0, 0.25)},  # s3 has no pair: left out
           "stata_early": {"s0": run(90.0, 0.5)}}  # no random_early: no row
    rows = ab.criterion(res)
    assert [r["label"] for r in rows] == ["rho 0.5, blocks 2-3 (recipe)"]
    r = rows[0]
    assert r["seeds"] == [0, 1] and r["diffs"] == [2.0, 0.5]
    m, lo, hi = ab.t_interval([2.0, 0.5])
    assert (r["diff"], r["diff_lo"], r["diff_hi"]) == (m, lo, hi) and r["diff"] == pytest.approx(1.25)
    assert hi - m == pytest.approx(12.706 * (1.5 / 2**0.5) / 2**0.5, rel=1e-3)  # t_{0.975,1} * sample sd / sqrt(n)
    assert r["verdict"] == "no detectable difference" and r["stata_recall"] == pytest.approx(0.65)
    assert "| rho 0.5, blocks 2-3 (recipe) | 2 | +1.25" in ab.criterion_markdown(rows)


def test_every_arm_overrides_a_valid_recipe():
    from efficient.config import apply_overrides, load_yaml

    ab = _ablation()
    for arm in ab.arms().values():
        cfg = validate(apply_overrides(load_yaml(arm.recipe), list(arm.overrides)), arm.recipe)
        if arm.name.endswith("_early"):
            assert cfg.model["prune_blocks"] == [1, 2]
    assert [p[2] for p in ab.criterion_pairs()][-1].endswith("(early)")


def test_criterion_pools_the_schedules_per_seed_when_there_are_several():
    ab = _ablation()
    run = lambda acc: {"acc": acc, "digit_recall": 0.5}  # noqa: E731
    res = {"stata": {"s0": run(97.0), "s1": run(96.0), "s2": run(95.0)},
           "random": {"s0": run(95.0), "s1": run(95.5), "s2": run(95.0)},
           "stata_early": {"s0": run(90.0), "s1": run(92.0)},  # s2 missing here: the pooled row uses s0, s1
           "random_early": {"s0": run(91.0), "s1": run(90.0)}}
    rows = ab.criterion(res)
    assert len(rows) == 3
    last = rows[-1]
    assert last["label"] == "mean over the 2 schedules above" and last["seeds"] == [0, 1]
    assert last["diffs"] == [pytest.approx((2.0 - 1.0) / 2), pytest.approx((0.5 + 2.0) / 2)]
    assert last["diff"] == pytest.approx(0.875)
    assert (last["diff_lo"], last["diff_hi"]) == pytest.approx(ab.t_interval(last["diffs"])[1:])
    assert ab.criterion({"stata": res["stata"], "random": res["random"]})[-1]["label"] != last["label"]  # one schedule: no pooled row
