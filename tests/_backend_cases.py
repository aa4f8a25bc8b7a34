"""Every public kernel on tiny inputs, run through one backend value and compared with its torch
path. Shared by test_backend.py and its Triton-interpreter child process (run as a script, it checks
every kernel with backend='auto' under the EFFICIENT_BACKEND it inherits and prints one JSON line)."""

from __future__ import annotations

import json
import sys
from typing import Callable

import torch

from efficient.kernels.exit_confidence import exit_confidence
from efficient.kernels.lif import lif
from efficient.kernels.linear_ce import linear_ce
from efficient.kernels.ssa import spiking_attention
from efficient.kernels.token_select import gather_tokens, select_tokens


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _spikes(*shape: int, seed: int) -> torch.Tensor:
    return (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.4).float()


def run_lif(backend: str) -> list[torch.Tensor]:
    x = (_randn(3, 2, 4, seed=0) * 1.5 + 0.6).requires_grad_()
    s, h = lif(x, return_membrane=True, backend=backend)
    ((s * _randn(3, 2, 4, seed=1)).sum() + (h * _randn(3, 2, 4, seed=2)).sum()).backward()
    return [s, h, x.grad]


def run_select_tokens(backend: str) -> list[torch.Tensor]:
    idx, z = select_tokens(_randn(2, 2, 6, seed=3), 3, backend=backend)
    return [idx, z]


def run_gather_tokens(backend: str) -> list[torch.Tensor]:
    x = _randn(2, 2, 6, 4, seed=4).requires_grad_()
    out = gather_tokens(x, torch.tensor([[0, 2, 5], [1, 3, 4]]), backend=backend)
    (out * _randn(2, 2, 3, 4, seed=5)).sum().backward()
    return [out, x.grad]


def run_spiking_attention(backend: str) -> list[torch.Tensor]:
    q, k, v = (_spikes(2, 1, 2, 5, 4, seed=s).requires_grad_() for s in (6, 7, 8))
    y, s, c = spiking_attention(q, k, v, anchor=True, scores=True, backend=backend)
    ((y * _randn(2, 1, 2, 5, 4, seed=9)).sum() + s.sum() + 0.5 * c.sum()).backward()
    return [y, s, c, q.grad, k.grad, v.grad]


def run_linear_ce(backend: str) -> list[torch.Tensor]:
    h, w = _randn(6, 8, seed=10).requires_grad_(), _randn(11, 8, seed=11).requires_grad_()
    target = torch.tensor([0, 3, 10, -100, 7, 2])
    loss = linear_ce(h, w, target, chunk_size=4, backend=backend)
    loss.backward()
    return [loss, h.grad, w.grad]


def run_exit_confidence(backend: str) -> list[torch.Tensor]:
    p, a = exit_confidence(_randn(5, 8, seed=12), _randn(11, 8, seed=13), backend=backend)
    return [p, a]


CASES: dict[str, Callable[[str], list[torch.Tensor]]] = {
    "lif": run_lif,
    "select_tokens": run_select_tokens,
    "gather_tokens": run_gather_tokens,
    "spiking_attention": run_spiking_attention,
    "linear_ce": run_linear_ce,
    "exit_confidence": run_exit_confidence,
}


def compare(name: str, backend: str) -> str:
    """'ok' if kernel `name` through `backend` matches its explicit torch path, else what differs."""
    got, want = CASES[name](backend), CASES[name]("torch")
    problems = []
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.detach(), b.detach()
        if a.shape != b.shape:
            problems.append(f"output {i}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        elif b.is_floating_point() and not torch.allclose(a.to(b.dtype), b, rtol=1e-5, atol=1e-5):
            problems.append(f"output {i}: max diff {(a.to(b.dtype) - b).abs().max().item():.2e}")
        elif not b.is_floating_point() and not torch.equal(a, b):
            problems.append(f"output {i}: values differ")
    return "ok" if not problems else "FAIL " + "; ".join(problems)


if __name__ == "__main__":
    print(json.dumps({name: compare(name, "auto") for name in CASES}))
    sys.exit(0)
