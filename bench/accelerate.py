"""Training-step time before vs after `efficient.accelerate`, on spikingjelly and snntorch models.

    python bench/accelerate.py [--repeats 7] [--quick]

Each model is deep-copied and accelerated; a training step (forward, loss, backward, SGD step) of
the original and of the accelerated copy alternate (interleaved, so load changes hit both), and the
table reports medians in ms and the speedup. "neurons only" rows time the snntorch Leaky layers alone
(per-step Python loop vs one kernel call over [T, ...], forward + backward).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Callable

import torch
from torch import nn

import efficient


def _sj_models(quick: bool) -> list[tuple[str, nn.Module, torch.Tensor, Callable, Callable]]:
    from spikingjelly.activation_based import functional, layer, neuron
    from spikingjelly.activation_based.model.spikformer import spikformer_cifar10

    def step(model, x):
        out = model(x)
        out = out.mean(0) if out.dim() == 3 else out
        loss = nn.functional.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))
        loss.backward()
        functional.reset_net(model)

    torch.manual_seed(0)
    sformer = spikformer_cifar10(T=2)
    conv = nn.Sequential(
        layer.Conv2d(2, 16, 3, padding=1), layer.BatchNorm2d(16), neuron.LIFNode(tau=2.0),
        layer.MaxPool2d(2), layer.Conv2d(16, 32, 3, padding=1), layer.BatchNorm2d(32),
        neuron.ParametricLIFNode(), layer.MaxPool2d(2), layer.Flatten(),
        layer.Linear(32 * 8 * 8, 10), neuron.LIFNode(tau=2.0),
    )
    functional.set_step_mode(conv, "m")
    return [
        ("spikingjelly spikformer_cifar10 (T=2, B=2, 32x32)", sformer, torch.rand(2, 3, 32, 32), step, step),
        ("spikingjelly conv SNN (T=8, B=16, 2x32x32)", conv, torch.rand(8, 16, 2, 32, 32) * 2, step, step),
    ]


def _snn_models(quick: bool) -> list[tuple[str, nn.Module, torch.Tensor, Callable, Callable]]:
    import snntorch as snn
    from snntorch import utils

    def loop(model, x):
        utils.reset(model)
        spk, mem = zip(*(model(x[t]) for t in range(x.shape[0])))
        _loss(torch.stack(spk)).backward()

    def multi(model, x):
        utils.reset(model)
        spk, mem = model.multi_step(x)
        _loss(spk).backward()

    def _loss(spk):
        return nn.functional.cross_entropy(spk.sum(0), torch.zeros(spk.shape[1], dtype=torch.long))

    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Flatten(), nn.Linear(784, 1024), snn.Leaky(beta=0.9, learn_beta=True, init_hidden=True),
        nn.Linear(1024, 1024), snn.Leaky(beta=torch.full((1024,), 0.8), learn_beta=True, init_hidden=True,
                                         reset_mechanism="zero"),
        nn.Linear(1024, 10), snn.Leaky(beta=0.9, init_hidden=True, output=True),
    )
    conv = nn.Sequential(
        nn.Conv2d(2, 16, 3, padding=1), nn.MaxPool2d(2), snn.Leaky(beta=0.8, learn_beta=True, init_hidden=True),
        nn.Conv2d(16, 32, 3, padding=1), nn.MaxPool2d(2), snn.Leaky(beta=0.8, learn_beta=True, init_hidden=True),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10), snn.Leaky(beta=0.9, init_hidden=True, output=True),
    )
    mlp_x, conv_x = torch.rand(16, 64, 1, 28, 28), torch.rand(8, 16, 2, 32, 32) * 2
    return [
        ("snntorch Leaky MLP (T=16, B=64, 784-1024-1024-10)", mlp, mlp_x, loop, multi),
        ("snntorch conv net (T=8, B=16, 2x32x32)", conv, conv_x, loop, multi),
        ("  its Leaky neurons only: MLP", *_neurons_of(mlp, mlp_x, snn, utils)),
        ("  its Leaky neurons only: conv net", *_neurons_of(conv, conv_x, snn, utils)),
    ]


def _neurons_of(model: nn.Module, x: torch.Tensor, snn, utils) -> tuple:
    """The Leaky layers of `model` alone, on random currents of the shapes they see in it."""
    shapes: list = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: shapes.append(inp[0].shape))
             for m in model if isinstance(m, snn.Leaky)]
    with torch.no_grad():
        utils.reset(model)
        model(x[0])
    for h in hooks:
        h.remove()
    layers = nn.ModuleList(copy.deepcopy(m) for m in model if isinstance(m, snn.Leaky))
    for m in layers:
        m.output = True
        snn.SpikingNeuron.instances.append(m)  # copies: let snntorch.utils.reset find them
    xs = [torch.randn(x.shape[0], *s) + 0.5 for s in shapes]

    def loop(ls, inputs):
        utils.reset(ls)
        total = 0.0
        for layer, xi in zip(ls, inputs):
            xi = xi.clone().requires_grad_()
            total = total + torch.stack([layer(xi[t])[0] for t in range(xi.shape[0])]).sum()
        total.backward()

    def multi(ls, inputs):
        utils.reset(ls)
        total = 0.0
        for layer, xi in zip(ls, inputs):
            total = total + layer.multi_step(xi.clone().requires_grad_())[0].sum()
        total.backward()

    return layers, xs, loop, multi


def _time(fn: Callable, model: nn.Module, x) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    fn(model, x)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    ap.add_argument("--only", default="", help="run the rows whose name contains this text")
    args = ap.parse_args()
    repeats = 2 if args.quick else args.repeats
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU threads, load {os.getloadavg()[0]:.2f}")
    print("| model | before ms | after ms | speedup |")
    print("|---|---|---|---|")
    for name, model, x, before_fn, after_fn in _sj_models(args.quick) + _snn_models(args.quick):
        if args.only not in name:
            continue
        fast, report = efficient.accelerate(copy.deepcopy(model))
        assert not report.skipped, str(report)
        for _ in range(2):  # warm-up: the compiled loop builds once per configuration
            _time(before_fn, model, x)
            _time(after_fn, fast, x)
        tb, ta = [], []
        for _ in range(repeats):
            tb.append(_time(before_fn, model, x))
            ta.append(_time(after_fn, fast, x))
        b, a = statistics.median(tb), statistics.median(ta)
        print(f"| {name} | {b:.1f} | {a:.1f} | {b / a:.2f}x |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
