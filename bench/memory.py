"""Training that fits: the bytes one training step keeps for backward, its peak memory and its time,
for our memory levels (`efficient.memory.optimize`: none, bits, recompute) against spikingjelly 2.0
plain and spikingjelly 2.0 with `memopt.optimize_memory(level=1, compress=True)`.

    python bench/memory.py                                   # the issue's grid (long: run on an idle machine)
    python bench/memory.py --quick                           # batch 2, T 2 and 4, 8-512 at 64 px: a smoke test
    python bench/memory.py --probes memory.json              # reuse an earlier run's checks and probes
    python bench/memory.py --json memory.json --plot memory_vs_T.png --budget-gb 16 --max-gb 18

A step is forward + cross-entropy of the logits (averaged over T where a model returns them per
step) + backward, with the parameters' gradients set to None before it (as `zero_grad` does), no
optimizer. Architectures (ours from the zoo, the peer from spikingjelly's model zoo, matched as its
builders allow; the run prints what differs): spikformer-4-384 (32 px, batch 64), spikformer-8-512
(224 px, batch 8), sdt-2-512 (32 px, batch 64), stable-snn-vgg11 (32 px, batch 64), each at T=4 and
T=16.

Saved bytes: `efficient.memory.measure.activation_memory(model, x, loss_fn=cross-entropy,
backward=False)`, the same call on both libraries' models. Its saved-tensor hooks see every tensor
autograd keeps during forward + loss and count each storage once (`nbytes`; views and repeated saves
of one tensor count once), leaving out parameters and buffers; a spike our `bits`/`recompute` levels
keep as bits counts its packed record (the level's own hooks report it, since saved-tensor hooks do
not nest). spikingjelly's memopt keeps its compressed inputs as ordinary uint8 tensors saved by
`torch.utils.checkpoint`, which the outer hooks see.

Peak memory. Each (architecture, implementation, T, batch) runs in a fresh subprocess: build the
model (and memopt's own probe forward), allocate the inputs, run one warm-up step (one-off
allocations: lazily compiled kernels, allocator growth), free the gradients, `gc` and `malloc_trim`,
reset the kernel's peak-RSS mark (`/proc/self/clear_refs` "5" resets VmHWM, Linux >= 4.0), read RSS
(the baseline: model, its inputs, the interpreter), run one step and report VmHWM - baseline. Where
clear_refs cannot be written, the first step is measured instead from `ru_maxrss`, and the cell says
so. A watchdog thread stops the case if RSS passes --max-gb.

Step time: the measured step and `--steps - 1` more, the median (after the warm-up step). Cells in
separate processes minutes apart see the machine at different speeds; `--beside` times the
implementations side by side instead (one process per architecture and T, the steps in rotation,
the median of per-round ratios), which is the comparison to read for a time ratio. It also counts
each step's minor page faults and system CPU seconds; `--host-memory reuse` runs it with glibc keeping
freed blocks (`train.host_memory: reuse`), without the faults a CPU step pays and a GPU's caching
allocator does not. The saved bytes of a cell are counted in one further forward (the counting hook
slows a step, so no timed step has it).

Cells that cannot run here (estimated peak over --max-gb, or an estimated step over --max-step-s)
are not run; their saved bytes are exact all the same. A probe process per implementation measures
the saved bytes at batch 2, 3 and 4 and at three T; saved bytes are affine in the batch (a fixed part:
BatchNorm's per-channel batch statistics, memopt's cloned buffers; the rest per sample) and in T. The
script checks both with exact integers (batch 4 against the line through 2 and 3; the middle T against
the line through the other two; for our `none` a batch mismatch stops the run) and extrapolates along
them: a cell not run shows "(scaled)", or "(probe)" where the probe measured that very point. Batch 1
is left out: there an image repeated over T can stay a stride-0 view where a larger batch copies it.
A cell that runs counts its saved bytes again and shows any difference from the probe's figure. The
estimated peak of a cell is 1.25 x its saved bytes + its weights and gradients + 1 GiB (interpreter
and libraries); its estimated time scales the probe's step time (batch 3) by T x batch.

"What it buys": for spikformer-4-384 at batch 64 and spikformer-8-512 at batch 32, the largest T whose
saved bytes fit --budget-gb (GiB), per implementation, from the affine fit in T; --plot draws saved
GiB against T with the budget line. Weights, gradients and optimizer state come on top of the budget.

Correctness, before any timing, per architecture at batch 2: our `bits` gives the loss and every
gradient of `none` bitwise; `recompute` within 1e-5 relative (each gradient's largest difference over
its own largest value, floored at 1e-3 of the largest gradient of the pass, since a bias that feeds
BatchNorm has a gradient of rounding noise); spikingjelly memopt against spikingjelly plain likewise.

spikingjelly's memopt levels 2-4 search split points by measuring peak CUDA memory
(`torch.cuda.max_memory_allocated`) and refuse a CPU model; they are left out. Level 1 is
`optimize_memory(model, targets, lambda m: m(example), level=1, compress=True)`, with the default
`checkpoint_budget="memory"` (every outermost module of a target type is checkpointed). It runs the
example forward once and decides per module whether its first input is binary (all 0/1 on that
example); those inputs are then kept as bits for good. So the decision depends on the example: an
all-zero dummy makes every input look binary (on spikformer-4-384 all 9 checkpointed modules then
pack their input, real-valued block inputs included, against 4 with images), and an input that is all
zeros on the example (behind a layer silent at initialisation) is judged binary and packed even when it
later carries other values (on the VGG, the classifier's second Linear and its LIF: packed or not
depending on which random batch is the example). The example
here is one fixed batch of 4 random images, the same in every process, so that a cell and its probe
make the same decisions; the count of packed inputs is printed. Targets per architecture are in PEERS
below: the model's own block type where it has one (as spikingjelly's Spikformer builder does) and
the stem's conv-BN-LIF units, whose spike inputs are what compression acts on.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

LEVELS = ("none", "bits", "recompute")
IMPLS = ("none", "bits", "bits-keep-membrane", "recompute", "recompute-budget", "recompute-peak", "recompute-peak-lean",
         "recompute-whole-stem", "recompute-keep-membrane",
         "recompute-whole-conv", "recompute-checkpoint", "sj", "sj-memopt")
RECOMPUTE_BUDGET = 0.2  # recompute-budget: at most this fraction of none's saved bytes (planned on the step's own batch)
LABEL = {"none": "ours none", "bits": "ours bits", "recompute": "ours recompute", "sj": "spikingjelly",
         "recompute-budget": f"ours recompute, budget {RECOMPUTE_BUDGET:.0%}",
         "recompute-peak": f"ours recompute, peak budget {RECOMPUTE_BUDGET:.0%}", "sj-memopt": "spikingjelly memopt L1",
         "recompute-whole-stem": "ours recompute, stem as one unit",
         "recompute-keep-membrane": "ours recompute, reruns keep H",
         "bits-keep-membrane": "ours bits, fused units keep H",
         "recompute-whole-conv": "ours recompute, stem convolutions' backward whole",
         "recompute-checkpoint": "ours recompute, every unit under torch's checkpoint",
         "recompute-in-backward": "ours recompute, SGD update inside backward",
         "recompute-wide-chunks": "ours recompute, a quarter as many chunks"}


def label(impl: str, budget: float = RECOMPUTE_BUDGET) -> str:
    """An implementation's table label, with the budget a budgeted plan was given."""
    if impl == "recompute-budget":
        return f"ours recompute, budget {budget:.1%}"
    if impl == "recompute-peak":
        return f"ours recompute, peak budget {budget:.1%}"
    if impl == "recompute-peak-lean":
        return f"ours recompute, peak budget {budget:.1%}, every rerun lean"
    return LABEL[impl]


WIDE_CHUNK_PARTS = 4  # recompute-wide-chunks (GPU rows): z in chunks of up to a quarter, not a sixteenth
MiB, GiB = 2**20, 2**30
RESULT = "RESULT "  # a child's last line: RESULT <json>


# ----------------------------------------------------------------------------- architectures


@dataclass(frozen=True)
class Arch:
    ours: str            # zoo name
    batch: int           # the table's batch
    peer: str | None     # key into PEERS, None: no peer model


ARCHS: dict[str, Arch] = {
    "spikformer-4-384": Arch("spikformer-4-384", 64, "spikformer-4-384"),
    "spikformer-8-512": Arch("spikformer-8-512", 8, "spikformer-8-512"),
    "sdt-2-512": Arch("sdt-2-512", 64, "sdt-2-512"),
    "stable-snn-vgg11": Arch("stable-snn-vgg11", 64, "stable-snn-vgg11"),
}
RERUN = {"recompute": "none", "sj-memopt": "sj"}  # level -> the dense level whose largest block a rerun holds
BUYS = {"spikformer-4-384": 64, "spikformer-8-512": 32}  # "what it buys": architecture -> batch
QUICK_IMG = {"spikformer-8-512": 64}  # --quick runs the 224-px model on 64-px images (4x4 tokens)


def _sj_spikformer_cifar(T: int, img: int):
    from spikingjelly.activation_based.model.spikformer import spikformer_cifar10
    return spikformer_cifar10(T=T, num_classes=10)


def _sj_spikformer_imagenet(T: int, img: int):
    from spikingjelly.activation_based.model.spikformer import Spikformer
    return Spikformer(T=T, img_size_h=img, img_size_w=img, patch_size=16, num_classes=1000, embed_dims=512,
                      num_heads=8, mlp_ratio=4.0, depths=8)


def _sj_sdt(T: int, img: int):
    from spikingjelly.activation_based.model.spike_driven_transformer import SpikeDrivenTransformer
    return SpikeDrivenTransformer(T=T, num_classes=10, embed_dims=512, num_heads=8, depths=2, mlp_ratio=4.0,
                                  pooling_stat="0011")


def _sj_vgg11(T: int, img: int):
    from spikingjelly.activation_based import functional, neuron
    from spikingjelly.activation_based.model.spiking_vgg import SpikingVGG
    net = SpikingVGG(cfg=[64, "M", 128, 256, "M", 512, 512, 512, "M", 512, 512], batch_norm=True, num_classes=10,
                     spiking_neuron=neuron.LIFNode)
    functional.set_step_mode(net, "m")
    return net


def _targets_spikformer():
    from spikingjelly.activation_based.model.spikformer import SpikformerBlock, SpikformerConv2dBNLIF
    return (SpikformerConv2dBNLIF, SpikformerBlock)


def _targets_sdt():
    from torch import nn
    from spikingjelly.activation_based.model.spike_driven_transformer import _Block
    return (nn.Sequential, _Block)


def _targets_vgg():
    from spikingjelly.activation_based import layer, neuron
    return (layer.Conv2d, layer.BatchNorm2d, neuron.BaseNode, layer.MaxPool2d, layer.Linear)


@dataclass(frozen=True)
class Peer:
    build: Callable[[int, int], Any]  # (T, image side) -> spikingjelly model
    call: str                       # how it is built, as printed
    seq_input: bool                 # the model takes [T, B, C, H, W] (we repeat the image), else [B, C, H, W]
    targets: Callable[[], tuple]    # memopt level-1 target types
    targets_text: str
    differs: str


PEERS: dict[str, Peer] = {
    "spikformer-4-384": Peer(
        _sj_spikformer_cifar, "spikformer_cifar10(T=T, num_classes=10)", False, _targets_spikformer,
        "(SpikformerConv2dBNLIF, SpikformerBlock): the stem's conv-BN-LIF stages and the blocks",
        "same depth 4, D 384, 12 heads, 4x4 patches, 8x8 tokens; its q/k/v convs have no bias (ours: bias, "
        "as the reference CIFAR code); LIFNode (torch backend on CPU) instead of our fused LIF op; its head "
        "is per-timestep, averaged over T here"),
    "spikformer-8-512": Peer(
        _sj_spikformer_imagenet, "Spikformer(T=T, img_size 224, patch_size=16, embed_dims=512, num_heads=8, depths=8, "
        "num_classes=1000)", False, _targets_spikformer,
        "(SpikformerConv2dBNLIF, SpikformerBlock): the stem's conv-BN-LIF stages and the blocks",
        "same depth 8, D 512, 8 heads, 224 px, 14x14 tokens, bias-free q/k/v; LIFNode instead of our fused LIF "
        "op; per-timestep head averaged over T"),
    "sdt-2-512": Peer(
        _sj_sdt, "SpikeDrivenTransformer(T=T, embed_dims=512, num_heads=8, depths=2, pooling_stat='0011', "
        "num_classes=10)", False, _targets_sdt,
        "(nn.Sequential, _Block): the stem's conv-BN-LIF(-pool) stages and the blocks",
        "same depth 2, D 512, 8 heads, pools on the last two stem stages (8x8 tokens); "
        "spikingjelly's SDT v1 layers (conv 1x1 q/k/v, its SDSA) against ours; LIFNode instead of our LIF op"),
    "stable-snn-vgg11": Peer(
        _sj_vgg11, "SpikingVGG(cfg=[64,M,128,256,M,512,512,512,M,512,512], batch_norm=True, num_classes=10, "
        "spiking_neuron=LIFNode), multi-step", True, _targets_vgg,
        "(Conv2d, BatchNorm2d, BaseNode, MaxPool2d, Linear): every layer of the flat VGG (it has no unit module)",
        "our layer plan and widths, but max-pools for our average pools; a fixed 7x7 adaptive pool, so its first "
        "FC takes 25088 features (ours 8192) and the model has 2x the parameters; dropout in the classifier; "
        "LIFNode (tau 2, its builder passes no neuron options to the conv layers) instead of our DLIF (leak 0.99, "
        "learnable per-step input scale)"),
}


# ----------------------------------------------------------------------------- what runs in a child


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rss() -> int:
    v = _proc_status("VmRSS")
    return v if v is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not let us."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm, rss = _proc_status("VmHWM"), _proc_status("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 4 * MiB


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _watchdog(max_bytes: int) -> None:
    def watch() -> None:
        while True:
            rss = _rss()
            if rss > max_bytes:
                print(RESULT + json.dumps({"error": f"stopped: RSS {rss / GiB:.1f} GiB passed --max-gb {max_bytes / GiB:g}"}),
                      flush=True)
                os._exit(3)
            time.sleep(0.05)
    threading.Thread(target=watch, daemon=True).start()


def _peer_module(arch: str, T: int, img: int):
    """spikingjelly's model in a wrapper that takes the images [B, C, H, W], resets the neurons'
    state (its neurons carry membrane potential across calls) and returns logits [B, classes]."""
    from torch import nn
    from spikingjelly.activation_based import functional

    peer = PEERS[arch]

    class PeerModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = peer.build(T, img)

        def forward(self, x):
            functional.reset_net(self.net)
            if peer.seq_input:
                x = x.unsqueeze(0).repeat(T, *([1] * x.dim()))
            out = self.net(x)
            return out.mean(0) if out.dim() == 3 else out

    return PeerModel()


def _img(arch: str, img: int | None) -> int:
    from efficient import zoo

    return img or zoo.get_entry(ARCHS[arch].ours).input_spec.shape[-1]


def _inputs(arch: str, B: int, seed: int = 0, img: int | None = None):
    import torch
    from efficient import zoo

    spec = zoo.get_entry(ARCHS[arch].ours).input_spec
    g = torch.Generator().manual_seed(seed)
    shape = (spec.shape[0], _img(arch, img), _img(arch, img))
    return torch.rand(B, *shape, generator=g), torch.randint(0, spec.num_classes, (B,), generator=g)


MEMOPT_EXAMPLE = (4, 2)  # batch, seed of the images memopt probes (the same in every process)


def _memopt(model, arch: str, img: int | None) -> dict:
    """spikingjelly's level-1 memopt on `model`, probed on fixed images; what it did."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from spikingjelly.activation_based import memopt

    example = _inputs(arch, MEMOPT_EXAMPLE[0], seed=MEMOPT_EXAMPLE[1], img=img)[0]
    memopt.optimize_memory(model, PEERS[arch].targets(), lambda cur: cur(example), level=1, compress=True)
    wrapped = [w for w in model.modules() if isinstance(w, CheckpointWrapper)]
    return {"checkpointed": len(wrapped), "compressed": sum(w.checkpoint_fn.keywords.get("compressor") is not None for w in wrapped)}


def rewrap(model, plan, **how) -> None:
    """Wrap `plan`'s units again with `recompute.wrap`'s options `how` (keeping their kept outputs):
    `lean=False`, reruns keep what their units keep outside a region; `light=False`, every unit under
    torch's checkpoint."""
    from efficient.memory.recompute import units, wrap

    named = dict(units(model))
    for name in plan.units:
        unit = named[name]
        wrap(unit, unit.__dict__.get("_efficient_kept"), **how)


def _whole_convs(model) -> list:
    """The recompute level as before `region_conv2d`: a convolution with a hook is called as it is,
    its backward over the whole batch. Returns the hooks' handles."""
    import torch

    return [m.register_forward_hook(lambda *_: None) for m in model.modules() if type(m) is torch.nn.Conv2d]


_PEAK_PLAINS: dict[tuple, list[str]] = {}  # (arch, T, img, budget) -> the units a peak plan runs plainly


def build(arch: str, impl: str, T: int, img: int | None = None, example: Any = None,
          budget: float = RECOMPUTE_BUDGET) -> tuple[Any, Any, dict]:
    """The model of `impl` at T (training mode), its memory plan (ours) and what was done to it.
    `recompute-budget` plans its units on `example` (the step's images) for `budget` x none's bytes,
    `recompute-peak` for `budget` x none's step peak of live tensors (`budget_of="peak"`)."""
    import torch

    torch.manual_seed(0)
    if impl in LEVELS or impl in ("recompute-budget", "recompute-peak", "recompute-peak-lean", "recompute-whole-stem",
                                  "recompute-keep-membrane",
                                  "recompute-whole-conv", "recompute-checkpoint", "bits-keep-membrane"):
        import efficient
        from efficient import memory

        m = efficient.load(ARCHS[arch].ours, timesteps=T, **({"img_size": img} if img else {})).train()
        if impl == "recompute-whole-stem":  # the stem rerun whole, as before its stages were units
            for mod in m.modules():
                if hasattr(mod, "recompute_parts"):
                    mod.recompute_parts = list
            impl = "recompute"
        if impl == "recompute-whole-conv":
            _whole_convs(m)
            impl = "recompute"
        if impl == "recompute-checkpoint":  # every unit under torch's checkpoint, as before `recompute._Region`
            plan = memory.optimize(m, "recompute")
            rewrap(m, plan, light=False)
            return m, plan, {"summary": plan.summary()}
        if impl == "recompute-keep-membrane":  # reruns keep H and pool inputs, as before bn_lif(keep_membrane=False)
            plan = memory.optimize(m, "recompute")
            rewrap(m, plan, lean=False)
            return m, plan, {"summary": plan.summary()}
        if impl == "bits-keep-membrane":  # fused units keep their membrane traces, as before bits rebuilt them
            plan = memory.optimize(m, "bits")
            m._efficient_memory.rebuild = False
            return m, plan, {"summary": plan.summary()}
        key = (arch, T, img, budget)
        if impl == "recompute-peak-lean":
            # the units recompute-peak runs plainly (planned once per process on the same inputs), every rerun
            # lean, as before reruns off the peak kept their traces
            from efficient.memory.levels import apply

            if key not in _PEAK_PLAINS:
                _PEAK_PLAINS[key] = memory.optimize(m, "recompute", budget=budget, example=example,
                                                    budget_of="peak").plain
            plan = apply(m, "recompute", plain=_PEAK_PLAINS[key])
            return m, plan, {"summary": plan.summary()}
        if impl in ("recompute-budget", "recompute-peak"):
            t0 = time.perf_counter()
            plan = memory.optimize(m, "recompute", budget=budget, example=example,
                                   budget_of="peak" if impl == "recompute-peak" else "saved")
            if impl == "recompute-peak":
                _PEAK_PLAINS[key] = plan.plain
            return m, plan, {"summary": plan.summary(), "plan_s": time.perf_counter() - t0, "keep": plan.keep,
                             "kept_fraction": plan.kept_fraction, "rerun_share": plan.rerun_share}
        plan = memory.optimize(m, impl)
        return m, plan, {"summary": plan.summary()}
    m = _peer_module(arch, T, _img(arch, img)).train()
    info: dict[str, Any] = {}
    if impl == "sj-memopt":
        info = _memopt(m, arch, img)
    return m, None, info


def _loss(model, x, y):
    import torch.nn.functional as F

    return F.cross_entropy(model(x), y)


def train_step(model, x, y) -> float:
    for p in model.parameters():
        p.grad = None
    loss = _loss(model, x, y)
    loss.backward()
    return float(loss.detach())


def count_saved(model, x, y) -> dict[str, Any]:
    """What forward + loss keep for backward (`efficient.memory.measure`, no backward run)."""
    import torch.nn.functional as F
    from efficient.memory.measure import activation_memory

    mem = activation_memory(model, x, loss_fn=lambda out: F.cross_entropy(out, y), backward=False)
    return {"saved": mem.total_bytes, "dense": mem.dense_bytes, "packed": mem.packed_bytes, "tensors": mem.tensors,
            "by_block": mem.by_block}


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_case(spec: dict) -> dict:
    """One cell in this (fresh) process: see the module docstring for the protocol."""
    import torch

    _watchdog(int(spec["max_gb"] * GiB))
    arch, impl, T, B, steps, img = spec["arch"], spec["impl"], spec["T"], spec["batch"], spec["steps"], spec["img"]
    x, y = _inputs(arch, B, img=img)
    model, plan, info = build(arch, impl, T, img, example=x)
    _trim()
    base0, hwm0 = _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    t0 = time.perf_counter()
    train_step(model, x, y)  # warm-up
    warm = time.perf_counter() - t0
    for p in model.parameters():
        p.grad = None
    _trim()
    if _reset_peak():
        base = _rss()
        t0 = time.perf_counter()
        train_step(model, x, y)
        times.append(time.perf_counter() - t0)
        peak, how = _proc_status("VmHWM") - base, "VmHWM after clear_refs, second step"
    else:  # the first step, from ru_maxrss (a lower bound when it did not pass the process's earlier peak)
        hwm1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak, how = hwm1 - base0, "ru_maxrss, first step" + (" (lower bound)" if hwm1 <= hwm0 else "")
    for _ in range(steps - len(times)):
        t0 = time.perf_counter()
        train_step(model, x, y)
        times.append(time.perf_counter() - t0)
    saved = count_saved(model, x, y)
    return {"arch": arch, "impl": impl, "T": T, "batch": B, "peak_bytes": peak, "peak_how": how,
            "step_s": statistics.median(times), "times_s": times, "warmup_s": warm, "threads": torch.get_num_threads(),
            "param_bytes": _param_bytes(model), **saved, **info}


def run_beside(spec: dict) -> dict:
    """Step times of several implementations in one process, in rotation: each round runs every
    implementation's step once (the order rotated by one each round), so a drift of the machine's
    speed falls on all of them alike; per-round ratios to the first implementation."""
    import torch

    arch, T, B, rounds, impls, img = spec["arch"], spec["T"], spec["batch"], spec["rounds"], spec["impls"], spec["img"]
    if spec.get("host_memory", "system") == "reuse":  # before any tensor exists: every block then comes from the heap
        from efficient.memory import host

        host.keep_freed_memory()
    x, y = _inputs(arch, B, img=img)
    budget = spec.get("budget", RECOMPUTE_BUDGET)
    built = {impl: build(arch, impl, T, img, example=x, budget=budget) for impl in impls}
    models = {impl: b[0] for impl, b in built.items()}
    for _ in range(spec.get("warmup", 1)):  # warm-up: one-off allocations and compilations; with freed blocks
        for m in models.values():  # kept, the heap settles over a few steps
            train_step(m, x, y)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    # what each step cost the kernel: minor page faults (a fresh page of a freed and mapped-again
    # block, zero-filled) and system CPU seconds, the part of a CPU step that is the allocator's
    faults: dict[str, list[int]] = {impl: [] for impl in impls}
    system: dict[str, list[float]] = {impl: [] for impl in impls}
    for r in range(rounds):
        for impl in impls[r % len(impls):] + impls[: r % len(impls)]:
            # no malloc_trim between steps, as in a training loop: a trim would make every step
            # fault its memory in afresh, which costs most the level that keeps the most
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            train_step(models[impl], x, y)  # sets the gradients to None first
            times[impl].append(time.perf_counter() - t0)
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            faults[impl].append(u1.ru_minflt - u0.ru_minflt)
            system[impl].append(u1.ru_stime - u0.ru_stime)
    from host_memory import geo_ci  # here: bench/host_memory.py imports this module

    ref = times[impls[0]]
    ratios = {impl: [t / b for t, b in zip(ts, ref)] for impl, ts in times.items()}
    return {"arch": arch, "T": T, "batch": B, "rounds": rounds, "threads": torch.get_num_threads(), "times_s": times,
            "median_s": {i: statistics.median(ts) for i, ts in times.items()},
            "ratio_median": {i: statistics.median(rs) for i, rs in ratios.items()},
            "ratio_min": {i: min(rs) for i, rs in ratios.items()}, "ratio_max": {i: max(rs) for i, rs in ratios.items()},
            "ratio_ci": {i: list(geo_ci(rs)) for i, rs in ratios.items()},
            "faults": faults, "faults_median": {i: statistics.median(v) for i, v in faults.items()},
            "system_s": system, "system_median_s": {i: statistics.median(v) for i, v in system.items()},
            "host_memory": spec.get("host_memory", "system"), "plans": {i: b[2] for i, b in built.items() if b[2]}}


def beside_main(args) -> int:
    """`--beside`: the step-time table of the implementations side by side (see `run_beside`)."""
    import torch

    load0 = _load()
    print(f"# bench/memory.py --beside -- {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
          f"torch {torch.__version__}, load before {load0}")
    print(f"# command: python bench/memory.py {' '.join(sys.argv[1:])}")
    print(f"# host memory: {args.host_memory}")
    print("\n| architecture | T | batch | impl | median step s | time vs %s (median of rounds) | range over rounds | "
          "geometric mean, 95 %% interval | minor faults / step | system s / step |" % label(args.impls[0], args.recompute_budget))
    print("|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for arch in args.archs:
        for T in args.beside_ts:
            B = args.beside_batch or ARCHS[arch].batch
            res = _child("beside", {"arch": arch, "T": T, "batch": B, "rounds": args.rounds, "impls": args.impls,
                                    "img": None, "budget": args.recompute_budget, "host_memory": args.host_memory,
                                    "warmup": args.warmup},
                         timeout=7200)
            out.append(res)
            if "error" in res:
                print(f"| {arch} | {T} | {B} | | {res['error']} | | | | | |")
                continue
            for impl in args.impls:
                name = label(impl, args.recompute_budget)
                mid, lo, hi = res["ratio_ci"][impl]
                print(f"| {arch} | {T} | {B} | {name} | {res['median_s'][impl]:.2f} | {res['ratio_median'][impl]:.3f} | "
                      f"{res['ratio_min'][impl]:.3f}-{res['ratio_max'][impl]:.3f} | {mid:.3f} [{lo:.3f}, {hi:.3f}] | "
                      f"{res['faults_median'][impl]:,.0f} | {res['system_median_s'][impl]:.2f} |", flush=True)
    print(f"\n# load after {_load()}")
    if args.json:
        _write_json(args.json, {"date": str(datetime.date.today()), "machine": f"{platform.machine()} {os.cpu_count()} cores",
                                "torch": torch.__version__, "load_before": load0, "rounds": args.rounds, "beside": out})
    return 0


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _rel_err(a: list, b: list) -> float:
    """Largest per-gradient max|a - b| / max|b|, floored at 1e-3 of the largest gradient of the pass."""
    floor = 1e-3 * max((float(g.abs().max()) for g in b if g is not None and g.numel()), default=0.0)
    worst = 0.0
    for ga, gb in zip(a, b):
        if ga is None or gb is None:
            if (ga is None) != (gb is None):
                return math.inf
            continue
        scale = max(float(gb.abs().max()), floor)
        d = float((ga - gb).abs().max())
        worst = max(worst, d / scale if scale > 0 else (0.0 if d == 0 else math.inf))
    return worst


def _check(arch: str, T: int, B: int, img: int | None) -> dict:
    """Loss and gradients of bits == none bitwise, recompute within 1e-5; memopt against plain."""
    import copy
    import torch
    from efficient import memory

    x, y = _inputs(arch, B, seed=1, img=img)
    out: dict[str, Any] = {"T": T, "batch": B}
    m, _, _ = build(arch, "none", T, img)
    ref = None
    for level in LEVELS:
        memory.optimize(m, level)
        torch.manual_seed(0)
        loss = train_step(m, x, y)
        g = _grads(m)
        if ref is None:
            ref = (loss, g)
            continue
        bitwise = loss == ref[0] and all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g, ref[1]))
        out[level] = {"bitwise": bitwise, "loss": ref[0], "loss_diff": abs(loss - ref[0]), "grad_rel": _rel_err(g, ref[1])}
    memory.optimize(m, "none")
    if ARCHS[arch].peer:
        plain, _, _ = build(arch, "sj", T, img)
        opt = copy.deepcopy(plain)
        _memopt(opt, arch, img)
        res = []
        for model in (plain, opt):
            torch.manual_seed(0)
            res.append((train_step(model, x, y), _grads(model)))
        out["sj-memopt"] = {"bitwise": res[0][0] == res[1][0] and all(torch.equal(a, b) for a, b in zip(res[0][1], res[1][1])),
                            "loss": res[0][0], "loss_diff": abs(res[0][0] - res[1][0]), "grad_rel": _rel_err(res[1][1], res[0][1])}
    return out


def run_check(spec: dict) -> dict:
    _watchdog(int(spec["max_gb"] * GiB))
    t0 = time.perf_counter()
    out = _check(spec["arch"], spec["Ts"][0], 2, spec["img"])
    out["check_s"] = time.perf_counter() - t0
    return out


def run_probe(spec: dict) -> dict:
    """One implementation of one architecture: saved bytes at (T, batch) points, one timed step,
    parameter counts."""
    _watchdog(int(spec["max_gb"] * GiB))
    arch, impl, (Ta, Tb, Tc), (b1, b2, b3), img = spec["arch"], spec["impl"], spec["Ts"], spec["batches"], spec["img"]
    rec: dict[str, Any] = {"saved": {}}
    t_start = time.perf_counter()
    for T, batches in {Ta: (b1, b2, b3), Tb: (b1, b2), Tc: (b1,)}.items():
        model, plan, info = build(arch, impl, T, img, example=_inputs(arch, b1, img=img)[0])
        for B in batches:
            x, y = _inputs(arch, B, img=img)
            rec["saved"][f"{T},{B}"] = count_saved(model, x, y)
        if T == Ta:
            x, y = _inputs(arch, b2, img=img)
            train_step(model, x, y)
            t0 = time.perf_counter()
            train_step(model, x, y)
            rec["step_s"] = {"T": T, "batch": b2, "s": time.perf_counter() - t0}
            rec["params"] = sum(p.numel() for p in model.parameters())
            rec["param_bytes"] = _param_bytes(model)
            rec["info"] = info
        del model, plan
        _trim()
    rec["probe_s"] = time.perf_counter() - t_start
    return rec


def _child(kind: str, spec: dict, timeout: float, script: str = __file__) -> dict:
    """Run `script --child kind spec` in a fresh process; its last RESULT line, or the error."""
    cmd = [sys.executable, os.path.abspath(script), "--child", kind, json.dumps(spec)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(RESULT)]
    if lines:
        return json.loads(lines[-1][len(RESULT):])
    tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {r.returncode}: " + " | ".join(tail)}


# ----------------------------------------------------------------------------- fits (pure)


def affine_at(v1: int, v2: int, x1: int, x2: int, x: int) -> Fraction:
    """The value at x of the line through (x1, v1), (x2, v2), exactly."""
    return Fraction(v1) + Fraction(v2 - v1, x2 - x1) * (x - x1)


def largest_fitting(v1: float, v2: float, x1: int, x2: int, budget: float) -> int:
    """The largest integer x >= 0 with the affine value at x within `budget` (-1: none fits; a
    non-increasing line fits every x: returns a large sentinel, 10**9)."""
    slope = (v2 - v1) / (x2 - x1)
    base = v1 - slope * x1
    if slope <= 0:
        return 10**9 if base <= budget else -1
    return math.floor((budget - base) / slope) if base <= budget else -1


class Fits:
    """Saved bytes of one (arch, impl) as a function of (T, batch), from its probe's points."""

    def __init__(self, rec: dict, Ts: tuple[int, int, int], batches: tuple[int, int, int]) -> None:
        self.s = {tuple(int(v) for v in k.split(",")): d["saved"] for k, d in rec["saved"].items()}
        self.Ta, self.Tb, self.Tc = Ts
        self.b1, self.b2, self.b3 = batches

    def at(self, T: int, B: int) -> Fraction:
        """Exact at the probed T (affine in the batch); affine in T between Ta and Tb otherwise."""
        def per_T(t: int) -> Fraction:
            return affine_at(self.s[(t, self.b1)], self.s[(t, self.b2)], self.b1, self.b2, B)
        if T in (self.Ta, self.Tb):
            return per_T(T)
        return affine_at(per_T(self.Ta), per_T(self.Tb), self.Ta, self.Tb, T)  # type: ignore[arg-type]

    def batch_check(self) -> tuple[bool, int]:
        pred = affine_at(self.s[(self.Ta, self.b1)], self.s[(self.Ta, self.b2)], self.b1, self.b2, self.b3)
        meas = self.s[(self.Ta, self.b3)]
        return pred == meas, int(meas - pred)

    def T_check(self) -> tuple[bool, float]:
        pred = affine_at(self.s[(self.Ta, self.b1)], self.s[(self.Tb, self.b1)], self.Ta, self.Tb, self.Tc)
        meas = self.s[(self.Tc, self.b1)]
        return pred == meas, float(meas - pred)

    def fixed_part(self) -> Fraction:
        """The batch-independent part at Ta (BatchNorm statistics and the like)."""
        return affine_at(self.s[(self.Ta, self.b1)], self.s[(self.Ta, self.b2)], self.b1, self.b2, 0)


# ----------------------------------------------------------------------------- report


def _mib(v: float) -> str:
    return f"{float(v) / MiB:,.1f}"


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


# ----------------------------------------------------------------------------- on a CUDA device (bench/gpu.sh)
#
#   python bench/memory.py --device cuda --json memory_cuda.json      (about a minute on an H200)
#   python bench/memory.py --device cpu --dry-run                      (rehearsal: batch 2, the same code)
#
# Per architecture at batch 64, T=4: our levels none / bits / recompute in one process (the level
# switched on the same model), spikingjelly plain and memopt levels 1-4 in another (a fresh copy of
# the plain model per level). Levels 2-4 search split points by measuring peak CUDA memory (spatial
# splits need a split function, given for the Spikformer from spikingjelly's own builder; temporal
# splits a chunk predicate; level 4 unwraps greedily); a search that passes --search-s is stopped and
# its row says so. Every level is checked against its plain model first (loss and gradients at the
# same weights and batch, tolerance below); then one step's peak above what was allocated before it
# (`torch.cuda.max_memory_allocated`; weights, and no gradients, before the step) and the median step
# time (forward + CE + backward, no optimizer).

CUDA_ARCHS = ("spikformer-4-384", "sdt-2-512", "stable-snn-vgg11")
CUDA_T, CUDA_BATCH, DRY_BATCH = 4, 64, 2
MEM_TOL = (1e-5, 1e-4)  # |loss difference| / |loss|, gradient-difference L2 / gradient L2 (all parameters)


class SearchTimeout(BaseException):
    """Raised by the alarm inside a memopt search; a BaseException so that memopt's own per-trial
    `except Exception` does not swallow it."""


def _dev_sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _dev_grads(model) -> list:
    import torch
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().float().clone() for p in model.parameters()]


def _compare(loss: float, grads: list, ref: tuple[float, list]) -> dict:
    num = sum(float((a - b).double().pow(2).sum()) for a, b in zip(grads, ref[1]))
    den = sum(float(b.double().pow(2).sum()) for b in ref[1])
    loss_rel = abs(loss - ref[0]) / max(abs(ref[0]), 1e-12)
    grad_rel = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    return {"loss_rel": loss_rel, "grad_rel": grad_rel, "match": loss_rel <= MEM_TOL[0] and grad_rel <= MEM_TOL[1]}


def _dev_measure(model, x, y, dev, steps: int, step=None) -> dict:
    """One step's peak above the memory allocated before it, then the median of `steps` steps
    (`step(model, x, y)`, default `train_step`)."""
    import torch
    step = step or train_step
    for p in model.parameters():
        p.grad = None
    gc.collect()
    rec: dict[str, Any] = {}
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step(model, x, y)
        torch.cuda.synchronize(dev)
        rec.update(step_peak_bytes=torch.cuda.max_memory_allocated(dev) - before, allocated_before=before)
    times = []
    for _ in range(steps):
        _dev_sync(dev)
        t0 = time.perf_counter()
        step(model, x, y)
        _dev_sync(dev)
        times.append(time.perf_counter() - t0)
    rec["step_ms"] = 1e3 * statistics.median(times)
    for p in model.parameters():
        p.grad = None
    return rec


def _dev_inputs(arch: str, spec: dict):
    import torch
    x, y = _inputs(arch, spec["batch"], seed=1, img=spec.get("img"))
    dev = torch.device(spec["device"])
    return x.to(dev), y.to(dev), dev


def run_cuda_ours(spec: dict) -> dict:
    """Our levels on one model: check each against `none`, then peak and time."""
    import torch
    import efficient
    from efficient import memory
    from efficient.kernels import bn_lif

    arch = spec["arch"]
    x, y, dev = _dev_inputs(arch, spec)
    torch.manual_seed(0)
    m = efficient.load(ARCHS[arch].ours, timesteps=spec["T"], **({"img_size": spec["img"]} if spec.get("img") else {}))
    m = m.train().to(dev)
    rows, ref = {}, None
    hooks: list = []
    parts = bn_lif.RECOMPUTE_PARTS
    for level in (*LEVELS, "bits-keep-membrane", "recompute-keep-membrane", "recompute-whole-conv",
                  "recompute-wide-chunks", "recompute-peak"):
        for h in hooks:  # the whole-batch convolutions are that level's alone
            h.remove()
        hooks = []
        if level == "recompute-peak":  # units run plainly while the step's peak stays within 20 % of none's
            t0 = time.perf_counter()
            try:
                plan = memory.optimize(m, "recompute", budget=RECOMPUTE_BUDGET, example=x, budget_of="peak")
            except RuntimeError as e:
                rows[level] = {"check": "error", "why": str(e)[:300]}
                continue
            rows[level] = {"plan_s": time.perf_counter() - t0, "plain": plan.plain, "keeping": plan.keeping,
                           "summary": plan.summary()}
        else:
            plan = memory.optimize(m, level if level in LEVELS else level.split("-")[0])
        # a quarter as many chunks (and batch slices) per rebuilt unit: fewer launches for a higher peak
        bn_lif.RECOMPUTE_PARTS = WIDE_CHUNK_PARTS if level == "recompute-wide-chunks" else parts
        if level == "bits-keep-membrane":  # the level as before its fused units rebuilt membranes
            m._efficient_memory.rebuild = False
        if level == "recompute-keep-membrane":  # the level as before its reruns rebuilt membranes
            rewrap(m, plan, lean=False)
        if level == "recompute-whole-conv":
            hooks = _whole_convs(m)
        train_step(m, x, y)  # warm-up
        torch.manual_seed(0)  # the checked step draws the same dropout masks at every level
        loss = train_step(m, x, y)
        g = _dev_grads(m)
        row: dict[str, Any] = {"loss": loss, **rows.get(level, {})}
        if ref is None:
            ref = (loss, g)
            row["check"] = "reference"
        else:
            c = _compare(loss, g, ref)
            row.update(c, check="match" if c["match"] else "MISMATCH")
        del g
        if row["check"] != "MISMATCH":
            row.update(_dev_measure(m, x, y, dev, spec["steps"]))
        rows[level] = row
    bn_lif.RECOMPUTE_PARTS = parts
    for h in hooks:
        h.remove()
    rows["recompute-in-backward"] = _in_backward_row(m, x, y, dev, spec["steps"], ref)
    memory.optimize(m, "none")
    return {"rows": rows, "params": sum(p.numel() for p in m.parameters())}


def _in_backward_row(m, x, y, dev, steps: int, ref: tuple) -> dict:
    """Level recompute with each parameter updated inside backward (`train.optimizer_in_backward`),
    which frees its gradient there. SGD with momentum at lr 0: the weights stay put, and after the
    first step each momentum buffer is that step's gradient exactly, which is checked against none's."""
    import torch
    from efficient import memory
    from efficient.train.optim import InBackwardOptimizer

    memory.optimize(m, "recompute")
    opt = InBackwardOptimizer(torch.optim.SGD(m.parameters(), lr=0.0, momentum=0.9))

    def step(model, x, y):
        with opt.stepping():
            return train_step(model, x, y)

    torch.manual_seed(0)
    loss = step(m, x, y)
    left = [n for n, p in m.named_parameters() if p.grad is not None]
    if left:
        opt.remove_hooks()
        return {"check": "skipped", "why": f"gradients left after backward: {left[:3]}"}
    grads = [opt.state[p]["momentum_buffer"].detach().float().clone() if p in opt.state else torch.zeros_like(p)
             for p in m.parameters()]
    c = _compare(loss, grads, ref)
    row: dict[str, Any] = {"loss": loss, **c, "check": "match" if c["match"] else "MISMATCH"}
    del grads
    if c["match"]:
        row.update(_dev_measure(m, x, y, dev, steps, step=step))
    opt.remove_hooks()
    return row


def _memopt_level(model, arch: str, level: int, example, budget_s: float) -> dict:
    """spikingjelly's memopt at `level` on `model` (on the device); SearchTimeout past budget_s."""
    import signal
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from spikingjelly.activation_based import memopt, neuron

    if arch.startswith("spikformer"):
        from spikingjelly.activation_based.model.spikformer import SpikformerBuilder
        kw = {"split_fn": SpikformerBuilder._memopt_split, "can_chunk": SpikformerBuilder._memopt_can_chunk}
    else:  # a flat VGG: no sub-units to split spatially; its neurons chunk over time
        kw = {"can_chunk": lambda mod: isinstance(mod, neuron.BaseNode)}

    def stop(signum, frame):
        raise SearchTimeout(f"memopt level {level} search passed {budget_s:.0f} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    t0 = time.perf_counter()
    try:
        memopt.optimize_memory(model, PEERS[arch].targets(), lambda cur: cur(example), level=level, compress=True, **kw)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    wrapped = [w for w in model.modules() if isinstance(w, CheckpointWrapper)]
    return {"search_s": time.perf_counter() - t0, "checkpointed": len(wrapped)}


def run_cuda_sj(spec: dict) -> dict:
    """spikingjelly plain, then memopt levels 1-4 on fresh copies: check, peak, time."""
    import copy
    import torch

    arch = spec["arch"]
    x, y, dev = _dev_inputs(arch, spec)
    example = _inputs(arch, MEMOPT_EXAMPLE[0], seed=MEMOPT_EXAMPLE[1], img=spec.get("img"))[0].to(dev)
    torch.manual_seed(0)
    plain = _peer_module(arch, spec["T"], _img(arch, spec.get("img"))).train().to(dev)
    pristine = copy.deepcopy(plain)
    train_step(plain, x, y)
    torch.manual_seed(0)  # the checked step draws the same dropout masks in every model
    loss = train_step(plain, x, y)
    ref = (loss, _dev_grads(plain))
    rows = {"sj": {"loss": loss, "check": "reference", **_dev_measure(plain, x, y, dev, spec["steps"])}}
    del plain
    t_end = time.perf_counter() + spec["budget_s"]
    for level in spec["levels"]:
        key = f"sj-memopt-L{level}"
        left = t_end - time.perf_counter()
        if left < 5:
            rows[key] = {"check": "skipped", "why": f"the part's budget is spent ({left:.0f} s left)"}
            continue
        m = copy.deepcopy(pristine)
        try:
            info = _memopt_level(m, arch, level, example, min(spec["search_s"], left - 3))
        except SearchTimeout as e:
            rows[key] = {"check": "skipped", "why": str(e)}
            del m
            continue
        except RuntimeError as e:  # levels 2-4 refuse a model off CUDA (the CPU rehearsal)
            rows[key] = {"check": "skipped", "why": f"{type(e).__name__}: {str(e)[:160]}"}
            del m
            continue
        train_step(m, x, y)
        torch.manual_seed(0)
        loss = train_step(m, x, y)
        c = _compare(loss, _dev_grads(m), ref)
        row = {"loss": loss, **info, **c, "check": "match" if c["match"] else "MISMATCH"}
        if c["match"]:
            row.update(_dev_measure(m, x, y, dev, spec["steps"]))
        rows[key] = row
        del m
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows}


def cuda_main(args) -> int:
    """The device table: our levels vs spikingjelly memopt, checked, then peak and time; targets."""
    import torch

    t_start = time.perf_counter()
    dev = "cpu" if args.dry_run else args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible")
        return 1
    try:
        from importlib.metadata import version
        sj_version = version("spikingjelly")
    except Exception:
        sj_version = None
    name = torch.cuda.get_device_name() if dev == "cuda" else platform.machine()
    B = DRY_BATCH if args.dry_run else CUDA_BATCH
    print(f"# bench/memory.py --device {dev} -- {datetime.date.today()}, {name}, torch {torch.__version__}, "
          f"spikingjelly {sj_version or 'not installed'}, batch {B}, T={CUDA_T}")
    out: dict[str, Any] = {"device": name, "torch": torch.__version__, "spikingjelly": sj_version, "batch": B, "T": CUDA_T,
                           "archs": {}}
    failed = False
    archs = [a for a in args.archs if a in CUDA_ARCHS] or list(CUDA_ARCHS)
    for i, arch in enumerate(archs):
        left = args.budget_s - (time.perf_counter() - t_start)
        share = left / (len(archs) - i)  # this architecture's share of what is left
        spec = {"arch": arch, "T": CUDA_T, "batch": B, "device": dev, "steps": args.steps or 5,
                "img": QUICK_IMG.get(arch) if args.dry_run else None}
        res: dict[str, Any] = {"ours": _child("cuda_ours", spec, timeout=max(20.0, 0.4 * share))}
        if sj_version is not None and any(i.startswith("sj") for i in args.impls):
            left = args.budget_s - (time.perf_counter() - t_start)
            share = left / (len(archs) - i)
            res["sj"] = _child("cuda_sj", {**spec, "levels": [1, 2, 3, 4], "search_s": args.search_s,
                                           "budget_s": max(10.0, share - 20)}, timeout=max(20.0, share))
        out["archs"][arch] = res
        for k, r in res.items():
            if "error" in r:
                print(f"# {arch} {k}: {r['error']}")
                failed = True
    print(f"\n## activation memory on the device: one step (forward + CE + backward), batch {B}, T={CUDA_T}\n")
    print("| architecture | impl | check vs plain (loss rel, grad rel) | step peak MiB above weights | vs ours none | step ms "
          "| time vs ours none |")
    print("|---|---|---|---|---|---|---|")
    peer_mismatch = []
    for arch, res in out["archs"].items():
        ours_rows = res.get("ours", {}).get("rows", {})
        rows = {**ours_rows, **res.get("sj", {}).get("rows", {})}
        base = rows.get("none", {})
        for impl, r in rows.items():
            chk = r["check"] if r["check"] in ("reference", "skipped") else f"{r['check']} ({r['loss_rel']:.1e}, {r['grad_rel']:.1e})"
            if r["check"] == "skipped":
                chk += f": {r['why']}"
            if r["check"] == "MISMATCH":  # ours fails the part; a peer's mismatch is a finding about the peer
                if impl in ours_rows:
                    failed = True
                else:
                    peer_mismatch.append(f"{arch} {impl}: loss rel {r['loss_rel']:.1e}, grad rel {r['grad_rel']:.1e}")
            pk = r.get("step_peak_bytes")
            pk_s = _mib(pk) if pk is not None else "n/a"
            rel = f"{pk / base['step_peak_bytes']:.3f}" if pk is not None and base.get("step_peak_bytes") else ""
            ms = f"{r['step_ms']:.1f}" if "step_ms" in r else ""
            tr = f"{r['step_ms'] / base['step_ms']:.2f}" if "step_ms" in r and base.get("step_ms") else ""
            extra = f" (search {r['search_s']:.1f} s, {r['checkpointed']} checkpointed)" if "search_s" in r else ""
            print(f"| {arch} | {LABEL.get(impl, impl.replace('sj-memopt-', 'spikingjelly memopt '))}{extra} | {chk} | {pk_s} | "
                  f"{rel} | {ms} | {tr} |")
        out["archs"][arch]["targets"] = _cuda_targets(arch, rows, judged=not args.dry_run)
    for line in peer_mismatch:
        print(f"# spikingjelly memopt differs from spikingjelly plain (reported, not timed): {line}")
    out["peer_mismatch"] = peer_mismatch
    if args.json:
        _write_json(args.json, out)
    print(f"\n# memory part: {time.perf_counter() - t_start:.0f} s; checks {'FAILED' if failed else 'passed'}")
    return 1 if failed else 0


def _cuda_targets(arch: str, rows: dict, judged: bool) -> dict:
    """recompute: at most 20 % of none's step peak, at most 1.25x its time, below spikingjelly memopt's best."""
    none, rec = rows.get("none", {}), rows.get("recompute", {})
    sj = [r["step_peak_bytes"] for k, r in rows.items() if k.startswith("sj-memopt") and r.get("step_peak_bytes") is not None]
    if not (none.get("step_peak_bytes") and rec.get("step_peak_bytes") is not None):
        print(f"target recompute peak <= 20% of none, time <= 1.25x, below spikingjelly memopt's best ({arch}): FAIL (not measured"
              f"{'' if judged else ': no CUDA peak on a CPU rehearsal'})")
        return {"met": False}
    mem = rec["step_peak_bytes"] / none["step_peak_bytes"]
    tim = rec["step_ms"] / none["step_ms"]
    best_sj = min(sj) if sj else None
    ok = mem <= 0.2 and tim <= 1.25 and (best_sj is None or rec["step_peak_bytes"] < best_sj)
    sj_txt = f"{_mib(best_sj)} MiB" if best_sj is not None else "not measured"
    print(f"target recompute peak <= 20% of none, time <= 1.25x, below spikingjelly memopt's best ({arch}): peak {mem:.1%} of none, "
          f"time {tim:.2f}x, {_mib(rec['step_peak_bytes'])} MiB vs spikingjelly memopt best {sj_txt} "
          f"{'PASS' if ok and best_sj is not None else 'FAIL'}")
    out = {"met": ok and best_sj is not None, "peak_vs_none": mem, "time_vs_none": tim, "sj_best_bytes": best_sj}
    # the same target with the parameter gradients freed in backward, and with fewer, larger chunks (the
    # launches the chunks cost against the memory they save)
    for key, prefix, what in (("recompute-in-backward", "in_backward", "the update inside backward"),
                              ("recompute-wide-chunks", "wide_chunks", "a quarter as many chunks"),
                              ("recompute-peak", "peak_budget", "units run plainly within 20 % of none's peak")):
        r = rows.get(key, {})
        if r.get("step_peak_bytes") is None:
            continue
        out[f"{prefix}_peak_vs_none"] = r["step_peak_bytes"] / none["step_peak_bytes"]
        out[f"{prefix}_time_vs_none"] = r["step_ms"] / none["step_ms"]
        print(f"  with {what} ({arch}): peak {out[f'{prefix}_peak_vs_none']:.1%} of none, "
              f"time {out[f'{prefix}_time_vs_none']:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 2, T 2 and 4, spikformer-8-512 on 64-px images: a smoke test")
    ap.add_argument("--archs", nargs="*", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--impls", nargs="*", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--steps", type=int, default=None, help="timed steps per cell after the warm-up (default 3; 1 with --quick)")
    ap.add_argument("--max-gb", type=float, default=18.0, help="largest RSS (GiB) a cell may reach; cells estimated above it are not run")
    ap.add_argument("--max-step-s", type=float, default=180.0, help="cells whose step is estimated longer are not run")
    ap.add_argument("--budget-gb", type=float, default=16.0, help="activation budget (GiB) for 'what it buys'")
    ap.add_argument("--probe-ts", nargs=3, type=int, metavar=("TA", "TB", "TC"),
                    help="probe saved bytes at these T (fit through TA and TB, check at TC) instead of the table's T; "
                         "the table's T then come from the fitted line")
    ap.add_argument("--probe-batches", nargs=3, type=int, default=[2, 3, 4], metavar=("B1", "B2", "B3"),
                    help="probe saved bytes at these batches (fit through B1 and B2, check at B3)")
    ap.add_argument("--skip-cells", action="store_true", help="no peak/time cells: checks, fits, what it buys, --verify")
    ap.add_argument("--verify", action="store_true",
                    help="run one step at each claimed largest T (ours none and recompute) at --verify-batch, to check the claim")
    ap.add_argument("--verify-batch", type=int, default=2)
    ap.add_argument("--verify-max-s", type=float, default=900.0, help="claims whose check step is estimated longer are not run")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument("--plot", type=Path, help="PNG of saved GiB against T with the budget line")
    ap.add_argument("--probes", type=Path, help="reuse the checks and probes of an earlier --json file (same --quick)")
    ap.add_argument("--beside", action="store_true",
                    help="step times only: --impls side by side in one process per (architecture, T), in rotation for --rounds "
                         "rounds, ratios to the first of --impls")
    ap.add_argument("--rounds", type=int, default=5, help="--beside: rounds (each runs every implementation once)")
    ap.add_argument("--beside-ts", nargs="*", type=int, default=[4], help="--beside: the T values")
    ap.add_argument("--warmup", type=int, default=1, help="--beside: untimed rounds before the timed ones")
    ap.add_argument("--recompute-budget", type=float, default=RECOMPUTE_BUDGET,
                    help="--beside: the budget of impls recompute-budget (a fraction of none's saved bytes) and "
                         "recompute-peak (of none's step peak of live tensors)")
    ap.add_argument("--beside-batch", type=int, default=None, help="--beside: the batch (default: the architecture's table batch)")
    ap.add_argument("--host-memory", choices=("system", "reuse"), default="system",
                    help="--beside: glibc's malloc as it is, or keeping freed blocks (`train.host_memory: reuse`)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help="cuda: the device table (levels vs memopt 1-4, CUDA peaks); cpu: the tables above")
    ap.add_argument("--dry-run", action="store_true", help="the device table's code on this CPU at batch 2 (rehearsal)")
    ap.add_argument("--search-s", type=float, default=25.0, help="device table: stop a memopt level's search after this long")
    ap.add_argument("--budget-s", type=float, default=150.0, help="device table: the whole part")
    args = ap.parse_args(argv)

    if args.child:
        kind, spec = args.child[0], json.loads(args.child[1])
        res = {"case": run_case, "check": run_check, "probe": run_probe, "cuda_ours": run_cuda_ours,
               "cuda_sj": run_cuda_sj, "beside": run_beside}[kind](spec)
        print(RESULT + json.dumps(res), flush=True)
        return 0
    if args.device != "cpu" or args.dry_run:
        return cuda_main(args)
    if args.beside:
        return beside_main(args)

    table_Ts = (2, 4) if args.quick else (4, 16)      # the table's T
    # probe T: two to fit the line, a third to check it (default: the table's T and their middle)
    Ts = tuple(args.probe_ts) if args.probe_ts else (*table_Ts, 3 if args.quick else 8)
    # probe batches: fit, fit, check (not 1: see the docstring). They must take the same code paths
    # as the table's batch: Spikformer's Q/K/V units run fused above an input size (at T=4 from
    # batch 4 on at 32 px), which keeps other tensors
    batches = tuple(args.probe_batches)
    steps = args.steps or (1 if args.quick else 3)
    imgs = QUICK_IMG if args.quick else {}
    import torch  # versions only; the parent does no tensor work
    try:
        from importlib.metadata import version
        sj_version = version("spikingjelly")
    except Exception:
        sj_version = "?"
    started, load0 = time.time(), _load()
    print(f"# bench/memory.py {'--quick ' if args.quick else ''}-- {datetime.date.today()}, {platform.machine()} "
          f"{os.cpu_count()} cores, torch {torch.__version__}, spikingjelly {sj_version}, load before {load0}")
    print(f"# command: python bench/memory.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())

    probes: dict[str, dict] = {}
    if args.probes:
        old = json.loads(args.probes.read_text())
        if tuple(old.get("Ts", ())) != Ts or tuple(old.get("probe_batches", ())) != batches:
            print(f"{args.probes}: its probes are at T {old.get('Ts')} and batches {old.get('probe_batches')}, this run needs "
                  f"T {Ts} and batches {batches}: run it with the same --quick setting")
            return 2
        probes = old["probes"]
    for arch in args.archs:
        if arch in probes:
            continue
        t0 = time.time()
        spec = {"arch": arch, "Ts": Ts, "batches": batches, "max_gb": args.max_gb, "img": imgs.get(arch)}
        probes[arch] = {"check": _child("check", spec, timeout=3600), "probes": {}}
        for impl in args.impls:
            if impl in LEVELS or ARCHS[arch].peer:
                probes[arch]["probes"][impl] = _child("probe", {**spec, "impl": impl}, timeout=3600)
        for what, res in [("check", probes[arch]["check"]), *probes[arch]["probes"].items()]:
            if "error" in res:
                print(f"# {arch}: {what} failed: {res['error']}")
        print(f"# {arch}: check and probes in {time.time() - t0:.0f} s")
    header = {"date": str(datetime.date.today()), "machine": f"{platform.machine()} {os.cpu_count()} cores",
              "torch": torch.__version__, "spikingjelly": sj_version, "load_before": load0, "quick": args.quick, "Ts": Ts,
              "probe_batches": batches, "budget_gb": args.budget_gb, "max_gb": args.max_gb, "max_step_s": args.max_step_s,
              "steps": steps}
    if args.json:  # the probes alone first: a later failure keeps them (--probes reuses them)
        _write_json(args.json, {**header, "probes": probes})

    # correctness
    print("\n## correctness (batch 2, T=%d)\n" % Ts[0])
    print("| architecture | ours bits vs none | ours recompute vs none | spikingjelly memopt vs plain |")
    print("|---|---|---|---|")
    failed: set[str] = set()  # architectures whose levels do not reproduce `none`: not timed
    for arch in args.archs:
        c = probes[arch]["check"]
        if "error" in c:
            failed.add(arch)
            print(f"| {arch} | check failed: {c['error']} | | |")
            continue
        cells = []
        for key, want_bitwise in (("bits", True), ("recompute", False), ("sj-memopt", False)):
            if key not in c:
                cells.append("no peer model")
                continue
            r = c[key]
            good = r["bitwise"] if want_bitwise else (r["bitwise"] or (r["grad_rel"] <= 1e-5 and r["loss_diff"] <= 1e-5 * abs(r["loss"])))
            if not good and key != "sj-memopt":
                failed.add(arch)
            cells.append(("bitwise equal" if r["bitwise"] else f"loss diff {r['loss_diff']:.1e}, grad rel {r['grad_rel']:.1e}")
                         + ("" if good else " FAILS"))
        print(f"| {arch} | " + " | ".join(cells) + " |")
    if failed:
        print(f"\nour levels do not reproduce `none` on {', '.join(sorted(failed))}: not timed")

    # fits
    fits: dict[tuple[str, str], Fits] = {}
    print("\n## saved bytes are affine in the batch and in T (probe batches %s, T %s)\n" % (batches, Ts))
    print("| architecture | impl | batch-independent part KiB | per sample at T=%d MiB | batch %d as predicted | T=%d as predicted |" % (Ts[0], batches[2], Ts[2]))
    print("|---|---|---|---|---|---|")
    for arch in args.archs:
        for impl, rec in probes[arch]["probes"].items():
            if "error" in rec:
                print(f"| {arch} | {LABEL[impl]} | probe failed: {rec['error']} | | | |")
                continue
            f = fits[(arch, impl)] = Fits(rec, Ts, batches)
            bok, bdev = f.batch_check()
            tok, tdev = f.T_check()
            if impl == "none":
                assert bok, f"{arch} none: saved bytes are not affine in the batch (off by {bdev} B at batch {batches[2]})"
            per = f.at(Ts[0], 1) - f.fixed_part()
            print(f"| {arch} | {LABEL[impl]} | {float(f.fixed_part()) / 1024:,.1f} | {_mib(per)} | "
                  f"{'exact' if bok else f'off by {bdev} B'} | {'exact' if tok else f'off by {tdev:.0f} B'} |")

    # peers
    print("\n## peer models (spikingjelly %s)\n" % sj_version)
    for arch in args.archs:
        p = ARCHS[arch].peer
        ours_rec = probes[arch]["probes"].get("none")
        if not p:
            print(f"- {arch}: no peer model")
            continue
        peer, sjr = PEERS[p], probes[arch]["probes"].get("sj-memopt") or probes[arch]["probes"].get("sj")
        params = f"params ours {ours_rec['params'] / 1e6:.2f} M" if ours_rec and "params" in ours_rec else ""
        if sjr and "params" in sjr:
            params += f", spikingjelly {sjr['params'] / 1e6:.2f} M"
        mo = probes[arch]["probes"].get("sj-memopt", {}).get("info", {})
        memo = f"; memopt L1 targets {peer.targets_text}: {mo.get('checkpointed', '?')} modules checkpointed, {mo.get('compressed', '?')} with inputs kept as bits" if mo else ""
        print(f"- {arch}: `{peer.call}`; {params}. Differs: {peer.differs}{memo}.")

    # cells
    rows: list[dict] = []
    print(f"\n# cells (each a fresh process; --max-gb {args.max_gb:g}, --max-step-s {args.max_step_s:g}, {steps} timed step(s))")
    for arch in ([] if args.skip_cells else args.archs):
        B = 2 if args.quick else ARCHS[arch].batch
        for T in table_Ts:
            for impl in args.impls:
                row: dict[str, Any] = {"arch": arch, "T": T, "batch": B, "impl": impl}
                rows.append(row)
                rec = probes[arch]["probes"].get(impl)
                if rec is None:
                    row["status"] = "no peer model"
                    continue
                if "error" in rec:
                    row["status"] = "probe failed"
                    continue
                f = fits[(arch, impl)]
                saved = f.at(T, B)
                row["saved_scaled"] = float(saved)
                est_peak = 1.25 * float(saved) + 2 * rec["param_bytes"] + GiB  # + weights, gradients, interpreter
                st = rec["step_s"]
                est_time = st["s"] * (T * B) / (st["T"] * st["batch"])
                row.update(est_peak_bytes=est_peak, est_step_s=est_time)
                if arch in failed:
                    row["status"] = "not timed (check failed)"
                    continue
                if est_peak > args.max_gb * GiB:
                    row["status"] = f"not run (needs ~{est_peak / GiB:.0f} GB)" if est_peak >= 2 * GiB else f"not run (needs ~{est_peak / GiB:.1f} GB)"
                    continue
                if est_time > args.max_step_s:
                    row["status"] = f"not run (~{est_time:.0f} s/step)"
                    continue
                t0 = time.time()
                res = _child("case", {"arch": arch, "impl": impl, "T": T, "batch": B, "steps": steps, "max_gb": args.max_gb,
                                      "img": imgs.get(arch)},
                             timeout=max(900.0, 4 * (steps + 1) * max(est_time, args.max_step_s)))
                if "error" in res:
                    row["status"] = res["error"]
                    print(f"#   {arch} T={T} b={B} {impl}: {res['error']}")
                    continue
                row.update(res, status="ran")
                if res["saved"] != saved:
                    row["saved_mismatch"] = int(res["saved"] - saved)
                print(f"#   {arch} T={T} b={B} {LABEL[impl]}: {time.time() - t0:.0f} s "
                      f"(est. step {est_time:.1f} s, measured {res['step_s']:.1f} s; peak {_mib(res['peak_bytes'])} MiB)")

    print(f"\n## one training step (forward + CE + backward), {datetime.date.today()}\n")
    print("| architecture | T | batch | impl | saved MiB | vs ours none | peak MiB | step s | time vs ours none |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = {(r["arch"], r["T"]): r for r in rows if r["impl"] == "none"}
    for r in rows:
        if "saved_scaled" not in r:  # no peer model, or its probe failed
            print(f"| {r['arch']} | {r['T']} | {r['batch']} | {LABEL[r['impl']]} | {r['status']} | | | | |")
            continue
        b = base.get((r["arch"], r["T"]))
        ran = r["status"] == "ran"
        saved = r["saved"] if ran else r["saved_scaled"]
        probed = r["batch"] in {Ts[0]: batches, Ts[1]: batches[:2]}.get(r["T"], ())
        s_txt = _mib(saved) + ("" if ran else " (probe)" if probed else " (scaled)") + (f" [probe fit off by {r['saved_mismatch']} B]" if r.get("saved_mismatch") else "")
        b_saved = None if b is None else (b["saved"] if b["status"] == "ran" else b.get("saved_scaled"))
        ratio = f"{saved / b_saved:.3f}" if b_saved else ""
        peak = _mib(r["peak_bytes"]) + (" (first step)" if "first" in r.get("peak_how", "") else "") if ran else r["status"]
        tsec = f"{r['step_s']:.2f}" if ran else r["status"]
        tr = f"{r['step_s'] / b['step_s']:.2f}" if ran and b is not None and b["status"] == "ran" else ""
        print(f"| {r['arch']} | {r['T']} | {r['batch']} | {LABEL[r['impl']]} | {s_txt} | {ratio} | {peak} | {tsec} | {tr} |")

    # what it buys
    buys: list[dict] = []
    budget = args.budget_gb * GiB
    print(f"\n## what it buys: the largest T whose saved bytes fit {args.budget_gb:g} GiB\n")
    print("| architecture | batch | impl | saved GiB at T=%d | + largest unit's rerun GiB | MiB per extra timestep | largest T | vs ours none |" % table_Ts[0])
    print("|---|---|---|---|---|---|---|---|")
    for arch, B in BUYS.items():
        if arch not in args.archs:
            continue
        tmax_none = None
        for impl in args.impls:
            if (arch, impl) not in fits:
                continue
            f = fits[(arch, impl)]
            va, vb = float(f.at(table_Ts[0], B)), float(f.at(table_Ts[1], B))
            # a recomputed unit holds all its activations while backward reruns it: the largest
            # unit's share of the dense level comes on top of what is kept between units
            rerun_a = rerun_b = 0.0
            dense = RERUN.get(impl)
            if dense and (arch, dense) in fits and (arch, "none") in fits:
                # the largest unit's share of a step, from our dense level's per-block bytes (the
                # peer's model is one block to the counter; its blocks are the same architecture's)
                point = probes[arch]["probes"]["none"]["saved"][f"{Ts[0]},{batches[0]}"]
                share = max(point["by_block"].values()) / point["saved"]
                rerun_a = share * float(fits[(arch, dense)].at(table_Ts[0], B))
                rerun_b = share * float(fits[(arch, dense)].at(table_Ts[1], B))
            tmax = largest_fitting(va + rerun_a, vb + rerun_b, table_Ts[0], table_Ts[1], budget)
            slope = (vb + rerun_b - va - rerun_a) / (table_Ts[1] - table_Ts[0])
            if impl == "none":
                tmax_none = tmax
            buys.append({"arch": arch, "batch": B, "impl": impl, "saved_at_Ta": va, "rerun_at_Ta": rerun_a, "per_T": slope,
                         "largest_T": tmax, "line": [va + rerun_a - slope * table_Ts[0], slope]})
            t_txt = "none fits" if tmax < 1 else ("any" if tmax >= 10**9 else str(tmax))
            rel = f"{tmax / tmax_none:.1f}x" if tmax_none and tmax_none > 0 and 0 < tmax < 10**9 else ""
            print(f"| {arch} | {B} | {LABEL[impl]} | {va / GiB:.2f} | {rerun_a / GiB:.2f} | {slope / MiB:,.1f} | {t_txt} | {rel} |")
    print("\nSaved bytes are affine in T as checked above (T=%d predicted from T=%d and T=%d at batch %d); weights, "
          "gradients and optimizer state come on top of the budget." % (Ts[2], Ts[0], Ts[1], batches[0]))
    if imgs:
        print("--quick: " + ", ".join(f"{a} at {v} px" for a, v in imgs.items()) + ".")

    verified: list[dict] = []
    if args.verify and buys:
        vb = args.verify_batch
        print(f"\n## the claims checked: one training step at the claimed T, batch {vb}\n")
        print("| architecture | impl | claimed T (batch) | saved MiB predicted at batch %d | measured | peak MiB | step s |" % vb)
        print("|---|---|---|---|---|---|---|")
        for b in buys:
            T = b["largest_T"]
            if b["impl"] not in ("none", "recompute") or not 0 < T < 10**9:
                continue
            f, rec = fits[(b["arch"], b["impl"])], probes[b["arch"]]["probes"][b["impl"]]
            want = float(f.at(T, vb))
            st = rec["step_s"]
            est = st["s"] * (T * vb) / (st["T"] * st["batch"])
            row = {"arch": b["arch"], "impl": b["impl"], "T": T, "batch": vb, "predicted": want, "est_step_s": est}
            verified.append(row)
            head = f"| {b['arch']} | {LABEL[b['impl']]} | {T} ({b['batch']}) | {_mib(want)} |"
            if est > args.verify_max_s:
                row["status"] = f"not run (~{est:.0f} s/step)"
                print(f"{head} {row['status']} | | |")
                continue
            res = _child("case", {"arch": b["arch"], "impl": b["impl"], "T": T, "batch": vb, "steps": 1, "max_gb": args.max_gb,
                                  "img": imgs.get(b["arch"])}, timeout=max(900.0, 4 * est))
            if "error" in res:
                row["status"] = res["error"]
                print(f"{head} {res['error']} | | |")
                continue
            row.update(res, status="ran")
            print(f"{head} {_mib(res['saved'])} ({res['saved'] / want:.4f} of predicted) | {_mib(res['peak_bytes'])} | "
                  f"{res['step_s']:.1f} |")

    if args.plot and buys:
        _plot(args.plot, buys, budget, args.budget_gb)
        print(f"plot: {args.plot}")
    load1 = _load()
    print(f"\n# done in {time.time() - started:.0f} s; load before {load0}, after {load1}")
    if args.json:
        _write_json(args.json, {**header, "load_after": load1, "probes": probes, "cells": rows, "what_it_buys": buys,
                                      "verified": verified})
    return 0


def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(path)


def _plot(path: Path, buys: list[dict], budget: float, budget_gb: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    archs = list(dict.fromkeys(b["arch"] for b in buys))
    fig, axes = plt.subplots(1, len(archs), figsize=(6 * len(archs), 4.2), squeeze=False)
    style = {"none": ("C0", "-"), "bits": ("C1", "-"), "recompute": ("C2", "-"), "sj": ("0.5", ":"), "sj-memopt": ("C3", "--")}
    for ax, arch in zip(axes[0], archs):
        mine = [b for b in buys if b["arch"] == arch]
        fitting = [b["largest_T"] for b in mine if 0 < b["largest_T"] < 10**9]
        t_hi = min(4096, max(64, 2 * max(fitting, default=32)))
        ts = sorted({round(2 ** (k / 8)) for k in range(0, 8 * int(math.log2(t_hi)) + 1)})
        for b in mine:
            c, ls = style[b["impl"]]
            a0, a1 = b["line"]
            ax.plot(ts, [max(a0 + a1 * t, 1.0) / GiB for t in ts], color=c, ls=ls, label=LABEL[b["impl"]])
            if 0 < b["largest_T"] < 10**9:
                ax.plot([b["largest_T"]], [budget / GiB], "o", color=c, ms=4)
                if b["impl"] in ("none", "recompute"):  # the comparison the section is about
                    ax.annotate(f"T={b['largest_T']}", (b["largest_T"], budget / GiB), textcoords="offset points",
                                xytext=(4, 6), fontsize=8, color=c)
        ax.axhline(budget / GiB, color="k", lw=0.8)
        ax.text(1.1, budget / GiB * 1.08, f"budget {budget_gb:g} GiB", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_yscale("log")
        ax.set_xlim(1, t_hi)
        ax.set_ylim(budget / GiB / 2000, budget / GiB * 8)
        ax.set_xlabel("timesteps T")
        ax.set_ylabel("activations held per step, GiB\n(kept + largest unit rerun)")
        ax.set_title(f"{arch}, batch {mine[0]['batch']}")
        ax.grid(True, which="major", lw=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
