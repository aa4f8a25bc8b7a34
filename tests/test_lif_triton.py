"""Triton LIF kernels on CPU under TRITON_INTERPRET=1, against the torch reference.

The interpreter must be chosen before triton is imported, so the cases run in one child process
(tests/_lif_triton_cases.py) and each case becomes one test here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("_lif_triton_cases.py")
CASES = (
    [f"lif-vr{vr}-detach{d}-decay{dec}-{sg}" for vr in ("0.0", "None") for d in (True, False)
     for dec in (True, False) for sg in ("sigmoid", "atan", "triangle")]
    + ["lif-ste", "T1", "noncontiguous", "two-blocks"]
    + [f"plif-vr{vr}-decay{dec}" for vr in ("0.0", "None") for dec in (True, False)]
    + ["leak-dlif", "no-membrane-grad", "fp16"]
    + [f"state-vr{vr}-decay{dec}" for vr in ("0.0", "None") for dec in (True, False)]
    + [f"leaky-{r}-perneuron{p}-{sg}" for r in ("subtract", "zero", "none") for p in (False, True)
       for sg in ("atan", "sigmoid")]
)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter run crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return dict(re.findall(r"^case (\S+) (.*)$", proc.stdout, flags=re.M))


@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_reference(interpreter_results, case):
    assert case in interpreter_results, f"case {case} did not run"
    assert interpreter_results[case] == "ok", interpreter_results[case]


def test_every_case_is_listed(interpreter_results):
    assert sorted(interpreter_results) == sorted(CASES)
