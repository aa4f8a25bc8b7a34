"""Check a NIR graph written by any library: `efficient import graph.nir [--dt SECONDS] [--steps T]`.

Reads the `.nir` file, builds it on our kernels (the network `efficient.load` returns), runs it for
`--steps` time steps on zero input and prints what each node became. A graph we cannot run
(unknown nodes, recurrent edges, shapes that do not chain, a damaged file) ends with one message
saying which node or edge and why. `--dt` is the seconds per time step (default: the graph's own,
else 1e-4). Example:

    efficient import model.nir --dt 1e-3
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("graph", metavar="GRAPH.nir", help="a NIR graph file (HDF5)")
    p.add_argument("--dt", type=float, default=None, metavar="SECONDS", help="seconds per time step (default: the graph's, else 1e-4)")
    p.add_argument("--steps", type=int, default=2, metavar="T", help="time steps of the dry run on zeros (default 2)")


def run(args: argparse.Namespace) -> int:
    import torch

    from efficient.errors import ConfigError
    from efficient.export import load_nir
    from efficient.profiler.console import echo

    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: give at least one time step")
    net = load_nir(args.graph, dt=args.dt)
    if net.input_shape is None:
        raise ConfigError(f"{args.graph}: its Input node has no shape; NIR graphs state the per-sample input shape")
    with torch.no_grad():
        try:
            out = net(torch.zeros(args.steps, 1, *net.input_shape))
        except (RuntimeError, ValueError) as e:  # shapes that do not chain, found when the layers run
            raise ConfigError(f"{args.graph}: the graph does not run on its own input shape "
                              f"{list(net.input_shape)}: {str(e).splitlines()[0]}") from None
    echo(f"{args.graph}: {len(net.order)} nodes, dt={net.dt:g} s per step, input {list(net.input_shape)} "
         f"-> output {list(out.shape[2:])}")
    for name in net.order:
        if name in net.nodes:
            echo(f"  {name}: {net.nodes[name]!r}".splitlines()[0])
    echo(f"load it with efficient.load({args.graph!r}); it takes time-major input [T, B, ...]")
    return 0
