"""Export a spiking model to NIR: `efficient export MODEL_OR_RUN --to nir OUT.nir`.

MODEL_OR_RUN is a zoo name (with `--pretrained` weights and key=value options), a run dir or a
.safetensors checkpoint. The graph describes one time step of one sample (see efficient.export);
`--dt` is the seconds per step its time constants are written for (default 1e-4). Models with
LIF/PLIF neurons, or DLIF whose per-step gains are all equal, export; spiking transformers do not
(the error says why). Examples:

    efficient export stable-snn-vgg5 neuron=lif --to nir vgg5.nir
    efficient export runs/stable-lif --to nir model.nir --dt 1e-3
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_OR_RUN", help="zoo name, run dir or .safetensors checkpoint")
    p.add_argument("--to", nargs=2, metavar=("FORMAT", "OUT"), required=True,
                   help="output format and file: `--to nir model.nir` (NIR is the one format)")
    p.add_argument("--dt", type=float, default=None, metavar="SECONDS", help="seconds per time step (default 1e-4)")
    p.add_argument("--pretrained", metavar="SOURCE", nargs="?", const=True,
                   help="zoo names: the shipped weights (no value), a tag of them, a run dir or a weights file")
    p.add_argument("overrides", nargs="*", help="model options as key=value (e.g. neuron=lif timesteps=4)")


def _options(items: list[str]) -> dict:
    from efficient.config import parse_override
    from efficient.errors import ConfigError

    out = {}
    for item in items:
        parts, value = parse_override(item)
        if len(parts) != 1:
            raise ConfigError(f"option {item!r}: give model options as name=value (e.g. timesteps=4)")
        out[parts[0]] = value
    return out


def _sample_input(model, source: str):
    """A zero sample of the shape the zoo entry says the model eats (an image batch of one)."""
    import torch

    from efficient import zoo
    from efficient.errors import ConfigError

    name = getattr(model, "zoo_name", None)
    if name is None:
        raise ConfigError(f"{source}: cannot tell the model's input shape (no zoo name recorded)")
    spec = zoo.get_entry(name).input_spec
    cfg = getattr(model, "zoo_cfg", {}) or {}
    shape = list(spec.shape)
    if len(shape) == 3:  # images: the model may have been built for another size or channel count
        shape = [int(cfg.get("in_chans", shape[0])), int(cfg.get("img_size", shape[1])), int(cfg.get("img_size", shape[2]))]
    return torch.zeros(1, *shape)


def run(args: argparse.Namespace) -> int:
    from efficient import zoo
    from efficient.errors import ConfigError
    from efficient.export import DEFAULT_DT, to_nir, write_nir
    from efficient.profiler.console import echo

    fmt, out = args.to[0], Path(args.to[1])
    if fmt != "nir":
        raise ConfigError(f"--to {fmt}: unknown export format; the one format is nir (`--to nir OUT.nir`)")
    if out.suffix != ".nir":
        raise ConfigError(f"{out}: NIR graphs are written to a .nir file")
    model = zoo.load(args.model, pretrained=args.pretrained, **_options(args.overrides))
    graph = to_nir(model, _sample_input(model, args.model), dt=args.dt if args.dt is not None else DEFAULT_DT)
    write_nir(graph, out)
    neurons = sum(type(n).__name__ in ("LIF", "IF") for n in graph.nodes.values())
    echo(f"wrote {out}: {len(graph.nodes)} nodes ({neurons} spiking), {len(graph.edges)} edges, "
         f"dt={graph.metadata['dt']:g} s per step; load it with efficient.load({str(out)!r})")
    return 0
