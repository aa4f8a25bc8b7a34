"""Numerical fingerprints of every zoo model: outputs, gradients, buffers and STATA statistics.

`compute_case(case)` builds one zoo model at a fixed seed on a small fixed batch and runs it in
each of its modes (train / eval, and for STATA models before, during and after the keep-ratio
warm-up). Each tensor is recorded by its dtype, shape and three float64 statistics (sum, L1 norm,
and a dot product with a fixed +-0.5 probe, which sees permutations and sign flips that keep sum
and norm); small outputs are kept in full. `compare(want, got)` checks a record against the
committed reference `tests/data/zoo_reference.json` (see `test_zoo_reference.py`): exactly for
what is exact on every CPU (state-dict keys and order, shapes, dtypes, integers such as kept
token indices and token counts), and within `RTOL` of each tensor's L1 norm for the floats.

Why float64: BLAS, oneDNN and ATen's SIMD kernels sum in an order that depends on the CPU (AVX-512,
AVX2, SSE, ...), so fp32 results differ in the last bits from machine to machine; in a spiking
model such a difference flips a spike whose membrane sat within an ulp of threshold, and one flip
moves every later layer. In float64 the same reordering moves values by ~1e-16 relative, ten orders
of magnitude below what a spike flip needs, so the models are built and run with float64 as the
default dtype (weights are drawn in float64 too: fp32 `randn` itself differs across SIMD levels).
The fp32-only paths (the fused LIF loop) still run, on float64 inputs rounded to fp32.

Regenerate the reference (only when numerics are meant to change) with
`python tests/zoo_reference.py`; `python tests/zoo_reference.py --check` prints, per case, the
largest difference from it in units of the tolerance (run it under another CPU capability, e.g.
`ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41`, to see how much room the tolerance leaves).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

REFERENCE = Path(__file__).parent / "data" / "zoo_reference.json"
BATCH = 2
FULL_VALUES_MAX = 64  # outputs with at most this many elements are stored in full, for diagnosis
DTYPE = torch.float64
# Tolerance for every float, relative to the L1 norm of the tensor it belongs to (to the magnitude
# of a scalar). Measured across CPU capabilities (native AVX-512, ATEN_CPU_CAPABILITY=avx2, and
# default with ONEDNN_MAX_CPU_ISA=SSE41) and 1 vs 2 threads, the largest difference of any float
# of any case is below 1e-13 of its scale (see tests/README.md); a real behaviour change (another
# reset, a swapped op, an fp32 cast in a float64 path) moves values by 1e-7 or far more.
RTOL = 1e-10
# An absolute floor on top: a gradient that is zero in exact arithmetic (a bias feeding BatchNorm)
# is pure rounding noise, ~1e-16 of the gradients around it, with no digits to keep. So within a
# group of tensors (the gradients, or the buffers, of one pass) differences below NOISE times the
# group's largest L1 norm are not compared, and below ATOL nowhere.
ATOL = 1e-12
NOISE = 1e-14

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
    rtol: float | None = None  # a looser tolerance for a case that runs an fp32-only path (None: RTOL)


# a spiking transformer at 64 channels (4 heads) instead of 256-512; a stable-SNN CIFAR network at
# T=4 (the WRN at widening 1): the same units, blocks and modes at a fraction of the time, for
# tests whose property does not depend on the width or the number of steps
NARROW = {"embed_dim": 64, "num_heads": 4}
NARROW_CNN = {"timesteps": 4}


def narrow(case: Case) -> Case:
    """`case` at NARROW width when it is a spiking transformer wider than its tiny variant, a
    stable-SNN CIFAR network at NARROW_CNN."""
    if case.name.startswith(("spikformer", "sdt", "spikingformer", "qkformer")) and "tiny" not in case.name:
        extra = NARROW
    elif case.name.startswith("stable-snn-vgg"):
        extra = NARROW_CNN
    elif case.name.startswith("stable-snn-wrn"):
        extra = {**NARROW_CNN, "widen": 1}
    else:
        return case
    if any(k in case.overrides for k in extra):
        return case
    return dataclasses.replace(case, overrides={**case.overrides, **extra})


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
    # transformers' Llama (4 x 64, GQA 4/2 heads, byte vocabulary) with a shared-head exit at layer 2
    Case("hf", "hf"),
    Case("stable-snn-digits", "stable-snn-digits", dict(SPIKING)),
    # the VGGs' two 4096-wide spiking FC layers and full conv widths (61M params for VGG-11) would
    # dominate the suite in float64: same layers, neurons and init, narrower
    Case("stable-snn-vgg5", "stable-snn-vgg5", {**SPIKING, "fc_dim": 256, "width": 0.25},
         note="fc 4096 -> 256, conv widths x0.25"),
    Case("stable-snn-vgg11", "stable-snn-vgg11", {**SPIKING, "fc_dim": 256, "width": 0.25},
         note="fc 4096 -> 256, conv widths x0.25"),
    Case("stable-snn-wrn16", "stable-snn-wrn16", dict(SPIKING)),
    Case("spikformer-tiny", "spikformer-tiny", dict(SPIKING)),
    # auto runs the fused fp32 LIF loop (compiled where a C++ compiler exists): its surrogate
    # gradient uses a vectorised exp whose last bit depends on the SIMD level, so the gradients
    # agree to ~1e-8 of their norm across CPUs (forward spikes are exact: the charge is * and +)
    Case("spikformer-tiny/auto", "spikformer-tiny", {}, note="neuron backend auto (model-wide choice)", rtol=1e-5),
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
    # QKFormer: the CIFAR entries at 16 px (QKTA on 16x16 and 8x8 tokens, SSA on 4x4), the ImageNet
    # ones at 64 px (16x16, 8x8, 4x4) and narrower, the DVS one at 64 px and T=2
    Case("qkformer-tiny", "qkformer-tiny", dict(SPIKING)),
    Case("qkformer-4-384", "qkformer-4-384", {**SPIKING, "img_size": 16}, note="16 px instead of 32"),
    *[Case(f"qkformer-10-{d}", f"qkformer-10-{d}", {**SPIKING, "img_size": 64, "embed_dim": 96},
           note="64 px instead of 224, width 96") for d in (384, 512, 768)],
    Case("qkformer-2-256-dvs", "qkformer-2-256-dvs", {**SPIKING, "img_size": 64, "timesteps": 2},
         note="64 px, T=2 instead of 128 px, T=16"),
    Case("qkformer-tiny-stata", "qkformer-tiny-stata", {**SPIKING, "keep_warmup_start": 10.0, "keep_warmup_epochs": 60.0},
         STATA_MODES),
    Case("qkformer-4-384-stata", "qkformer-4-384-stata", {**SPIKING, "img_size": 16}, STATA_MODES,
         note="16 px instead of 32 (16 -> 12 -> 9 patch tokens)"),
    Case("qkformer/token-score", "qkformer-tiny-stata", {**SPIKING, "stata_score": "token"}, ("train:done", "eval")),
    # Spikingformer: the ImageNet entries at 64 px (4x4 tokens), the widest one also narrower
    Case("spikingformer-tiny", "spikingformer-tiny", dict(SPIKING)),
    Case("spikingformer-4-384", "spikingformer-4-384", dict(SPIKING)),
    Case("spikingformer-8-384", "spikingformer-8-384", {**SPIKING, "img_size": 64}, note="64 px instead of 224"),
    Case("spikingformer-8-512", "spikingformer-8-512", {**SPIKING, "img_size": 64, "embed_dim": 128},
         note="64 px instead of 224, width 512 -> 128"),
    Case("spikingformer-8-768", "spikingformer-8-768", {**SPIKING, "img_size": 64, "embed_dim": 128},
         note="64 px instead of 224, width 768 -> 128"),
    Case("spikingformer-2-256-dvs", "spikingformer-2-256-dvs", {**SPIKING, "img_size": 64, "timesteps": 2},
         note="64 px, T=2 instead of 128 px, T=16"),
    Case("spikingformer-tiny-stata", "spikingformer-tiny-stata", {**SPIKING, "keep_warmup_start": 10.0,
                                                                  "keep_warmup_epochs": 60.0}, STATA_MODES),
    Case("spikingformer-stata", "spikingformer-stata", dict(SPIKING), STATA_MODES),
    # Meta-SpikeFormer (SDT v2): the ImageNet / CIFAR / DVS entries narrower (conv stages 8-16-32, SDSA blocks
    # at 64 and 80; same stages, blocks, strides and init), the ImageNet and DVS ones at 64 px, T=2
    Case("sdt-v2-tiny", "sdt-v2-tiny", dict(SPIKING)),
    *[Case(f"sdt-v2-8-{d}", f"sdt-v2-8-{d}", {**SPIKING, "img_size": 64, "timesteps": 2, "embed_dim": 64, "last_dim": 80},
           note="64 px, T=2, widths 64/80") for d in (256, 384, 512)],
    Case("sdt-v2-cifar", "sdt-v2-cifar", {**SPIKING, "timesteps": 2, "embed_dim": 64, "last_dim": 80},
         note="T=2, widths 64/80 instead of 256/360"),
    Case("sdt-v2-dvs", "sdt-v2-dvs", {**SPIKING, "img_size": 64, "timesteps": 2, "embed_dim": 64, "last_dim": 80},
         note="64 px, T=2, widths 64/80"),
    Case("sdt-v2-tiny-stata", "sdt-v2-tiny-stata", {**SPIKING, "keep_warmup_start": 10.0, "keep_warmup_epochs": 60.0},
         STATA_MODES),
    Case("sdt-v2-stata", "sdt-v2-stata", {**SPIKING, "timesteps": 2, "embed_dim": 64, "last_dim": 80},
         STATA_MODES, note="T=2, widths 64/80 (65 -> 46 -> 33 -> 24 tokens)"),
    Case("sdt-v2/fuse-after-block", "sdt-v2-tiny-stata", {**SPIKING, "fuse_pruned": True, "prune_point": "after_block"},
         ("train:done", "eval")),
]



_PROBE = torch.empty(0, dtype=torch.float64)


def _probe(n: int) -> torch.Tensor:
    """Fixed weights in [-0.5, 0.5) from integer hashing: exact, the same on every machine (entry i
    does not depend on n, so one long probe is cut to length)."""
    global _PROBE
    if len(_PROBE) < n:
        i = torch.arange(max(n, 2 * len(_PROBE)), dtype=torch.int64)
        _PROBE = ((i * 2654435761) % 4294967296).to(torch.float64) / 4294967296 - 0.5
    return _PROBE[:n]


def fingerprint(t: torch.Tensor, full: bool = False) -> str | dict[str, Any]:
    """A float tensor as `"float64[shape] ~ sum l1 dot"` (compared within RTOL); an integer or bool
    tensor as `"int64[shape] = sha256 sum"` (compared exactly). With `full`, a dict that also holds
    the values of a small tensor."""
    t = t.detach().cpu().contiguous()
    head = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    if t.is_floating_point():
        x = t.double().reshape(-1)
        stats = (x.sum().item(), x.abs().sum().item(), (x * _probe(x.numel())).sum().item()) if x.numel() else (0.0, 0.0, 0.0)
        fp = f"{head} ~ " + " ".join(repr(float(v)) for v in stats)
    else:
        raw = t.reshape(-1).to(torch.int64) if t.dtype == torch.bool else t.reshape(-1)
        sha = hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]
        fp = f"{head} = {sha} {int(raw.sum()) if raw.numel() else 0}"
    if full and t.numel() <= FULL_VALUES_MAX:
        return {"fp": fp, "values": t.double().flatten().tolist()}
    return {"fp": fp} if full else fp


def _parse(fp: str) -> tuple[str, str, str] | None:
    """(head, kind, rest) of a fingerprint string, or None for any other string."""
    m = re.fullmatch(r"(\w+\[[\d, ]*\]) ([~=]) (.*)", fp)
    return (m.group(1), m.group(2), m.group(3)) if m else None


def _l1(fp: Any) -> float:
    """The L1 norm in a float fingerprint string, 0 for anything else."""
    p = _parse(fp) if isinstance(fp, str) else None
    return float(p[2].split()[1]) if p is not None and p[1] == "~" else 0.0


def compare(want: Any, got: Any, path: str = "", worst: list[float] | None = None, rtol: float | None = None,
            floor: float = ATOL) -> list[str]:
    """Where record `got` differs from `want`: exact for keys, strings, integers and integer
    tensors; within RTOL of the scale for floats. `worst` (a one-element list), when given, is
    raised to the largest float difference seen, in units of the tolerance RTOL * scale + floor
    (ATOL, or NOISE times the largest L1 norm of the tensors beside it)."""
    worst = worst if worst is not None else [0.0]
    rtol = RTOL if rtol is None else rtol

    def close(w: float, g: float, scale: float, where: str) -> list[str]:
        err = abs(g - w)
        if not math.isfinite(err):
            return [] if (w == g or (math.isnan(w) and math.isnan(g))) else [f"{where}: want {w!r}, got {g!r}"]
        units = err / (rtol * scale + floor)
        worst[0] = max(worst[0], units)
        return [] if units <= 1 else [f"{where}: want {w!r}, got {g!r} (off by {err / scale if scale else err:.2e} of {scale:.3g})"]

    if isinstance(want, dict) and isinstance(got, dict):
        group = max([_l1(v) for v in want.values()], default=0.0)
        floor = max(floor, NOISE * group)  # a group of tensors: its noise floor
        out = [f"{path}.{k}: missing" for k in want if k not in got] + [f"{path}.{k}: unexpected" for k in got if k not in want]
        if list(want) != list(got) and not out:
            out.append(f"{path}: keys in another order")
        for k in want:
            if k in got:
                if k == "values" and isinstance(want[k], list) and isinstance(got[k], list) and len(want[k]) == len(got[k]):
                    scale = max([abs(v) for v in want[k] + got[k]], default=0.0)
                    out += [e for i, (w, g) in enumerate(zip(want[k], got[k])) for e in close(w, g, scale, f"{path}.values[{i}]")]
                else:
                    out += compare(want[k], got[k], f"{path}.{k}", worst, rtol, floor)
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: want {len(want)} items, got {len(got)}"]
        return [e for i, (w, g) in enumerate(zip(want, got)) for e in compare(w, g, f"{path}[{i}]", worst, rtol, floor)]
    if isinstance(want, str) and isinstance(got, str):
        pw, pg = _parse(want), _parse(got)
        if pw is None or pg is None or pw[1] == "=" or pw[:2] != pg[:2]:
            return [] if want == got else [f"{path}: want {want!r}, got {got!r}"]
        (sw, lw, dw), (sg, lg, dg) = (tuple(float(v) for v in p[2].split()) for p in (pw, pg))
        scale = max(lw, lg)
        return close(sw, sg, scale, f"{path} (sum)") + close(lw, lg, scale, f"{path} (L1)") + close(dw, dg, scale, f"{path} (probe)")
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return close(want, float(got), max(abs(want), abs(got)), path)
    return [] if (type(want) is type(got) and want == got) else [f"{path}: want {want!r}, got {got!r}"]


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
        rec[f"scores.{i}.s"], rec[f"scores.{i}.c"] = fingerprint(s), fingerprint(c)
    for k, v in sorted(stats.items()):
        if k == "kept_idx":
            for i, idx in enumerate(v):
                rec[f"stats.kept_idx.{i}"] = fingerprint(idx)
        else:  # counts kept on the device (no host sync in the step) are read here
            rec[f"stats.{k}"] = v.item() if isinstance(v, torch.Tensor) else v
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
            rec["logs"] = {k: float(v) for k, v in sorted(logs.items())}
        else:
            out = model(x)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out.dtype)
            loss = (out * w).sum()
            rec["output"] = fingerprint(out, full=True)
        rec["loss"] = fingerprint(loss, full=True)
        loss.backward()
        rec["grads"] = {n: fingerprint(p.grad) for n, p in checkpoint_named_parameters(model) if p.grad is not None}
        params = {id(p) for p in model.parameters()}
        rec["buffers"] = {n: fingerprint(b) for n, b in model.named_buffers() if id(b) not in params}  # BN statistics
    if case.name.startswith(("spikformer", "sdt", "qkformer", "spikingformer")) and (stata or mode == "eval"):
        rec["stata"] = _stata_record(model)
    return rec


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build and run under `dtype` as torch's default floating dtype, restoring it after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def compute_case(case: Case, perturb: Callable[[torch.nn.Module], None] | None = None) -> dict[str, Any]:
    """Fingerprints of one case: state-dict keys and initial weights, then every mode from them.
    `perturb(model)`, when given, edits the fresh model before anything is recorded (tests use it
    to show which changes the comparison tolerates and which it catches)."""
    from efficient.zoo import create

    with default_dtype(DTYPE):
        torch.manual_seed(0)
        model = create(case.name, **case.overrides)
        if perturb is not None:
            perturb(model)
        init = {k: v.clone() for k, v in model.state_dict().items()}
        x, y = _inputs(model, case.name, case.seq_len)
        rec: dict[str, Any] = {
            "name": case.name,
            "overrides": case.overrides,
            "state_dict_keys": list(init),
            "parameter_names": [n for n, _ in checkpoint_named_parameters(model)],
            "init": {k: fingerprint(v) for k, v in init.items()},
            "modes": {},
        }
        for mode in case.modes:
            model.load_state_dict(init)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            rec["modes"][mode] = _run_mode(model, case, mode, x, y)
    return json.loads(json.dumps(rec))  # the same float / list round trip as the file


def compute_all(cases: list[Case] = CASES) -> dict[str, Any]:
    return {c.id: compute_case(c) for c in cases}


def _write(data: dict[str, Any]) -> None:
    """Write the reference atomically, short numeric lists kept on one line."""
    text = json.dumps({k: data[k] for k in [c.id for c in CASES] if k in data}, indent=1)
    text = re.sub(r"\[\s+([^\[\]{}\"]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=REFERENCE.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the reference is an ordinary tracked file
    os.replace(tmp, REFERENCE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Regenerate (default) or check the zoo reference file.")
    p.add_argument("ids", nargs="*", help="case ids (default: all)")
    p.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = p.parse_args(argv)
    unknown = sorted(set(args.ids) - {c.id for c in CASES})
    if unknown:
        p.error(f"unknown case ids {unknown}; known: {[c.id for c in CASES]}")
    cases = [c for c in CASES if not args.ids or c.id in args.ids]
    data = json.loads(REFERENCE.read_text(encoding="utf-8")) if REFERENCE.exists() and (args.ids or args.check) else {}
    failed = 0
    for c in cases:
        got = compute_case(c)
        if args.check:
            worst = [0.0]
            problems = compare(data[c.id], got, worst=worst, rtol=c.rtol) if c.id in data else ["not in the reference"]
            failed += bool(problems)
            print(f"{c.id:28s} {'FAIL' if problems else 'ok  '} largest float difference {worst[0]:.3g} x tolerance", flush=True)
            for line in problems[:5]:
                print("    " + line)
        else:
            print(c.id, flush=True)
            data[c.id] = got
    if not args.check:
        _write(data)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
