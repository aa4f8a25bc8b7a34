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
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
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


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
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


def measure_model(label: str, build: Callable[[], tuple], repeats: int, compile_: bool) -> dict[str, Any]:
    step, model, compile_it = build()
    step()  # one-off allocations
    counter = OpCounter()
    with counter:
        step()
    eager, _ = _median_s(step, repeats, 1)
    row = {"model": label, "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "ops": counter.n, "eager_s": eager}
    if compile_:
        compile_it(model)
        row["compiled_s"], row["compile_s"] = _median_s(step, repeats, 2)
    return row


# ------------------------------------------------------------------------------------ host cost

def _host_cases() -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """(op, ours, plain torch) closures: forward + backward on tiny inputs."""
    from efficient.kernels.exit_confidence import exit_confidence, exit_confidence_reference
    from efficient.kernels.lif import lif
    from efficient.kernels.spike_pack import pack_spikes, unpack_spikes
    from efficient.kernels.ssa import attention_ref, spiking_attention
    from efficient.kernels.token_select import gather_tokens, gather_tokens_ref, select_tokens, select_tokens_ref

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1, 16, generator=g, requires_grad=True)

    def lif_plain() -> None:
        v, out = torch.zeros_like(x[0]), []
        for t in range(x.shape[0]):
            h = v + (x[t] - v) / 2.0
            s = (h >= 1.0).float() + torch.sigmoid(4.0 * (h - 1.0)) - torch.sigmoid(4.0 * (h - 1.0)).detach()
            v = h * (1.0 - s.detach())
            out.append(s)
        torch.stack(out).sum().backward()

    def lif_ours() -> None:
        lif(x, 2.0, 1.0, 0.0, True, True, "sigmoid", 4.0).sum().backward()

    q, k, v = ((torch.rand(4, 1, 2, 8, 4, generator=g) > 0.5).float().requires_grad_() for _ in range(3))
    scores = torch.rand(4, 1, 8, generator=g)
    tok = torch.randn(4, 1, 8, 4, generator=g, requires_grad=True)
    idx = torch.tensor([[0, 2, 5, 7]])
    h, w = torch.randn(3, 16, generator=g), torch.randn(64, 16, generator=g)
    sp = (torch.rand(4, 1, 64, generator=g) > 0.5).float()
    return [
        ("lif fwd+bwd [4,1,16]", lif_ours, lif_plain),
        ("ssa fwd+bwd [4,1,2,8,4]", lambda: spiking_attention(q, k, v, 0.125)[0].sum().backward(),
         lambda: attention_ref(q, k, v, 0.125).sum().backward()),
        ("select_tokens [4,1,8] k=4", lambda: select_tokens(scores, 4), lambda: select_tokens_ref(scores, 4)),
        ("gather_tokens fwd+bwd [4,1,8,4]", lambda: gather_tokens(tok, idx).sum().backward(),
         lambda: gather_tokens_ref(tok, idx).sum().backward()),
        ("exit_confidence [3,16]x[64,16]", lambda: exit_confidence(h, w), lambda: exit_confidence_reference(h, w)),
        ("pack+unpack spikes [4,1,64]", lambda: unpack_spikes(pack_spikes(sp), sp.shape, sp.dtype),
         lambda: (sp != 0).to(torch.uint8).to(sp.dtype)),
    ]


def host_costs(rounds: int = 7, calls: int = 200) -> list[dict[str, Any]]:
    rows = []
    for name, ours, plain in _host_cases():
        for f in (ours, plain):  # warm-up (first-call compilation of a CPU path)
            for _ in range(3):
                f()
        res = {}
        for label, f in (("ours", ours), ("plain", plain)):
            per = []
            for _ in range(rounds):
                t = time.perf_counter()
                for _ in range(calls):
                    f()
                per.append((time.perf_counter() - t) / calls)
            res[label] = statistics.median(per)
        rows.append({"op": name, "ours_us": res["ours"] * 1e6, "plain_us": res["plain"] * 1e6})
    return rows


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
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(os.cpu_count() or 1)
    if args.child:  # one model in this fresh process: no compiled kernels, caches or threads of another
        build = (lambda: _spikingjelly(args.batch)) if args.child == PEER else (lambda: _ours(args.child, args.batch))
        print(RESULT + json.dumps(measure_model(args.child, build, args.repeats, not args.no_compile)), flush=True)
        return 0
    print(f"# bench/step.py -- {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load before {_load()}")
    print(f"# command: python bench/step.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    rows = []
    for label in [*args.models, *([] if args.no_peer else [PEER])]:
        cmd = [sys.executable, __file__, "--child", label, "--batch", str(args.batch), "--repeats", str(args.repeats),
               *(["--no-compile"] if args.no_compile else [])]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)]
        if out.returncode or not lines:
            print(f"#   {label}: failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        rows.append(json.loads(lines[-1][len(RESULT):]))
        print(f"#   {label}: done (load {_load()})", flush=True)
    print(f"\n## one training step, batch {args.batch} (forward + objective + backward), medians of {args.repeats}\n")
    print("| model | params M | aten ops / step | eager s | compiled s | compiled vs eager | compile s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        c = f"{r['compiled_s']:.3f} | {r['eager_s'] / r['compiled_s']:.2f}x | {r['compile_s']:.0f}" if "compiled_s" in r else " | | "
        print(f"| {r['model']} | {r['params_m']:.2f} | {r['ops']} | {r['eager_s']:.3f} | {c} |")
    if not args.no_host:
        print("\n## host cost of one call (tiny inputs, median of 7 x 200 calls)\n")
        print("| op | ours us | plain torch us | ours / plain |")
        print("|---|---|---|---|")
        for r in host_costs():
            print(f"| {r['op']} | {r['ours_us']:.0f} | {r['plain_us']:.0f} | {r['ours_us'] / r['plain_us']:.2f} |", flush=True)
    print(f"\n# load after {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
