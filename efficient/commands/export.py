"""Export a spiking model to NIR: `efficient export MODEL_OR_RUN --to nir OUT.nir`.

MODEL_OR_RUN is a zoo name (with `--pretrained` weights and key=value options), a run dir, a
.safetensors checkpoint, or `FILE.py:NAME` naming a spikingjelly / snntorch / torch model in a Python
file (NAME a module or a function that returns one; `--weights` a state dict for it, `--input-shape`
what it is called with: `T,B,...` for multi-step spikingjelly, `B,...` for snntorch). The graph describes one time step of one sample (see efficient.export);
`--dt` is the seconds per step its time constants are written for (default 1e-4). Models with
LIF/PLIF neurons, or DLIF whose per-step gains are all equal, export; spiking transformers do not
(the error says why). Examples:

    efficient export stable-snn-vgg5 neuron=lif --to nir vgg5.nir
    efficient export runs/stable-lif --to nir model.nir --dt 1e-3
    efficient export net.py:build --input-shape 1,2,8,8 --weights net.pt --to nir net.nir
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
    p.add_argument("--input-shape", metavar="DIMS", help="FILE.py:NAME models: the shape the model is called with, "
                   "e.g. 4,1,2,8,8 ([T, B, C, H, W], multi-step) or 1,2,8,8 (one step)")
    p.add_argument("--weights", metavar="FILE", help="FILE.py:NAME models: a state dict (.safetensors or torch .pt) to load")
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


def _python_model(spec: str, weights: str | None):
    """The module `NAME` (or what function `NAME()` returns) of Python file `FILE.py`, with `weights` loaded."""
    import importlib.util

    import torch
    from torch import nn

    from efficient.errors import ConfigError

    file, _, name = spec.rpartition(":")
    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"{file}: no such Python file (give FILE.py:NAME)")
    mod_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{file}: importing it failed ({type(e).__name__}: {e})") from None
    if not hasattr(module, name):
        raise ConfigError(f"{file}: defines no {name!r}")
    obj = getattr(module, name)
    model = obj if isinstance(obj, nn.Module) else obj() if callable(obj) else None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec}: is neither a torch module nor a function returning one")
    if weights:
        from efficient.io import load_weights

        load_weights(model, Path(weights))  # safetensors or weights-only torch; mismatched keys are named
    return model


def _shape(text: str | None, spec: str):
    import torch

    from efficient.errors import ConfigError

    try:
        dims = [int(d) for d in (text or "").split(",")]
    except ValueError:
        dims = []
    if not dims or min(dims) < 1:
        raise ConfigError(f"{spec}: give --input-shape as positive integers separated by commas (e.g. 4,1,2,8,8), "
                          f"got {text!r}")
    return torch.zeros(*dims)


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
    if args.model.rpartition(":")[0].endswith(".py"):
        model, sample = _python_model(args.model, args.weights), _shape(args.input_shape, args.model)
    else:
        model = zoo.load(args.model, pretrained=args.pretrained, **_options(args.overrides))
        sample = _sample_input(model, args.model)
    graph = to_nir(model, sample, dt=args.dt if args.dt is not None else DEFAULT_DT)
    write_nir(graph, out)
    neurons = sum(type(n).__name__ in ("LIF", "IF") for n in graph.nodes.values())
    echo(f"wrote {out}: {len(graph.nodes)} nodes ({neurons} spiking), {len(graph.edges)} edges, "
         f"dt={graph.metadata['dt']:g} s per step; load it with efficient.load({str(out)!r})")
    return 0
