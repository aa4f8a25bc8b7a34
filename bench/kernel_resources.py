"""Registers, spill stack and shared memory of the attention and token-selection kernels on an
NVIDIA GPU, measured without one.

Triton's wheel ships ptxas and cuobjdump. `triton.compile` on an `ASTSource` with a `GPUTarget`
lowers a kernel all the way to a cubin for the chosen architecture on the CPU; `cuobjdump
--dump-resource-usage` then reads back registers per thread (REG) and local-memory stack (STACK:
anything above 0 is spilled registers). Shared memory per program comes from the compiled
kernel's metadata. Each kernel is compiled at the block sizes its wrapper picks for the real
shapes of the zoo (Spikformer-4-384 on CIFAR: N=64, head dim 32; Spikformer-8-512 on ImageNet:
N=197 with the anchor, head dim 64; and N=1024).

    python bench/kernel_resources.py [--arch 90] [--max-shared-kb 200]

Prints one row per kernel and shape and exits non-zero if a kernel spills or exceeds the shared
memory limit.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

# a fresh cache, so the compile times printed are real compiles, not cache hits
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel_resources_")

import triton  # noqa: E402
import triton.backends.nvidia as nvidia_backend  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from efficient.kernels import ssa, token_select as ts  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")


def compile_and_measure(fn, signature: dict, constexprs: dict, arch: int, num_warps: int = 4) -> dict:
    """Compile one @triton.jit kernel for sm_`arch`; return regs, stack, shared bytes and seconds."""
    t0 = time.perf_counter()
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps},
    )
    seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        dump = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", dump)
    stack = re.search(r"STACK:(\d+)", dump)
    return {
        "regs": int(reg.group(1)) if reg else -1,
        "stack": int(stack.group(1)) if stack else -1,
        "shared": int(kernel.metadata.shared),
        "seconds": seconds,
    }


def cases():
    """(kernel, shape, fn, signature, constexprs, num_warps) at the sizes the wrappers launch. N is a
    runtime argument, so shapes that differ only in N share one binary (cached: 0 s to compile)."""
    for n, d in [(64, 32), (197, 64), (1024, 64), (1024, 128)]:
        for scores, anchor in [(True, True), (False, False)]:
            sig = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "y_ptr": "*fp16",
                   "s_ptr": "*fp32", "c_ptr": "*fp32", "N": "i32", "D": "i32", "scale": "fp32",
                   "P": "constexpr", "SCORES": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr",
                   "BLOCK_E": "constexpr"}
            const = ssa.ssa_blocks(d)
            warps = const.pop("num_warps")
            yield "ssa_fwd", f"N={n} D={d} scores={int(scores)}", ssa._ssa_fwd_kernel, sig, {"P": int(anchor), "SCORES": scores, **const}, warps
    for n in (64, 196, 1024):
        label = f"N={n}"
        yield ("select_zscore", label, ts._zscore_kernel,
               {"s_ptr": "*fp32", "z_ptr": "*fp32", "T": "i32", "B": "i32", "N": "i32", "eps": "fp32",
                "STANDARDIZE": "constexpr", "BLOCK": "constexpr"},
               {"STANDARDIZE": True, "BLOCK": ts.SELECT_BLOCK}, 4)
        yield ("select_rank", label, ts._rank_kernel,
               {"z_ptr": "*fp32", "kept_ptr": "*i32", "N": "i32", "K": "i32", "BLOCK_I": "constexpr", "BLOCK_J": "constexpr"},
               {"BLOCK_I": ts.RANK_BLOCK, "BLOCK_J": ts.RANK_BLOCK}, 4)
        yield ("select_slot", label, ts._slot_kernel,
               {"kept_ptr": "*i32", "idx_ptr": "*i64", "N": "i32", "K": "i32", "BLOCK": "constexpr"},
               {"BLOCK": ts.SELECT_BLOCK}, 4)
    for scatter in (False, True):
        yield ("gather" if not scatter else "scatter_add", "D=512", ts._gather_kernel,
               {"src_ptr": "*fp16", "idx_ptr": "*i64", "out_ptr": "*fp16", "B": "i32", "N_SRC": "i32", "K": "i32",
                "D": "i32", "SCATTER": "constexpr", "BLOCK_D": "constexpr"},
               {"SCATTER": scatter, "BLOCK_D": 512}, 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--max-shared-kb", type=float, default=200.0)
    args = ap.parse_args()
    print(f"sm_{args.arch}, triton {triton.__version__}")
    print(f"{'kernel':<14} {'shape':<24} {'warps':>5} {'regs':>5} {'stack':>6} {'shared B':>9} {'compile s':>10}")
    bad = []
    for name, label, fn, sig, const, warps in cases():
        r = compile_and_measure(fn, sig, const, args.arch, warps)
        print(f"{name:<14} {label:<24} {warps:>5} {r['regs']:>5} {r['stack']:>6} {r['shared']:>9} {r['seconds']:>10.2f}", flush=True)
        if r["stack"] != 0 or r["shared"] > args.max_shared_kb * 1024:
            bad.append(f"{name} {label}")
    if bad:
        print("over budget (spills or shared memory):", ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
