"""Registers, spill stack and shared memory of every Triton kernel on NVIDIA GPUs, measured without one.

Triton's wheel ships ptxas and cuobjdump. `triton.compile` on an `ASTSource` with a `GPUTarget`
lowers a kernel all the way to a cubin for the chosen architecture on the CPU; `cuobjdump
--dump-resource-usage` then reads back registers per thread (REG) and local-memory stack (STACK:
anything above 0 is spilled registers). Shared memory per program comes from the compiled
kernel's metadata. Each kernel is compiled at the block sizes and warps its wrapper picks on CUDA
for the real shapes of the zoo: Spikformer-4-384 on CIFAR (N=64 tokens, head dim 32, D=384),
Spikformer-8-512 on ImageNet (N=197 with the anchor, head dim 64, D=512), N=1024, and ee-gpt-small
(D=512, vocab up to 32000). Sizes that are runtime arguments (N, V, D of the row kernels) share one
binary, so a case is one binary per (kernel, dtype, compile-time switches).

Targets (`problems`): no spills (STACK 0); shared memory within 99 KB per program, so consumer GPUs
launch it too; and for the memory-bound kernels, registers and shared memory that let at least 2
programs of 4 warps (8 warps) reside on one SM.

    python bench/kernel_resources.py [--arch 80 90] [--markdown]

Prints one row per kernel and architecture and exits non-zero if a kernel misses a target.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ARCHS = (80, 90)
MAX_SHARED = 99 * 1024  # bytes per program: what consumer GPUs (sm_86/89/120) grant
# per SM: 64K 32-bit registers, 64 resident warps, 32 resident programs; shared memory per SM
REGS_PER_SM, WARPS_PER_SM, PROGRAMS_PER_SM = 65536, 64, 32
SHARED_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
MIN_RESIDENT_WARPS = 8  # 2 programs of 4 warps


def cuobjdump() -> str:
    """The cuobjdump bundled with Triton's NVIDIA backend (ptxas sits beside it)."""
    import triton.backends.nvidia as nvidia_backend

    return os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")


def tools_missing() -> str | None:
    """Why the compile cannot run here (None when it can)."""
    try:
        import triton.backends.nvidia as nvidia_backend  # noqa: F401
    except Exception as e:  # pragma: no cover - triton is a dependency
        return f"triton's NVIDIA backend is not importable ({e})"
    bindir = os.path.dirname(cuobjdump())
    missing = [t for t in ("ptxas", "cuobjdump") if not os.access(os.path.join(bindir, t), os.X_OK)]
    return f"triton's bundled {' and '.join(missing)} not found in {bindir}" if missing else None


@dataclass(frozen=True)
class Case:
    kernel: str
    shape: str
    fn: object = field(repr=False, compare=False)
    signature: tuple  # ((name, type), ...)
    constexprs: tuple  # ((name, value), ...)
    num_warps: int
    memory_bound: bool

    def key(self) -> tuple:
        return (self.kernel, self.signature, self.constexprs, self.num_warps)


def _case(kernel, shape, fn, signature: dict, constexprs: dict, num_warps: int, memory_bound: bool) -> Case:
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    return Case(kernel, shape, fn, tuple(sig.items()), tuple(constexprs.items()), num_warps, memory_bound)


def cases() -> list[Case]:
    """One case per binary the wrappers launch at the real shapes (on CUDA)."""
    import torch

    from efficient.kernels import exit_confidence as ec
    from efficient.kernels import bn_lif, leaky, lif, linear_ce, spike_pack as sp, ssa, token_select as ts

    out = []
    # spiking self-attention: compute-bound (tl.dot); N is a runtime argument (64, 197, 1024 share a binary)
    for d, shapes in ((32, "N=64 d=32"), (64, "N=197/1024 d=64")):
        for dt in ("fp32", "bf16"):
            for scores, anchor in ((True, True), (False, False)):
                blocks = ssa.ssa_blocks(d)
                warps = blocks.pop("num_warps")
                sig = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "y_ptr": f"*{dt}", "s_ptr": "*fp32",
                       "c_ptr": "*fp32", "H": "i32", "N": "i32", "D": "i32", "scale": "fp32",
                       **{f"s{t}_{a}": "i32" for t in "qkvy" for a in ("tb", "h", "n")}}
                label = f"{shapes} {dt}{' scores' if scores else ''}"
                out.append(_case("ssa_fwd", label, ssa._ssa_fwd_kernel, sig, {"P": int(anchor), "SCORES": scores, **blocks}, warps, False))
    # its backward: two [d, d] fp32 tiles and four row blocks (Q, K, V spikes and y's gradient)
    for d, shapes in ((32, "N=64 d=32"), (64, "N=197/1024 d=64")):
        for dt in ("fp32", "bf16"):
            blocks = ssa.ssa_bwd_blocks(d)
            sig = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "g_ptr": f"*{dt}", "dq_ptr": f"*{dt}",
                   "dk_ptr": f"*{dt}", "dv_ptr": f"*{dt}", "H": "i32", "N": "i32", "D": "i32", "scale": "fp32",
                   **{f"s{t}_{a}": "i32" for t in "qkvgo" for a in ("tb", "h", "n")}}
            out.append(_case("ssa_bwd", f"{shapes} {dt}", ssa._ssa_bwd_kernel, sig,
                             {"BLOCK_N": blocks["BLOCK_N"], "BLOCK_D": blocks["BLOCK_D"]}, blocks["num_warps"], False))
    # token selection (N=196 / 1024 share a binary) and gather / scatter of D=384 / 512 rows
    out.append(_case("select_zscore", "N<=1024", ts._zscore_kernel,
                     {"s_ptr": "*fp32", "z_ptr": "*fp32", "T": "i32", "B": "i32", "N": "i32", "eps": "fp32"},
                     {"STANDARDIZE": True, "BLOCK": ts.SELECT_BLOCK}, 4, True))
    out.append(_case("select_rank", "N<=1024", ts._rank_kernel,
                     {"z_ptr": "*fp32", "kept_ptr": "*i32", "N": "i32", "K": "i32"},
                     {"BLOCK_I": ts.RANK_BLOCK, "BLOCK_J": ts.RANK_BLOCK}, 4, True))
    out.append(_case("select_slot", "N<=1024", ts._slot_kernel,
                     {"kept_ptr": "*i32", "idx_ptr": "*i64", "N": "i32", "K": "i32"},
                     {"BLOCK": ts.SELECT_BLOCK}, 4, True))
    for dt in ("fp32", "bf16"):
        for scatter in (False, True):
            out.append(_case("token_scatter" if scatter else "token_gather", f"D=384/512 {dt}", ts._gather_kernel,
                             {"src_ptr": f"*{dt}", "idx_ptr": "*i64", "out_ptr": f"*{dt}", "B": "i32", "N_SRC": "i32",
                              "K": "i32", "D": "i32"},
                             {"SCATTER": scatter, "BLOCK_D": min(1024, ts._next_pow2(512))}, 4, True))
    # spike packing: elementwise over numel (runtime; i64 once it passes 2^31), a [BLOCK, 8] tile per program
    for dt in ("fp32", "bf16"):
        for n_type in ("i32", "i64"):
            out.append(_case("pack_spikes", f"{dt} N:{n_type}", sp._pack_kernel,
                             {"x_ptr": f"*{dt}", "bits_ptr": "*u8", "N": n_type}, {"BLOCK": sp.PACK_BLOCK}, sp.NUM_WARPS, True))
            out.append(_case("unpack_spikes", f"{dt} N:{n_type}", sp._unpack_kernel,
                             {"bits_ptr": "*u8", "out_ptr": f"*{dt}", "N": n_type}, {"BLOCK": sp.UNPACK_BLOCK}, sp.NUM_WARPS, True))
    # LIF: elementwise over N = B*C*H*W, a loop over T; the default neuron and PLIF (learned rate)
    for dt in ("fp32", "bf16"):
        for rate, label in ((False, "LIF"), (True, "PLIF")):
            # the PLIF variant also carries an initial membrane (efficient.accelerate's stateful neurons)
            out.append(_case("lif_fwd", f"{label} {dt}", lif._lif_fwd_kernel,
                             {"x_ptr": f"*{dt}", "rate_ptr": "*fp32", "v0_ptr": "*fp32", "s_ptr": f"*{dt}", "h_ptr": "*fp32",
                              "N": "i32", "T": "i32", "c": "fp32", "v_th": "fp32", "v_reset": "fp32", "stride_xt": "i64",
                              "stride_xn": "i64"},
                             {"CHARGE": lif.CHARGE_DECAY_INPUT, "HAS_RATE": rate, "HARD": True, "HAS_V0": rate,
                              "BLOCK": lif._BLOCK},
                             lif._NUM_WARPS, True))
            out.append(_case("lif_bwd", f"{label} {dt}" + (" +grad_h +v0" if rate else ""), lif._lif_bwd_kernel,
                             {"gs_ptr": f"*{dt}", "gm_ptr": "*fp32", "h_ptr": "*fp32", "rate_ptr": "*fp32", "v0_ptr": "*fp32",
                              "gx_ptr": f"*{dt}", "grate_ptr": "*fp32", "gv0_ptr": "*fp32", "N": "i32", "T": "i32",
                              "c": "fp32", "v_th": "fp32", "v_reset": "fp32", "alpha": "fp32"},
                             {"CHARGE": lif.CHARGE_DECAY_INPUT, "HAS_RATE": rate, "HAS_GM": rate, "HARD": True,
                              "DETACH": False, "SURROGATE": 0, "HAS_V0": rate, "BLOCK": lif._BLOCK},
                             lif._NUM_WARPS, True))
        # BatchNorm-apply + LIF (the zoo's units): per-channel statistics in, a loop over T; in
        # training it also writes the saved and running statistics
        for training in (True, False):
            out.append(_case("bn_lif_fwd", f"LIF {dt}{' training' if training else ' eval'}", bn_lif._bn_lif_fwd_kernel,
                             {"z_ptr": f"*{dt}", "mean_ptr": "*fp32", "var_ptr": "*fp32", "w_ptr": f"*{dt}",
                              "b_ptr": f"*{dt}", "rm_ptr": "*fp32", "rv_ptr": "*fp32", "stats_ptr": f"*{dt}",
                              "new_rm_ptr": "*fp32", "new_rv_ptr": "*fp32", "s_ptr": f"*{dt}", "h_ptr": "*fp32",
                              "N": "i32", "T": "i32", "C": "i32", "S": "i32", "eps": "fp32", "momentum": "fp32",
                              "unbias": "fp32", "c": "fp32", "v_th": "fp32", "v_reset": "fp32"},
                             {"TRAINING": training, "CHARGE": lif.CHARGE_DECAY_INPUT, "HARD": True, "STORE_H": True,
                              "BLOCK": lif._BLOCK},
                             lif._NUM_WARPS, True))
        # the backward of a unit that kept z but not H (memory level recompute's reruns): H rebuilt in
        # the gradient's buffer, then the reverse-time loop over it
        out.append(_case("bn_lif_recompute_bwd", f"LIF {dt} training", bn_lif._bn_lif_recompute_bwd_kernel,
                         {"z_ptr": f"*{dt}", "gs_ptr": f"*{dt}", "stats_ptr": f"*{dt}", "w_ptr": f"*{dt}",
                          "b_ptr": f"*{dt}", "gy_ptr": "*fp32", "N": "i32", "T": "i32", "C": "i32", "S": "i32",
                          "eps": "fp32", "c": "fp32", "v_th": "fp32", "v_reset": "fp32", "alpha": "fp32"},
                         {"TRAINING": True, "CHARGE": lif.CHARGE_DECAY_INPUT, "HARD": True, "DETACH": True,
                          "SURROGATE": 0, "BLOCK": lif._BLOCK},
                         lif._NUM_WARPS, True))
        # snntorch's Leaky order (efficient.accelerate): per-neuron beta and threshold
        for m0, label in ((False, "Leaky"), (True, "Leaky +m0")):
            out.append(_case("leaky_fwd", f"{label} {dt}", leaky._leaky_fwd_kernel,
                             {"x_ptr": f"*{dt}", "m0_ptr": "*fp32", "beta_ptr": "*fp32", "thr_ptr": "*fp32", "s_ptr": f"*{dt}",
                              "m_ptr": "*fp32", "N": "i32", "T": "i32"},
                             {"RESET": lif.RESET_SUBTRACT, "HAS_M0": m0, "BLOCK": lif._BLOCK}, lif._NUM_WARPS, True))
            out.append(_case("leaky_bwd", f"{label} {dt}", leaky._leaky_bwd_kernel,
                             {"gs_ptr": f"*{dt}", "gm_ptr": "*fp32", "m_ptr": "*fp32", "m0_ptr": "*fp32", "beta_ptr": "*fp32",
                              "thr_ptr": "*fp32", "gx_ptr": f"*{dt}", "gm0_ptr": "*fp32", "gbeta_ptr": "*fp32",
                              "gthr_ptr": "*fp32", "N": "i32", "T": "i32", "alpha": "fp32"},
                             {"RESET": lif.RESET_SUBTRACT, "HAS_M0": m0, "HAS_GM": True, "SURROGATE": 0, "BLOCK": lif._BLOCK},
                             lif._NUM_WARPS, True))
    # early exit at ee-gpt-small: D=512 (several D tiles), vocab 256..32000 (runtime)
    for dt, torch_dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        blocks = ec.exit_conf_blocks(512, True, torch_dt)
        warps = blocks.pop("num_warps")
        out.append(_case("exit_confidence", f"D=512 V<=32000 {dt}", ec._exit_conf_kernel,
                         {"h_ptr": f"*{dt}", "w_ptr": f"*{dt}", "m_ptr": "*fp32", "s_ptr": "*fp32", "arg_ptr": "*i64", "N": "i32",
                          "V": "i32", "D": "i32", "V_PER_SPLIT": "i32", "stride_hn": "i32", "stride_wv": "i32"}, blocks, warps, False))
    # a decode step's rows (1 and the widest, FEW_ROWS) at D=4096
    for dt, torch_dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for n in (1, ec.FEW_ROWS):
            blocks = ec.exit_conf_few_blocks(n, 4096, True, torch_dt)
            warps = blocks.pop("num_warps")
            out.append(_case("exit_confidence_few", f"N={n} D=4096 {dt}", ec._exit_conf_few_kernel,
                             {"h_ptr": f"*{dt}", "w_ptr": f"*{dt}", "m_ptr": "*fp32", "s_ptr": "*fp32", "arg_ptr": "*i64",
                              "N": "i32", "V": "i32", "D": "i32", "V_PER_SPLIT": "i32", "stride_hn": "i32",
                              "stride_wv": "i32"}, blocks, warps, False))
    for conf in (False, True):
        blocks = linear_ce.ce_blocks(32000)
        warps = blocks.pop("num_warps")
        out.append(_case("linear_ce_rows", f"V=32000{' conf' if conf else ''}", linear_ce._ce_rows_kernel,
                         {"z_ptr": "*fp32", "t_ptr": "*i64", "loss_ptr": "*fp32", "stride": "i32", "V": "i32",
                          "ignore_index": "i32"}, {"CONF": conf, **blocks}, warps, True))
    return out


@functools.lru_cache(maxsize=None)
def _measure(key: tuple, arch: int, fn) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _, signature, constexprs, num_warps = key
    t0 = time.perf_counter()
    kernel = triton.compile(
        ASTSource(fn=fn, signature=dict(signature), constexprs=dict(constexprs)),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps},
    )
    seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        dump = subprocess.run([cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", dump)
    stack = re.search(r"STACK:(\d+)", dump)
    return {
        "regs": int(reg.group(1)) if reg else -1,
        "stack": int(stack.group(1)) if stack else -1,
        "shared": int(kernel.metadata.shared),
        "seconds": seconds,
        "ttir": kernel.asm["ttir"],
    }


def measure(case: Case, arch: int) -> dict:
    """Compile `case` for sm_`arch` (once per process) and add the resident warps per SM."""
    r = dict(_measure(case.key(), arch, case.fn))
    r["warps_per_sm"] = resident_programs(r["regs"], r["shared"], case.num_warps, arch) * case.num_warps
    return r


def resident_programs(regs: int, shared: int, num_warps: int, arch: int) -> int:
    """Programs of `num_warps` warps one SM holds at once, limited by registers (allocated per warp
    in units of 256), shared memory (1 KB reserved per program) and the warp / program slots."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * num_warps)
    by_shared = SHARED_PER_SM[arch] // (shared + 1024)
    return min(by_regs, by_shared, WARPS_PER_SM // num_warps, PROGRAMS_PER_SM)


def problems(case: Case, r: dict) -> list[str]:
    """The targets `case` misses with resources `r` (empty when it meets them all)."""
    bad = []
    if r["stack"] != 0:
        bad.append(f"spills ({r['stack']} B of stack)")
    if r["shared"] > MAX_SHARED:
        bad.append(f"{r['shared'] / 1024:.1f} KB of shared memory > {MAX_SHARED // 1024} KB")
    if case.memory_bound and r["warps_per_sm"] < MIN_RESIDENT_WARPS:
        bad.append(f"{r['regs']} registers x {case.num_warps} warps: {r['warps_per_sm']} resident warps per SM "
                   f"< 2 programs of 4 warps")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    ap.add_argument("--markdown", action="store_true", help="print a markdown table instead of columns")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kernel_resources_"))  # real compiles, not cache hits
    why = tools_missing()
    if why:
        print(why)
        return 2
    import triton

    print(f"triton {triton.__version__}; targets: STACK 0, shared <= {MAX_SHARED // 1024} KB, "
          f"memory-bound kernels >= {MIN_RESIDENT_WARPS} resident warps per SM")
    if args.markdown:
        print("| kernel | case | sm | warps | regs | stack B | shared KB | warps/SM | memory-bound |")
        print("|---|---|---|---|---|---|---|---|---|")
    else:
        print(f"{'kernel':<16} {'case':<28} {'sm':>3} {'warps':>5} {'regs':>5} {'stack':>6} {'shared B':>9} {'warps/SM':>8} {'compile s':>9}")
    bad = []
    for case in cases():
        for arch in args.arch:
            r = measure(case, arch)
            if args.markdown:
                print(f"| {case.kernel} | {case.shape} | {arch} | {case.num_warps} | {r['regs']} | {r['stack']} | "
                      f"{r['shared'] / 1024:.1f} | {r['warps_per_sm']} | {'yes' if case.memory_bound else 'no'} |", flush=True)
            else:
                print(f"{case.kernel:<16} {case.shape:<28} {arch:>3} {case.num_warps:>5} {r['regs']:>5} {r['stack']:>6} "
                      f"{r['shared']:>9} {r['warps_per_sm']:>8} {r['seconds']:>9.2f}", flush=True)
            bad += [f"{case.kernel} {case.shape} sm_{arch}: {p}" for p in problems(case, r)]
    if bad:
        print("targets missed:\n  " + "\n  ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
