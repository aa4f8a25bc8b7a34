"""Recipe schema: YAML + `a.b=value` overrides -> a validated `Recipe`, or a `ConfigError` naming
the file, the key path, what was expected and the closest valid key.

Sections: model, data, objective, optim, schedule, train, eval, profile. `model`, `data` and
`objective` choose a registered component by `name`; their other keys are checked against that
component's typed signature, so components add options without touching this file.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Union

import yaml

from efficient.data import DATA_LOADER_DEFAULTS, DATA_LOADER_KEYS, get_dataset_builder
from efficient.errors import ConfigError, did_you_mean
from efficient.recipe_yaml import SECTIONS, load_yaml, parse_yaml, yaml_load  # noqa: F401 - re-exported
from efficient.objectives import get_objective
from efficient.zoo import get_entry, signature_options




def _positive(v: Any) -> str | None:
    return None if v is None or v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v is None or v >= 0 else "must be >= 0"


def _unit(v: Any) -> str | None:
    return None if v is None or 0 <= v < 1 else "must be in [0, 1)"


def _fraction(v: Any) -> str | None:
    return None if v is None or 0 <= v <= 1 else "must be in [0, 1]"


def _loggers(v: list[str]) -> str | None:
    from efficient.report.loggers import logger_names_problem

    return logger_names_problem(v)


def _opt(check: Callable[[Any], str | None], **kw: Any) -> Any:
    return field(metadata={"check": check}, **kw)


@dataclass
class OptimConfig:
    """Optimizer. Weight decay skips 1-D parameters (norms, biases) unless `decay_1d` is true."""

    name: Literal["adamw", "sgd", "adam"] = "adamw"
    lr: float = _opt(_positive, default=1e-3)
    weight_decay: float = _opt(_non_negative, default=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = _opt(_positive, default=1e-8)
    momentum: float = _opt(_non_negative, default=0.9)
    nesterov: bool = False
    decay_1d: bool = False


@dataclass
class ScheduleConfig:
    """Learning-rate schedule, in epochs (fractions allowed): linear warm-up from `warmup_lr`,
    then cosine (or constant / linear) down to `min_lr`, then `cooldown_epochs` at `min_lr`."""

    name: Literal["cosine", "constant", "linear"] = "cosine"
    warmup_epochs: float = _opt(_non_negative, default=0.0)
    warmup_lr: float = _opt(_non_negative, default=1e-6)
    min_lr: float = _opt(_non_negative, default=0.0)
    cooldown_epochs: float = _opt(_non_negative, default=0.0)


@dataclass
class ParallelConfig:
    """Scale-out of one run over `--nproc` processes (efficient.train.parallel).

    `pipeline_stages` > 1 splits the layers into that many pipeline stages (processes); the rest
    of the processes are data-parallel replicas of the pipeline. `schedule` is one of
    torch.distributed.pipelining's (interleaved_1f1b runs two model chunks per process), over
    `microbatches` micro-batches of each replica's batch (default: twice the stages). `fsdp`
    shards parameters per transformer block with FSDP2 instead (no pipeline)."""

    pipeline_stages: int = _opt(_positive, default=1)
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    microbatches: int | None = _opt(_positive, default=None)
    fsdp: bool = False

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or (2 * self.pipeline_stages if self.pipeline_stages > 1 else 1)

    @property
    def enabled(self) -> bool:
        return self.pipeline_stages > 1 or self.fsdp

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks (pipeline stages) each process runs: 2 for the interleaved schedule."""
        return 2 if self.schedule == "interleaved_1f1b" else 1


@dataclass
class TrainConfig:
    epochs: int = _opt(_positive, default=1)
    max_steps: int | None = _opt(_positive, default=None)
    seed: int = 0
    device: str = "auto"
    amp: bool = True
    # CUDA only: fp32 matmuls and convolutions on TF32 tensor cores (torch's default for cuDNN
    # convolutions, not for matmuls); false: strict fp32 everywhere
    tf32: bool = True
    grad_clip: float | None = _opt(_positive, default=None)
    log_every: int = _opt(_positive, default=10)
    eval_every: int = _opt(_positive, default=1)
    checkpoint_every: int | None = _opt(_positive, default=None)
    # torch.compile of the training forward: false | true (= default) | default | reduce-overhead
    # (CUDA-graph replay of the step; CUDA only) | max-autotune | max-autotune-no-cudagraphs
    compile: bool | Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = False
    # activation memory of a step (efficient.memory): none | bits (spikes saved as bits, same gradients)
    # | recompute (units keep only their inputs and recompute the rest in backward)
    memory: Literal["none", "bits", "recompute"] = "none"
    # recompute only: keep at most this fraction of none's activation bytes (measured on the first
    # batch before training); as few units as that needs rerun whole, the others only their neurons.
    # null: every unit reruns whole (the least memory)
    memory_budget: float | None = _opt(_fraction, default=None)
    # what memory_budget is a fraction of: saved (none's activation bytes; matmul/convolution outputs
    # kept) | peak (none's step peak of live tensors, what a GPU's max_memory_allocated reports; units
    # run plainly, without a rerun, while the step's peak stays within it or within the peak of every
    # unit rerun whole, whichever is larger; reruns off that peak keep their membrane traces)
    memory_budget_of: Literal["saved", "peak"] = "saved"
    # host memory (efficient.memory.host): system (glibc as it is) | reuse (freed tensors stay with
    # malloc for the next step: no page faults per step; memory is not given back to the OS; glibc only)
    host_memory: Literal["system", "reuse"] = "system"
    # update each parameter inside backward as soon as its gradient exists, and free that gradient
    # (efficient.train.optim.InBackwardOptimizer): a step never holds all parameter gradients; same
    # updates; not with grad_clip or more than one process
    optimizer_in_backward: bool = False
    deterministic: bool = False
    threads: int | None = _opt(_positive, default=None)
    out_dir: str = "runs"
    progress: bool = True
    measures: list[str] = field(default_factory=list)  # training-time measures (efficient.metrics)
    measure_every: int = _opt(_positive, default=50)
    # where metric records go: metrics.jsonl (always) and TensorBoard event files (efficient.report.loggers)
    loggers: list[Literal["jsonl", "tensorboard"]] = _opt(_loggers, default_factory=lambda: ["jsonl"])
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass
class EvalConfig:
    batch_size: int | None = _opt(_positive, default=None)
    max_batches: int | None = _opt(_positive, default=None)


@dataclass
class ProfileConfig:
    """Cost report written at the end of training (profiler on `samples` validation inputs)."""

    enabled: bool = True
    samples: int = _opt(_positive, default=8)
    # memory.json at the end of a run at train.memory bits/recompute: bytes a step keeps per level
    # (three measured steps on one training batch)
    memory: bool = True
    energy: str = "45nm-fp32"
    flops_per_mac: int = _opt(_positive, default=2)


FIXED_SECTIONS: dict[str, type] = {
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "profile": ProfileConfig,
}


@dataclass
class Recipe:
    """A validated recipe. `model`, `data`, `objective` are plain dicts (name + options)."""

    model: dict[str, Any]
    data: dict[str, Any]
    objective: dict[str, Any]
    optim: OptimConfig
    schedule: ScheduleConfig
    train: TrainConfig
    eval: EvalConfig
    profile: ProfileConfig
    source: str = "<recipe>"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": dict(self.model), "data": dict(self.data), "objective": dict(self.objective)}
        for s in FIXED_SECTIONS:
            d = dataclasses.asdict(getattr(self, s))
            out[s] = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------------- parsing


def _err(source: str, path: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: {msg}" if path else f"{source}: {msg}")


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value typed like a YAML scalar)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key.path=value (e.g. optim.lr=1e-3)")
    key, _, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p or not p.replace("_", "").replace("-", "").isalnum() for p in parts):
        raise ConfigError(f"override {item!r}: {key!r} is not a key path like optim.lr")
    try:
        value = yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: keep as the literal string
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return data


# ------------------------------------------------------------------------------ type checking


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple, typing.Sequence):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string", dict: "a mapping", list: "a list"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def coerce(value: Any, tp: Any, source: str, path: str) -> Any:
    """Check `value` against annotation `tp`; return it (ints widened to floats, lists to tuples)."""
    origin = typing.get_origin(tp)
    bad = _err(source, path, f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if tp is Any or tp is inspect.Parameter.empty:
        return value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return coerce(value, arg, source, path)
            except ConfigError:
                continue
        raise bad
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            return value
        raise _err(source, path, f"expected {_type_name(tp)}, got {value!r}.{did_you_mean(str(value), [str(a) for a in typing.get_args(tp)])}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise _err(source, path, f"expected a finite number, got {value!r}")
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        args = typing.get_args(tp)
        if origin is tuple and args and Ellipsis not in args:
            if len(value) != len(args):
                raise _err(source, path, f"expected a list of {len(args)} values, got {len(value)}")
            return tuple(coerce(v, a, source, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        elem = args[0] if args else Any
        out = [coerce(v, elem, source, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad
        args = typing.get_args(tp)
        if args:
            return {k: coerce(v, args[1], source, f"{path}.{k}") for k, v in value.items()}
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return build_dataclass(tp, value, source, path)
    return value


def build_dataclass(cls: type, values: dict[str, Any], source: str, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in values.items():
        if not isinstance(k, str) or k not in fields:
            raise _err(source, f"{path}.{k}", f"unknown key.{did_you_mean(str(k), fields)} Valid keys: {', '.join(fields)}.")
        kwargs[k] = coerce(v, hints[k], source, f"{path}.{k}")
        check = fields[k].metadata.get("check")
        if check is not None and (msg := check(kwargs[k])):
            raise _err(source, f"{path}.{k}", f"{msg}, got {v!r}")
    return cls(**kwargs)


def check_kwargs_against(fn: Callable[..., Any], values: dict[str, Any], source: str, path: str, skip: typing.Iterable[str] = ()) -> dict[str, Any]:
    """Type-check `values` against the keyword parameters of `fn` (its annotations)."""
    return check_options(*_signature(fn), values, source, path, skip)


def check_options(params: dict[str, inspect.Parameter], open_: bool, values: dict[str, Any], source: str, path: str,
                  skip: typing.Iterable[str] = ()) -> dict[str, Any]:
    """Type-check `values` against `params` (option name -> parameter with its type); with `open_`
    unknown keys pass through unchecked."""
    out: dict[str, Any] = {}
    skip = set(skip)
    for k, v in values.items():
        if k in skip:
            continue
        if k not in params:
            if open_:
                out[k] = v
                continue
            raise _err(source, f"{path}.{k}", f"unknown key.{did_you_mean(str(k), params)} Valid keys: {', '.join(sorted(params))}.")
        tp = params[k].annotation
        out[k] = coerce(v, Any if tp is inspect.Parameter.empty else tp, source, f"{path}.{k}")
    return out


def _named_section(raw: Any, section: str, source: str, resolve: Callable[[str], tuple[dict[str, inspect.Parameter], bool]],
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `name:` section: the component `resolve(name)` gives its options (and whether it takes any key)."""
    if raw is None:
        raise _err(source, section, "missing section; it needs at least `name:`")
    if not isinstance(raw, dict):
        raise _err(source, section, f"expected a mapping with `name:`, got {raw!r}")
    if "name" not in raw or not isinstance(raw["name"], str):
        raise _err(source, f"{section}.name", "required: the registered name of the component")
    try:
        params, open_ = resolve(raw["name"])
    except ConfigError as e:
        raise _err(source, f"{section}.name", str(e)) from None
    out = {"name": raw["name"]}
    extra = extra or {}
    for k, tp in extra.items():
        if k in raw:
            out[k] = coerce(raw[k], tp, source, f"{section}.{k}")
    out.update(check_options(params, open_, {k: v for k, v in raw.items() if k != "name"}, source, section, skip=extra))
    return out


def _signature(fn: Callable[..., Any]) -> tuple[dict[str, inspect.Parameter], bool]:
    """The typed keyword parameters of `fn`, and whether it also takes `**kwargs`."""
    return signature_options(fn), any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _model_options(name: str) -> tuple[dict[str, inspect.Parameter], bool]:
    """A zoo model's options, from its config dataclass (or its builder's signature)."""
    entry = get_entry(name)
    return entry.accepted_kwargs(), entry.open_options()


def validate(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    """Validate a parsed recipe dict; raise ConfigError on the first problem."""
    for k in data:
        if k not in SECTIONS:
            raise _err(source, str(k), f"unknown section.{did_you_mean(str(k), SECTIONS)} Sections: {', '.join(SECTIONS)}.")
    model = _named_section(data.get("model"), "model", source, _model_options, {"pretrained": typing.Optional[str]})
    dataset = _named_section(data.get("data"), "data", source, lambda n: _signature(get_dataset_builder(n)), DATA_LOADER_KEYS)
    for k, v in DATA_LOADER_DEFAULTS.items():
        dataset.setdefault(k, v)
    if dataset["batch_size"] < 1:
        raise _err(source, "data.batch_size", f"must be >= 1, got {dataset['batch_size']}")
    objective = _named_section(data.get("objective") or {"name": "classification"}, "objective", source, lambda n: _signature(get_objective(n)))
    fixed = {}
    for s, cls in FIXED_SECTIONS.items():
        raw = data.get(s) or {}
        if not isinstance(raw, dict):
            raise _err(source, s, f"expected a mapping, got {raw!r}")
        fixed[s] = build_dataclass(cls, raw, source, s)
    recipe = Recipe(model=model, data=dataset, objective=objective, source=source, **fixed)
    check_parallel(recipe)
    check_optimizer_in_backward(recipe, 1, parallel=recipe.train.parallel.enabled)
    return recipe


def check_optimizer_in_backward(recipe: Recipe, world_size: int, parallel: bool = False) -> None:
    """`train.optimizer_in_backward` needs each parameter's final gradient when backward accumulates it:
    not with a clip over all gradients' norm, gradients averaged across processes, pipeline stages or
    FSDP shards."""
    t = recipe.train
    if not t.optimizer_in_backward:
        return
    if t.grad_clip:
        raise ConfigError(
            f"{recipe.source}: train.optimizer_in_backward updates each parameter inside backward, before the norm of all "
            f"gradients that train.grad_clip={t.grad_clip} clips by exists; turn one of them off"
        )
    if world_size > 1 or parallel:
        raise ConfigError(
            f"{recipe.source}: train.optimizer_in_backward runs in one process only (here {world_size}"
            f"{' with pipeline stages or FSDP' if parallel else ''}): data-parallel gradients are averaged after backward, "
            "when the update would already have used this process's own; set it false for multi-process runs"
        )


PARALLEL_FAMILIES = ("ee-gpt",)  # models whose layers split into pipeline stages / FSDP units


def check_global_batch(recipe: Recipe, world_size: int) -> None:
    """The global batch `data.batch_size` must split evenly over `world_size` processes."""
    bs = recipe.data["batch_size"]
    if world_size > 1 and bs % world_size:
        raise ConfigError(f"{recipe.source}: data.batch_size={bs} (the global batch) must be divisible by the {world_size} processes")


def check_parallel(recipe: Recipe, world_size: int | None = None) -> None:
    """`train.parallel` against the model, objective, batch and (when known) the process count.

    Called when the recipe is loaded and again with `--nproc`, so that a layout that cannot run
    fails before any process starts."""
    from efficient.zoo import get_entry

    par, src = recipe.train.parallel, recipe.source
    if par.microbatches is not None and par.microbatches > 1 and par.pipeline_stages == 1:
        raise _err(src, "train.parallel.microbatches", "only applies to pipeline training; set train.parallel.pipeline_stages >= 2")
    if not par.enabled:
        return
    entry = get_entry(recipe.model["name"])
    what = "fsdp" if par.fsdp else "pipeline_stages"
    if entry.family not in PARALLEL_FAMILIES:
        raise _err(src, f"train.parallel.{what}", f"model {recipe.model['name']!r} cannot be split into transformer blocks "
                   f"(supported: the {', '.join(PARALLEL_FAMILIES)} models, e.g. ee-gpt-tiny); train it with DDP (--nproc N) instead")
    if par.fsdp and par.pipeline_stages > 1:
        raise _err(src, "train.parallel", "fsdp: true and pipeline_stages > 1 cannot be combined; choose one")
    if recipe.train.compile:
        raise _err(src, "train.compile", "is not supported with train.parallel; set train.compile=false")
    if recipe.train.measures:
        raise _err(src, "train.measures", "needs the whole model in one process; not supported with train.parallel")
    bs = recipe.data["batch_size"]
    if par.pipeline_stages > 1:
        if recipe.objective["name"] != "exits":
            raise _err(src, "train.parallel.pipeline_stages", f"pipeline stages compute the 'exits' objective; objective {recipe.objective['name']!r} is not supported")
        layers = recipe.model.get("n_layer", entry.default_cfg.get("n_layer"))
        n_stages = par.pipeline_stages * par.chunks_per_rank
        if layers is not None and n_stages > layers:
            chunks = f" ({par.pipeline_stages} x {par.chunks_per_rank} chunks for {par.schedule})" if par.chunks_per_rank > 1 else ""
            raise _err(src, "train.parallel.pipeline_stages", f"{n_stages} pipeline stages{chunks} for a {layers}-layer model; use at most {layers // par.chunks_per_rank}")
        if par.n_microbatches < par.pipeline_stages:
            raise _err(src, "train.parallel.microbatches", f"{par.n_microbatches} micro-batches cannot fill {par.pipeline_stages} stages; use at least {par.pipeline_stages}")
        if par.schedule == "interleaved_1f1b" and par.n_microbatches % par.pipeline_stages:
            raise _err(src, "train.parallel.microbatches", f"the interleaved schedule needs a multiple of pipeline_stages={par.pipeline_stages}, got {par.n_microbatches}")
    if world_size is None:
        if bs % par.n_microbatches:
            raise _err(src, "data.batch_size", f"{bs} does not split into {par.n_microbatches} micro-batches (train.parallel.microbatches)")
        return
    if world_size % par.pipeline_stages:
        raise _err(src, "train.parallel.pipeline_stages", f"--nproc {world_size} is not a multiple of {par.pipeline_stages} stages")
    if par.fsdp and world_size < 2:
        raise _err(src, "train.parallel.fsdp", "sharding needs at least 2 processes; run with --nproc N (N >= 2)")
    if par.pipeline_stages > 1 and world_size < par.pipeline_stages:
        raise _err(src, "train.parallel.pipeline_stages", f"{par.pipeline_stages} stages need --nproc >= {par.pipeline_stages}")
    replicas = world_size // par.pipeline_stages
    if bs % (replicas * par.n_microbatches):
        raise _err(src, "data.batch_size", f"{bs} (the global batch) does not split into {replicas} data-parallel replica(s) x "
                   f"{par.n_microbatches} micro-batches; use a multiple of {replicas * par.n_microbatches}")


def load_recipe(path: str | Path, overrides: typing.Sequence[str] = ()) -> Recipe:
    data = load_yaml(path)
    data = apply_overrides(data, overrides)
    return validate(data, str(path))
