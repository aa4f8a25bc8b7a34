"""Bitwise fingerprints of every zoo model: outputs, gradients, buffers and STATA statistics.

`compute_case(case)` builds one zoo model at a fixed seed on a small fixed batch and runs it in
each of its modes (train / eval, and for STATA models before, during and after the keep-ratio
warm-up), recording per tensor its shape, dtype, float64 sum and a SHA-256 of its bytes (plus the
full values of small outputs). Equal hashes mean bitwise-equal tensors, so a refactor that must
not change numerics is checked by comparing fingerprints with the committed reference file
`tests/data/zoo_reference.json` (see `test_zoo_bitwise.py`).

Regenerate the reference (only when numerics are meant to change) with
`python tests/zoo_reference.py`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REFERENCE = Path(__file__).parent / "data" / "zoo_reference.json"
BATCH = 2
FULL_VALUES_MAX = 64  # outputs with at most this many elements are stored in full, for diagnosis

# STATA zoo entries warm their keep ratio up from epoch 10 over 60 epochs: 0 is before the warm-up,
# 40 half-way, 100 after it. Eval mode always uses the target ratio.
WARMUP_PROGRESS = {"before": 0.0, "mid": 40.0, "done": 100.0}


@dataclass(frozen=True)
class Case:
    """One model build: zoo `name` with `overrides`, run in `modes` (train:<progress> or eval)."""

    id: str
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    modes: tuple[str, ...] = ("train", "eval")
    seq_len: int = 16  # token models only
    note: str = ""


STATA_MODES = ("train:before", "train:mid", "train:done", "eval")
SPIKING = {"backend": "torch"}  # the eager neuron path: no compile step, same numerics on every CPU

CASES: list[Case] = [
    Case("bilipnet-digits", "bilipnet-digits"),
    Case("mlp-tiny", "mlp-tiny"),
    Case("mlp-small", "mlp-small"),
    Case("mlp-base", "mlp-base"),
    Case("ee-gpt-tiny", "ee-gpt-tiny"),
    Case("ee-gpt-small", "ee-gpt-small"),
    # the paper-shaped GPTs do not fit a test machine: same depth, exits, head kinds, vocabulary and
    # init, narrower layers
    Case("ee-gpt-1.3b", "ee-gpt-1.3b", {"n_embd": 64, "n_head": 4, "mlp_hidden": 128},
         note="width shrunk to 64 (1.3B params do not fit a test run)"),
    Case("ee-gpt-7b", "ee-gpt-7b", {"n_embd": 64, "n_head": 4, "mlp_hidden": 128},
         note="width shrunk to 64 (7B params do not fit a test run)"),
    Case("stable-snn-digits", "stable-snn-digits", dict(SPIKING)),
    Case("stable-snn-vgg5", "stable-snn-vgg5", dict(SPIKING)),
    Case("stable-snn-vgg11", "stable-snn-vgg11", dict(SPIKING)),
    Case("stable-snn-wrn16", "stable-snn-wrn16", dict(SPIKING)),
    Case("spikformer-tiny", "spikformer-tiny", dict(SPIKING)),
    Case("spikformer-tiny/auto", "spikformer-tiny", {}, note="neuron backend auto (model-wide choice)"),
    Case("spikformer-4-384", "spikformer-4-384", dict(SPIKING)),
    Case("spikformer-8-512", "spikformer-8-512", {**SPIKING, "img_size": 64},
         note="64 px instead of 224 (4x4 tokens): the smallest input that still prunes in every block"),
    Case("sdt-2-512", "sdt-2-512", dict(SPIKING)),
    Case("spikformer-tiny-stata", "spikformer-tiny-stata", {**SPIKING, "keep_warmup_start": 10.0, "keep_warmup_epochs": 60.0},
         STATA_MODES),
    Case("spikformer-stata", "spikformer-stata", dict(SPIKING), STATA_MODES),
    Case("spikformer-8-512-stata", "spikformer-8-512-stata", {**SPIKING, "img_size": 64}, STATA_MODES,
         note="64 px instead of 224 (16 -> 12 -> 9 -> 7 patch tokens)"),
    Case("sdt-stata", "sdt-stata", dict(SPIKING), STATA_MODES),
    # the STATA switches the zoo entries leave at their defaults
    Case("stata/fuse", "spikformer-tiny-stata", {**SPIKING, "fuse_pruned": True}, ("train:done", "eval")),
    Case("stata/after-block", "spikformer-tiny-stata", {**SPIKING, "prune_point": "after_block"}, ("train:done", "eval")),
    Case("stata/shared-anchor-raw", "spikformer-tiny-stata", {**SPIKING, "anchor": "shared", "score": "raw"},
         ("train:done", "eval")),
    Case("stata/no-anchor", "spikformer-tiny-stata", {**SPIKING, "anchor": "off", "keep_ratio": [0.6, 0.5]},
         ("train:done", "eval")),
    Case("stata/not-lean", "spikformer-tiny-stata", {**SPIKING, "lean_inference": False}, ("eval",)),
    Case("sdt/fuse-after-block", "sdt-stata", {**SPIKING, "embed_dim": 64, "num_heads": 4, "fuse_pruned": True,
                                                "prune_point": "after_block"}, ("train:done", "eval")),
    # the DVS entries at 64 px (4x4 tokens) and T=2 instead of 128 px and T=16: same layers and init
    Case("spikformer-2-256-dvs", "spikformer-2-256-dvs", {**SPIKING, "img_size": 64, "timesteps": 2},
         note="64 px, T=2 instead of 128 px, T=16"),
    Case("spikformer-2-256-dvs-stata", "spikformer-2-256-dvs-stata", {**SPIKING, "img_size": 64, "timesteps": 2},
         STATA_MODES, note="64 px, T=2 (17 -> 12 -> 9 tokens)"),
    Case("sdt-2-256-dvs", "sdt-2-256-dvs", {**SPIKING, "img_size": 64, "timesteps": 2}, note="64 px, T=2"),
    Case("sdt-2-256-dvs-stata", "sdt-2-256-dvs-stata", {**SPIKING, "img_size": 64, "timesteps": 2}, STATA_MODES,
         note="64 px, T=2"),
]


def fingerprint(t: torch.Tensor, full: bool = False, digest: int = 64) -> str | dict[str, Any]:
    """`"dtype[shape] sha256 sum"`: the SHA-256 of the bytes of `t` (first `digest` hex digits) and
    its float64 sum. With `full`, a dict that also holds the values of a small tensor."""
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    sha = hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:digest]
    total = float(t.double().sum()) if t.numel() else 0.0
    fp = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} {sha} {total!r}"
    if full and t.numel() <= FULL_VALUES_MAX:
        return {"fp": fp, "values": t.double().flatten().tolist()}
    return {"fp": fp} if full else fp


def _short(t: torch.Tensor) -> str:
    """Fingerprint with a 64-bit digest: enough to tell tensors apart, a quarter of the size."""
    return fingerprint(t, digest=16)  # type: ignore[return-value]


def checkpoint_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """`model.parameters()` in their (optimizer) order, each named by its checkpoint key: the
    state-dict key, which a module may keep stable when a parameter moves between submodules."""
    key = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
    return [(key[id(p)], p) for p in model.parameters()]


def _inputs(model: torch.nn.Module, name: str, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    from efficient.zoo import get_entry

    spec = get_entry(name).input_spec
    g = torch.Generator().manual_seed(1234)
    if spec.dtype == "long":
        vocab = model.vocab_size
        x = torch.randint(0, vocab, (BATCH, seq_len), generator=g)
        return x, torch.randint(0, vocab, (BATCH, seq_len), generator=g)
    shape = list(spec.shape)
    if hasattr(model, "patch_embed"):  # an image-size override
        shape[-2:] = [model.patch_embed.img_size] * 2
    x = torch.rand(BATCH, *shape, generator=g) * 2  # spiking stems need drive to fire
    return x, torch.randint(0, 10, (BATCH,), generator=g)


def _stata_record(model: torch.nn.Module) -> dict[str, Any]:
    """What the STATA objective and its logs read after a forward: scores and statistics."""
    from efficient.models.stata import stata_outputs

    out = stata_outputs(model)
    scores, stats = out.scores, out.stats
    rec: dict[str, Any] = {}
    for i, (s, c) in enumerate(scores):
        rec[f"scores.{i}.s"], rec[f"scores.{i}.c"] = _short(s), _short(c)
    for k, v in sorted(stats.items()):
        if k == "kept_idx":
            for i, idx in enumerate(v):
                rec[f"stats.kept_idx.{i}"] = _short(idx)
        else:
            rec[f"stats.{k}"] = v
    return rec


def _run_mode(model: torch.nn.Module, case: Case, mode: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    from efficient.objectives.stata import Stata

    rec: dict[str, Any] = {}
    stata = mode.startswith("train:")
    if mode == "eval":
        model.eval()
        with torch.no_grad():
            out = model(x)
        rec["output"] = fingerprint(out, full=True)
    else:
        model.train()
        if stata:
            from efficient.models.progress import inform_progress

            inform_progress(model, WARMUP_PROGRESS[mode.split(":")[1]])
            seen: list[torch.Tensor] = []
            hook = model.register_forward_hook(lambda m, a, out: seen.append(out))
            loss, logs = Stata(label_smoothing=0.1).loss(model, (x, y))
            hook.remove()
            rec["output"] = fingerprint(seen[0], full=True)
            rec["logs"] = {k: v for k, v in sorted(logs.items())}
        else:
            out = model(x)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out.dtype)
            loss = (out * w).sum()
            rec["output"] = fingerprint(out, full=True)
        rec["loss"] = fingerprint(loss, full=True)
        loss.backward()
        rec["grads"] = {n: _short(p.grad) for n, p in checkpoint_named_parameters(model) if p.grad is not None}
        params = {id(p) for p in model.parameters()}
        rec["buffers"] = {n: _short(b) for n, b in model.named_buffers() if id(b) not in params}  # BN statistics
    if case.name.startswith(("spikformer", "sdt")) and (stata or mode == "eval"):
        rec["stata"] = _stata_record(model)
    return rec


def compute_case(case: Case) -> dict[str, Any]:
    """Fingerprints of one case: state-dict keys and initial weights, then every mode from them."""
    from efficient.zoo import create

    torch.manual_seed(0)
    model = create(case.name, **case.overrides)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _inputs(model, case.name, case.seq_len)
    rec: dict[str, Any] = {
        "name": case.name,
        "overrides": case.overrides,
        "state_dict_keys": list(init),
        "parameter_names": [n for n, _ in checkpoint_named_parameters(model)],
        "init": hashlib.sha256("".join(fingerprint(v) for v in init.values()).encode()).hexdigest(),
        "modes": {},
    }
    for mode in case.modes:
        model.load_state_dict(init)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        rec["modes"][mode] = _run_mode(model, case, mode, x, y)
    return rec


def compute_all(cases: list[Case] = CASES) -> dict[str, Any]:
    return {c.id: compute_case(c) for c in cases}


def main() -> None:
    torch.set_num_threads(1)  # CPU reductions are reproducible at a fixed thread count
    ids = sys.argv[1:]
    cases = [c for c in CASES if not ids or c.id in ids]
    data = json.loads(REFERENCE.read_text()) if ids and REFERENCE.exists() else {}
    for c in cases:
        print(c.id, flush=True)
        data[c.id] = compute_case(c)
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({k: data[k] for k in [c.id for c in CASES] if k in data}, indent=1)
    REFERENCE.write_text(re.sub(r"\[\s+([^\[\]{}\"]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n")


if __name__ == "__main__":
    main()
