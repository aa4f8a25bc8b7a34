"""How a rebuilding backward runs, each choice against the one before it.

- BatchNorm's output rebuilt from the forward's saved mean and invstd (`efficient.kernels.bn_lif._bn_rebuild`:
  aten's eval kernel, one read of z) against BatchNorm's training call again (statistics from z, then the
  output: three reads): per call at the zoo units' shapes on CPU, checked bit for bit before it is timed, or
  (`--step ARCH --compare bn-statistics`) whole training steps at memory levels with the one path or the other.
- `--compare chunk`: chunks of at most 1/16 of a tensor (`bn_lif.chunk_limit`) against a fixed chunk of
  `RECOMPUTE_CHUNK` elements, whole training steps.
- `--compare rerun`: the stable-SNN VGG's recomputed conv units as they run now (the rerun computes no
  spikes, backward writes z's gradient into z, the convolution's backward by batch slices with a spike
  input kept as bits) against their rerun computing the spikes, a separate gradient buffer and aten's
  convolution, whole training steps.
- `--compare unit-chunks`: a conv unit's forward without its membrane trace a chunk of channels at a time
  (`bn_lif.FORWARD_BY_CHUNKS`) and a stem stage's pooled backward writing z's gradient into z
  (`bn_lif_max_pool(donate=True)`), against the forward in one piece and a separate gradient buffer.
- `--compare conv-slices`: a recomputed region's convolution forward by batch slices on a CPU
  (`conv_backward.sliced_conv2d`, in the region's forward and its rerun) against the whole call.
- `--compare bits-input`: a checkpointed unit whose input is spikes kept as bits only and rerun on a
  placeholder (`recompute_input_from_bits`) against the checkpoint keeping the input (as bits) and
  rerunning on it unpacked.
- `--compare pooled-rerun`: a Spikformer stem stage's rerun leaving its pooled spikes uncomputed
  (`bn_lif_max_pool(compute=False)`: its backward runs each chunk's BatchNorm, LIF and pool once) against
  the rerun computing them.
- `--compare plain-traces`: a peak plan's plain units keeping their membrane traces (`plan.keeping`) against
  their rebuilding them in backward, as level `bits` does.
- `--compare lif-steps`: the compiled LIF backward one fused loop per step, writing its gradient over a
  membrane nothing reads again (`lif.STEPWISE_BACKWARD`), against the loop over all T; it runs at every
  level, so `none` is timed without it too (`none-before`).
- `--compare lif-forward-steps`: the compiled LIF forward one fused loop per step, writing a fused unit's H
  over its BatchNorm output (`lif.STEPWISE_FORWARD`), against the loop over all T; every level runs it.
- `--compare bn-over-z`: the eager Linear unit's BatchNorm backward written over z by chunks of channels
  (`bn_lif.BN_BACKWARD_OVER_Z_MIN`), against aten's whole call into a new tensor; every level runs it.
- `--compare linear-outputs`: a peak plan's rerun units keeping their fused Linear units' outputs for their
  reruns (`plan.outputs`, no matmul there) against the same plan computing them again.
- `--compare outputs`: the same for every output a plan keeps (fused units', Linears', convolutions'); its
  regions run as they do with them (a unit keeping one is a light region), keeping nothing.
- `--compare bn-max-pool`: a stem stage that pools its BatchNorm output, BatchNorm and the pool by chunks
  (`efficient.kernels.bn_max_pool`) against the two modules.
- `--compare linear-bits`: a rerun's Linear of spikes keeping them as bits (`efficient.memory.region_linear`)
  against keeping them in fp32.
- Changes joined by `+` (`--compare pooled-rerun+plain-traces`) are undone together.

The cases alternate in each round; ratios are geometric means of the per-round ratios with a 95 % interval.

    python bench/rebuild_paths.py
    python bench/rebuild_paths.py --step sdt-2-512 --impls none bits recompute --rounds 5
    python bench/rebuild_paths.py --step stable-snn-vgg11 --impls none recompute --compare chunk --rounds 6
    python bench/rebuild_paths.py --step stable-snn-vgg11 --impls none recompute --compare rerun --rounds 10
    python bench/rebuild_paths.py --step sdt-2-512 --impls bits recompute --compare unit-chunks --rounds 10
    python bench/rebuild_paths.py --step stable-snn-vgg11 --impls none recompute --compare conv-slices --rounds 10
    python bench/rebuild_paths.py --step stable-snn-vgg11 --impls none recompute --compare bits-input --rounds 10
    python bench/rebuild_paths.py --step spikformer-4-384 --impls none recompute-peak --compare pooled-rerun \
        --rounds 10 --warmup 3 --host-memory reuse --budget 0.2
    python bench/rebuild_paths.py --step spikformer-4-384 --impls none recompute-peak \
        --compare pooled-rerun+plain-traces --rounds 12 --warmup 3 --host-memory reuse --budget 0.2
    python bench/rebuild_paths.py --step spikformer-4-384 --impls none recompute-peak --compare lif-steps \
        --rounds 10 --warmup 2 --host-memory reuse --budget 0.2
    python bench/rebuild_paths.py --step spikformer-4-384 --impls recompute-peak --compare linear-outputs \
        --rounds 10 --warmup 2 --host-memory reuse --budget 0.2
    python bench/rebuild_paths.py --step sdt-2-512 --impls recompute-peak --compare outputs \
        --rounds 10 --warmup 2 --host-memory reuse --budget 0.2
    python bench/rebuild_paths.py --step sdt-2-512 --impls recompute --compare bn-max-pool+linear-bits \
        --rounds 10 --warmup 2 --host-memory reuse
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from efficient.kernels import bn_lif as K

# z [T*R, C, ...] of the units at CIFAR b64, T=4: SDT's stem stages, Spikformer's and SDT's Linear units
SHAPES = [(256, 64, 32, 32), (256, 128, 32, 32), (256, 256, 16, 16), (16384, 384), (16384, 1536), (16384, 2048)]


def _training_call(z, weight, bias, stats, eps):
    return torch.native_batch_norm(z, weight, bias, None, None, True, 0.0, eps)[0]


def calls(repeats: int) -> None:
    print("| z shape | training call ms | from statistics ms | ratio |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        g = torch.Generator().manual_seed(0)
        z = torch.randn(shape, generator=g) * 2 + 0.5
        w, b = torch.randn(shape[1], generator=g), torch.randn(shape[1], generator=g)
        _, mean, invstd = torch.native_batch_norm(z, w, b, None, None, True, 0.1, 1e-5)
        stats = torch.stack([mean, invstd])
        if not torch.equal(K._bn_rebuild(z, w, b, stats, 1e-5), _training_call(z, w, b, stats, 1e-5)):
            raise SystemExit(f"{shape}: the output from statistics differs from the training call's")
        t: dict[str, list[float]] = {"train": [], "rebuild": []}
        for _ in range(repeats):
            for name, fn in (("train", _training_call), ("rebuild", K._bn_rebuild)):
                t0 = time.perf_counter()
                fn(z, w, b, stats, 1e-5)
                t[name].append(time.perf_counter() - t0)
        a, r = statistics.median(t["train"]), statistics.median(t["rebuild"])
        print(f"| {list(shape)} | {a * 1e3:.1f} | {r * 1e3:.1f} | {r / a:.2f} |", flush=True)


CHANGES = ("bn-statistics", "chunk", "rerun", "unit-chunks", "conv-slices", "bits-input", "pooled-rerun", "plain-traces",
           "lif-steps", "lif-forward-steps", "bn-over-z", "linear-outputs", "outputs", "bn-max-pool", "linear-bits")
OF_EVERY_LEVEL = ("lif-steps", "lif-forward-steps", "bn-over-z")  # changes that level `none` runs too


@contextmanager
def _before(compare: str):
    """The path as it was before the changes `compare` names (joined by `+`)."""
    with contextlib.ExitStack() as stack:
        for change in compare.split("+"):
            stack.enter_context(_before_one(change))
        yield


@contextmanager
def _before_one(compare: str):
    """The path as it was before the change `compare` names."""
    from efficient.kernels import lif as L
    from efficient.memory import conv_backward as CB
    from efficient.memory import recompute as RC
    from efficient.memory import region_linear as RL
    from efficient.models import neurons as N
    from efficient.models import replay as RP
    from efficient.models import spikformer as SF
    from efficient.models import stable_snn as V

    new, lo, pooled, fslice, reads_bits = K._bn_rebuild, K.RECOMPUTE_CHUNK_MIN, K._pooled_backward, CB.FORWARD_SLICE, RC._reads_bits
    pooled_rerun, stem_replays, exact = K._pooled_rerun_backward, SF.replays_whole, N.rebuild_exact
    kept_output, store_for = N.linear_output, RP._store_for
    unit_calls = V.replays_whole, V.plain_conv, V.region_conv2d
    over_z = K.BN_BACKWARD_OVER_Z_MIN
    norm_pool, linear_bits = N.bn_max_pool, RL._bits_rerun
    if compare == "bn-statistics":
        K._bn_rebuild = _training_call
    elif compare == "chunk":
        K.RECOMPUTE_CHUNK_MIN = K.RECOMPUTE_CHUNK  # every chunk RECOMPUTE_CHUNK elements
    elif compare == "unit-chunks":  # the forward without H in one piece, the pooled backward's own gradient buffer
        K.FORWARD_BY_CHUNKS = False
        K._pooled_backward = lambda *args, donate=False: pooled(*args, donate=False)
        K._pooled_rerun_backward = lambda *args, donate=False: pooled_rerun(*args, donate=False)
    elif compare == "conv-slices":  # every convolution forward in one call
        CB.FORWARD_SLICE = 1 << 62
    elif compare == "bits-input":  # the checkpoint keeps the input and reruns on it
        RC._reads_bits = lambda module, x: False
    elif compare == "pooled-rerun":  # a stem stage's rerun computes its pooled spikes
        SF.replays_whole = lambda unit: False
    elif compare == "plain-traces":  # a plain unit rebuilds its traces in backward, as at level bits
        N.rebuild_exact = lambda module=None: exact()
    elif compare == "lif-steps":  # the compiled LIF backward over all T, into a new tensor
        L.STEPWISE_BACKWARD = False
    elif compare == "lif-forward-steps":  # the compiled LIF forward over all T, H a new tensor
        L.STEPWISE_FORWARD = False
    elif compare == "bn-over-z":  # BatchNorm's backward as one aten call, its gradient a new tensor
        K.BN_BACKWARD_OVER_Z_MIN = 1 << 62
    elif compare == "linear-outputs":  # no Linear output kept: the rerun runs every matmul again
        N.linear_output = lambda *args: None
    elif compare == "outputs":  # no output kept: the rerun runs every matmul and convolution again
        RP._store_for = lambda owner: None
    elif compare == "bn-max-pool":  # a stage pooling its BatchNorm output runs the two modules
        N.bn_max_pool = lambda *args, **kwargs: None
    elif compare == "linear-bits":  # a rerun's Linear of spikes keeps them in fp32
        RL._bits_rerun = lambda x, linear: False
    else:  # the rerun computes the spikes, backward allocates z's gradient, aten's convolution
        V.replays_whole = V.plain_conv = lambda m: False
        V.region_conv2d = lambda conv, x, spikes=False, bits=None: conv(x)
    try:
        yield
    finally:
        K._bn_rebuild, K.RECOMPUTE_CHUNK_MIN, K._pooled_backward, K.FORWARD_BY_CHUNKS = new, lo, pooled, True
        K._pooled_rerun_backward, SF.replays_whole, N.rebuild_exact = pooled_rerun, stem_replays, exact
        CB.FORWARD_SLICE, RC._reads_bits = fslice, reads_bits
        V.replays_whole, V.plain_conv, V.region_conv2d = unit_calls
        L.STEPWISE_BACKWARD = L.STEPWISE_FORWARD = True
        K.BN_BACKWARD_OVER_Z_MIN = over_z
        N.linear_output, RP._store_for = kept_output, store_for
        N.bn_max_pool, RL._bits_rerun = norm_pool, linear_bits


def steps(arch: str, impls: list[str], rounds: int, compare: str, budget: float, warmup: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import memory as M
    from scipy import stats as S

    from efficient.memory.levels import restore

    x, y = M._inputs(arch, 64)
    every_level = any(c in OF_EVERY_LEVEL for c in compare.split("+"))
    cases = [c for i in impls if i == "none" for c in (("none", "none-before") if every_level else ("none",))]
    cases += [c for i in impls if i != "none" for c in (i, i + "-before")]
    models = {}
    for c in cases:
        if c == "none-before":  # level none itself, run without the change
            models[c] = models["none"]
        elif c.endswith("-before") and c.replace("-before", "") in ("recompute-budget", "recompute-peak"):
            # a planned level: the same plan on a fresh copy of the model, not planned again
            models[c] = M.build(arch, "none", 4, None, example=x)[0]
            restore(models[c], models[c.replace("-before", "")]._efficient_memory.plan)
        else:
            models[c] = M.build(arch, c.replace("-before", ""), 4, None, example=x, budget=budget)[0]

    def step(case: str) -> float:
        with _before(compare) if case.endswith("-before") else contextlib.nullcontext():
            t0 = time.perf_counter()
            M.train_step(models[case], x, y)
            return time.perf_counter() - t0

    for _ in range(warmup):
        for c in cases:
            step(c)
    times: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(rounds):
        for c in cases if r % 2 == 0 else cases[::-1]:
            times[c].append(step(c))

    def ratio(a: str, b: str) -> str:
        logs = [math.log(p / q) for p, q in zip(times[a], times[b])]
        m, s = statistics.mean(logs), statistics.stdev(logs)
        h = S.t.ppf(0.975, len(logs) - 1) * s / math.sqrt(len(logs))
        return f"{math.exp(m):.3f} [{math.exp(m - h):.3f}, {math.exp(m + h):.3f}]"

    print(f"| {arch}, b64, T=4 ('-before': without the change `{compare}`) | median step s | vs none | vs before |")
    print("|---|---|---|---|")
    for c in cases:
        vs_none = ratio(c, "none") if "none" in times and c != "none" else ""
        if c.endswith("-before") and "none-before" in times and c != "none-before":  # each path against its own none
            vs_none = ratio(c, "none-before")
        pair = ratio(c, c + "-before") if c + "-before" in times else ""
        print(f"| {c} | {statistics.median(times[c]):.2f} | {vs_none} | {pair} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--step", default=None, help="an architecture of bench/memory.py: time whole steps instead")
    ap.add_argument("--impls", nargs="+", default=["none", "bits", "recompute"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones")
    ap.add_argument("--budget", type=float, default=0.2, help="of recompute-budget / recompute-peak")
    ap.add_argument("--host-memory", choices=("system", "reuse"), default="system",
                    help="reuse: glibc keeps freed blocks (train.host_memory), so steps pay no page faults")
    ap.add_argument("--compare", default="bn-statistics",
                    help=f"a change ({', '.join(CHANGES)}), or several joined by +")
    args = ap.parse_args()
    if unknown := [c for c in args.compare.split("+") if c not in CHANGES]:
        ap.error(f"--compare: {', '.join(unknown)} not a change; choose from {', '.join(CHANGES)} (joined by +)")
    print(f"# bench/rebuild_paths.py -- {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, host memory {args.host_memory}, load {os.getloadavg()[0]:.2f} before\n")
    if args.host_memory == "reuse":  # before any tensor exists: every block then comes from the heap
        from efficient.memory import host

        host.keep_freed_memory()
    if args.step:
        steps(args.step, args.impls, args.rounds, args.compare, args.budget, args.warmup)
    else:
        calls(args.repeats)
    print(f"\n# load {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
