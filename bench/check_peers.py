"""`efficient check` on the peers' own example models: spikingjelly 2.0's zoo (Spikformer, QKFormer,
Spike-driven Transformer, SEW-ResNet, the PLIF nets) and snntorch's tutorial conv net, each with
and without the reset its library documents. Fresh weights on random inputs, so the firing-rate
check (trained weights, real data) is left out. Prints one markdown row per model (PASS/FAIL/SKIP and
the number of each check), at small widths and input sizes so it runs in a minute on a CPU.

    python bench/check_peers.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

import torch
from torch import nn

import efficient
from efficient.checks.report import CHECKS


Case = tuple[str, Callable[[], nn.Module], torch.Tensor, Any, bool]  # name, build, input, reset, time-major input


def _sj_models() -> list[Case]:
    from spikingjelly.activation_based import functional, neuron, surrogate
    from spikingjelly.activation_based.model import parametric_lif_net, qkformer, sew_resnet, spike_driven_transformer, spikformer

    def multistep(m: nn.Module) -> nn.Module:
        functional.set_step_mode(m, "m")
        return m

    img = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    seq = img[None].repeat(4, 1, 1, 1, 1)  # [T, B, C, H, W]
    mnist = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    reset = functional.reset_net
    return [
        ("spikingjelly spikformer_cifar10 (T=4)", lambda: spikformer.spikformer_cifar10(T=4, num_classes=10), img, reset, False),
        ("spikingjelly QKFormer (T=4, 64 wide)", lambda: qkformer.QKFormer(T=4, num_classes=10, embed_dims=64, num_heads=(1, 2, 2),
                                                                            depths=(1, 1, 1)), img, reset, False),
        ("spikingjelly SpikeDrivenTransformer (T=4, 64 wide)",
         lambda: spike_driven_transformer.SpikeDrivenTransformer(T=4, num_classes=10, embed_dims=64, num_heads=2, depths=1),
         img, reset, False),
        ("spikingjelly sew_resnet18 (multi-step, IF)",
         lambda: multistep(sew_resnet.sew_resnet18(spiking_neuron=neuron.IFNode, surrogate_function=surrogate.ATan(),
                                                   detach_reset=True, cnf="ADD", num_classes=10)), seq, reset, True),
        ("spikingjelly parametric_lif_net.MNISTNet (multi-step)",
         lambda: multistep(parametric_lif_net.MNISTNet(channels=16, spiking_neuron=neuron.ParametricLIFNode,
                                                       surrogate_function=surrogate.ATan(), detach_reset=True)),
         mnist[None].repeat(4, 1, 1, 1, 1), reset, True),
    ]


class SnntorchTutorialCSNN(nn.Module):
    """snntorch's tutorial 6 convolutional SNN (12C5-MP2-64C5-MP2-1024FC10), Leaky with init_hidden,
    looped over T inside forward as the tutorial does; returns the spike record [T, B, 10]."""

    def __init__(self, steps: int = 4, beta: float = 0.5) -> None:
        super().__init__()
        import snntorch as snn
        from snntorch import surrogate

        grad = surrogate.fast_sigmoid(slope=25)
        self.steps = steps
        self.net = nn.Sequential(
            nn.Conv2d(1, 12, 5), nn.MaxPool2d(2), snn.Leaky(beta=beta, spike_grad=grad, init_hidden=True),
            nn.Conv2d(12, 64, 5), nn.MaxPool2d(2), snn.Leaky(beta=beta, spike_grad=grad, init_hidden=True),
            nn.Flatten(), nn.Linear(64 * 4 * 4, 10), snn.Leaky(beta=beta, spike_grad=grad, init_hidden=True, output=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.net(x)[0] for _ in range(self.steps)])


def _snntorch_models() -> list[Case]:
    from snntorch import utils

    mnist = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    return [("snntorch tutorial CSNN (Leaky, init_hidden)", SnntorchTutorialCSNN, mnist, lambda m: utils.reset(m.net), False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = []
    for loader in (_sj_models, _snntorch_models):
        try:
            cases += loader()
        except ImportError as e:
            print(f"skipped: {e}")
    # the rates check judges trained weights on real data: these are fresh weights on random inputs
    ids = [c for c in CHECKS if c != "rates"]
    print("| model | reset between calls | " + " | ".join(ids) + " |")
    print("|---|---|" + "---|" * len(ids))
    rows = []
    for name, build, x, reset, time_major in cases:
        for with_reset in (True, False):
            torch.manual_seed(0)
            rep = efficient.check(build(), x, reset=reset if with_reset else None, only=ids, time_major=time_major,
                                  timesteps=x.shape[0] if time_major else None)
            cells = {r.id: (r.status, r.value) for r in rep.results}
            rows.append({"model": name, "reset": with_reset, "checks": {k: {"status": s, "value": v} for k, (s, v) in cells.items()},
                         "details": {r.id: r.detail for r in rep.results}})
            print(f"| {name} | {'library reset' if with_reset else 'none'} | "
                  + " | ".join(f"{cells[i][0]} {cells[i][1]:.3g}" if i in cells and cells[i][1] is not None
                               else (cells[i][0] if i in cells else "-") for i in ids) + " |", flush=True)
    for r in rows:
        for k, c in r["checks"].items():
            if c["status"] == "FAIL":
                print(f"- {r['model']} (reset: {r['reset']}) {k}: {r['details'][k]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
