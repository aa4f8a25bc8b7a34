"""LIF forward+backward time and saved-activation memory: ours vs spikingjelly, snntorch, torch.compile.

    python bench/neurons.py                      # both shapes, Spikformer's LIF (tau=2, hard reset, detached)
    python bench/neurons.py --shapes 4x32x24576 --repeats 7 --no-detach-reset

Every implementation runs the same multi-step LIF (tau=2, v_th=1, sigmoid surrogate alpha=4) on
the same fp32 input, forward then backward of `(spikes * g).sum()`, in one process; the table
reports medians over `--repeats` timed runs (after one warm-up run that also triggers
compilation) and ratios to spikingjelly's eager LIFNode. Saved activations are the unique storage
bytes of every tensor autograd saves during the forward (torch.autograd.graph.saved_tensors_hooks).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from efficient.kernels import lif as K

TAU, VTH, ALPHA = 2.0, 1.0, 4.0


def saved_bytes(fn, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run fn(x) recording unique storages autograd saves; returns (output, bytes)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, sum(storages.values())


def make_impls(detach_reset: bool):
    """name -> callable(x) returning spikes; each callable is stateless across calls."""
    impls = {}
    impls["ours auto"] = lambda x: K.lif(x, TAU, VTH, 0.0, detach_reset, True, "sigmoid", ALPHA, backend="auto")
    impls["ours reference"] = lambda x: K.lif(x, TAU, VTH, 0.0, detach_reset, True, "sigmoid", ALPHA, backend="torch")
    try:
        from spikingjelly.activation_based import functional, neuron, surrogate

        sj = neuron.LIFNode(tau=TAU, decay_input=True, v_threshold=VTH, v_reset=0.0,
                            surrogate_function=surrogate.Sigmoid(alpha=ALPHA),
                            detach_reset=detach_reset, step_mode="m")

        def run_sj(x):
            functional.reset_net(sj)
            return sj(x)

        impls["spikingjelly LIFNode"] = run_sj
    except ImportError:
        print("spikingjelly not installed: skipped")
    try:
        import snntorch
        from snntorch import surrogate as snn_surrogate

        # same cost class: beta=1-1/tau, reset to zero, sigmoid surrogate with the same slope
        leaky = snntorch.Leaky(beta=1 - 1 / TAU, threshold=VTH, reset_mechanism="zero",
                               spike_grad=snn_surrogate.sigmoid(slope=ALPHA))

        def run_snn(x):
            mem = leaky.init_leaky()
            out = []
            for t in range(x.shape[0]):
                spk, mem = leaky(x[t] / TAU, mem)
                out.append(spk)
            return torch.stack(out)

        impls["snntorch Leaky loop"] = run_snn
    except ImportError:
        print("snntorch not installed: skipped")

    def plain_loop(x):
        v = torch.zeros_like(x[0])
        out = []
        for t in range(x.shape[0]):
            h = v + (x[t] - v) / TAU
            s = K._Heaviside.apply(h - VTH, 0, ALPHA)
            sr = s.detach() if detach_reset else s
            v = h * (1.0 - sr)
            out.append(s)
        return torch.stack(out)

    impls["torch.compile plain loop"] = torch.compile(plain_loop, dynamic=False)
    return impls


def bench_shape(shape, impls, repeats: int, base: str) -> list[dict]:
    torch.manual_seed(0)
    x0 = torch.randn(*shape) * 1.5 + 0.5
    g = torch.randn(*shape)
    rows = []
    ref_spikes = None
    for name, fn in impls.items():
        x = x0.clone().requires_grad_()
        y, mem = saved_bytes(fn, x)  # warm-up (compiles) and memory measurement
        (y * g).sum().backward()
        if ref_spikes is None:
            ref_spikes = y.detach()
        agree = torch.equal(y.detach(), ref_spikes) if "snntorch" not in name else None
        del y
        times = []
        for _ in range(repeats):
            x.grad = None
            t0 = time.perf_counter()
            y = fn(x)
            (y * g).sum().backward()
            times.append(time.perf_counter() - t0)
            del y
        rows.append({"name": name, "ms": 1e3 * statistics.median(times), "bytes": mem, "agree": agree})
        print(f"  {name:28s} {rows[-1]['ms']:9.1f} ms  saved {mem / 2**20:8.1f} MiB", flush=True)
    ref = next((r for r in rows if r["name"] == base), rows[0])
    for r in rows:
        r["speedup"] = ref["ms"] / r["ms"]
        r["mem_ratio"] = r["bytes"] / ref["bytes"] if ref["bytes"] else float("nan")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4x32x24576,8x64x65536")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--no-detach-reset", action="store_true", help="spikingjelly's default detach_reset=False")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    detach = not args.no_detach_reset
    impls = make_impls(detach)
    base = "spikingjelly LIFNode"
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, detach_reset={detach}, auto -> "
          f"{K.resolve_backend('auto', torch.device('cpu'))}")
    for spec in args.shapes.split(","):
        shape = tuple(int(s) for s in spec.split("x"))
        print(f"shape {list(shape)}")
        rows = bench_shape(shape, impls, args.repeats, base)
        print(f"\n| shape {list(shape)} | fwd+bwd median (ms) | speed-up vs spikingjelly | saved activations (MiB) "
              f"| memory vs spikingjelly | spikes equal ours auto |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            agree = "n/a (other dynamics)" if r["agree"] is None else ("yes" if r["agree"] else "NO")
            print(f"| {r['name']} | {r['ms']:.1f} | {r['speedup']:.2f}x | {r['bytes'] / 2**20:.1f} | "
                  f"{r['mem_ratio']:.2f} | {agree} |")
        print()


if __name__ == "__main__":
    main()
