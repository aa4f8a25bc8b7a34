"""Where a run's metric records go: `metrics.jsonl` always, TensorBoard event files on request.

A recipe chooses with `train.loggers: [jsonl, tensorboard]` (default `[jsonl]`). A record is the dict
the engine logs: {"step", "epoch", ["split": "val"], name: value, ...}. TensorBoard gets each number
as a scalar tagged `train/<name>` or `val/<name>` at `step`, and at the end of the run the cost
profile's firing rate per spiking layer and exit fractions (`firing_rate/<layer>`, `exits/...`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

from efficient.errors import ConfigError
from efficient.io import append_jsonl

LOGGERS: tuple[str, ...] = ("jsonl", "tensorboard")
TENSORBOARD_DIR = "tensorboard"  # inside the run dir: `tensorboard --logdir RUN_DIR`
_RECORD_KEYS = ("step", "epoch", "split")  # bookkeeping, not scalars


class SpikingLayer(Protocol):
    """A spiking layer of a cost profile: its name and output firing rate."""

    @property
    def name(self) -> str: ...

    @property
    def output_firing_rate(self) -> float | None: ...


class CostProfile(Protocol):
    """What the loggers read of a cost profile (the profiler's `Report`): per-sample totals, the
    spiking layers and the exit distribution."""

    @property
    def totals(self) -> Mapping[str, float]: ...

    @property
    def neurons(self) -> Sequence[SpikingLayer]: ...

    @property
    def exits(self) -> Mapping[str, Any] | None: ...

    def per_sample(self, key: str) -> float | None: ...


class MetricLogger(Protocol):
    """One destination of metric records."""

    def log(self, record: dict[str, Any]) -> None: ...

    def log_profile(self, report: CostProfile, step: int) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """One JSON line per record in `metrics.jsonl` (flushed to disk: it survives a kill and feeds
    resume and the run report). The profile is written whole to profile.json by the engine."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def log(self, record: dict[str, Any]) -> None:
        append_jsonl(self.path, record)

    def log_profile(self, report: CostProfile, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars in TensorBoard event files under `log_dir`, written by `torch.utils.tensorboard`.

    `purge_step` (a resumed run's step + 1) tells TensorBoard to drop the events an interrupted run
    wrote after its checkpoint, as metrics.jsonl drops those lines."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "train.loggers: tensorboard needs the tensorboard package, which is not installed; "
                "install it with `pip install 'efficient[report]'` (or `pip install tensorboard`), "
                "or drop tensorboard from train.loggers"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        prefix = "val" if record.get("split") == "val" else "train"
        for tag, value in scalars(record, prefix):
            self.writer.add_scalar(tag, value, int(record["step"]))
        self.writer.flush()

    def log_profile(self, report: CostProfile, step: int) -> None:
        for tag, value in profile_scalars(report):
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Loggers:
    """All of a run's loggers as one: every record goes to each of them."""

    def __init__(self, loggers: Sequence[MetricLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, record: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log(record)

    def log_profile(self, report: CostProfile, step: int) -> None:
        for lg in self.loggers:
            lg.log_profile(report, step)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def build_loggers(names: Sequence[str], run_dir: str | Path, resume_step: int | None = None) -> Loggers:
    """The loggers `train.loggers` names, writing into `run_dir`; `resume_step` is the step a
    resumed run continues from (None for a fresh run)."""
    check_logger_names(names)
    run_dir = Path(run_dir)
    out: list[MetricLogger] = []
    for name in names:
        if name == "jsonl":
            out.append(JsonlLogger(run_dir / "metrics.jsonl"))
        else:
            purge = resume_step + 1 if resume_step is not None else None
            out.append(TensorBoardLogger(run_dir / TENSORBOARD_DIR, purge_step=purge))
    return Loggers(out)


def check_logger_names(names: Sequence[str], where: str = "train.loggers") -> None:
    """Raise a ConfigError when `names` is not a valid `train.loggers` list (see `logger_names_problem`)."""
    problem = logger_names_problem(names)
    if problem:
        raise ConfigError(f"{where}: {problem}, got {list(names)!r}")


def logger_names_problem(names: Sequence[str]) -> str | None:
    """What is wrong with a `train.loggers` list, or None: each name known and listed once, jsonl
    among them (resume and the run report read metrics.jsonl), tensorboard only when installed."""
    import importlib.util

    from efficient.errors import did_you_mean

    for n in names:
        if n not in LOGGERS:
            return f"unknown logger {n!r}.{did_you_mean(str(n), LOGGERS)} Loggers: {', '.join(LOGGERS)}"
    if len(set(names)) != len(names):
        return "lists a logger more than once"
    if "jsonl" not in names:
        return "must include jsonl (resume and the run report read metrics.jsonl); add tensorboard beside it"
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        return ("tensorboard is not installed; install it with `pip install 'efficient[report]'` "
                "(or `pip install tensorboard`), or drop it from the list")
    return None


def scalars(record: dict[str, Any], prefix: str) -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number in `record` (nested dicts such as `measures` flattened
    with '/'), tagged `<prefix>/<name>`; step, epoch and split are bookkeeping and skipped."""
    for key, value in record.items():
        if key in _RECORD_KEYS:
            continue
        yield from _flatten(f"{prefix}/{key}", value)


def _flatten(tag: str, value: Any) -> Iterator[tuple[str, float]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(f"{tag}/{k}", v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        yield tag, float(value)


def profile_scalars(report: CostProfile) -> list[tuple[str, float]]:
    """The cost profile as scalars: per-sample totals, firing rate per spiking layer, exit fractions."""
    out = []
    for key in ("dense_macs", "macs", "sops", "energy_pj"):
        v = report.per_sample(key)
        if v is not None:
            out.append((f"profile/{key}_per_sample", float(v)))
    if "mean_firing_rate" in report.totals:
        out.append(("profile/mean_firing_rate", float(report.totals["mean_firing_rate"])))
    for n in report.neurons:
        out.append((f"firing_rate/{n.name}", float(n.output_firing_rate or 0.0)))
    for layer, frac in ((report.exits or {}).get("distribution") or {}).items():
        out.append((f"exits/fraction_at_layer_{layer}", float(frac)))
    return out
