"""Reading recipe and run-config YAML: a SafeLoader that types `1e-3` as a float, and errors that name
the file and the line. Shared by the recipe schema (efficient.config) and run-dir loading (efficient.zoo)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from efficient.errors import ConfigError

SECTIONS = ("model", "data", "objective", "optim", "schedule", "train", "eval", "profile")


class RecipeLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-3` as a float (YAML 1.2 style); PyYAML alone makes it a string."""


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
# YAML 1.2 booleans too: only true / false. PyYAML's YAML 1.1 rules also read yes/no/on/off as
# booleans, which would turn a choice among strings such as `anchor: off` into False.
RecipeLoader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for ch, resolvers in RecipeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - RecipeLoader is a SafeLoader


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: recipe file not found. List the shipped ones with `ls recipes/`.")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"{p}: cannot read it as a YAML file ({e.strerror or e})") from None
    return parse_yaml(text, str(p))


def parse_yaml(text: str, source: str = "<recipe>") -> dict[str, Any]:
    try:
        data = yaml_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise ConfigError(f"{source}: malformed YAML at {where}: {e.problem or e}") from None
    except yaml.YAMLError as e:  # e.g. a control character: PyYAML's text spans lines
        raise ConfigError(f"{source}: malformed YAML: {' '.join(str(e).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a recipe is a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}")
    return data
