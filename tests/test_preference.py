"""Preference losses (DPO / IPO / SLiC / GPO family / rDPO / KTO) and the preference datasets."""

from __future__ import annotations

import inspect
import json
import math
import types

import pytest
import torch
from torch import nn

from efficient.data.preferences import make_synthetic_pairs, prefs, synthetic_prefs, true_reward
from efficient.errors import ConfigError, DataError
from efficient.objectives.preference import (
    GPO_FUNCTIONS,
    KTO,
    Preference,
    kto_losses,
    preference_losses,
    sequence_logps,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: thread hand-offs cost more than the math


class BigramLM(nn.Module):
    """Smallest causal byte LM: next-token logits from the current token only."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(256, 8)
        self.head = nn.Linear(8, 256)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(256, 8, generator=g) * 0.1)
            self.head.weight.copy_(torch.randn(256, 8, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def _logsig(x: float) -> float:  # independent scalar reference: log sigmoid(x)
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


H = torch.linspace(-6, 6, 49, dtype=torch.float64)


# ------------------------------------------------------------------------- rDPO / DPO / cDPO


def test_rdpo_with_eps_zero_is_dpo():
    d = torch.randn(64, dtype=torch.float64) * 5
    assert torch.equal(preference_losses(d, 0.1, "robust", eps=0.0), preference_losses(d, 0.1, "sigmoid"))


def test_dpo_matches_scalar_formula():
    d = torch.randn(32, dtype=torch.float64) * 10
    ours = preference_losses(d, 0.3, "sigmoid")
    ref = torch.tensor([-_logsig(0.3 * x) for x in d.tolist()], dtype=torch.float64)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("eps", [0.05, 0.2, 0.4])
def test_rdpo_is_unbiased_and_cdpo_is_not(eps):
    beta = 1.0
    rob = lambda h: preference_losses(h, beta, "robust", eps=eps)  # noqa: E731
    clean = preference_losses(H, beta, "sigmoid")
    torch.testing.assert_close((1 - eps) * rob(H) + eps * rob(-H), clean, atol=1e-12, rtol=0)
    cdpo = lambda h: preference_losses(h, beta, "sigmoid", label_smoothing=eps)  # noqa: E731
    gap = ((1 - eps) * cdpo(H) + eps * cdpo(-H) - clean).abs().max()
    assert gap > 1e-2


def test_rdpo_unbounded_below_with_linear_slope():
    eps, beta = 0.2, 0.1
    d = torch.tensor([1e3, 1e4], dtype=torch.float64, requires_grad=True)
    loss = preference_losses(d, beta, "robust", eps=eps)
    loss.sum().backward()
    slope = -eps * beta / (1 - 2 * eps)
    torch.testing.assert_close(d.grad, torch.full_like(d, slope), rtol=1e-6, atol=0)
    assert loss[1] < loss[0] < -10  # keeps falling: nothing clips it
    torch.testing.assert_close(loss[1] - loss[0], torch.tensor(slope * 9e3, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("eps", [0.5, 0.7, -0.1])
def test_rdpo_rejects_flip_rate_at_or_above_half(eps):
    with pytest.raises(ConfigError, match="eps"):
        Preference(loss_type="robust", eps=eps)
    with pytest.raises(ConfigError, match=r"\[0, 0.5\)"):
        preference_losses(torch.zeros(2), 0.1, "robust", eps=eps)


# ---------------------------------------------------------------------------------- GPO family


def test_gpo_members_match_their_closed_forms():
    x = H
    forms = {
        "logistic": [math.log1p(math.exp(-v)) for v in x.tolist()],
        "hinge": [max(0.0, 1 - v) for v in x.tolist()],
        "squared": [(v - 1) ** 2 for v in x.tolist()],
        "exponential": [math.exp(-v) for v in x.tolist()],
        "truncated_quadratic": [max(0.0, 1 - v) ** 2 for v in x.tolist()],
        "savage": [(1 + math.exp(v)) ** -2 for v in x.tolist()],
    }
    assert set(forms) == set(GPO_FUNCTIONS)
    for name, ref in forms.items():
        torch.testing.assert_close(preference_losses(x, 1.0, name), torch.tensor(ref, dtype=torch.float64), msg=name)
    # the TRL names are the same functions
    torch.testing.assert_close(preference_losses(x, 0.7, "sigmoid"), preference_losses(x, 0.7, "logistic"))
    torch.testing.assert_close(preference_losses(x, 0.7, "hinge"), GPO_FUNCTIONS["hinge"](0.7 * x))


def test_squared_with_beta_two_tau_is_scaled_ipo():
    tau = 0.1
    d = torch.randn(50, dtype=torch.float64) * 8
    sq = preference_losses(d, 2 * tau, "squared")
    ipo = preference_losses(d, tau, "ipo")
    torch.testing.assert_close(sq, 4 * tau**2 * ipo)
    torch.testing.assert_close(ipo, (d - 1 / (2 * tau)) ** 2)


def _derivatives(f, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
    (g2,) = torch.autograd.grad(g.sum(), x)
    return g.detach(), g2


@pytest.mark.parametrize("name", sorted(GPO_FUNCTIONS))
def test_gpo_slope_at_zero_is_negative_and_convexity_except_savage(name):
    f = GPO_FUNCTIONS[name]
    g0, _ = _derivatives(f, torch.zeros(1, dtype=torch.float64))
    assert g0.item() < 0
    x = torch.linspace(-4, 4, 161, dtype=torch.float64)
    _, f2 = _derivatives(f, x)
    if name == "savage":
        ln2 = math.log(2)
        assert (f2[x < -ln2 - 1e-6] < 0).all() and (f2[x > -ln2 + 1e-6] > 0).all()
    else:
        assert (f2 >= -1e-12).all()


# ------------------------------------------------------------------------------------ TRL parity


def _trl_pair_loss(loss_type: str, beta: float, label_smoothing: float, logps: list[float]) -> torch.Tensor:
    """TRL's DPO loss for one pair, through DPOTrainer._compute_loss itself (TRL >= 1.0, where the
    loss lives inline there). A stand-in trainer and model supply exactly what it reads: sequence
    log-probs (one completion token each, so TRL's per-token IPO normalisation is 1) and the
    precomputed reference log-probs."""
    from collections import defaultdict

    from trl import DPOTrainer

    chosen, rejected, ref_chosen, ref_rejected = logps
    seq = torch.tensor([[0.0, chosen], [0.0, rejected]], dtype=torch.float64)  # [chosen, rejected] x tokens

    def model(**_kw):  # TRL reads log_probs[:, -completion_len:] and a few tensors for its metrics
        z = torch.zeros(2, 1, dtype=torch.float64)
        return types.SimpleNamespace(log_probs=seq[:, 1:], entropy=z, mean_logits=z, is_top1=z.bool())

    model.training = False
    identity = lambda t: t  # noqa: E731 - single process: gathering is the identity
    fake = types.SimpleNamespace(
        model=model, beta=beta, loss_types=[loss_type], loss_weights=[1.0], label_smoothing=label_smoothing,
        f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0, ld_alpha=None, use_weighting=False,
        precompute_ref_logps=True, aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1,
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=identity, gather=identity),
    )
    inputs = {"input_ids": torch.zeros(2, 2, dtype=torch.long), "attention_mask": torch.ones(2, 2, dtype=torch.long),
              "completion_mask": torch.tensor([[0, 1], [0, 1]]),
              "ref_chosen_logps": torch.tensor([ref_chosen], dtype=torch.float64),
              "ref_rejected_logps": torch.tensor([ref_rejected], dtype=torch.float64)}
    return DPOTrainer._compute_loss(fake, model, inputs, False)


def _trl_losses(loss_type: str, beta: float, label_smoothing: float, logps: list[torch.Tensor]) -> torch.Tensor:
    """Per-pair TRL losses. TRL 1.x dropped cDPO's label smoothing from "sigmoid"; cDPO is by
    definition (1 - ls) * DPO(pair) + ls * DPO(pair with chosen and rejected swapped), so that case
    is built from TRL's own DPO loss on both orders."""
    pairs = [[float(t[i]) for t in logps] for i in range(len(logps[0]))]
    if loss_type == "sigmoid" and label_smoothing:
        swap = lambda p: [p[1], p[0], p[3], p[2]]  # noqa: E731
        return torch.stack([(1 - label_smoothing) * _trl_pair_loss("sigmoid", beta, 0.0, p)
                            + label_smoothing * _trl_pair_loss("sigmoid", beta, 0.0, swap(p)) for p in pairs])
    return torch.stack([_trl_pair_loss(loss_type, beta, label_smoothing, p) for p in pairs])


@pytest.mark.parametrize("loss_type,ls", [("sigmoid", 0.0), ("sigmoid", 0.1), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.2)])
def test_losses_equal_trl_on_same_logps(loss_type, ls):
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    logps = [-(torch.rand(16, generator=g, dtype=torch.float64) * 30) for _ in range(4)]
    delta = (logps[0] - logps[2]) - (logps[1] - logps[3])
    ours = preference_losses(delta, 0.1, loss_type, eps=ls, label_smoothing=0.0 if loss_type == "robust" else ls)
    theirs = _trl_losses(loss_type, 0.1, ls, logps).to(ours.dtype)
    assert theirs.std() > 0  # 16 different pairs, not one value repeated
    torch.testing.assert_close(ours, theirs)


# ---------------------------------------------------------------------------------------- KTO


def test_kto_half_loss_at_init_and_gradients():
    beta, lam_d, lam_u = 0.1, 1.0, 1.5
    r = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    r_kl = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, 1, 1, 0, 0, 0])
    losses, z0 = kto_losses(r, r_kl, labels, beta, lam_d, lam_u)
    lam = torch.tensor([lam_d] * 3 + [lam_u] * 3, dtype=torch.float64)
    torch.testing.assert_close(losses, 0.5 * lam)
    assert z0.item() == 0.0
    losses.sum().backward()
    sign = torch.tensor([-1.0] * 3 + [1.0] * 3, dtype=torch.float64)
    torch.testing.assert_close(r.grad, sign * beta * lam * 0.25)  # +-0.025 lambda at beta = 0.1
    assert r_kl.grad is None  # no gradient reaches the reference point


def test_kto_reference_point_is_clamped_mean_and_loss_in_range():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(64, generator=g, dtype=torch.float64) * 50
    labels = torch.rand(64, generator=g) > 0.5
    for shift, expect in [(3.0, None), (-3.0, 0.0)]:
        r_kl = torch.randn(64, generator=g, dtype=torch.float64) + shift
        losses, z0 = kto_losses(r, r_kl, labels, 0.1, 1.0, 2.0)
        assert z0.item() == pytest.approx(r_kl.mean().item() if expect is None else 0.0)
        lam = torch.where(labels, 1.0, 2.0).double()
        assert (losses >= 0).all() and (losses <= lam).all()
        d = torch.tensor([1.0 - 1 / (1 + math.exp(-0.1 * (ri - z0.item()))) if li else 2.0 * (1.0 - 1 / (1 + math.exp(-0.1 * (z0.item() - ri)))) for ri, li in zip(r.tolist(), labels.tolist())], dtype=torch.float64)
        torch.testing.assert_close(losses, d)


def test_kto_objective_loss_is_half_at_init_on_real_batches():
    data = synthetic_prefs(num_train=16, num_val=8, format="unpaired")
    batch = data.collate_fn([data.train[i] for i in range(8)])
    model = BigramLM()
    obj = KTO(beta=0.1, lambda_d=1.0, lambda_u=1.0)
    obj.setup(model, data, None)
    loss, logs = obj.loss(model, batch)
    assert loss.item() == pytest.approx(0.5, abs=1e-6)
    assert logs["z0"] == 0.0


def test_kto_refuses_pair_training_data():
    data = synthetic_prefs(num_train=8, num_val=4, format="pairs")
    with pytest.raises(ConfigError, match="unpaired"):
        KTO().setup(BigramLM(), data, None)


# ------------------------------------------------------------------------------ log-probs, data


def test_sequence_logps_sum_completion_tokens_and_ignore_padding():
    model = BigramLM()
    data = synthetic_prefs(num_train=4, num_val=4, max_extra_len=4, completion_len=3)
    items = [data.train[i] for i in range(4)]
    ids, mask = data.collate_fn(items)
    got = sequence_logps(model, ids, mask)
    for row, rec in enumerate(items + items):
        comp = rec["chosen"] if row < 4 else rec["rejected"]
        seq = list((rec["prompt"] + comp).encode())
        logp = torch.log_softmax(model(torch.tensor([seq[:-1]])), -1)[0]
        n_p = len(rec["prompt"])
        ref = sum(logp[t - 1, seq[t]].item() for t in range(n_p, len(seq)))
        assert got[row].item() == pytest.approx(ref, abs=1e-5)
    assert mask.sum(1).tolist() == [len(r["chosen"]) for r in items] + [len(r["rejected"]) for r in items]


def test_synthetic_prefs_flip_rate_and_clean_validation():
    recs = make_synthetic_pairs(4000, seed=0, flip_rate=0.2)
    assert sum(r["flipped"] for r in recs) / len(recs) == pytest.approx(0.2, abs=0.02)
    wrong = sum(r["true_chosen"] < r["true_rejected"] for r in recs) / len(recs)
    assert 0.17 < wrong < 0.3  # flips plus the annotator's own Bradley-Terry noise
    data = synthetic_prefs(num_train=64, num_val=200, flip_rate=0.2)
    assert all(r["true_chosen"] > r["true_rejected"] for r in data.val.records)
    assert true_reward("aabc") == pytest.approx(2 / 3)
    with pytest.raises(DataError, match="flip_rate"):
        synthetic_prefs(flip_rate=0.5)


def test_kto_collate_pairs_each_prompt_with_the_next_completion():
    data = synthetic_prefs(num_train=6, num_val=4, format="unpaired")
    items = [data.train[i] for i in range(3)]
    ids, mask, labels, kl_ids, kl_mask = data.collate_fn(items)
    for i in range(3):
        kl = bytes(kl_ids[i][kl_mask[i] > 0].tolist()).decode()
        assert kl == items[(i + 1) % 3]["completion"]
        assert bytes(kl_ids[i][: len(items[i]["prompt"])].tolist()).decode() == items[i]["prompt"]
    assert labels.tolist() == [1.0 if r["label"] else 0.0 for r in items]


def test_prefs_jsonl_formats_and_errors(tmp_path):
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("\n".join(json.dumps({"prompt": f"q{i}?", "chosen": "yes", "rejected": "no"}) for i in range(10)))
    b = prefs(files=[str(pairs)], val_fraction=0.2)
    assert b.meta["format"] == "pairs" and len(b.train) == 8 and len(b.val) == 2
    ids, mask = b.collate_fn([b.train[0], b.train[1]])
    assert ids.shape[0] == 4 and mask[0].sum().item() == 3 and mask[2].sum().item() == 2
    kto = prefs(files=[str(pairs)], val_fraction=0.2, format="unpaired")
    assert len(kto.train) == 16 and kto.meta["val_format"] == "pairs"
    unp = tmp_path / "u.jsonl"
    unp.write_text("\n".join(json.dumps({"prompt": "q", "completion": "a" * i, "label": i % 2 == 0}) for i in range(1, 9)))
    assert prefs(files=[str(unp)], val_fraction=0.25).meta["format"] == "unpaired"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "answer": "x"}))
    with pytest.raises(DataError, match="expected keys"):
        prefs(files=[str(bad)])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n{oops\n')
    with pytest.raises(DataError, match="broken.jsonl:2"):
        prefs(files=[str(broken)])
    with pytest.raises(DataError, match="no file matches"):
        prefs(files=[str(tmp_path / "none*.jsonl")])


def test_truncation_keeps_completion_tokens():
    from efficient.data.preferences import PairCollate

    ids, mask = PairCollate(max_len=6)([{"prompt": "abcdefgh", "chosen": "xyz", "rejected": "uvwxyz12"}])
    assert ids.shape[1] == 6
    assert bytes(ids[0][mask[0] > 0].tolist()) == b"xyz"
    assert bytes(ids[1][mask[1] > 0].tolist()) == b"uvwxy" and mask[1].sum() == 5


# ------------------------------------------------------------------------------ training effect


def _train(obj, data, steps: int = 60, lr: float = 0.05, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = BigramLM(seed)
    obj.setup(model, data, None)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    n = len(data.train)
    for step in range(steps):
        idx = [(step * 32 + i) % n for i in range(32)]
        loss, _ = obj.loss(model, data.collate_fn([data.train[i] for i in idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _pref_acc(obj, model, data) -> float:
    out = obj.evaluate(model, data.collate_fn(list(data.val.records)))
    return out["pref_acc"] / out["n"]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "robust", "savage"])
def test_preference_training_learns_the_true_reward(loss_type):
    data = synthetic_prefs(num_train=256, num_val=128, flip_rate=0.1, seed=1)
    beta = 0.5
    obj = Preference(loss_type=loss_type, beta=beta, eps=0.1)
    model = BigramLM()
    obj.setup(model, data, None)
    assert _pref_acc(obj, model, data) == 0.0  # Delta == 0 everywhere before training
    model = _train(obj, data)
    assert _pref_acc(obj, model, data) > 0.9


def test_kto_training_learns_the_true_reward():
    data = synthetic_prefs(num_train=256, num_val=128, flip_rate=0.1, seed=1, format="unpaired")
    obj = KTO(beta=0.5)
    model = _train(obj, data)
    assert _pref_acc(obj, model, data) > 0.9
