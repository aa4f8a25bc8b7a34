"""Every Triton kernel, compiled for sm_80 and sm_90 at the zoo's real shapes (with the block sizes and
warps its wrapper picks on CUDA), meets the resource targets: no register spills, shared memory
within 99 KB, and for memory-bound kernels at least 2 programs of 4 warps resident per SM.

Compiled on the CPU with the ptxas / cuobjdump bundled in Triton's wheel (no GPU needed); each
binary is compiled once per session and shared by the tests below."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_spec = importlib.util.spec_from_file_location("kernel_resources", Path(__file__).resolve().parents[1] / "bench" / "kernel_resources.py")
kr = importlib.util.module_from_spec(_spec)
sys.modules["kernel_resources"] = kr
_spec.loader.exec_module(kr)

CASES = kr.cases()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{(case index, arch): resources}, compiled on first use into a cache private to this module."""
    why = kr.tools_missing()
    if why:
        pytest.skip(f"cannot compile for NVIDIA targets on this machine: {why}")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
    results: dict = {}

    def get(i: int, arch: int) -> dict:
        if (i, arch) not in results:
            results[(i, arch)] = kr.measure(CASES[i], arch)
        return results[(i, arch)]

    yield get
    mp.undo()


def test_every_kernel_is_covered():
    """A new @triton.jit kernel in efficient.kernels must get a case here (and in the bench table);
    device functions that kernels call (named `*_tl`) are compiled inside them."""
    import triton

    from efficient.kernels import bn_lif, exit_confidence, leaky, lif, linear_ce, spike_pack, ssa, token_select

    jitted = {f"{m.__name__}.{name}" for m in (bn_lif, exit_confidence, leaky, lif, linear_ce, spike_pack, ssa, token_select)
              for name, obj in vars(m).items() if isinstance(obj, triton.runtime.JITFunction) and not name.endswith("_tl")}
    covered = {f"{c.fn.__module__}.{c.fn.__name__}" for c in CASES}
    assert jitted and jitted <= covered, f"kernels without a resource case: {sorted(jitted - covered)}"


@pytest.mark.parametrize("arch", kr.ARCHS)
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c.kernel}[{c.shape}]" for c in CASES])
def test_kernel_meets_resource_targets(measured, i, arch):
    r = measured(i, arch)
    assert r["regs"] > 0 and r["stack"] >= 0, "cuobjdump's resource line was not understood"
    assert kr.problems(CASES[i], r) == []


def test_exit_confidence_addresses_tiles_with_int64_offsets(measured):
    """V * D passes 2^31 at a 32k vocab and D = 8192: the weight and hidden tiles' offsets are 64-bit."""
    i = next(j for j, c in enumerate(CASES) if c.kernel == "exit_confidence")
    ttir = measured(i, 90)["ttir"]
    # row * stride goes onto the base pointer as a [rows, 1] i64 offset; the D-tile offset (< D) is added after
    row_ptrs = [ln for ln in ttir.splitlines() if "tt.addptr" in ln and "x1x!tt.ptr" in ln]
    assert len(row_ptrs) >= 2, "expected [rows, 1] pointer tensors for hidden and weight rows:\n" + ttir[:3000]
    assert all("x1xi64>" in ln.rsplit(":", 1)[-1] for ln in row_ptrs), "\n".join(row_ptrs)


def test_occupancy_arithmetic():
    """2 programs of 4 warps fit by registers up to 255 per thread, 1 program at 8 warps x 255."""
    assert kr.resident_programs(255, 0, 4, 90) == 2
    assert kr.resident_programs(128, 0, 4, 80) == 4
    assert kr.resident_programs(179, 0, 4, 90) == 2
    assert kr.resident_programs(64, 0, 4, 90) == 8
    assert kr.resident_programs(32, 100 * 1024, 4, 80) == 1  # shared memory limits first
