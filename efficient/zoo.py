"""Model registry: `register_model`, `register_variants`, `create`, `load` -- names, run dirs and
safetensors files.

A zoo entry is a builder plus metadata (default config, input spec, paper). A model with a config
dataclass registers its variants as data (`register_variants(Model, {name: Variant(...)})`): their
options are the config's fields, nested config dataclasses flattened (`keep_ratio`, not
`stata.keep_ratio`), and the recipe validator checks them against the fields' types. Entries are
also registered into `timm.create_model` under the same name with underscores.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import importlib.abc
import importlib.util
import inspect
import json
import sys
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from efficient.errors import ArtifactError, ConfigError, closest
from efficient.io import check_and_load, load_weights, read_state_dict, save_model  # noqa: F401 - the zoo's weights API

# Modules whose import registers models. Imported lazily on first registry access so that
# `import efficient` stays cheap.
MODEL_MODULES: list[str] = [
    "efficient.models.spikformer",
    "efficient.models.sdt",
    "efficient.models.qkformer",
    "efficient.models.ee_gpt",
    "efficient.models.stable_snn",
    "efficient.models.mlp",
    "efficient.models.bilipnet",
    "efficient.models.spikingformer",
    "efficient.models.meta_spikeformer",
    "efficient.hf.registry",
]


@dataclass(frozen=True)
class InputSpec:
    """What a model eats: `shape` per sample (e.g. (3, 32, 32) or (seq_len,)), timesteps, normalisation."""

    shape: tuple[int, ...]
    timesteps: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    dtype: str = "float32"  # "long" for token ids
    num_classes: int | None = None

    def describe(self) -> str:
        s = "x".join(str(d) for d in self.shape)
        if self.dtype == "long":
            s = f"tokens[{s}]"
        if self.timesteps:
            s += f", T={self.timesteps}"
        return s


@dataclass
class ModelEntry:
    name: str
    builder: Callable[..., nn.Module]
    input_spec: InputSpec
    paper: str = ""
    description: str = ""
    default_cfg: dict[str, Any] = field(default_factory=dict)
    family: str = ""
    config: type | None = None  # the model's config dataclass, if it has one: its fields are the options

    def options_fn(self) -> Callable[..., Any]:
        """The callable whose typed signature lists this model's options: the builder, or, for a
        `def builder(**kw) -> ModelClass`, the annotated class's constructor."""
        params = inspect.signature(self.builder).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return self.builder
        try:
            ret = typing.get_type_hints(self.builder).get("return")
        except Exception:
            ret = None
        return ret if isinstance(ret, type) and issubclass(ret, nn.Module) else self.builder

    def accepted_kwargs(self) -> dict[str, inspect.Parameter]:
        """This model's options: name -> keyword parameter with its type (resolved) and default."""
        if self.config is not None:
            return config_options(self.config)
        return signature_options(self.options_fn())

    def open_options(self) -> bool:
        """Whether the builder takes any keyword (`**kw` with no typed model class behind it)."""
        if self.config is not None:
            return False
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(self.options_fn()).parameters.values())

    def weights(self) -> dict[str, Any]:
        """Tag -> shipped checkpoint (`efficient.hub.ShippedWeights`), the default first."""
        from efficient import hub

        return hub.shipped(self.name)

    def resolved_cfg(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        cfg = {k: p.default for k, p in self.accepted_kwargs().items() if p.default is not inspect.Parameter.empty}
        cfg.update(self.default_cfg)
        cfg.update(overrides or {})
        return cfg


def signature_options(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The keyword parameters of `fn` (a function or a class), annotations resolved to types."""
    try:
        hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
    except Exception:
        hints = {}
    return {k: p.replace(annotation=hints.get(k, inspect.Parameter.empty)) for k, p in inspect.signature(fn).parameters.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def config_options(cls: type) -> dict[str, inspect.Parameter]:
    """The flat options of config dataclass `cls`: its fields, a nested config dataclass's fields
    standing in for it, each with its type and default."""
    hints = typing.get_type_hints(cls)
    out: dict[str, inspect.Parameter] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(config_options(tp))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else inspect.Parameter.empty)
        out[f.name] = inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=tp)
    return out


def config_to_options(cfg: Any) -> dict[str, Any]:
    """Flat option values of a config dataclass instance (inverse of `config_from_options`)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out.update(config_to_options(v) if dataclasses.is_dataclass(v) else {f.name: v})
    return out


def config_from_options(cls: type, options: dict[str, Any], base: Any = None) -> Any:
    """Config `cls` from flat `options` over `base` (the class defaults if None); an option that is
    no field raises TypeError, as an unknown keyword argument would."""
    unknown = [k for k in options if k not in config_options(cls)]
    if unknown:
        raise TypeError(f"{cls.__name__} has no option {unknown[0]!r}")
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        cur = getattr(base, f.name) if base is not None else None
        if dataclasses.is_dataclass(hints[f.name]):
            sub = config_options(hints[f.name])
            kw[f.name] = config_from_options(hints[f.name], {k: v for k, v in options.items() if k in sub}, cur)
        elif f.name in options:
            kw[f.name] = options[f.name]
        elif base is not None:
            kw[f.name] = cur
    return cls(**kw)


_REGISTRY: dict[str, ModelEntry] = {}
_loaded = False


def register_model(
    name: str,
    *,
    input_spec: InputSpec,
    paper: str = "",
    description: str = "",
    family: str = "",
    **default_cfg: Any,
) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator: register `builder(**kwargs) -> nn.Module` under `name` (lowercase, hyphens).

    `default_cfg` are the keyword arguments that define this variant; users override any of them.
    """
    _check_name(name)

    def deco(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        _add(ModelEntry(name, builder, input_spec, paper, description, dict(default_cfg), family))
        return builder

    return deco


def _check_name(name: str) -> None:
    if name != name.lower() or "_" in name or " " in name:
        raise ValueError(f"zoo names are lowercase with hyphens, got {name!r}")


def _add(entry: ModelEntry) -> None:
    if entry.name in _REGISTRY:
        raise ValueError(f"model {entry.name!r} is registered twice")
    _REGISTRY[entry.name] = entry
    _register_timm(entry)


@dataclass(frozen=True)
class Variant:
    """A zoo entry as data: what the model eats, the paper, a one-line description, its config
    (an instance of the model's config dataclass) and, where it is not the family's model class,
    what builds it from that config (`model(config)`)."""

    input_spec: InputSpec
    paper: str
    description: str
    config: Any
    model: Callable[[Any], nn.Module] | None = None


def register_variants(model_cls: Callable[[Any], nn.Module], variants: dict[str, Variant], family: str = "") -> None:
    """Register each variant `name` of a model built as `model_cls(config)` (or as its own
    `Variant.model(config)`). A variant's options are its config's flat fields; those that differ
    from the class defaults define it."""
    for name, v in variants.items():
        _check_name(name)
        cls = type(v.config)
        defaults, values = config_to_options(cls()), config_to_options(v.config)

        builder = _config_builder(v.model or model_cls, cls, name)
        default_cfg = {k: val for k, val in values.items() if val != defaults[k]}
        _add(ModelEntry(name, builder, v.input_spec, v.paper, v.description, default_cfg, family, config=cls))


def _config_builder(model_cls: Callable[[Any], nn.Module], cls: type, name: str) -> Callable[..., nn.Module]:
    def builder(**options: Any) -> nn.Module:
        return model_cls(config_from_options(cls, options))

    builder.__module__ = model_cls.__module__
    builder.__qualname__ = builder.__name__ = name.replace("-", "_")
    return builder


def _register_timm(entry: ModelEntry) -> None:
    """Expose the entry through `timm.create_model(name_with_underscores)`: at once where timm's
    models are loaded, otherwise as soon as they are. Importing timm loads torchvision and dynamo
    (seconds), which `import efficient` need not pay."""
    timm_models = sys.modules.get("timm.models")
    if timm_models is not None and hasattr(timm_models, "register_model"):
        _timm_register(entry)
        return
    _TIMM_PENDING.append(entry)
    if not any(isinstance(f, _OnTimmImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnTimmImport())


_TIMM_PENDING: list[ModelEntry] = []


class _OnTimmImport(importlib.abc.MetaPathFinder):
    """Registers the pending zoo entries into timm right after `timm.models` is imported (once)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "timm.models":
            return None
        sys.meta_path.remove(self)  # the real spec comes from the other finders
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run(module: Any) -> None:
            exec_module(module)
            while _TIMM_PENDING:
                _timm_register(_TIMM_PENDING.pop(0))

        spec.loader.exec_module = run
        return spec


def _timm_register(entry: ModelEntry) -> None:
    try:
        from timm.models import register_model as timm_register
    except ImportError:  # timm is a dependency, but the zoo itself does not need it
        return

    def fn(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        for k in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
            kwargs.pop(k, None)
        if pretrained:  # the weights shipped with the package (an error names the models that have some)
            return load(entry.name, pretrained=True, **kwargs)
        return create(entry.name, **kwargs)

    fn.__name__ = entry.name.replace("-", "_")
    fn.__qualname__ = fn.__name__
    fn.__module__ = entry.builder.__module__
    try:
        timm_register(fn)
    except Exception:  # a timm model of the same name exists: keep timm's, ours stays in our zoo
        pass


def _ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in MODEL_MODULES:
        importlib.import_module(mod)


def registry() -> dict[str, ModelEntry]:
    _ensure_loaded()
    return _REGISTRY


def list_models(pattern: str | None = None) -> list[str]:
    """Registered zoo names, sorted; `pattern` is a shell glob such as ``"spikformer*"``."""
    names = sorted(registry())
    if pattern:
        names = [n for n in names if fnmatch.fnmatch(n, pattern)]
    return names


def get_entry(name: str) -> ModelEntry:
    reg = registry()
    if name not in reg:
        alt = name.replace("_", "-").lower()
        if alt in reg:
            return reg[alt]
        hint = closest(name, list(reg))
        msg = f"unknown model {name!r}."
        msg += f" Did you mean: {', '.join(hint)}?" if hint else ""
        msg += " Run `efficient zoo` for the full list."
        raise ConfigError(msg)
    return reg[name]


def check_kwargs(entry: ModelEntry, kwargs: dict[str, Any], where: str = "model") -> None:
    """Fail on keyword arguments the builder does not take, naming the closest valid ones."""
    accepted = entry.accepted_kwargs()
    if entry.open_options():
        return
    for k in kwargs:
        if k not in accepted:
            hint = closest(k, list(accepted))
            raise ConfigError(
                f"{where}.{k}: not an option of model {entry.name!r}."
                + (f" Did you mean {hint[0]!r}?" if hint else "")
                + f" Valid options: {', '.join(sorted(accepted))}."
            )


def create(name: str, **overrides: Any) -> nn.Module:
    """Build a zoo model with fresh weights; `overrides` change its config."""
    entry = get_entry(name)
    check_kwargs(entry, overrides)
    cfg = {**entry.default_cfg, **overrides}
    model = entry.builder(**cfg)
    model.zoo_name = entry.name  # type: ignore[attr-defined]
    model.zoo_cfg = entry.resolved_cfg(overrides)  # type: ignore[attr-defined]
    return model


def load(name_or_path: str | Path, pretrained: bool | str | Path | None = None, allow_pickle: bool = False,
         **overrides: Any) -> nn.Module:
    """Build a model from a zoo name, a run dir, a `.safetensors` file with its sidecar config, or a
    NIR graph (`.nir`: a `efficient.export.NIRNetwork` on time-major input; `dt=` seconds per step).

    `pretrained` (for zoo names): True (the weights shipped for it), a tag of them (``"digits"``),
    a URL (downloaded once into the cache and checked against ``#sha256=HEX``), ``hf-hub:ORG/NAME``,
    a run dir, a `.safetensors` file, or a torch state-dict file (`.pt`/`.pth`/`.tar`, read with
    `weights_only=True`: pickled objects are refused unless `allow_pickle=True`). Spikformer and SDT
    checkpoints in spikingjelly's or the official repositories' layouts are mapped onto ours
    (`efficient.export.checkpoints`). Shipped weights bring the options they were trained with (overrides
    go on top). The model's `pretrained_cfg` records where its weights came from.
    """
    p = Path(name_or_path)
    provenance: dict[str, Any] | None = None
    if p.suffix == ".nir":
        return _load_nir(p, pretrained, overrides)
    if p.exists():
        if pretrained is True or (isinstance(pretrained, str) and not Path(pretrained).exists()):
            raise ConfigError(f"{p}: a run dir or weights file brings its own weights; pretrained= takes a file or run dir here")
        name, cfg, weights = _resolve_artifact(p)
        cfg.update(overrides)
        model = _create_from_artifact(p, name, cfg)
        load_weights(model, weights)
        provenance = {"source": "file", "architecture": name, "file": str(weights)}
    else:
        if str(name_or_path).endswith(".safetensors") or "/" in str(name_or_path):
            raise ConfigError(f"{name_or_path}: no such file or directory (expected a zoo name, a run dir or a .safetensors file)")
        resolved = None
        if pretrained is not None and pretrained is not False:
            from efficient import hub

            resolved = hub.resolve(get_entry(str(name_or_path)).name, pretrained)
        model = create(str(name_or_path), **({**resolved.config, **overrides} if resolved else overrides))
        if resolved is not None:
            model, extra = load_pretrained(model, resolved.file)
            provenance = {**resolved.pretrained_cfg, **extra}
            pretrained = None
    if pretrained is not None and pretrained is not False:
        src = Path(pretrained)
        if not src.exists():
            raise ConfigError(f"pretrained={pretrained!s}: no such file or directory (give a run dir, a .safetensors file, a URL or a shipped tag)")
        weights = src if src.is_file() else _resolve_artifact(src)[2]  # a file: only its tensors are needed
        # our files, or Spikformer / SDT checkpoints in other code bases' layouts (mapped by their keys)
        model, extra = load_pretrained(model, weights, allow_pickle)
        provenance = {"source": "file", "architecture": getattr(model, "zoo_name", None), "file": str(weights), **extra}
    if provenance is not None:
        model.pretrained_cfg = provenance  # type: ignore[assignment]
    model.eval()
    return model


def _load_nir(p: Path, pretrained: Any, overrides: dict[str, Any]) -> nn.Module:
    """A NIR graph file as a module on our kernels (`efficient.export.from_nir`); takes `dt` and `backend`."""
    from efficient.export.from_nir import load_nir

    if pretrained is not None and pretrained is not False:
        raise ConfigError(f"{p}: a NIR graph carries its own weights; pretrained= does not apply")
    unknown = sorted(set(overrides) - {"dt", "backend"})
    if unknown:
        raise ConfigError(f"{p}: {unknown[0]!r} is not an option for a NIR graph; it takes dt= (seconds per time step) and backend=")
    net = load_nir(p, dt=overrides.get("dt"), backend=overrides.get("backend", "auto"))
    net.pretrained_cfg = {"source": "file", "architecture": "nir", "file": str(p)}  # type: ignore[assignment]
    return net


def _create_from_artifact(p: Path, name: str, cfg: dict[str, Any]) -> nn.Module:
    """`create` with the model recorded in a file; a bad record names the file it came from."""
    try:
        return create(name, **cfg)
    except ArtifactError:
        raise
    except ConfigError as e:
        raise ArtifactError(f"{p}: the model recorded in it cannot be built: {e}") from None
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{p}: the model recorded in it ({name!r}) cannot be built from its config: {e}") from None


def _resolve_artifact(p: Path) -> tuple[str, dict[str, Any], Path]:
    """(zoo name, model config, weights file) for a run dir or a safetensors file."""
    from efficient.io import parse_json_field, read_json, safetensors_metadata

    if p.is_dir():
        cfg_file = p / "config.yaml"
        if not cfg_file.exists():
            raise ArtifactError(f"{p}: not a run dir (no config.yaml). Train one with `efficient train RECIPE.yaml`.")
        name, model_cfg = _run_dir_model(cfg_file)
        for cand in (p / "checkpoint" / "best" / "model.safetensors", p / "checkpoint" / "last" / "model.safetensors"):
            if cand.exists():
                return name, model_cfg, cand
        raise ArtifactError(f"{p}: run dir has no checkpoint/best or checkpoint/last/model.safetensors; did the run save one?")
    if p.suffix == ".safetensors":
        side = p.with_suffix(".json")
        meta = safetensors_metadata(p)
        if meta.get("efficient.model"):
            name = meta["efficient.model"]
            return name, parse_json_field(meta.get("efficient.config", "{}"), str(p), "efficient.config"), p
        if side.exists():
            d = read_json(side, "sidecar config (JSON)")
            if not isinstance(d.get("name"), str) or not isinstance(d.get("config", {}), dict):
                raise ArtifactError(f'{side}: sidecar config should be {{"name": ZOO_NAME, "config": {{...}}}}; found keys {sorted(d)}')
            return d["name"], dict(d.get("config", {})), p
        raise ArtifactError(f"{p}: safetensors file without model metadata or sidecar {side.name}; pass a zoo name with pretrained=")
    raise ArtifactError(f"{p}: expected a run dir or a .safetensors file")


def _run_dir_model(cfg_file: Path) -> tuple[str, dict[str, Any]]:
    """(zoo name, model options) from a run dir's resolved config.yaml."""
    from efficient.recipe_yaml import load_yaml

    try:
        run_cfg = load_yaml(cfg_file)
    except ConfigError as e:
        raise ArtifactError(f"{e} (the run dir's resolved config; restore it from the recipe the run was started with)") from None
    model_cfg = run_cfg.get("model")
    if not isinstance(model_cfg, dict) or not isinstance(model_cfg.get("name"), str):
        raise ArtifactError(f"{cfg_file}: model.name is missing or not a name; a run dir's config.yaml has a `model:` section with the zoo name (e.g. `model: {{name: spikformer-tiny}}`)")
    model_cfg = dict(model_cfg)
    name = model_cfg.pop("name")
    model_cfg.pop("pretrained", None)
    return name, model_cfg


def load_pretrained(model: nn.Module, weights: Path, allow_pickle: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """Load `weights` (ours or a foreign layout) into zoo model `model`; returns the model (rebuilt
    if the layout's architecture needs other options) and what to add to its `pretrained_cfg`."""
    from efficient.export.checkpoints import detect_layout, from_layout, strip_ddp

    weights = Path(weights)
    sd = strip_ddp(read_state_dict(weights, allow_pickle), model.state_dict())
    layout = detect_layout(sd)
    if layout is None:  # ours, or something unknown: the strict loader names the keys that differ
        check_and_load(model, sd, weights)
        return model, {}
    kind = type(model).__name__
    if kind != layout.family:
        name = getattr(model, "zoo_name", kind)
        other = {"Spikformer": "spikformer-4-384", "QKFormer": "qkformer-4-384", "Spikingformer": "spikingformer-4-384",
                 "MetaSpikeFormer": "sdt-v2-8-512"}.get(layout.family, "sdt-2-512")
        raise ArtifactError(f"{weights}: a {layout.family} checkpoint in the layout of {layout.description}, but {name!r} is a {kind}; "
                            f"load it into a {layout.family} entry (e.g. efficient.load({other!r}, pretrained=...))")
    cfg = dict(getattr(model, "zoo_cfg", {}) or {})
    if any(cfg.get(k) != v for k, v in layout.options.items()):
        was_training = model.training
        model = create(model.zoo_name, **{**cfg, **layout.options})
        model.train(was_training)
    converted, filled = from_layout(sd, layout, model.state_dict(), str(weights))
    model.load_state_dict(converted, strict=True)
    return model, {"layout": layout.name, **({"filled": filled} if filled else {}), **layout.options}


def entry_summary(entry: ModelEntry) -> dict[str, Any]:
    d = {k: v for k, v in asdict(entry.input_spec).items()}
    weights = {t: {k: v for k, v in asdict(w).items() if k not in ("name", "tag")} for t, w in entry.weights().items()}
    return {"name": entry.name, "paper": entry.paper, "description": entry.description, "input": d, "config": entry.resolved_cfg(),
            "weights": weights}


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_param_count(name: str, **overrides: Any) -> int:
    """Parameter count without allocating weights (built on the meta device)."""
    with torch.device("meta"):
        m = create(name, **overrides)
    return count_params(m)
