"""PGD attack throughput (images/s) on `stable-snn-vgg5`: our neurons vs spikingjelly's LIFNode.

    .venv/bin/python bench/attacks.py [--batch 8] [--steps 10] [--repeats 5] [--threads 1] [--no-dlif] [--profile]

One process, one fixed input batch (random images in [0, 1], random labels, seed 0) and the same
attack code (`efficient.attacks.pgd`, eps 8/255, uniform random start from a fixed generator).
The LIF model is built as the zoo builds it (`neuron: lif`); its spikingjelly twin is a deep copy
whose LIF modules are swapped for `LIFNode(step_mode="m")` with the same dynamics (tau = 1/(1-leak),
decay_input=False, hard reset to 0 not detached, PiecewiseQuadratic = our triangle surrogate), wrapped
so every forward starts from a reset state. The script first checks that both give the same logits and
input gradient (at a lower threshold, so that neurons fire), then times round-robin repeats after one warm-up attack each (which also compiles
ours) and prints medians and the ours / spikingjelly time ratio. DLIF (the default neuron) has no
spikingjelly counterpart; its row is ours only.

Where the time goes: a third copy, "shell", has every neuron replaced by `ShellSpike` (the same
Heaviside forward, an identity backward: two elementwise ops, no time loop), so its time is what
the convolutions, linear layers, BN, pooling and the attack loop cost; attack time minus shell time
is the neurons' share, and (shell + spikingjelly's neuron share) / shell bounds the ratio any
neuron of ours could reach against spikingjelly in this model. `--profile` also prints
torch.profiler's top operators of one attack per model.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
from torch import nn


class ResetEachForward(nn.Module):
    """Calls spikingjelly's reset_net before each forward: its neurons keep state across calls."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from spikingjelly.activation_based import functional

        functional.reset_net(self.net)
        return self.net(x)


def to_spikingjelly(model: nn.Module) -> nn.Module:
    """Deep copy of `model` with every `efficient.models.neurons.LIF` replaced by an equivalent LIFNode."""
    from spikingjelly.activation_based import neuron as sj_neuron
    from spikingjelly.activation_based import surrogate

    from efficient.models.neurons import LIF

    twin = copy.deepcopy(model)
    swapped = 0
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LIF):
                if child.surrogate != "triangle":
                    raise ValueError(f"no spikingjelly twin for surrogate {child.surrogate!r} in this bench")
                node = sj_neuron.LIFNode(
                    tau=child.tau, decay_input=child.decay_input, v_threshold=child.v_threshold,
                    v_reset=child.v_reset, detach_reset=child.detach_reset,
                    surrogate_function=surrogate.PiecewiseQuadratic(alpha=child.alpha), step_mode="m",
                )
                setattr(parent, name, node)
                swapped += 1
    if not swapped:
        raise ValueError("model has no efficient LIF modules to swap (build it with neuron='lif')")
    return ResetEachForward(twin)


class ShellSpike(nn.Module):
    """Stand-in neuron for timing the rest of the model: spikes = (x >= v_threshold) per step without
    membrane dynamics, gradient passed straight through (x - x.detach() keeps the graph)."""

    def __init__(self, v_threshold: float) -> None:
        super().__init__()
        self.v_threshold = v_threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x >= self.v_threshold).to(x.dtype) + (x - x.detach())


def to_shell(model: nn.Module) -> nn.Module:
    """Deep copy of `model` with every efficient spiking neuron replaced by `ShellSpike`."""
    from efficient.models.neurons import SpikingNeuron

    twin = copy.deepcopy(model)
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, SpikingNeuron):
                setattr(parent, name, ShellSpike(child.v_threshold))
    return twin


def profile_attack(label: str, m: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, steps: int, rows: int = 12) -> None:
    """torch.profiler's top operators (self CPU time) of one PGD attack."""
    from torch.profiler import ProfilerActivity, profile

    from efficient.attacks import pgd

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pgd(m, x, y, eps, steps=steps, generator=torch.Generator().manual_seed(1))
    print(f"\n### profile: {label}, PGD-{steps}, batch {len(y)}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def check(name: str, x: torch.Tensor, y: torch.Tensor, v_threshold: float) -> None:
    """Ours vs the spikingjelly twin: same logits and input gradient. Fresh weights at threshold 1 barely
    spike (zero logits, zero gradient), so the check uses a lower threshold to exercise firing and resets."""
    from efficient import zoo
    from efficient.attacks import input_grad

    torch.manual_seed(0)
    ours = zoo.create(name, neuron="lif", v_threshold=v_threshold).eval()
    sj = to_spikingjelly(ours).eval()
    with torch.no_grad():
        ref = ours(x)
        d_logits = (ref - sj(x)).abs().max().item()
        drift = (sj(x) - sj(x)).abs().max().item()  # reset works: same output on a second call
    g = input_grad(ours, x, y)
    d_grad = (g - input_grad(sj, x, y)).abs().max().item()
    print(f"check at v_threshold={v_threshold}: max |logits| {ref.abs().max().item():.2e}, ours - sj {d_logits:.1e}; "
          f"sj repeat-call drift {drift:.1e}; max |dx| {g.abs().max().item():.2e}, ours - sj {d_grad:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="stable-snn-vgg5")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eps", default="8/255")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-threshold", type=float, default=0.1, help="v_threshold of the equivalence check")
    ap.add_argument("--no-dlif", action="store_true", help="skip the ours-only DLIF row")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top operators of one attack per model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from efficient import zoo
    from efficient.attacks import parse_eps, pgd

    eps = parse_eps(args.eps)
    torch.manual_seed(0)
    ours = zoo.create(args.model, neuron="lif").eval()
    sj = to_spikingjelly(ours).eval()
    models = {"ours (LIF)": ours, "spikingjelly LIFNode": sj, "shell (no neuron dynamics)": to_shell(ours).eval()}
    if not args.no_dlif:
        models["ours (DLIF, as built by default)"] = zoo.create(args.model).eval()
    c, s = ours.in_chans, ours.img_size
    g = torch.Generator().manual_seed(0)
    x = torch.rand(args.batch, c, s, s, generator=g)
    y = torch.randint(0, ours.num_classes, (args.batch,), generator=g)

    check(args.model, x, y, args.check_threshold)

    def attack(m: nn.Module) -> float:
        gen = torch.Generator().manual_seed(1)
        t0 = time.perf_counter()
        pgd(m, x, y, eps, steps=args.steps, generator=gen)
        return time.perf_counter() - t0

    for m in models.values():  # warm-up (compiles ours)
        attack(m)
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(args.repeats):
        keys = list(models)
        keys = keys[r % len(keys):] + keys[: r % len(keys)]  # rotate the order against drift
        for k in keys:
            times[k].append(attack(models[k]))

    if args.profile:
        for k, m in models.items():
            profile_attack(k, m, x, y, eps, args.steps)

    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["spikingjelly LIFNode"]
    shell = med["shell (no neuron dynamics)"]
    print(f"\n{args.model}, T={ours.timesteps}, batch {args.batch}, PGD-{args.steps} eps {args.eps}, "
          f"{args.threads} thread(s), {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"median of {args.repeats}")
    print("| neurons | s / attack (median) | min-max | images/s | time ratio ours / sj |")
    print("|---|---|---|---|---|")
    for k, v in times.items():
        ratio = "1.00" if k == "spikingjelly LIFNode" else ("n/a" if "DLIF" in k or "shell" in k else f"{med[k] / ref:.2f}")
        print(f"| {k} | {med[k]:.2f} | {min(v):.2f}-{max(v):.2f} | {args.batch / med[k]:.2f} | {ratio} |")
    n_ours, n_sj = med["ours (LIF)"] - shell, ref - shell
    print(f"\nneurons' share of the attack: ours {n_ours:.2f} s ({100 * n_ours / med['ours (LIF)']:.0f} %), "
          f"spikingjelly {n_sj:.2f} s ({100 * n_sj / ref:.0f} %); the rest (shell) {shell:.2f} s. "
          f"speed-up over spikingjelly: {ref / med['ours (LIF)']:.2f}x; with neurons of zero cost it would be "
          f"{ref / shell:.2f}x (the ceiling for this model)")


if __name__ == "__main__":
    main()
