"""What a training step costs the host: aten ops dispatched per step, graph breaks, step time eager
vs compiled (`torch.compile`, mode default), spikingjelly's step beside ours, and the host cost of
each of our custom ops on a tiny tensor (where the arithmetic is nothing and the call is everything).

    python bench/step.py                                    # the models of the table, batch 8
    python bench/step.py --models spikformer-4-384 --no-compile --repeats 5

A step is forward + the model's training objective (cross-entropy; STATA's loss with its alignment
terms on the STATA models; the MPD stability loss on the VGG; the exit loss on EE-GPT) + backward,
gradients set to None before it. Ops are counted with a `TorchDispatchMode` over one step (every
aten call, forward and backward). Times are medians of `--repeats` steps after warm-up steps (which
compile, in compiled mode); each model runs in its own process, eager then compiled.

Host cost: each op forward + backward on a tiny input, median over 7 rounds of 200 calls, beside a
plain torch implementation of the same computation (for LIF: a 4-step loop with a sigmoid surrogate,
as a user would write it).

Device steps (`--device cuda`, run by bench/gpu.sh): each model and amp in its own process, eager,
`torch.compile` default and reduce-overhead (spikingjelly: eager, compiled, its StaticCudaGraph),
each mode checked before it is timed (CHECK_TOL says what "match" and "flips" mean), peak memory,
and one profiled step per mode: kernels, their summed time, host launch calls, the costliest kernels.

    python bench/step.py --device cuda --sizes cifar --amp fp32 --modes reduce-overhead cudagraph
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

# model -> (objective config, batch maker name)
MODELS: dict[str, dict[str, Any]] = {
    "spikformer-4-384": {"name": "classification"},
    "spikformer-stata": {"name": "stata"},
    "sdt-stata": {"name": "stata"},
    "stable-snn-vgg11": {"name": "stability", "perturbation": "gaussian"},
    "ee-gpt-tiny": {"name": "exits", "weights": [0.5, 0.5]},
}


PEER = "spikingjelly spikformer_cifar10 (4-384)"
RESULT = "RESULT "


# ops that launch no kernel on a GPU: allocations, and `_unsafe_view` (a view its schema does not mark)
_NO_WORK = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view"})


class OpCounter(TorchDispatchMode):
    """Every op dispatched (`n`), and those that do work (`work`): not views, aliases (detach
    included) or allocations, i.e. what a GPU launches a kernel for. A custom op counts as one."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.work = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        if not (getattr(func, "is_view", False) or func.__name__.split(".")[0] in _NO_WORK):
            self.work += 1
        return func(*args, **(kwargs or {}))


def _batch(name: str, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    from efficient.zoo import get_entry

    spec = get_entry(name).input_spec
    g = torch.Generator().manual_seed(0)
    if name.startswith("ee-gpt"):
        x = torch.randint(0, spec.num_classes, (B, *spec.shape), generator=g)
        return x, torch.randint(0, spec.num_classes, (B, *spec.shape), generator=g)
    return torch.rand(B, *spec.shape, generator=g), torch.randint(0, spec.num_classes, (B,), generator=g)


def _ours(name: str, B: int) -> tuple[Callable[[], torch.Tensor], torch.nn.Module, Callable[[torch.nn.Module], None]]:
    """A step closure for our model `name` with its objective, the model, and a compile hook."""
    import efficient
    from efficient.models.progress import inform_progress
    from efficient.objectives import build_objective

    torch.manual_seed(0)
    model = efficient.load(name).train()
    inform_progress(model, 100.0)  # STATA past its warm-up: the keep ratio the model trains at
    obj = build_objective(dict(MODELS[name]))
    obj.setup(model, None, None)
    x, y = _batch(name, B)
    holder = {"fwd": model}

    def step() -> torch.Tensor:
        for p in model.parameters():
            p.grad = None
        loss, _ = obj.loss(holder["fwd"], (x, y))
        loss.backward()
        return loss

    def compile_it(m: torch.nn.Module) -> None:
        holder["fwd"] = torch.compile(m)

    return step, model, compile_it


def _spikingjelly(B: int) -> tuple[Callable[[], torch.Tensor], torch.nn.Module, Callable[[torch.nn.Module], None]]:
    from spikingjelly.activation_based import functional
    from spikingjelly.activation_based.model.spikformer import spikformer_cifar10

    torch.manual_seed(0)
    model = spikformer_cifar10(T=4, num_classes=10).train()
    x, y = torch.rand(B, 3, 32, 32), torch.randint(0, 10, (B,))
    holder = {"fwd": model}

    def step() -> torch.Tensor:
        functional.reset_net(model)
        for p in model.parameters():
            p.grad = None
        out = holder["fwd"](x)
        loss = F.cross_entropy(out.mean(0) if out.dim() == 3 else out, y)
        loss.backward()
        return loss

    def compile_it(m: torch.nn.Module) -> None:
        holder["fwd"] = torch.compile(m)

    return step, model, compile_it


def _median_s(step: Callable[[], Any], repeats: int, warmup: int) -> tuple[float, float]:
    """(median seconds per step, seconds of the warm-up steps)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times), warm


def _breaks(step: Callable[[], Any]) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(step)().graph_break_count


def _separate_units_step(step: Callable[[], Any]) -> Callable[[], Any]:
    from efficient.models.neurons import separate_units

    def run() -> Any:
        with separate_units():
            return step()

    return run


def measure_model(label: str, build: Callable[[], tuple], repeats: int, compile_: bool,
                  separate: bool = False) -> dict[str, Any]:
    step, model, compile_it = build()
    step()  # one-off allocations
    counter = OpCounter()
    with counter:
        step()
    eager, _ = _median_s(step, repeats, 1)
    row = {"model": label, "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "ops": counter.n,
           "work_ops": counter.work, "eager_s": eager}
    if separate:  # BatchNorm and neuron as two calls, in the same process: ops, and step times alternated
        sep = _separate_units_step(step)
        counter = OpCounter()
        with counter:
            sep()
        row["ops_separate"] = counter.n
        fused_t, sep_t = [], []
        for _ in range(repeats):
            fused_t.append(_median_s(step, 1, 0)[0])
            sep_t.append(_median_s(sep, 1, 0)[0])
        row["eager_s"], row["eager_separate_s"] = statistics.median(fused_t), statistics.median(sep_t)
    if compile_:
        compile_it(model)
        row["compiled_s"], row["compile_s"] = _median_s(step, repeats, 2)
    return row


# ------------------------------------------------------------------------------------ host cost

def _plain_lif(x: torch.Tensor) -> torch.Tensor:
    """A plain 4-step torch LIF (tau 2, hard reset to 0, detached reset, sigmoid surrogate alpha 4)."""
    v, out = torch.zeros_like(x[0]), []
    for t in range(x.shape[0]):
        h = v + (x[t] - v) / 2.0
        s = (h >= 1.0).float() + torch.sigmoid(4.0 * (h - 1.0)) - torch.sigmoid(4.0 * (h - 1.0)).detach()
        v = h * (1.0 - s.detach())
        out.append(s)
    return torch.stack(out)


def _plain_leaky(x: torch.Tensor, beta: float = 0.9, thr: float = 1.0, alpha: float = 2.0) -> torch.Tensor:
    """A plain snntorch-order Leaky loop (subtract reset, detached, arctan surrogate)."""
    mem, out = torch.zeros_like(x[0]), []
    for t in range(x.shape[0]):
        reset = (mem > thr).float()
        mem = beta * mem + x[t] - reset * thr
        u = mem - thr
        soft = torch.atan(math.pi / 2 * alpha * u) / math.pi
        out.append((u > 0).float() + soft - soft.detach())
    return torch.stack(out)


def _host_cases() -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """(op, ours, plain torch) closures: forward + backward on tiny inputs, one row per custom op
    family (the training units' ops in their fused form, BatchNorm then the neuron)."""
    from efficient.kernels.bn_lif import bn_lif
    from efficient.kernels.exit_confidence import exit_confidence, exit_confidence_reference
    from efficient.kernels.leaky import leaky
    from efficient.kernels.lif import lif
    from efficient.kernels.linear_ce import linear_ce
    from efficient.kernels.spike_pack import pack_spikes, unpack_spikes
    from efficient.kernels.ssa import attention_ref, spiking_attention, spiking_attention_unit
    from efficient.kernels.token_select import gather_tokens, gather_tokens_ref, select_tokens, select_tokens_ref

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1, 16, generator=g, requires_grad=True)

    def lif_ours() -> None:
        lif(x, 2.0, 1.0, 0.0, True, True, "sigmoid", 4.0).sum().backward()

    # BatchNorm + LIF units: z [T*R, C, 2, 2] (T=4, R=2, C=4); the Linear unit's input [T*R, 16] -> 8
    z = torch.randn(8, 4, 2, 2, generator=g, requires_grad=True)
    xl = torch.randn(8, 16, generator=g, requires_grad=True)
    lw, lb = (torch.randn(8, 16, generator=g) / 4).requires_grad_(), torch.zeros(8, requires_grad=True)
    bn = {c: (torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True), torch.zeros(c), torch.ones(c))
          for c in (4, 8)}

    def unit_plain(inp: torch.Tensor, c: int) -> None:
        w, b, rm, rv = bn[c]
        _plain_lif(F.batch_norm(inp, rm, rv, w, b, True).reshape(4, -1)).sum().backward()

    q, k, v = ((torch.rand(4, 1, 2, 8, 4, generator=g) > 0.5).float().requires_grad_() for _ in range(3))
    qkv = (torch.rand(4, 1, 8, 24, generator=g) > 0.5).float().requires_grad_()

    def _merged_attention(t: torch.Tensor) -> torch.Tensor:
        heads = [u.reshape(4, 1, 8, 2, 4).transpose(2, 3) for u in t.split(8, -1)]
        return attention_ref(*heads, 0.125).transpose(2, 3).reshape(4, 1, 8, 8)

    scores = torch.rand(4, 1, 8, generator=g)
    tok = torch.randn(4, 1, 8, 4, generator=g, requires_grad=True)
    idx = torch.tensor([[0, 2, 5, 7]])
    h, w = torch.randn(3, 16, generator=g), torch.randn(64, 16, generator=g)
    hc, wc = torch.randn(8, 16, generator=g, requires_grad=True), torch.randn(64, 16, generator=g, requires_grad=True)
    yc = torch.randint(0, 64, (8,), generator=g)
    sp = (torch.rand(4, 1, 64, generator=g) > 0.5).float()
    return [
        ("lif fwd+bwd [4,1,16]", lif_ours, lambda: _plain_lif(x).sum().backward()),
        ("leaky fwd+bwd [4,1,16] (snntorch order)", lambda: leaky(x, 0.9, 1.0, "subtract", "atan", 2.0).sum().backward(),
         lambda: _plain_leaky(x).sum().backward()),
        ("bn_lif fwd+bwd [8,4,2,2] T=4", lambda: bn_lif(z, 4, *bn[4], True).sum().backward(), lambda: unit_plain(z, 4)),
        ("linear_bn_lif fwd+bwd [8,16]->8 T=4", lambda: bn_lif(xl, 4, *bn[8], True, lin_weight=lw, lin_bias=lb).sum().backward(),
         lambda: unit_plain(F.linear(xl, lw, lb), 8)),
        ("ssa fwd+bwd [4,1,2,8,4]", lambda: spiking_attention(q, k, v, 0.125)[0].sum().backward(),
         lambda: attention_ref(q, k, v, 0.125).sum().backward()),
        # the zoo's attention unit: heads merged in and out (the plain form splits, attends, merges)
        ("ssa_unit fwd+bwd [4,1,8,2x4]", lambda: spiking_attention_unit(*qkv.split(8, -1), 2, 0.125)[0].sum().backward(),
         lambda: _merged_attention(qkv).sum().backward()),
        ("select_tokens [4,1,8] k=4", lambda: select_tokens(scores, 4), lambda: select_tokens_ref(scores, 4)),
        ("gather_tokens fwd+bwd [4,1,8,4]", lambda: gather_tokens(tok, idx).sum().backward(),
         lambda: gather_tokens_ref(tok, idx).sum().backward()),
        ("exit_confidence [3,16]x[64,16]", lambda: exit_confidence(h, w), lambda: exit_confidence_reference(h, w)),
        ("linear_ce fwd+bwd [8,16]x[64,16]", lambda: linear_ce(hc, wc, yc).backward(),
         lambda: F.cross_entropy(hc @ wc.T, yc).backward()),
        ("pack+unpack spikes [4,1,64]", lambda: unpack_spikes(pack_spikes(sp), sp.shape, sp.dtype),
         lambda: (sp != 0).to(torch.uint8).to(sp.dtype)),
    ]


def host_costs(rounds: int = 15, calls: int = 200) -> list[dict[str, Any]]:
    """Per op: `rounds` rounds, each timing `calls` calls of ours and then of plain torch (the order
    alternating by round), so a drift of the machine's speed falls on both; the medians of each and
    the median and range of the per-round ratios."""
    rows = []
    for name, ours, plain in _host_cases():
        for f in (ours, plain):  # warm-up (first-call compilation of a CPU path)
            for _ in range(3):
                f()
        res: dict[str, list[float]] = {"ours": [], "plain": []}
        for r in range(rounds):
            for label in (("ours", "plain") if r % 2 == 0 else ("plain", "ours")):
                f = ours if label == "ours" else plain
                t = time.perf_counter()
                for _ in range(calls):
                    f()
                res[label].append((time.perf_counter() - t) / calls)
        ratios = [a / b for a, b in zip(res["ours"], res["plain"])]
        rows.append({"op": name, "ours_us": statistics.median(res["ours"]) * 1e6,
                     "plain_us": statistics.median(res["plain"]) * 1e6, "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return rows


# ------------------------------------------------------------------- device steps (bench/gpu.sh)
#
#   python bench/step.py --device cuda --sizes cifar imagenet --amp fp32 bf16 --json steps.json
#   python bench/step.py --device cpu --dry-run --sizes cifar imagenet --amp fp32   (rehearsal: tiny models)
#
# A device step is zero_grad + forward (autocast) + cross-entropy + backward + AdamW, the same for every
# model. Modes: ours eager, `torch.compile` default and reduce-overhead (what `train.compile` applies to
# the forward: CUDA-graph replay with `cudagraph_mark_step_begin` per step, the loss cloned out of the
# graph's memory); spikingjelly's Spikformer eager, compiled, and replayed by its own CUDA-graph helper
# (`activation_based._cuda_graph.StaticCudaGraph` over forward + loss + backward, as its trainer does).
# Each (model, amp) is one process. A wave (one image size) compiles and checks all its processes at
# once, then times them one after the other: every compiled or replayed mode must give the eager loss
# and gradients within a tolerance at the same weights and batch before it is timed.

STEP_SIZES: dict[str, dict[str, Any]] = {
    "cifar": {"batch": 64, "img": 32, "classes": 10, "models": ["spikformer-4-384", "spikformer-stata"], "peer": True},
    "imagenet": {"batch": 32, "img": 224, "classes": 1000, "models": ["spikformer-8-512", "spikformer-8-512-stata"],
                 "peer": False},
}
# --dry-run: the same models at toy width on small images (the code paths, not the numbers)
DRY_STEP = {"cifar": {"batch": 2, "img": 32, "kw": {"embed_dim": 32, "num_heads": 2}},
            "imagenet": {"batch": 2, "img": 64, "kw": {"embed_dim": 32, "num_heads": 2, "img_size": 64}}}
OUR_MODES = ("eager", "default", "reduce-overhead")
PEER_MODES = ("eager", "default", "cudagraph")
# (loss rel, gradient rel L2) of a mode against its reference, per amp: |loss difference| / |loss| and
# the gradient difference's L2 norm over the reference gradients' (all parameters as one vector),
# same weights and batch. A step compiled by inductor sums in another order than eager; at full
# width and batch some membrane potentials lie within that rounding of the threshold, their spikes
# flip and the surrogate gradients carry the flips through every later block (an H200 run: loss
# 1e-4..2e-3, gradients 40-50 % apart, spikingjelly's compiled step as ours), while the same
# comparison at toy widths agrees to 3e-7 (the CPU rehearsal). Such a mode is "flips": timed, its
# loss within FLIP_LOSS_TOL; the CPU tests hold compiled training equal to eager where no spike sits
# that close. A CUDA-graph replay runs the kernels it captured: exact against what it replays.
CHECK_TOL = {"fp32": (1e-4, 2e-3), "bf16": (2e-2, 5e-2), "fp16": (2e-2, 5e-2)}
FLIP_LOSS_TOL = 1e-2
INDUCTOR_MODES = ("default", "reduce-overhead")
READY = "READY "


def _amp_ctx(device: torch.device, amp: str):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _launch_profile(step: Callable[[], Any], dev: torch.device) -> dict[str, Any]:
    """One more step under torch.profiler: on CUDA the kernels the device ran (copies and fills
    excepted), their summed time and the host's launch calls (a CUDA-graph replay is one launch
    for many kernels); a step whose kernels take a small share of its time waits on the host. On
    CPU (rehearsal) the top-level aten ops instead."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            step()
            _sync(dev)
        ev = prof.events()
        if dev.type == "cuda":
            kern = [e for e in ev if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
            calls = [e for e in ev if e.device_type == DeviceType.CPU
                     and any(k in e.name for k in ("LaunchKernel", "GraphLaunch", "cuLaunch"))]
            by: dict[str, list[float]] = {}
            for e in kern:
                t = by.setdefault(e.name, [0, 0.0])
                t[0] += 1
                t[1] += e.time_range.elapsed_us()
            top = sorted(by.items(), key=lambda kv: -kv[1][1])[:10]
            return {"kernels": len(kern), "kernel_ms": sum(e.time_range.elapsed_us() for e in kern) / 1e3,
                    "launch_calls": len(calls),
                    "top_kernels": [[name[:120], int(c), us / 1e3] for name, (c, us) in top]}
        top = [e for e in ev if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
        return {"aten_ops": len(top)}
    except Exception as e:  # the count is an addition to the part: its failure is reported, not fatal
        return {"launch_error": f"{type(e).__name__}: {str(e)[:200]}"}


class DeviceStep:
    """One model, one batch, one amp: a step callable per mode, checks against eager, timing."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec, self.dev, self.amp = spec, torch.device(spec["device"]), spec["amp"]
        size = STEP_SIZES[spec["size"]]
        dry = DRY_STEP[spec["size"]] if spec["dry"] else None
        B, img = (dry["batch"], dry["img"]) if dry else (size["batch"], size["img"])
        g = torch.Generator().manual_seed(0)
        x = torch.rand(B, 3, img, img, generator=g)
        y = torch.randint(0, size["classes"], (B,), generator=g)
        torch.manual_seed(0)
        name, _, level = spec["model"].partition("@")  # "model@level": ours at that memory level
        self.peer = name == "spikingjelly"
        self.info: dict[str, Any] = {"batch": B, "img": img}
        if self.peer:
            from spikingjelly.activation_based import functional
            from spikingjelly.activation_based.model.spikformer import Spikformer, spikformer_cifar10

            self.reset = functional.reset_net
            if dry:
                self.model = Spikformer(T=4, img_size_h=img, img_size_w=img, patch_size=4, num_classes=size["classes"],
                                        embed_dims=dry["kw"]["embed_dim"], num_heads=2, depths=4)
            else:
                self.model = spikformer_cifar10(T=4, num_classes=size["classes"])
        else:
            from efficient.zoo import create

            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from stata import macs

            self.reset = None
            # built as stata.py builds it: at the final keep ratio (no warm-up told)
            self.model = create(name, **(dry["kw"] if dry else {}))
            _stage("model built")
            m, b = macs(self.model.train(), x[:1])  # counted on the CPU before the move
            _stage("MACs counted")
            self.info.update(macs=m, block_macs=b)
        self.model = self.model.train().to(self.dev)
        _stage(f"model on {self.dev}")
        if level:  # before any mode compiles: its regions become the compiler's
            from efficient import memory

            memory.optimize(self.model, level)
            self.info["memory"] = level
        self.info["params_m"] = sum(p.numel() for p in self.model.parameters()) / 1e6
        self.x, self.y = x.to(self.dev), y.to(self.dev)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.steps: dict[str, Callable[[], torch.Tensor]] = {}

    # a step without the optimizer: zero_grad, forward, loss, backward; returns the loss (outliving a replay)
    def _loss(self, fwd) -> torch.Tensor:
        with _amp_ctx(self.dev, self.amp):
            out = fwd(self.x)
        if out.dim() == 3:  # spikingjelly's Spikformer: per-step logits [T, B, classes]
            out = out.mean(0)
        return F.cross_entropy(out.float(), self.y)

    def make(self, mode: str) -> Callable[[], torch.Tensor]:
        model = self.model
        if mode == "eager" or mode == "default":
            fwd = model if mode == "eager" else torch.compile(model)

            def step() -> torch.Tensor:
                for p in self.params:
                    p.grad = None
                loss = self._loss(fwd)
                loss.backward()
                if self.reset is not None:
                    self.reset(model)
                return loss.detach()
        elif mode == "reduce-overhead":
            fwd = torch.compile(model, mode="reduce-overhead")

            def step() -> torch.Tensor:
                torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs may be overwritten now
                for p in self.params:
                    p.grad = None
                loss = self._loss(fwd)
                loss.backward()
                return loss.detach().clone()
        elif mode == "cudagraph":
            if self.dev.type != "cuda":
                raise RuntimeError("spikingjelly's StaticCudaGraph needs a CUDA device")
            from spikingjelly.activation_based._cuda_graph import StaticCudaGraph, validate_cuda_graph_model

            validate_cuda_graph_model(model)

            def fwd_bwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                with _amp_ctx(self.dev, self.amp):
                    out = model(x)
                loss = F.cross_entropy((out.mean(0) if out.dim() == 3 else out).float(), y)
                loss.backward()
                return loss

            graph = StaticCudaGraph(fwd_bwd, warmup_steps=3)
            captured: list[torch.Tensor] = []  # the gradient tensors the captured backward accumulates into

            def step() -> torch.Tensor:
                if captured:  # another mode may have replaced .grad since: point it back at the graph's tensors
                    for p, g in zip(self.params, captured):
                        p.grad = g
                for p in self.params:  # its trainer zeroes in place: the graph accumulates into fixed tensors
                    if p.grad is not None:
                        p.grad.zero_()
                loss = graph(self.x, self.y)
                if graph._graph is not None and not captured:
                    captured.extend(p.grad for p in self.params)
                self.reset(model)
                return loss.detach().clone()
        else:
            raise ValueError(f"unknown mode {mode!r}")
        self.steps[mode] = step
        return step

    def grads(self) -> list[torch.Tensor]:
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().float().clone() for p in self.params]

    def prepare(self, modes: list[str]) -> dict[str, Any]:
        """Compile and warm every mode, check each against eager; peak memory of each mode's first steps."""
        out: dict[str, Any] = {}
        ref_loss = ref_g = None
        compiled: dict[str, tuple[float, list[torch.Tensor]]] = {}  # the default mode's loss and gradients
        for mode in modes:
            row: dict[str, Any] = {}
            out[mode] = row
            try:
                _stage(f"{mode}: building")
                step = self.make(mode)
                if self.dev.type == "cuda":
                    torch.cuda.empty_cache()
                _peak_reset(self.dev)
                counters = torch._dynamo.utils.counters
                graphs0, skips0 = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
                t0 = time.perf_counter()
                for _ in range(1 if mode == "eager" else 3):  # compile, CUDA-graph warm-up and capture
                    step()
                _sync(self.dev)
                row["warmup_s"] = time.perf_counter() - t0
                _stage(f"{mode}: warm ({row['warmup_s']:.0f} s)")
                if mode in ("default", "reduce-overhead"):  # graphs compiled (1 = no graph break); CUDA graphs refused
                    row["graphs"] = counters["stats"]["unique_graphs"] - graphs0
                    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips0
                loss = step()  # the checked step (a replay in the graph modes)
                _sync(self.dev)
                row["peak_bytes"] = _peak(self.dev)
                g = self.grads()
                _stage(f"{mode}: checked")
                row["loss"] = float(loss)
                if mode == "eager":
                    ref_loss, ref_g = float(loss), g
                    row["checked"] = "reference"
                    continue
                if ref_g is None:
                    raise RuntimeError("no eager reference to check against")
                # a CUDA-graph replay of compiled code is checked against the compiled step it
                # replays, exactly; inductor's code against eager may differ by spikes that flip
                # where its reordered sums round the membrane across the threshold (see CHECK_TOL)
                against, (rl, rg) = "eager", (ref_loss, ref_g)
                if mode == "reduce-overhead" and "default" in compiled:
                    against, (rl, rg) = "default", compiled["default"]
                num = sum(float((a - b).double().pow(2).sum()) for a, b in zip(g, rg))
                den = sum(float(b.double().pow(2).sum()) for b in rg)
                row["against"] = against
                row["loss_rel"] = abs(float(loss) - rl) / max(abs(rl), 1e-12)
                row["grad_rel"] = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
                tl, tg = CHECK_TOL[self.amp]
                if row["loss_rel"] <= tl and row["grad_rel"] <= tg:
                    row["checked"] = "match"
                elif (mode in INDUCTOR_MODES and against == "eager" and row["loss_rel"] <= max(tl, FLIP_LOSS_TOL)
                      and math.isfinite(row["grad_rel"])):
                    row["checked"] = "flips"
                else:
                    row["checked"] = "MISMATCH"
                if mode == "default" and row["checked"] != "MISMATCH":
                    compiled["default"] = (float(loss), g)
                del g
            except Exception as e:  # reported: a mode that cannot run is a failure of this part, not a crash of the rest
                first = (str(e).strip().splitlines() or [""])[0]
                row["error"] = f"{type(e).__name__}: {first[:240]}"
                row["error_full"] = str(e)[:2000]
            finally:
                for p in self.params:
                    p.grad = None
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        return out

    def time(self, modes: list[str], steps: int, warmup: int) -> dict[str, dict[str, Any]]:
        """Median step ms per mode with AdamW, modes interleaved step by step in rotating order; then
        one profiled step per mode (kernels, their time, launch calls)."""
        opt = torch.optim.AdamW(self.params, lr=1e-5)
        fns = {m: self.steps[m] for m in modes}
        times: dict[str, list[float]] = {m: [] for m in modes}

        def unit(m: str) -> None:  # one timed step: the mode's step and the optimizer
            if m == "cudagraph":  # its trainer keeps the gradient tensors the graph writes into
                opt.zero_grad(set_to_none=False)
            fns[m]()
            opt.step()

        for i in range(warmup + steps):
            for m in modes[i % len(modes):] + modes[: i % len(modes)]:
                _sync(self.dev)
                t0 = time.perf_counter()
                unit(m)
                _sync(self.dev)
                if i >= warmup:
                    times[m].append(time.perf_counter() - t0)
        out = {m: {"step_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v)} for m, v in times.items()}
        # one more step per mode under the profiler, here rather than in prepare: the processes of a
        # wave prepare side by side on one device, and a kernel's recorded time then includes the
        # other processes' time slices (kernel sums above the step time, 2026-12-04); timing runs alone
        for m in modes:
            out[m].update(_launch_profile(functools.partial(unit, m), self.dev))
        return out


_T_CHILD = time.perf_counter()


def _stage(what: str) -> None:
    """A device child's progress on stderr: the parent shows the last lines of a child that never gets ready."""
    print(f"# stage {time.perf_counter() - _T_CHILD:.0f} s: {what}", file=sys.stderr, flush=True)


def gpu_child(spec: dict[str, Any]) -> int:
    """One (model, amp): prepare, print READY, wait for a line on stdin, time, print RESULT."""
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    if spec.get("precision", "torch") != "torch":  # the same for ours and the peer's (1x1 convolutions)
        from efficient.train.engine import set_fp32_precision

        set_fp32_precision(torch.device(spec["device"]), spec["precision"] == "tf32")
    try:
        bench = DeviceStep(spec)
        checks = bench.prepare(spec["modes"])
    except Exception as e:
        print(READY + json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
        return 1
    print(READY + json.dumps({"info": bench.info, "modes": checks, "prepare_s": time.perf_counter() - t0}), flush=True)
    if not sys.stdin.readline().strip():
        return 0  # the parent closed the pipe: no timing slot
    ok = [m for m in spec["modes"] if checks[m].get("checked") in ("reference", "match", "flips")]
    res = bench.time(ok, spec["steps"], spec["warmup"]) if ok else {}
    print(RESULT + json.dumps(res), flush=True)
    return 0


def _wait_pids(path: str | None, max_s: float) -> None:
    """Wait (at most max_s) until no process listed in `path` is alive: they share the device."""
    if not path or not os.path.exists(path):
        return
    pids = [int(p) for p in Path(path).read_text().split() if p.strip().isdigit()]
    t0 = time.perf_counter()
    def alive(p: int) -> bool:
        try:
            os.kill(p, 0)
            return True
        except OSError:
            return False
    while any(alive(p) for p in pids) and time.perf_counter() - t0 < max_s:
        time.sleep(0.5)
    waited = time.perf_counter() - t0
    if waited > 1:
        print(f"# waited {waited:.0f} s for processes {pids} sharing the device before timing", flush=True)


def _run_wave(jobs: list[dict[str, Any]], args: argparse.Namespace, deadline: float) -> list[dict[str, Any]]:
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(max(2, (os.cpu_count() or 2) // max(1, len(jobs))))}
    procs = []
    for job in jobs:
        cmd = [sys.executable, os.path.abspath(__file__), "--gpu-child", json.dumps(job)]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    # stderr drained in threads: a full pipe would stall a child
    errs: list[list[str]] = [[] for _ in procs]
    stages = ["no stage reported"] * len(procs)  # each child's last "# stage" line (see _stage)
    def drain(i: int) -> None:
        for line in procs[i].stderr:  # type: ignore[union-attr]
            if line.startswith("# stage"):
                stages[i] = line[2:].strip()
                continue
            errs[i].append(line)
            del errs[i][:-20]
    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()

    def read_tagged(p: subprocess.Popen, tag: str, until: float) -> dict[str, Any] | None:
        box: list[str] = []
        def reader() -> None:
            for line in p.stdout:  # type: ignore[union-attr]
                if line.startswith(tag):
                    box.append(line[len(tag):])
                    return
        th = threading.Thread(target=reader, daemon=True)
        th.start()
        th.join(max(1.0, until - time.perf_counter()))
        return json.loads(box[0]) if box else None

    prep_until = min(deadline, time.perf_counter() + args.prepare_s)
    results = []
    for i, (job, p, e) in enumerate(zip(jobs, procs, errs)):
        r = read_tagged(p, READY, prep_until)
        if r is None:  # still preparing, or gone: the stage it last reported says where it stood
            rc = p.poll()
            state = "still preparing" if rc is None else f"exited with code {rc}"
            r = {"error": f"not ready in time: {state}, last {stages[i]} ({''.join(e[-3:]).strip()[-300:]})"}
        results.append({**job, **r})
        state = "ready" if "error" not in r else f"failed: {r['error']}"
        print(f"#   {job['model']} {job['amp']}: {state}" + (f" after {r['prepare_s']:.0f} s" if "prepare_s" in r else ""), flush=True)
    _wait_pids(args.wait_pids, max(0.0, deadline - time.perf_counter()))
    for res, p, e in zip(results, procs, errs):
        if "error" in res or p.poll() is not None or time.perf_counter() > deadline - 5:
            if "error" not in res:
                res["error"] = "no time left to time it"
            p.kill()
            continue
        p.stdin.write("go\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        r = read_tagged(p, RESULT, min(deadline, time.perf_counter() + args.time_s))
        if r is None:
            res["error"] = f"timing did not finish ({''.join(e[-3:]).strip()[-300:]})"
            p.kill()
        else:
            for mode, t in r.items():
                res["modes"][mode].update(t)
        print(f"#   {res['model']} {res['amp']}: timed", flush=True)
    for p in procs:
        try:
            p.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
    return results


def _best(res: dict[str, Any]) -> tuple[str, float] | None:
    modes = res.get("modes")
    if not isinstance(modes, dict):  # a child that failed before reporting: the modes it was asked for
        return None
    timed = [(m, r["step_ms"]) for m, r in modes.items() if "step_ms" in r]
    return min(timed, key=lambda t: t[1]) if timed else None


def device_targets(results: list[dict[str, Any]]) -> bool:
    """The step targets as PASS/FAIL lines; False when a target cannot be evaluated or fails."""
    ok = True
    by = {(r["size"], r["model"], r["amp"]): r for r in results}
    def line(text: str, good: bool | None) -> None:
        nonlocal ok
        ok &= bool(good)
        print(f"target {text} {'PASS' if good else 'FAIL' if good is not None else 'FAIL (not measured)'}")
    ours_c, sj_c = by.get(("cifar", "spikformer-4-384", "fp32")), by.get(("cifar", "spikingjelly", "fp32"))
    bo, bs = (_best(ours_c) if ours_c else None), (_best(sj_c) if sj_c else None)
    if bo and bs:
        line(f"CIFAR b64 fp32 step >= 1.5x spikingjelly's best mode: ours {bo[0]} {bo[1]:.2f} ms, spikingjelly {bs[0]} "
             f"{bs[1]:.2f} ms: {bs[1] / bo[1]:.2f}x", bs[1] / bo[1] >= 1.5)
    else:
        line("CIFAR b64 fp32 step >= 1.5x spikingjelly's best mode", None)
    for size, s in STEP_SIZES.items():
        dense, stata = s["models"]
        for amp in ("fp32", "bf16"):
            d, st = by.get((size, dense, amp)), by.get((size, stata, amp))
            if d is None and st is None:
                continue
            bd, bst = (_best(d) if d else None), (_best(st) if st else None)
            if not (bd and bst and "macs" in d.get("info", {}) and "macs" in st.get("info", {})):
                line(f"STATA >= 90% of its ideal speed-up ({size} {amp})", None)
                continue
            ideal = d["info"]["macs"] / st["info"]["macs"]
            real = bd[1] / bst[1]
            line(f"STATA >= 90% of its ideal speed-up ({size} {amp}, best modes {bd[0]} / {bst[0]}): {real:.2f}x of ideal "
                 f"{ideal:.2f}x = {real / ideal:.0%}", real / ideal >= 0.9)
    for size, s in STEP_SIZES.items():
        for model in s["models"]:
            f32, b16 = by.get((size, model, "fp32")), by.get((size, model, "bf16"))
            if f32 is None or b16 is None:
                continue
            bf, bb = _best(f32), _best(b16)
            if bf and bb:
                line(f"bf16 not slower than fp32 ({size} {model}, best modes): bf16 {bb[1]:.2f} ms vs fp32 {bf[1]:.2f} ms",
                     bb[1] <= bf[1])
            else:
                line(f"bf16 not slower than fp32 ({size} {model})", None)
    # the memory levels in each mode against level none in the same mode (the memory part times the
    # eager step; here the compiled and CUDA-graph ones, where a launch-bound step's reruns cost least)
    for (size, model, amp), r in by.items():
        base, _, level = model.partition("@")
        none = by.get((size, base, amp))
        if not level or none is None or not isinstance(r.get("modes"), dict) or not isinstance(none.get("modes"), dict):
            continue
        for mode, m in r["modes"].items():
            n = none["modes"].get(mode, {})
            if not all(k in d and d[k] is not None for d in (m, n) for k in ("peak_bytes", "step_ms")):
                line(f"{level} ({size} {amp} {mode}) peak <= 20% of none's at <= 1.25x its time", None)
                continue
            pk, tm = m["peak_bytes"] / n["peak_bytes"], m["step_ms"] / n["step_ms"]
            line(f"{level} ({size} {amp} {mode}) peak <= 20% of none's at <= 1.25x its time: "
                 f"{m['peak_bytes'] / 2**20:,.0f} / {n['peak_bytes'] / 2**20:,.0f} MiB = {pk:.1%}, "
                 f"{m['step_ms']:.2f} / {n['step_ms']:.2f} ms = {tm:.2f}x", pk <= 0.2 and tm <= 1.25)
    return ok


def device_main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible")
        return 1
    try:
        from importlib.metadata import version
        sj = version("spikingjelly")
    except Exception:
        sj = None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine()
    print(f"# bench/step.py --device {args.device} -- {datetime.date.today()}, {name}, torch {torch.__version__}, "
          f"spikingjelly {sj or 'not installed'}, fp32 precision {args.precision}{' (dry run: toy widths)' if args.dry_run else ''}")
    results: list[dict[str, Any]] = []
    failed = False
    for size in args.sizes:
        s = STEP_SIZES[size]
        models = list(s["models"]) + (["spikingjelly"] if s["peer"] and not args.no_peer else [])
        if "spikingjelly" in models and sj is None:
            print("# spikingjelly not installed: its rows are not measured")
            models.remove("spikingjelly")
        jobs = [{"size": size, "model": m, "amp": amp, "device": args.device, "dry": args.dry_run, "steps": args.steps,
                 "warmup": args.warmup, "precision": args.precision,
                 "modes": [md for md in (PEER_MODES if m == "spikingjelly" else OUR_MODES)
                           if not (args.dry_run and md == "cudagraph") and (md == "eager" or md in args.modes)]}
                for amp in args.amp for m in models]
        # --max-procs splits a size's processes into waves (the ImageNet steps hold tens of GiB each)
        per = args.max_procs or len(jobs)
        waves = [jobs[w:w + per] for w in range(0, len(jobs), per)]
        # then the size's dense model again at each other memory level (`train.memory`), every mode: a wave
        # of its own, so its compiles never slow the main processes' way to ready
        if args.memory_levels:
            waves.append([{**jobs[0], "model": f"{s['models'][0]}@{level}", "amp": amp,
                           "modes": [md for md in OUR_MODES if md == "eager" or md in args.modes]}
                          for level in args.memory_levels for amp in args.amp])
        for i, wave in enumerate(waves):
            if time.perf_counter() > deadline - 30:
                left = [j for later in waves[i:] for j in later]
                print(f"# {size}: {len(left)} processes skipped, the part's budget is spent")
                failed = True
                results += [{**j, "error": "skipped: the part's budget is spent"} for j in left]
                break
            print(f"# {size}: {len(wave)} processes compile and check at once, then time one after the other", flush=True)
            results += _run_wave(wave, args, deadline)
            if args.json:
                Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "spikingjelly": sj,
                                                       "results": results}, indent=1, default=str))
    print("\n## training step on the device (zero_grad + forward + CE + backward + AdamW), median ms\n")
    print("| size | model | amp | mode | check vs eager (loss rel, grad rel) | peak MiB (first steps) | step ms | warm-up s "
          "| kernels / step (host launch calls) | kernel ms / step | device busy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r and not isinstance(r.get("modes"), dict):  # the child never reported its modes
            print(f"| {r['size']} | {r['model']} | {r['amp']} | | {r['error']} | | | |")
            failed = True
            continue
        for mode, m in r["modes"].items():
            if "error" in m:
                chk = m["error"]
            elif m.get("checked") == "reference":
                chk = "reference"
            else:
                chk = f"{m['checked']} vs {m.get('against', 'eager')} ({m['loss_rel']:.1e}, {m['grad_rel']:.1e})"
            failed |= "error" in m or m.get("checked") == "MISMATCH" or "step_ms" not in m
            peak = f"{m['peak_bytes'] / 2**20:,.0f}" if m.get("peak_bytes") is not None else "n/a"
            st = f"{m['step_ms']:.2f}" if "step_ms" in m else r.get("error", "not timed")
            ws = f"{m['warmup_s']:.1f}" if "warmup_s" in m else ""
            if "kernels" in m:
                kn, km = f"{m['kernels']} ({m['launch_calls']})", f"{m['kernel_ms']:.2f}"
                busy = f"{m['kernel_ms'] / m['step_ms']:.0%}" if "step_ms" in m else ""
            elif "aten_ops" in m:  # CPU rehearsal
                kn, km, busy = f"{m['aten_ops']} aten ops", "", ""
            else:
                kn, km, busy = m.get("launch_error", ""), "", ""
            print(f"| {r['size']} | {r['model']} | {r['amp']} | {mode} | {chk} | {peak} | {st} | {ws} | {kn} | {km} | {busy} |")
    tops = [(r, mode, m["top_kernels"]) for r in results if isinstance(r.get("modes"), dict)
            for mode, m in r["modes"].items() if m.get("top_kernels")]
    if tops:
        print("\n## costliest kernels of one profiled step: calls x, total ms (five of the ten in the JSON)\n")
        for r, mode, top in tops:
            listed = "; ".join(f"{name[:60]} {c}x {ms:.2f}" for name, c, ms in top[:5])
            print(f"- {r['size']} {r['model']} {r['amp']} {mode}: {listed}")
    for size in args.sizes:
        info = {r["model"]: r.get("info", {}) for r in results if r["size"] == size and r["amp"] == args.amp[0]}
        dense, stata = STEP_SIZES[size]["models"]
        if "macs" in info.get(dense, {}) and "macs" in info.get(stata, {}):
            print(f"\n{size}: ideal STATA speed-up (profiler MACs, whole step) {info[dense]['macs'] / info[stata]['macs']:.2f}x")
    met = device_targets(results)  # on a dry run (toy widths, CPU) the lines rehearse the code, they judge nothing
    verdict = "not judged (dry run)" if args.dry_run else ("met" if met else "not all met (see target lines)")
    print(f"\n# step part: {time.perf_counter() - t_start:.0f} s; checks {'FAILED' if failed else 'passed'}; targets {verdict}")
    return 1 if failed else 0


def _load() -> str:
    try:
        return os.getloadavg().__repr__()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-host", action="store_true")
    ap.add_argument("--separate-units", action="store_true",
                    help="also count and time each step with BatchNorm and neuron as two calls (alternated)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    dv = ap.add_argument_group("device steps (bench/gpu.sh): eager / compiled / CUDA-graph steps, fp32 and bf16")
    dv.add_argument("--device", default="cpu", help="cuda: the device steps; cpu (default): the host-cost tables above")
    dv.add_argument("--dry-run", action="store_true", help="the device steps on this CPU at toy widths (rehearsal)")
    dv.add_argument("--sizes", nargs="+", default=list(STEP_SIZES), choices=list(STEP_SIZES))
    dv.add_argument("--amp", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    dv.add_argument("--modes", nargs="+", default=list(dict.fromkeys(OUR_MODES + PEER_MODES)),
                    choices=list(dict.fromkeys(OUR_MODES + PEER_MODES)),
                    help="step modes to prepare and time (eager, the reference, always; ours: default, reduce-overhead; "
                         "spikingjelly: default, cudagraph)")
    dv.add_argument("--precision", choices=["tf32", "strict", "torch"], default="tf32",
                    help="fp32 matmuls and convolutions on CUDA, every model alike: tf32 (what the trainer's "
                         "train.tf32 sets), strict, or torch's defaults (TF32 convolutions, strict matmuls)")
    dv.add_argument("--memory-levels", nargs="*", default=[], choices=["bits", "recompute"],
                    help="also the dense model at these memory levels (each its own process, every mode): "
                         "peak and time beside level none's")
    dv.add_argument("--steps", type=int, default=15, help="timed steps per mode (after --warmup)")
    dv.add_argument("--warmup", type=int, default=2, help="untimed steps per mode before timing (compiled already)")
    dv.add_argument("--budget-s", type=float, default=600.0, help="the whole device part; what does not fit is skipped")
    dv.add_argument("--prepare-s", type=float, default=240.0, help="per wave: compile and check")
    dv.add_argument("--max-procs", type=int, default=0,
                    help="at most this many processes per wave (default: a size's all at once); jobs are ordered amp by amp")
    dv.add_argument("--time-s", type=float, default=90.0, help="per process: timing")
    dv.add_argument("--wait-pids", default=None, help="file of process ids sharing the device: time only once they are gone")
    dv.add_argument("--json", default=None)
    dv.add_argument("--gpu-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.gpu_child:
        return gpu_child(json.loads(args.gpu_child))
    if args.device != "cpu" or args.dry_run:
        return device_main(args)
    torch.set_num_threads(os.cpu_count() or 1)
    if args.child:  # one model in this fresh process: no compiled kernels, caches or threads of another
        build = (lambda: _spikingjelly(args.batch)) if args.child == PEER else (lambda: _ours(args.child, args.batch))
        print(RESULT + json.dumps(measure_model(args.child, build, args.repeats, not args.no_compile,
                                                args.separate_units and args.child != PEER)), flush=True)
        return 0
    print(f"# bench/step.py -- {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load before {_load()}")
    print(f"# command: python bench/step.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    rows = []
    for label in [*args.models, *([] if args.no_peer else [PEER])]:
        cmd = [sys.executable, __file__, "--child", label, "--batch", str(args.batch), "--repeats", str(args.repeats),
               *(["--no-compile"] if args.no_compile else []), *(["--separate-units"] if args.separate_units else [])]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)]
        if out.returncode or not lines:
            print(f"#   {label}: failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        rows.append(json.loads(lines[-1][len(RESULT):]))
        print(f"#   {label}: done (load {_load()})", flush=True)
    print(f"\n## one training step, batch {args.batch} (forward + objective + backward), medians of {args.repeats}\n")
    print("| model | params M | aten ops / step | of which do work | eager s | compiled s | compiled vs eager | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = f"{r['compiled_s']:.3f} | {r['eager_s'] / r['compiled_s']:.2f}x | {r['compile_s']:.0f}" if "compiled_s" in r else " | | "
        print(f"| {r['model']} | {r['params_m']:.2f} | {r['ops']} | {r['work_ops']} | {r['eager_s']:.3f} | {c} |")
    if any("ops_separate" in r for r in rows):
        print("\n## BatchNorm + neuron as one op vs two calls (same process, steps alternated)\n")
        print("| model | aten ops / step, one op | two calls | eager s, one op | two calls | two calls / one op |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if "ops_separate" in r:
                print(f"| {r['model']} | {r['ops']} | {r['ops_separate']} | {r['eager_s']:.3f} | {r['eager_separate_s']:.3f} | "
                      f"{r['eager_separate_s'] / r['eager_s']:.3f} |")
    if not args.no_host:
        print("\n## host cost of one call (tiny inputs; 15 rounds of 200 calls each, ours and plain alternating)\n")
        print("| op | ours us | plain torch us | ours / plain (median of rounds) | range |")
        print("|---|---|---|---|---|")
        for r in host_costs():
            print(f"| {r['op']} | {r['ours_us']:.0f} | {r['plain_us']:.0f} | {r['ratio']:.2f} | "
                  f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f} |", flush=True)
    print(f"\n# load after {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
