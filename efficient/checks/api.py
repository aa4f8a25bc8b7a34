"""`check(model, example, ...)`: resolves the model and its inputs (a module and a batch, a zoo
name, a run dir), sets up the passes and runs the checks asked for."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
from torch import Tensor, nn

from efficient.checks.passes import _is_multi_step, _kept_as_it_was, _run, _Setup, _generator, spiking_layers
from efficient.checks.report import CHECKS, CheckReport, CheckResult
from efficient.checks.suite import (_check_batch, _check_binary, _check_causality, _check_rates, _check_state,
                                    _check_surrogate, _skip_all)
from efficient.errors import ConfigError, closest

RTOL = 1e-4  # relative change that counts as a dependence (rounding moves ~1e-7, a real dependence O(1))
SILENT_RATE = 0.0  # a layer at or below this firing rate is silent
SATURATED_RATE = 0.99  # a layer at or above this firing rate is saturated
# samples in the batch, state, causality and gradient passes: the first and last are kept, those
# between replaced; one more when T is 3, so the batch and time axes never have the same size
CHECK_BATCH = 3


def _device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in itertools.chain(model.parameters(), model.buffers()):
        if p.is_floating_point():
            return p.device, p.dtype
    return torch.device("cpu"), torch.get_default_dtype()


def _timesteps(model: nn.Module, given: int | None) -> int | None:
    if given is not None:
        return given
    for attr in ("timesteps", "T", "num_steps"):
        v = getattr(model, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    from efficient.profiler.api import built_input_spec

    spec = built_input_spec(model)
    return spec.timesteps if spec is not None else None


def _random_example(model: nn.Module, n: int, seed: int) -> tuple[Tensor, str]:
    from efficient.profiler.api import built_input_spec, fmt_shape

    spec = built_input_spec(model)
    if spec is None:
        raise ConfigError(f"check({type(model).__name__}): give an example input (a batch of real data); "
                          "only zoo models know the input they were built for")
    device, dtype = _device_dtype(model)
    g = _generator(seed)
    if spec.dtype == "long":
        x = torch.randint(0, int(getattr(model, "vocab_size", 256)), (n, *spec.shape), generator=g)
        return x.to(device), f"random tokens [{n}, {fmt_shape(spec.shape)}]"
    return torch.randn((n, *spec.shape), generator=g).to(device, dtype), f"random normal [{n}, {fmt_shape(spec.shape)}]"


def _is_time_major(model: nn.Module, x: Tensor, T: int | None, given: bool | None) -> bool:
    if given is not None:
        return given
    from efficient.profiler.api import built_input_spec

    spec = built_input_spec(model)
    return bool(spec is not None and T and x.dim() == len(spec.shape) + 2 and x.shape[0] == T)


def _spec_free(model: nn.Module) -> bool:
    from efficient.profiler.api import built_input_spec

    return built_input_spec(model) is None


def _check_batch_of(x: Tensor, batch_dim: int, T: int | None) -> Tensor:
    """The samples the batch, state, causality and gradient passes use: the example's first
    CHECK_BATCH (cycling a smaller example), one more where that equals T."""
    have = x.shape[batch_dim]
    n = CHECK_BATCH + (1 if T == CHECK_BATCH else 0)
    idx = torch.arange(n, device=x.device) % have
    return x.index_select(batch_dim, idx)


def check(
    model: nn.Module | str | Path,
    example: Tensor | None = None,
    *,
    only: Sequence[str] | None = None,
    reset: Callable[[nn.Module], Any] | None = None,
    timesteps: int | None = None,
    time_major: bool | None = None,
    rtol: float = RTOL,
    silent_rate: float = SILENT_RATE,
    saturated_rate: float = SATURATED_RATE,
    seed: int = 0,
    pretrained: bool | str | None = None,
    checkpoint: Literal["last", "best"] = "last",
    data: str | None = None,
    batch: int = 8,
    name: str | None = None,
) -> CheckReport:
    """Run the checks of `efficient.checks` (see its docstring) on `model` and return the report.

    model: a module, or a zoo name / run dir / .safetensors file (loaded as `efficient.load` does).
    example: a batch of real inputs, `[B, ...]` or time-major `[T, B, ...]`. Without it a zoo model
      gets random inputs of the shape it was built for (and the rates check is skipped); a zoo name
      with shipped weights (`pretrained`) or a run dir gets its validation data, `data` names another
      source ("random", "val", a dataset name or a recipe YAML; `batch` samples).
    only: check ids to run (of `CHECKS`); the others are left out of the report.
    reset: what the caller runs between forwards (e.g. spikingjelly's `functional.reset_net`); the
      state check runs only this between calls, and every other pass starts from rest.
    timesteps: T, when the model has no `timesteps` / `T` / `num_steps` attribute (nor a zoo spec).
    time_major: whether `example` is `[T, B, ...]` (default: zoo models by their spec, else no).
    rtol: relative change counted as a dependence; silent_rate / saturated_rate: the rates check.
    """
    label = name
    source_note = ""
    real = example is not None
    if isinstance(model, (str, Path)):
        model, example, label, source_note, real = _load_source(str(model), example, pretrained, checkpoint, data, batch, name)
    elif pretrained is not None or data is not None:
        raise ConfigError("pretrained= and data= apply to a zoo name or run dir; for a module, pass example=")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"check() needs a torch.nn.Module, a zoo name or a run dir; got {type(model).__name__}")
    wanted = list(CHECKS) if only is None else list(dict.fromkeys(only))
    for cid in wanted:
        if cid not in CHECKS:
            near = closest(cid, CHECKS)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"no check {cid!r}; the checks are {', '.join(CHECKS)}{hint}")
    if not rtol > 0 or not 0 <= silent_rate < saturated_rate <= 1:
        raise ConfigError(f"need rtol > 0 and 0 <= silent_rate < saturated_rate <= 1; got {rtol}, {silent_rate}, {saturated_rate}")
    label = label or getattr(model, "zoo_name", None) or type(model).__name__
    T = _timesteps(model, timesteps)
    if example is None:
        example, source = _random_example(model, CHECK_BATCH, seed)
    else:
        if not isinstance(example, Tensor):
            raise ConfigError(f"example must be a tensor (a batch of inputs), got {type(example).__name__}")
        device, dtype = _device_dtype(model)
        example = example.to(device, dtype) if example.is_floating_point() else example.to(device)
        source = source_note or f"example {list(example.shape)}"
    layers = spiking_layers(model)
    if time_major is None and T is None and _spec_free(model) and any(_is_multi_step(m) for m in layers.values()):
        # multi-step neurons read [T, B, ...]; whether the model or its caller adds the time axis
        # cannot be told from the input's shape, and guessing wrong swaps samples and time steps
        raise ConfigError(f"check({label}): its spiking layers are multi-step ([T, B, ...]) and the model names no T; "
                          f"say whether example {list(example.shape)} is time-major: time_major=True (its first axis is "
                          "time; timesteps= defaults to its length) or time_major=False with timesteps=T")
    if time_major and T is None:
        T = example.shape[0]
    tm = _is_time_major(model, example, T, time_major)
    batch_dim = 1 if tm else 0
    if example.dim() <= batch_dim:
        raise ConfigError(f"example {list(example.shape)} has no batch axis (expected [B, ...]{' or [T, B, ...]' if T else ''})")
    x = _check_batch_of(example, batch_dim, T)
    s = _Setup(model, layers, {k: _is_multi_step(m) for k, m in layers.items()}, x, x.shape[batch_dim], batch_dim, tm, T,
               reset, seed, rtol)
    results: dict[str, CheckResult] = {}
    with _kept_as_it_was(model) as s.buffers:
        try:
            base_eval = _run(s, x, False)
        except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
            raise ConfigError(f"checking {label}: the model failed on the input ({source}, checked as "
                              f"{list(x.shape)}): {type(e).__name__}: {e}") from e
        if "state" in wanted:
            results["state"] = _check_state(s, base_eval)
            if results["state"].status == "FAIL":  # the other checks compare passes from the same leftover state
                s.prime = True
                base_eval = _run(s, x, False)
        if "batch" in wanted:
            results["batch"] = _check_batch(s, base_eval)
        if "causality" in wanted:
            results["causality"] = (_check_causality(s, base_eval) if layers or tm else
                                    _skip_all("causality", "no spiking layers and no time-major input: nothing to step through"))
        if {"rates", "binary"} & set(wanted):
            full = _run(s, example, False, record="count", drive=False)  # the example's own rates
            for cid, fn in (("rates", lambda: _check_rates(s, full, real, silent_rate, saturated_rate)),
                            ("binary", lambda: _check_binary(s, full))):
                if cid in wanted:
                    results[cid] = fn() if layers else _skip_all(cid, "no spiking layers found")
        if "surrogate" in wanted:
            results["surrogate"] = _check_surrogate(s, real) if layers else _skip_all("surrogate", "no spiking layers found")
    from efficient.profiler.neurons import neuron_kind

    return CheckReport(label, source, [(k, neuron_kind(m)) for k, m in layers.items()], [results[c] for c in CHECKS if c in results])


def _load_source(src: str, example: Tensor | None, pretrained: bool | str | None, checkpoint: Literal["last", "best"],
                 data: str | None, batch: int, name: str | None) -> tuple[nn.Module, Tensor | None, str, str, bool]:
    """(model, example, label, input description, whether the example is real data) for a zoo name or run dir."""
    from efficient.profiler.run import find_run, load_run_model, validation_inputs
    from efficient.zoo import load

    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    run = find_run(src, checkpoint)
    if run is not None:
        if pretrained is not None:
            raise ConfigError(f"pretrained= applies to zoo names; {src} brings its own weights (pick them with checkpoint=)")
        model, label = load_run_model(run), name or run.label
        shipped_data = None
    else:
        model, label = load(src, pretrained=pretrained), name or src
        shipped_data = getattr(model, "pretrained_cfg", {}).get("data")
    if example is not None:
        return model, example, label, "", True
    mode = data or ("val" if run is not None and run.recipe is not None or shipped_data else "random")
    if mode == "random":
        return model, None, label, "", False
    if mode == "val":
        if run is not None and run.recipe is not None:
            from efficient.data import build_data

            x = validation_inputs(build_data(run.recipe.data), batch)
            return model, x, label, f"validation data of the run, first {batch} samples {list(x.shape)}", True
        if shipped_data:
            from efficient.data import first_input
            from efficient.hub import validation_batches

            x = first_input(validation_batches(shipped_data, batch, 1)[0])
            return model, x, label, f"validation data of its weights ({shipped_data.get('name')}) {list(x.shape)}", True
        raise ConfigError(f"data='val' takes a run dir's validation data (or that of shipped weights), and {src} has none; "
                          "use data='random' or a dataset name")
    return model, _dataset_example(mode, batch), label, f"validation data of {mode}, first {batch} samples", True


def _dataset_example(spec: str, batch: int) -> Tensor:
    """The first `batch` validation inputs of a recipe YAML's data section or a registered dataset."""
    from torch.utils.data import DataLoader

    from efficient.data import build_data, first_input, get_dataset_builder

    if spec.endswith((".yaml", ".yml")):
        from efficient.config import load_recipe

        if not Path(spec).exists():
            raise ConfigError(f"data {spec}: no such recipe file")
        bundle = build_data(load_recipe(spec).data)
    else:
        bundle = get_dataset_builder(spec)()
    first = next(iter(DataLoader(bundle.val, batch_size=batch, shuffle=False, collate_fn=bundle.collate_fn)), None)
    if first is None:
        raise ConfigError(f"data {spec}: the validation split is empty")
    return first_input(first)
