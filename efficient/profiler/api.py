"""`profile(model, inputs | input_shape, ...) -> Report`: run one counted forward pass and report it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import math
from typing import Any, Iterable, Literal, Sequence

import torch
from torch import nn

from efficient.data import first_input
from efficient.errors import ConfigError
from efficient.profiler.conventions import Convention, ConventionSpec, resolve_convention
from efficient.profiler.counting import UNATTRIBUTED, CountingMode, ModuleStack
from efficient.profiler.energy import EnergyModel, EnergySpec, resolve_energy
from efficient.profiler.memory_access import MemoryModel, memory_energy
from efficient.profiler.exits import exit_distribution
from efficient.profiler.report import LayerStat, Report
from efficient.zoo import InputSpec, get_entry

MAX_DATA_BATCHES = 16  # batches of `data=` used to measure an exit distribution
# Below this mean firing rate a spiking network is reported as (nearly) silent: its SOPs and energy
# describe a network that barely computes (typical of a fresh initialisation), not a working one.
SILENT_FIRING_RATE = 0.01
SILENT_LAYERS_NAMED = 8  # layers named in the warning before "and N more"


def profile(
    model: nn.Module,
    inputs: Any = None,
    input_shape: Sequence[int] | str | None = None,
    *,
    timesteps: int | None = None,
    energy: EnergySpec = "45nm-fp32",
    data: Iterable[Any] | None = None,
    batch: int = 1,
    flops_per_mac: float = 2,
    spike_matmul: str | None = None,
    exit_threshold: float | None = None,
    name: str | None = None,
    random: Literal["normal", "unit"] = "normal",
    convention: ConventionSpec = "efficient",
    neurobench: bool = False,
    memory_access: bool | MemoryModel = False,
) -> Report:
    """Count MACs, synaptic operations and energy of one forward pass of `model`.

    inputs: a tensor, a tuple of positional tensors or a dict of keyword tensors; or give
      `input_shape` (per sample, without batch: ``(3, 32, 32)`` or ``"3x32x32"``) and `batch`
      for a seeded random input; or `data` (an iterable of batches; its first batch is used).
      With none of these, a zoo model uses the input shape it was built for (`built_input_spec`).
    timesteps: overrides the model's `timesteps` (or `T`) for this pass.
    energy: preset name ("45nm-fp32", "45nm-fp16", "45nm-int8"), EnergyModel, or
      {"e_mac_pj": .., "e_ac_pj": .., "preset": ..}.
    data: for early-exit models, also used to measure the exit distribution.
    flops_per_mac: FLOPs = flops_per_mac x dense_macs (2: a multiply and an add, as FlopCounterMode).
    spike_matmul: spike x spike matmuls charge "operand" = nnz(left operand) x fan-out (the
      convention's default) or "coincidence" = number of (1, 1) products (spikingjelly's SynOpCounter).
    random: values of the seeded random input: "normal" (standard normal, like normalised pixels)
      or "unit" (uniform in [0, 1], for models fed unnormalised images).
    convention: how operands are charged: a preset ("efficient" (default), "accumulate",
      "spikformer", "stata", "neurobench"; `conventions.PRESETS`), a Convention or a mapping.
    neurobench: also report NeuroBench's metrics (`report.neurobench`), with its definitions.
    memory_access: add the memory-traffic energy (True: Lemaire et al. 2022; or a MemoryModel),
      reported beside the compute-only energy (totals energy_memory_pj, energy_total_pj).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"profile() needs a torch.nn.Module, got {type(model).__name__}")
    emodel = resolve_energy(energy)
    if not isinstance(flops_per_mac, (int, float)) or not flops_per_mac > 0:
        raise ConfigError(f"flops_per_mac must be a positive number, got {flops_per_mac!r}")
    conv = resolve_convention(convention)
    if spike_matmul is not None:
        if spike_matmul not in ("operand", "coincidence"):
            raise ConfigError(f"spike_matmul must be 'operand' or 'coincidence', got {spike_matmul!r}")
        if spike_matmul != conv.spike_matmul:
            conv = dataclasses.replace(conv, spike_matmul=spike_matmul, name=f"{conv.name}, spike_matmul={spike_matmul}")
    mmodel = MemoryModel() if memory_access is True else memory_access or None
    if mmodel is not None and not isinstance(mmodel, MemoryModel):
        raise ConfigError(f"memory_access must be True, False or a MemoryModel, got {type(memory_access).__name__}")
    want_nb = neurobench or conv.modules_only
    if timesteps is not None and (not isinstance(timesteps, int) or timesteps < 1):
        raise ConfigError(f"timesteps must be a positive integer, got {timesteps!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch must be a positive integer, got {batch!r}")
    if random not in ("normal", "unit"):
        raise ConfigError(f"random must be 'normal' or 'unit', got {random!r}")

    data_batches = list(itertools.islice(iter(data), MAX_DATA_BATCHES)) if data is not None else None
    random_input = inputs is None and not data_batches
    args, kwargs, source = _resolve_inputs(model, inputs, input_shape, batch, data_batches, random)
    label = name or getattr(model, "zoo_name", None) or type(model).__name__
    _check_input_shape(model, args, kwargs, source, label)
    warnings: list[str] = []

    with _timesteps_override(model, timesteps) as (t_used, repeat_input):
        if repeat_input:
            args = tuple(_repeat_time(a, timesteps) for a in args)
        stack, mode, nb = _run_counted(model, args, kwargs, conv, source, label, neurobench=want_nb)
        batch_size = _batch_size(args, kwargs, model)
        layers = _layers(model, stack, emodel, nb if conv.modules_only else None)
        totals = _totals(model, layers, emodel, flops_per_mac, batch_size)
        if mmodel is not None:
            _add_memory(totals, layers, stack, mmodel)
        exits = _exits(model, args, kwargs, conv, emodel, data_batches, exit_threshold, source, label)

    neurons = [layer for layer in layers if layer.is_neuron]
    steps = max((len(n.firing_rate_per_step or []) for n in neurons if n.neuron and "multi" in n.neuron), default=0)
    from efficient.profiler.report import conventions_block

    meta = {
        "model": label,
        "input": source,
        "timesteps": t_used if t_used is not None else (steps or None),
        "energy": emodel.to_dict(),
        "flops_per_mac": flops_per_mac,
        "convention": conv.to_dict(),
        "conventions": conventions_block(conv, emodel, flops_per_mac, layers, stack, mode, mmodel),
        "spike_spike_matmul": {
            "operand_sops": sum(a.spike_spike_operand for a in stack.layers.values()),
            "coincidence_sops": sum(a.spike_spike_coincidence for a in stack.layers.values()),
        },
    }
    blocks = _blocks(stack)
    report = Report(totals=totals, layers=layers, meta=meta, blocks=blocks, exits=exits,
                    modules=_aggregate(model, layers), warnings=warnings,
                    neurobench=nb.metrics(batch_size) if (nb is not None and neurobench) else None)
    warnings.extend(_warnings(report, stack, mode, random_input))
    return report


# ---------------------------------------------------------------------------------------------
# inputs


def parse_shape(spec: Sequence[int] | str) -> tuple[int, ...]:
    """'3x32x32' or (3, 32, 32) -> (3, 32, 32); rejects non-positive sizes."""
    try:
        dims = tuple(int(d) for d in (spec.lower().replace(",", "x").split("x") if isinstance(spec, str) else spec))
    except (TypeError, ValueError):
        raise ConfigError(f"input shape {spec!r}: expected sizes like 3x32x32 (per sample, without batch)") from None
    if not dims or any(d < 1 for d in dims):
        raise ConfigError(f"input shape {spec!r}: every size must be a positive integer, e.g. 3x32x32")
    return dims


def built_input_spec(model: nn.Module) -> InputSpec | None:
    """The input a zoo-built model was built for: its entry's spec with the model's own image size,
    channels, sequence length and timesteps applied (a run with `img_size: 8` eats 8x8, not the default)."""
    name = getattr(model, "zoo_name", None)
    if not name:
        return None
    try:
        spec = get_entry(name).input_spec
    except ConfigError:
        return None
    cfg = getattr(model, "zoo_cfg", None) or {}
    shape = tuple(spec.shape)
    if spec.dtype != "long" and len(shape) == 3 and isinstance(cfg.get("img_size"), int):
        shape = (int(cfg.get("in_chans", shape[0])), cfg["img_size"], cfg["img_size"])
    if spec.dtype == "long" and len(shape) == 1 and isinstance(cfg.get("seq_len"), int):
        shape = (min(shape[0], cfg["seq_len"]),)
    t = next((getattr(model, a) for a in ("timesteps", "T") if isinstance(getattr(model, a, None), int)), spec.timesteps)
    return dataclasses.replace(spec, shape=shape, timesteps=t)


def fmt_shape(shape: Sequence[int]) -> str:
    """(1, 8, 8) -> '1x8x8', the form `--input` takes."""
    return "x".join(str(d) for d in shape)


def _built_for(spec: InputSpec) -> str:
    shape = f"tokens[{fmt_shape(spec.shape)}]" if spec.dtype == "long" else fmt_shape(spec.shape)
    return f"{shape} per sample" + (f" (T={spec.timesteps})" if spec.timesteps else "")


def _check_input_shape(model: nn.Module, args: tuple, kwargs: dict, source: str, label: str) -> None:
    """Fail before the pass when an image input's per-sample shape is not the one the model was built for."""
    spec = built_input_spec(model)
    x = args[0] if args else None
    if spec is None or spec.dtype == "long" or not isinstance(x, torch.Tensor) or kwargs:
        return
    n = len(spec.shape)
    if x.dim() == n + 2 and spec.timesteps and x.shape[0] == spec.timesteps:  # time-major [T, B, ...]
        per_sample = tuple(x.shape[2:])
    elif x.dim() == n + 1:
        per_sample = tuple(x.shape[1:])
    else:
        return  # another layout (e.g. flattened features): the forward pass decides
    if per_sample != tuple(spec.shape):
        want = fmt_shape(spec.shape)
        todo = (f"Pass --input {want} (input_shape={tuple(spec.shape)} from Python), or leave the shape out to use the model's"
                if source.startswith("random") else
                f"Give inputs of that shape (with --data, a recipe whose data section yields {want}), "
                f"or profile random ones with --input {want}")
        raise ConfigError(
            f"profiling {label}: the input ({source}) does not fit the model: it is {fmt_shape(per_sample)} per sample, "
            f"but the model was built for {_built_for(spec)}. {todo}."
        )


def _device(model: nn.Module) -> torch.device:
    for p in itertools.chain(model.parameters(), model.buffers()):
        return p.device
    return torch.device("cpu")


def _resolve_inputs(model: nn.Module, inputs: Any, input_shape: Any, batch: int,
                    data_batches: list[Any] | None, random: str = "normal") -> tuple[tuple, dict, str]:
    dev = _device(model)
    if inputs is not None:
        if isinstance(inputs, dict):
            return (), dict(inputs), "inputs: " + ", ".join(f"{k}{_shape(v)}" for k, v in inputs.items())
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return args, {}, "inputs: " + ", ".join(_shape(a) for a in args)
    if data_batches:
        x = first_input(data_batches[0]).to(dev)
        return (x,), {}, f"data: first batch {_shape(x)}"
    spec = built_input_spec(model)
    if input_shape is not None:
        shape = parse_shape(input_shape)
    elif spec is not None:
        shape = tuple(spec.shape)
    else:
        raise ConfigError(f"profile({type(model).__name__}): give inputs=, input_shape= (per sample, e.g. (3, 32, 32)) or data=")
    g = torch.Generator().manual_seed(0)
    if spec is not None and spec.dtype == "long":
        vocab = int(getattr(model, "vocab_size", 256))
        x = torch.randint(0, vocab, (batch, *shape), generator=g)
    elif random == "unit":
        x = torch.rand((batch, *shape), generator=g)
    else:
        x = torch.randn((batch, *shape), generator=g)
    kind = "random" if random == "normal" or x.dtype == torch.long else "random uniform [0, 1]"
    return (x.to(dev),), {}, f"{kind} {_shape(x)}"


def _shape(x: Any) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _batch_size(args: tuple, kwargs: dict, model: nn.Module) -> int:
    x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return 1
    t = getattr(model, "timesteps", None) or getattr(model, "T", None)
    if x.dim() == 5 and isinstance(t, int) and x.shape[0] == t:  # time-major [T, B, C, H, W]
        return int(x.shape[1])
    return int(x.shape[0])


@contextlib.contextmanager
def _timesteps_override(model: nn.Module, timesteps: int | None):
    """Yield (timesteps used, whether the input must be repeated over a new T axis)."""
    attr = next((a for a in ("timesteps", "T") if isinstance(getattr(model, a, None), int)), None)
    if timesteps is None:
        yield (getattr(model, attr) if attr else None), False
        return
    if attr is None:
        yield timesteps, True
        return
    old = getattr(model, attr)
    setattr(model, attr, timesteps)
    try:
        yield timesteps, False
    finally:
        setattr(model, attr, old)


def _repeat_time(x: Any, t: int) -> Any:
    return x.unsqueeze(0).expand(t, *x.shape).contiguous() if isinstance(x, torch.Tensor) else x


# ---------------------------------------------------------------------------------------------
# the counted pass


def _reset_peer_state(model: nn.Module) -> None:
    """spikingjelly neurons keep membrane state between calls; start from rest like ours do."""
    for m in model.modules():
        if type(m).__module__.startswith("spikingjelly") and hasattr(m, "reset") and callable(m.reset):
            m.reset()


@contextlib.contextmanager
def _eager_neurons_on_cpu(model: nn.Module):
    """Our neurons with backend="auto" run the eager torch reference on CPU while counted: same
    spikes, and no inductor compile (nor dynamo recompiles) inside the counting mode."""
    from efficient.profiler.neurons import neuron_library

    changed = [m for m in model.modules()
               if neuron_library(m) == "efficient" and getattr(m, "backend", None) == "auto"
               and _device(model).type == "cpu"]
    for m in changed:
        m.backend = "torch"
    try:
        yield
    finally:
        for m in changed:
            m.backend = "auto"


def _run_counted(model: nn.Module, args: tuple, kwargs: dict, convention: Convention, source: str,
                 label: str, neurobench: bool = False) -> tuple[ModuleStack, CountingMode, Any]:
    from efficient.profiler.neurobench import NeuroBenchCollector

    was_training = model.training
    stack = ModuleStack(model)
    blocks = _block_modules(model)
    stack.watch_blocks(blocks)
    model.eval()
    _reset_peer_state(model)
    mode = CountingMode(stack, convention)

    @contextlib.contextmanager
    def pause():
        mode.paused = True
        try:
            yield
        finally:
            mode.paused = False

    nb = NeuroBenchCollector(model, pause) if neurobench else None
    try:
        with torch.no_grad(), _eager_neurons_on_cpu(model), stack, nb or contextlib.nullcontext(), mode:
            model(*args, **kwargs)
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
        spec = built_input_spec(model)
        expect = (f" The model was built for {_built_for(spec)}; try --input {fmt_shape(spec.shape)}."
                  if spec is not None else "")
        raise ConfigError(
            f"profiling {label}: the input ({source}) does not fit the model.{expect} "
            f"The forward pass failed with {type(e).__name__}: {e}"
        ) from e
    finally:
        model.train(was_training)
        _reset_peer_state(model)
    return stack, mode, nb


def _block_modules(model: nn.Module) -> dict[str, nn.Module]:
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return {f"blocks.{i}": b for i, b in enumerate(blocks)}
    return {}


def _blocks(stack: ModuleStack) -> list[dict[str, Any]]:
    out = []
    for i, (name, tokens) in enumerate(sorted(stack.block_tokens.items(), key=lambda kv: int(kv[0].split(".")[1]))):
        out.append({"block": name, "index": int(name.split(".")[1]), "tokens_in": tokens[0], "calls": len(tokens)})
    return out


def _layers(model: nn.Module, stack: ModuleStack, emodel: EnergyModel, nb: Any = None) -> list[LayerStat]:
    """Per-layer stats; with `nb` (the NeuroBench convention) MACs and ACs are NeuroBench's Effective
    MACs / ACs of the Linear/Conv modules, and every other op counts 0."""
    mods = dict(model.named_modules())
    root = stack.root_label
    out = []
    for acc in stack.layers.values():
        if acc.dense_macs == 0 and acc.neuron is None:
            continue
        m = mods.get("" if acc.name == root else acc.name)
        params = sum(p.numel() for p in m.parameters(recurse=False)) if m is not None else 0
        macs, sops = acc.macs, acc.sops
        if nb is not None:
            row = nb.per_layer.get(id(m), {}) if m is not None else {}
            macs, sops = row.get("macs", 0), row.get("acs", 0)
        out.append(LayerStat(
            name=acc.name,
            type=acc.type,
            dense_macs=acc.dense_macs,
            macs=macs,
            sops=sops,
            int_operand_macs=acc.int_macs if nb is None else 0,
            int_operand_acs=acc.int_acs if nb is None else 0,
            real_operand_macs=acc.real_macs,
            energy_pj=emodel.energy_pj(macs, sops),
            input_firing_rate=(acc.in_nnz / acc.in_numel) if acc.in_numel else None,
            output_firing_rate=(acc.out_nnz / acc.out_numel) if acc.out_numel else None,
            firing_rate_per_step=acc.per_step,
            neuron=acc.neuron,
            ops=", ".join(f"{k} x{v}" for k, v in acc.ops.items()),
            params=params,
            neuron_outputs=acc.out_numel,
        ))
    return out


def _totals(model: nn.Module, layers: list[LayerStat], emodel: EnergyModel, flops_per_mac: float,
            batch_size: int) -> dict[str, float]:
    dense = sum(layer.dense_macs for layer in layers)
    macs = sum(layer.macs for layer in layers)
    sops = sum(layer.sops for layer in layers)
    energy = emodel.energy_pj(macs, sops)
    totals: dict[str, float] = {
        "params": sum(p.numel() for p in model.parameters()),
        "dense_macs": dense,
        "macs": macs,
        "sops": sops,
        "flops": flops_per_mac * dense,
        "flops_per_mac": flops_per_mac,
        "energy_pj": energy,
        "energy_mac_pj": emodel.e_mac_pj * macs,
        "energy_ac_pj": emodel.e_ac_pj * sops,
        "e_mac_pj": emodel.e_mac_pj,
        "e_ac_pj": emodel.e_ac_pj,
        "batch_size": batch_size,
        "energy_pj_per_sample": energy / batch_size,
    }
    totals["int_operand_macs"] = sum(layer.int_operand_macs for layer in layers)
    totals["int_operand_acs"] = sum(layer.int_operand_acs for layer in layers)
    neurons = [layer for layer in layers if layer.is_neuron]
    if neurons:
        # weighted by neuron outputs: total spikes / total neuron-step outputs
        outs = sum(n.neuron_outputs for n in neurons)
        totals["spiking_neurons"] = len(neurons)
        totals["mean_firing_rate"] = sum((n.output_firing_rate or 0.0) * n.neuron_outputs for n in neurons) / outs if outs else 0.0
    return totals


def _add_memory(totals: dict[str, float], layers: list[LayerStat], stack: ModuleStack, mmodel: MemoryModel) -> None:
    """Memory-access energy beside the compute-only energy: per layer and in totals."""
    by_name = {layer.name: layer for layer in layers}
    for acc in stack.layers.values():
        layer = by_name.get(acc.name)
        if layer is not None:
            layer.memory_pj = memory_energy([acc.memory], mmodel)["total_pj"]
    mem = memory_energy([acc.memory for acc in stack.layers.values()], mmodel)
    totals["energy_memory_pj"] = mem["total_pj"]
    totals["energy_total_pj"] = totals["energy_pj"] + mem["total_pj"]
    totals["energy_total_pj_per_sample"] = totals["energy_total_pj"] / totals["batch_size"]
    for k, v in mem.items():
        if k != "total_pj":
            totals[f"memory_{k}"] = v


def _aggregate(model: nn.Module, layers: list[LayerStat], max_depth: int = 3) -> dict[str, dict[str, float]]:
    """Totals per module prefix (depth <= max_depth) for the top-modules summary."""
    mods = dict(model.named_modules())
    agg: dict[str, dict[str, float]] = {}
    for layer in layers:
        if layer.name not in mods and layer.name == type(model).__name__:
            # ops the root module issues itself (functional code in its forward)
            row = agg.setdefault(f"({layer.name} own ops)", {
                "type": layer.type, "params": sum(p.numel() for p in model.parameters(recurse=False)),
                "dense_macs": 0, "macs": 0, "sops": 0, "energy_pj": 0.0})
            for k in ("dense_macs", "macs", "sops", "energy_pj"):
                row[k] += getattr(layer, k)
            continue
        parts = layer.name.split(".")
        for d in range(1, min(len(parts), max_depth) + 1):
            key = ".".join(parts[:d])
            if key not in mods:
                break
            row = agg.get(key)
            if row is None:
                row = agg[key] = {"type": type(mods[key]).__name__, "params": sum(p.numel() for p in mods[key].parameters()),
                                  "dense_macs": 0, "macs": 0, "sops": 0, "energy_pj": 0.0}
            for k in ("dense_macs", "macs", "sops", "energy_pj"):
                row[k] += getattr(layer, k)
    return agg


# ---------------------------------------------------------------------------------------------
# early exit


def _has_exits(model: nn.Module) -> bool:
    """An early-exit model lists `exit_layers` and runs up to one of them when its forward gets
    `exit_layer=k` (or, for models written that way, inside a `forced_exit(k)` context)."""
    if not hasattr(model, "exit_layers"):
        return False
    return hasattr(model, "forced_exit") or "exit_layer" in inspect.signature(model.forward).parameters


def _run_to_exit(model: nn.Module, k: int, args: tuple, kwargs: dict, convention: Convention, source: str, label: str) -> ModuleStack:
    """Counted forward pass that stops at the exit after layer `k`."""
    if hasattr(model, "forced_exit"):
        with model.forced_exit(k):
            return _run_counted(model, args, kwargs, convention, source, label)[0]
    return _run_counted(model, args, {**kwargs, "exit_layer": k}, convention, source, label)[0]


def _tokens_in(args: tuple, kwargs: dict) -> int:
    x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    if isinstance(x, torch.Tensor) and not x.dtype.is_floating_point and x.dim() >= 1:
        return int(x.numel())  # token ids [B, S]
    if isinstance(x, torch.Tensor) and x.dim() >= 2:
        return int(math.prod(x.shape[:2]))  # embeddings [B, S, D]
    return 1


def _backbone_prefix(model: nn.Module) -> str | None:
    for attr in ("blocks", "layers", "h"):
        if isinstance(getattr(model, attr, None), (nn.ModuleList, nn.Sequential)):
            return attr
    tr = getattr(model, "transformer", None)
    if tr is not None and isinstance(getattr(tr, "h", None), (nn.ModuleList, nn.Sequential)):
        return "transformer.h"
    return None


def _exits(model: nn.Module, args: tuple, kwargs: dict, spike_matmul: Convention, emodel: EnergyModel,
           data_batches: list[Any] | None, threshold: float | None, source: str, label: str) -> dict[str, Any] | None:
    if not _has_exits(model):
        return None
    exit_layers = sorted(int(k) for k in model.exit_layers)
    num_layers = int(getattr(model, "num_layers", exit_layers[-1]))
    if num_layers not in exit_layers:
        exit_layers.append(num_layers)
    tokens = _tokens_in(args, kwargs)
    prefix = _backbone_prefix(model)
    per_exit: dict[int, dict[str, float]] = {}
    for k in exit_layers:
        layers = _layers(model, _run_to_exit(model, k, args, kwargs, spike_matmul, source, label), emodel)
        dense = sum(layer.dense_macs for layer in layers)
        macs = sum(layer.macs for layer in layers)
        sops = sum(layer.sops for layer in layers)
        backbone = sum(layer.dense_macs for layer in layers
                       if prefix and (layer.name == prefix or layer.name.startswith(prefix + ".")))
        per_exit[k] = {
            "dense_macs": dense, "macs": macs, "sops": sops, "backbone_macs": backbone,
            "energy_pj": emodel.energy_pj(macs, sops),
            "macs_per_token": dense / tokens, "energy_pj_per_token": emodel.energy_pj(macs, sops) / tokens,
        }
    out: dict[str, Any] = {"exit_layers": exit_layers, "num_layers": num_layers, "tokens": tokens,
                           "backbone": prefix, "per_exit": per_exit}
    if data_batches:
        if hasattr(model, "exit_distribution"):
            measure = model.exit_distribution
        elif hasattr(model, "exit_states"):
            measure = functools.partial(exit_distribution, model)
        else:
            raise ConfigError(f"{label} has exits but neither exit_states(idx) nor exit_distribution(batches, threshold); cannot measure exits from data")
        thr = float(threshold if threshold is not None else getattr(model, "exit_threshold", 0.9))
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                dist = {int(k): float(v) for k, v in measure(data_batches, thr).items()}
        finally:
            model.train(was_training)
        unknown = sorted(set(dist) - set(per_exit))
        if unknown:
            raise ConfigError(f"{label}.exit_distribution returned layers {unknown} that are not exits {exit_layers}")
        total = sum(dist.values())
        if not math.isclose(total, 1.0, rel_tol=1e-3, abs_tol=1e-3):
            raise ConfigError(f"{label}.exit_distribution fractions sum to {total:.4f}, expected 1")
        exp_macs = sum(p * per_exit[k]["macs_per_token"] for k, p in dist.items())
        exp_energy = sum(p * per_exit[k]["energy_pj_per_token"] for k, p in dist.items())
        full = per_exit[num_layers]
        out.update({
            "threshold": thr,
            "distribution": dist,
            "expected_exit_layer": sum(k * p for k, p in dist.items()),
            "expected_macs_per_token": exp_macs,
            "expected_energy_pj_per_token": exp_energy,
            "full_macs_per_token": full["macs_per_token"],
            "speedup_bound": full["macs_per_token"] / exp_macs if exp_macs else None,
            "energy_saving": 1 - exp_energy / full["energy_pj_per_token"] if full["energy_pj_per_token"] else None,
        })
    return out


# ---------------------------------------------------------------------------------------------
# warnings


def _warnings(report: Report, stack: ModuleStack, mode: CountingMode, random_input: bool) -> list[str]:
    out = []
    silence = silent_network_warning(report)
    if silence:
        out.append(silence)
    if report.neurons and random_input:
        out.append("inputs were random: firing rates and SOPs depend on the data; pass inputs= or data= for real numbers")
    un = stack.layers.get(UNATTRIBUTED)
    if un is not None and (un.dense_macs or un.ops):
        kinds = ", ".join(f"{k} ({v})" for k, v in stack.unattributed_modules.items()) or "code outside any module"
        out.append(
            f"{un.dense_macs} dense MACs ({sum(un.ops.values())} ops) came from modules outside the model's "
            f"module tree and are listed as {UNATTRIBUTED}: {kinds}. Register them as submodules to attribute them."
        )
    if mode.unknown_ops:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(mode.unknown_ops.items()))
        out.append(f"custom ops without a counting rule were charged 0 MACs: {ops}")
    if report.totals["dense_macs"] == 0:
        out.append("no matmul/conv/linear ops were seen in the forward pass")
    return out


def silent_network_warning(report: Report, threshold: float = SILENT_FIRING_RATE) -> str | None:
    """A warning when the spiking layers (nearly) never fire: the mean firing rate is below
    `threshold` or some spiking layer never fired. It names the layers and says what to do;
    None for a network that fires (or has no spiking neurons)."""
    neurons = report.neurons
    if not neurons:
        return None
    rate = float(report.totals.get("mean_firing_rate", 0.0))
    silent = [n.name for n in neurons if not n.output_firing_rate]
    if rate >= threshold and not silent:
        return None
    if len(silent) == len(neurons):
        head = (f"the network is silent: none of its {len(neurons)} spiking layers fired (mean firing rate 0), "
                "so SOPs downstream of them are 0 and the energy is that of a network that does not compute. "
                f"Silent layers: {_name_some(silent)}.")
    else:
        head = (f"the network is nearly silent: mean firing rate {rate:.2g}, below {threshold:g}; SOPs and energy "
                "reflect a network that barely spikes, not a working one." if rate < threshold else
                f"some spiking layers never fired (mean firing rate {rate:.3g}), so SOPs downstream of them are 0.")
        if silent:
            head += f" Never fired ({len(silent)} of {len(neurons)} spiking layers): {_name_some(silent)}."
        else:
            quiet = sorted(neurons, key=lambda n: n.output_firing_rate or 0.0)[:SILENT_LAYERS_NAMED]
            head += " Quietest layers: " + ", ".join(f"{n.name} ({n.output_firing_rate or 0.0:.4f})" for n in quiet) + "."
    return (head + " A freshly initialised network, or inputs unlike its training data, does this: profile a trained "
            "run (`efficient profile RUN_DIR`, or a zoo name with --pretrained) or real data (`--data NAME`; "
            "data= or inputs= from Python).")


def _name_some(names: list[str]) -> str:
    shown = ", ".join(names[:SILENT_LAYERS_NAMED])
    return shown + (f" and {len(names) - SILENT_LAYERS_NAMED} more" if len(names) > SILENT_LAYERS_NAMED else "")
