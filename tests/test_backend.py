"""One backend resolver for every kernel: each documented backend value, given through
EFFICIENT_BACKEND or the `backend=` argument, runs every kernel (and a STATA model) and gives the
torch path's results; unknown values fail with an error naming the variable and the allowed values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_cxx

from efficient.kernels import _backend
from efficient.kernels import lif as K
from efficient.kernels import token_select as ts
from efficient.zoo import create

sys.path.insert(0, str(Path(__file__).parent))
from _backend_cases import CASES, compare  # noqa: E402

DOCUMENTED = ("auto", "torch", "compile", "loop")  # "triton" runs in the interpreter test below
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# (value, kernel) pairs; on CPU only lif's "compile" runs inductor (the others map it to torch, and
# "auto" falls back to the eager loop without a compiler)
VALUE_KERNEL = [pytest.param(v, n, marks=needs_cxx) if (v, n) == ("compile", "lif") else (v, n)
                for v in DOCUMENTED for n in sorted(CASES)]


def test_documented_values_are_the_resolvers():
    assert _backend.BACKENDS == ("auto", "triton", "torch", "compile", "loop")
    assert K.BACKENDS is ts.BACKENDS is _backend.BACKENDS


@pytest.mark.parametrize("value,name", VALUE_KERNEL)
def test_every_kernel_accepts_every_value_from_the_environment(monkeypatch, name, value):
    monkeypatch.setenv("EFFICIENT_BACKEND", value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert compare(name, "auto") == "ok"


@pytest.mark.parametrize("value,name", VALUE_KERNEL)
def test_every_kernel_accepts_every_value_as_argument(monkeypatch, name, value):
    monkeypatch.delenv("EFFICIENT_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert compare(name, value) == "ok"


@pytest.mark.skipif(not _backend.HAS_TRITON, reason="triton is not installed")
def test_every_kernel_accepts_triton_from_the_environment():
    """EFFICIENT_BACKEND=triton on CPU runs the Triton kernels in the interpreter (a child process,
    so the interpreter setting never leaks into other tests)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "EFFICIENT_BACKEND": "triton"}
    script = Path(__file__).with_name("_backend_cases.py")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert results == {name: "ok" for name in CASES}


@pytest.mark.parametrize("value", [pytest.param("compile", marks=needs_cxx), "loop"])
def test_stata_model_runs_under_lif_only_values(monkeypatch, value):
    """The values the LIF docs offer used to stop a STATA model in token selection."""
    monkeypatch.delenv("EFFICIENT_BACKEND", raising=False)
    model = create("spikformer-tiny-stata", embed_dim=16, num_heads=2, timesteps=2).train()  # batch statistics
    x = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(0)) * 2
    with torch.no_grad():
        want = model(x)
        monkeypatch.setenv("EFFICIENT_BACKEND", value)
        got = model(x)
    assert want.abs().sum() > 0 and torch.equal(got, want)


# ---- the mapping table of efficient.kernels._backend ------------------------------------------


@pytest.mark.parametrize("value", ["triton", "torch", "compile", "loop"])
def test_lif_keeps_every_value(monkeypatch, value):
    monkeypatch.delenv("EFFICIENT_BACKEND", raising=False)
    assert K.resolve_backend(value, CPU) == value and K.resolve_backend(value, CUDA) == value


@pytest.mark.skipif(not _backend.HAS_TRITON, reason="the CUDA column assumes triton is installed")
@pytest.mark.parametrize(
    "value,cpu,cuda",
    [("auto", "torch", "triton"), ("triton", "triton", "triton"), ("torch", "torch", "torch"),
     ("compile", "torch", "triton"), ("loop", "torch", "torch")],
)
def test_two_path_kernels_map_each_value_to_its_nearest_path(monkeypatch, value, cpu, cuda):
    monkeypatch.delenv("EFFICIENT_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for kernel in ("linear_ce", "exit_confidence", "token_select"):
        assert _backend.resolve_backend(value, CPU, kernel) == cpu
        assert _backend.resolve_backend(value, CUDA, kernel) == cuda
    monkeypatch.setenv("EFFICIENT_BACKEND", value)  # the same through the variable
    assert _backend.resolve_backend("auto", CPU) == cpu and _backend.resolve_backend("auto", CUDA) == cuda


def test_exit_confidence_auto_stays_on_torch_on_cuda(monkeypatch):
    """The Triton exit_confidence kernel lost to cuBLAS + softmax on the GPU: 'auto' keeps torch there,
    while an explicit request (argument or variable) still runs the kernel."""
    from efficient.kernels.exit_confidence import _pick_backend

    monkeypatch.delenv("EFFICIENT_BACKEND", raising=False)
    assert _pick_backend("auto", CUDA) == "torch" and _pick_backend("auto", CPU) == "torch"
    assert _pick_backend("triton", CUDA) == "triton"
    if _backend.HAS_TRITON:
        assert _pick_backend("compile", CUDA) == "triton"
        monkeypatch.setenv("EFFICIENT_BACKEND", "triton")
        assert _pick_backend("auto", CUDA) == "triton"


def test_interpreter_only_changes_auto_of_the_stata_kernels(monkeypatch):
    monkeypatch.delenv("EFFICIENT_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    expect = "triton" if _backend.HAS_TRITON else "torch"
    assert _backend.resolve_backend("auto", CPU, "ssa", interpreter_auto=True) == expect
    assert _backend.resolve_backend("auto", CPU, "linear_ce") == "torch"
    assert _backend.resolve_backend("compile", CPU, "ssa", interpreter_auto=True) == "torch"


def test_argument_wins_over_environment(monkeypatch):
    monkeypatch.setenv("EFFICIENT_BACKEND", "torch")
    assert K.resolve_backend("loop", CPU) == "loop"
    assert K.resolve_backend("auto", CPU) == "torch"
    for empty in ("", " ", "auto"):  # unset in all but name
        monkeypatch.setenv("EFFICIENT_BACKEND", empty)
        assert K.resolve_backend("auto", CPU, 8) == "loop"
        assert _backend.resolve_backend("auto", CPU, "linear_ce") == "torch"


# ---- unknown values -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_environment_value_names_the_variable_and_the_choices(monkeypatch, name):
    monkeypatch.setenv("EFFICIENT_BACKEND", "cuda-magic")
    with pytest.raises(ValueError) as err:
        CASES[name]("auto")
    msg = str(err.value)
    assert "EFFICIENT_BACKEND='cuda-magic'" in msg
    assert all(repr(v) in msg for v in _backend.BACKENDS), msg


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_argument_names_the_choices(monkeypatch, name):
    monkeypatch.delenv("EFFICIENT_BACKEND", raising=False)
    with pytest.raises(ValueError, match="backend must be one of") as err:
        CASES[name]("cuda")
    assert "'cuda'" in str(err.value) and all(repr(v) in str(err.value) for v in _backend.BACKENDS)
