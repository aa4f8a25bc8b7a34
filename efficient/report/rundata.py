"""A run dir's artifacts, read once for the report: recipe, metric lines, summary, cost profile,
activation memory of a step and `efficient attack` results. A file that is there but unreadable is
an error naming it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from efficient.errors import ConfigError
from efficient.io import read_json, read_text
from efficient.memory.measure import MEMORY_FILE  # what a step keeps at the run's train.memory level and at none

ATTACKS_FILE = "attacks.jsonl"  # one line per `efficient attack RUN_DIR` (efficient/commands/attack.py)
PROFILE_FILE = "profile.json"  # the run's cost profile, whole (Report.to_json)


@dataclass
class RunData:
    """What one run left: `train` lines (with lr), `val` lines, the resolved recipe (text and dict),
    summary.json, profile.json, memory.json and attack results (None / empty when the run has none)."""

    path: Path
    name: str
    recipe_text: str
    recipe: dict[str, Any]
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    attacks: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] | None = None  # memory.json: bytes a step keeps at the run's memory level and at none
    skipped_lines: list[int] = field(default_factory=list)  # metrics.jsonl lines that were not JSON (a kill mid-write)

    def series(self, split: str, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of metric `key` in the train or val lines that have it."""
        rows = self.train if split == "train" else self.val
        pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        return [p[0] for p in pts], [p[1] for p in pts]

    def keys(self, split: str) -> list[str]:
        """Numeric metric names of the train or val lines, in first-seen order."""
        out: dict[str, None] = {}
        for r in self.train if split == "train" else self.val:
            for k, v in r.items():
                if k not in ("step", "epoch", "split") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    out.setdefault(k, None)
        return list(out)

    @property
    def is_stata(self) -> bool:
        return any(k.startswith("stata/") for k in self.keys("train")) or self.recipe.get("objective", {}).get("name") == "stata"

    @property
    def exit_keys(self) -> list[str]:
        return sorted({k for k in self.keys("train") + self.keys("val") if k.startswith("loss_exit")}, key=_exit_layer)


def _exit_layer(key: str) -> int:
    digits = key.removeprefix("loss_exit")
    return int(digits) if digits.isdigit() else 0


def load_run(path: str | Path) -> RunData:
    """Read a run dir; a path that is not one is a ConfigError saying how to make one."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{p}: no such run dir. Train one with `efficient train RECIPE.yaml --out {p}`.")
    if not (p / "config.yaml").exists():
        raise ConfigError(f"{p}: not a run dir (no config.yaml). Train one with `efficient train RECIPE.yaml`.")
    from efficient.config import parse_yaml

    text = read_text(p / "config.yaml", "recipe")
    run = RunData(path=p, name=p.resolve().name, recipe_text=text, recipe=parse_yaml(text, str(p / "config.yaml")))
    metrics = p / "metrics.jsonl"
    if metrics.exists():
        for i, line in enumerate(read_text(metrics, "metrics log").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                run.skipped_lines.append(i)
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                run.skipped_lines.append(i)
            elif rec.get("split") == "val":
                run.val.append(rec)
            elif "lr" in rec:
                run.train.append(rec)
    if (p / "summary.json").exists():
        run.summary = read_json(p / "summary.json", "run summary")
    if (p / PROFILE_FILE).exists():
        run.profile = read_json(p / PROFILE_FILE, "cost profile")
    if (p / MEMORY_FILE).exists():
        run.memory = read_json(p / MEMORY_FILE, "activation memory record")
    if (p / ATTACKS_FILE).exists():
        for i, line in enumerate(read_text(p / ATTACKS_FILE, "attack log").splitlines(), 1):
            if line.strip():
                try:
                    run.attacks.append(json.loads(line))
                except json.JSONDecodeError:
                    raise ConfigError(f"{p / ATTACKS_FILE}: line {i} is not JSON; delete that line or the file "
                                      "and rerun `efficient attack`") from None
    return run


def report_from_dict(d: dict[str, Any]) -> Any:
    """A profiler `Report` rebuilt from its `to_dict()` (profile.json), for comparisons."""
    from efficient.profiler.report import LayerStat, Report

    exits = d.get("exits")
    if exits:  # JSON turned the integer exit layers into strings
        exits = {**exits, "per_exit": {int(k): v for k, v in exits.get("per_exit", {}).items()}}
        if exits.get("distribution"):
            exits["distribution"] = {int(k): v for k, v in exits["distribution"].items()}
    return Report(totals=d["totals"], layers=[LayerStat(**x) for x in d["layers"]], meta=d.get("meta", {}),
                  blocks=d.get("blocks", []), exits=exits, modules=d.get("modules", {}), warnings=d.get("warnings", []))
