"""The training loop: recipe -> model, data, objective -> run dir with metrics, checkpoints, summary.

Resume is exact on CPU: the data order of an epoch is a permutation seeded by (seed, epoch), and
the checkpoint stores the position in it together with optimizer, scheduler and RNG states.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from efficient import memory, zoo
from efficient.config import Recipe, check_global_batch, load_recipe
from efficient.data import DataBundle, build_data
from efficient.errors import ArtifactError, ConfigError
from efficient.io import write_json, write_text
from efficient.memory import host as host_memory
from efficient.models.progress import inform_progress
from efficient.objectives import Objective, build_objective
from efficient.report.environment import environment
from efficient.report.loggers import Loggers, build_loggers
from efficient.train import checkpoint as ckpt
from efficient.train import distributed as dist_utils
from efficient.train.optim import InBackwardOptimizer, build_optimizer, build_scheduler, check_optimizer_in_backward


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the last good checkpoint is kept."""


class EpochSampler(Sampler[int]):
    """A permutation seeded by (seed, epoch), starting at `start`: reproducible and resumable.

    With `world_size` > 1 each rank takes its slice of every global batch of `global_batch`
    samples, so N processes see exactly the batches one process would."""

    def __init__(self, n: int, seed: int, epoch: int = 0, start: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, global_batch: int = 1) -> None:
        self.n, self.seed, self.epoch, self.start, self.shuffle = n, seed, epoch, start, shuffle
        self.rank, self.world_size, self.global_batch = rank, world_size, global_batch

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def indices(self) -> list[int]:
        idx = self.order()[self.start :]
        if self.world_size == 1:
            return idx
        b = self.global_batch // self.world_size
        full = len(idx) // self.global_batch * self.global_batch
        return torch.tensor(idx[:full], dtype=torch.long).view(-1, self.world_size, b)[:, self.rank].flatten().tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return len(self.indices())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """`auto` -> cuda when available, else cpu; errors name `option` (the recipe key or CLI flag)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{option}: {name!r} is not a device (use auto, cpu, cuda, cuda:0)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option}: cuda requested but no CUDA device is available (use cpu)")
    return dev


def set_fp32_precision(device: torch.device, tf32: bool) -> None:
    """On CUDA, fp32 matmuls and convolutions on TF32 tensor cores (`tf32`) or in strict fp32.

    torch's own defaults differ by op: TF32 on for cuDNN convolutions, off for matmuls, so a model
    built of nn.Linear (ours) ran strict fp32 where one built of 1x1 nn.Conv1d (spikingjelly's
    Spikformer) ran TF32. Setting both alike makes the two kinds of model train at the same
    precision. Process-wide, as torch's flags are; nothing changes on a CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def build_model(recipe: Recipe, data: DataBundle) -> nn.Module:
    """Zoo model from the recipe; `num_classes` follows the dataset unless the recipe sets it."""
    cfg = {k: v for k, v in recipe.model.items() if k not in ("name", "pretrained")}
    entry = zoo.get_entry(recipe.model["name"])
    if "num_classes" in entry.accepted_kwargs() and "num_classes" not in cfg and data.num_classes and data.task == "classification":
        cfg["num_classes"] = data.num_classes
    try:
        model = zoo.create(recipe.model["name"], **cfg)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{recipe.source}: model: {e}") from None
    if "num_classes" in cfg:  # record what the run dir needs to rebuild the model
        recipe.model["num_classes"] = cfg["num_classes"]
    if recipe.model.get("pretrained"):
        _, _, weights = zoo._resolve_artifact(Path(recipe.model["pretrained"]))
        zoo.load_weights(model, weights)
    return model


def compile_mode(setting: bool | str, device: torch.device, console: Any = None) -> str | None:
    """The `torch.compile` mode for `train.compile` on `device`, None for no compilation. Modes that
    replay CUDA graphs need a CUDA device: elsewhere they compile without graphs, and say so."""
    if setting is False:
        return None
    mode = "default" if setting is True else str(setting)
    if device.type != "cuda" and mode in ("reduce-overhead", "max-autotune"):
        fallback = "default" if mode == "reduce-overhead" else "max-autotune-no-cudagraphs"
        if console is not None:
            console.print(f"train.compile={mode} replays CUDA graphs, which need a CUDA device; this run is on {device.type}, "
                          f"so it compiles with mode {fallback} instead")
        mode = fallback
    return mode


def window_means(window: dict[str, list[Any]]) -> dict[str, float]:
    """The mean of each logged value over a window of steps. Values logged as device tensors are
    averaged on the device and read back together, in one transfer."""
    dev = next((v.device for vs in window.values() for v in vs if isinstance(v, torch.Tensor)), None)
    if dev is None:
        return {k: float(np.mean(vs)) for k, vs in window.items()}
    means = torch.stack([torch.stack([torch.as_tensor(v, dtype=torch.float32, device=dev).reshape(()) for v in vs]).mean()
                         for vs in window.values()])
    return dict(zip(window, means.tolist()))


def autocast(amp: bool) -> Any:
    """bf16 autocast on CUDA when `amp`, else a no-op context."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if amp else nullcontext()


def val_loader(recipe: Recipe, data: DataBundle) -> DataLoader:
    """The validation split in order, at `eval.batch_size` (else the data batch sizes).

    An own generator keeps the loader off the global RNG, so evaluating mid-run leaves training's
    random stream where it was."""
    bs = recipe.eval.batch_size or recipe.data["eval_batch_size"] or recipe.data["batch_size"]
    return DataLoader(data.val, batch_size=bs, shuffle=False, num_workers=recipe.data["num_workers"],
                      collate_fn=data.collate_fn, generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def evaluate(model: nn.Module, objective: Objective, loader: DataLoader, device: torch.device,
             amp: bool = False, max_batches: int | None = None) -> dict[str, float]:
    """The objective's validation metrics over `loader`: its per-batch sums divided by the samples `n`.

    The one evaluation loop, used by training and by `efficient eval`; the model's train/eval mode
    is restored afterwards."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    for i, batch in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        with autocast(amp):
            out = objective.evaluate(model, to_device(batch, device))
        for k, v in out.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    model.train(was_training)
    n = sums.pop("n", 0.0) or 1.0
    return {k: v / n for k, v in sums.items()}


def evaluate_recipe(model: nn.Module, recipe: str | os.PathLike[str], overrides: list[str] | None = None,
                    max_batches: int | None = None) -> dict[str, float]:
    """Validation metrics of `model` under a recipe's data and objective (what training reports),
    on the device its parameters are on."""
    r = load_recipe(recipe, overrides or [])
    data = build_data(r.data)
    objective = build_objective(r.objective)
    objective.setup(model, data, r)
    device = next(iter(model.parameters()), torch.empty(0)).device
    return evaluate(model, objective, val_loader(r, data), device, max_batches=max_batches)


@dataclass
class Progress:
    """Where a run stands; saved in every `last` checkpoint and restored on resume."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    best: float | None = None
    elapsed: float = 0.0


class Trainer:
    """Runs one recipe into one run dir, in stages that read top to bottom:

    `setup` (runtime, data, model, objective, optimizer; state restored on resume) ->
    `fit`, which repeats `train_epoch` (each step a `loss_step` and an `optimizer_step`) and
    `validate` (`evaluate` + the best checkpoint) until the step budget is spent -> `finish`
    (summary.json, report.md). `save` / `restore` are the checkpoint pair. `fit()` returns the
    summary dict also written to summary.json."""

    compile_mode: str | None = None  # train.compile as applied (`_setup_optimizer`); None: eager
    _warmup_steps = 0  # steps left out of the reported throughput (compilation)

    def __init__(self, recipe: Recipe, run_dir: str | Path, resume: bool = False, console: Any = None) -> None:
        from rich.console import Console

        self.recipe, self.run_dir, self.resume = recipe, Path(run_dir), resume
        self.console = console or Console(stderr=False)
        self.setup()
        self.state = Progress()
        self._stop_requested = False
        self._unchecked: list[tuple[int, torch.Tensor]] = []  # (step, loss) not yet checked for finiteness
        if resume:
            self.restore()

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build everything the run needs, in a fixed order (the RNG sees the same draws every time)."""
        self._setup_runtime()
        self._setup_data()
        self._setup_model()
        self._setup_objective()
        self._setup_optimizer()

    def _setup_runtime(self) -> None:
        """Threads, determinism, device, process group, the shared run dir, seeds."""
        t = self.recipe.train
        world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if t.threads or world > 1:  # processes on one machine share its cores
            torch.set_num_threads(max(1, (t.threads or os.cpu_count() or 1) // world))
        if t.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            host_memory.apply(t.host_memory)
        except RuntimeError as e:
            raise ConfigError(f"{self.recipe.source}: train.host_memory: {e}") from None
        self.device = resolve_device(t.device)
        set_fp32_precision(self.device, t.tf32)
        self.dist = dist_utils.init_from_env(self.device.type)
        self.device = dist_utils.device_for(self.dist, self.device)
        # this process's share of the data: every process is a data-parallel replica here
        self.data_rank, self.data_world = self.dist.rank, self.dist.world_size
        self.run_dir = Path(dist_utils.broadcast_object(str(self.run_dir), self.dist))
        seed_everything(t.seed + self.dist.rank)  # DDP broadcasts rank 0's initial weights

    def _setup_data(self) -> None:
        r = self.recipe
        self.data = build_data(r.data)
        if len(self.data.train) == 0 or len(self.data.val) == 0:
            raise ConfigError(f"{r.source}: data: dataset {r.data['name']!r} has an empty train or val split")

    def _setup_model(self) -> None:
        self.model = build_model(self.recipe, self.data).to(self.device)
        t = self.recipe.train
        example = None
        if t.memory_budget is not None:
            if t.memory != "recompute":
                raise ConfigError(f"{self.recipe.source}: train.memory_budget applies to train.memory: recompute "
                                  f"(this recipe has {t.memory!r}); set train.memory=recompute or drop the budget")
            if t.compile:
                raise ConfigError(f"{self.recipe.source}: train.memory_budget does not work with train.compile yet "
                                  "(the compiler cannot trace the kept-output policy); drop one of them")
            example = self._first_input()
        # before DDP and compile wrap it
        if t.memory_budget_of != "saved" and t.memory_budget is None:
            raise ConfigError(f"{self.recipe.source}: train.memory_budget_of applies with train.memory_budget; "
                              "set a budget or drop memory_budget_of")
        self.memory_plan = memory.optimize(self.model, t.memory, budget=t.memory_budget, example=example,
                                           budget_of=t.memory_budget_of)

    def _first_input(self) -> Any:
        """The model's input in the first training batch, with every RNG left where it was (a
        dataset's augmentation draws from them)."""
        from efficient.memory.measure import first_input

        state = ckpt.rng_state()
        try:
            batch = next(iter(self.train_loader(0, 0)))
        finally:
            ckpt.set_rng_state(state)
        return first_input(to_device(batch, self.device))

    def _setup_objective(self) -> None:
        """The loss and metrics; training-time measures are checked by name before any step runs."""
        r = self.recipe
        if r.train.measures:
            from efficient.metrics import get_measure

            for name in r.train.measures:
                try:
                    get_measure(name)
                except ConfigError as e:
                    raise ConfigError(f"{r.source}: train.measures: {e}") from None
        self.objective: Objective = build_objective(r.objective)
        self.objective.setup(self.model, self.data, r)

    def _setup_optimizer(self) -> None:
        """Step budget, optimizer, LR schedule, then the model as the steps call it (DDP, compile, AMP)."""
        r, t = self.recipe, self.recipe.train
        check_global_batch(r, self.dist.world_size)
        self._setup_budget()
        check_optimizer_in_backward(r, self.dist.world_size)
        self.optimizer = build_optimizer(self.model, r.optim, in_backward=t.optimizer_in_backward)
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, self.steps_per_epoch, r.optim.lr, r.schedule)
        self.amp = t.amp and self.device.type == "cuda"
        self.forward_model: nn.Module = dist_utils.wrap(self.model, self.dist, self.device)
        self.compile_mode = compile_mode(t.compile, self.device, self.console)
        # steps left out of the reported throughput: the first compiles; CUDA-graph trees run one
        # more step eagerly and record on the next
        self._warmup_steps = {None: 0, "reduce-overhead": 3}.get(self.compile_mode, 1)
        if self.compile_mode:
            self.forward_model = torch.compile(self.forward_model, mode=self.compile_mode)

    def _setup_budget(self) -> None:
        """Steps per epoch and the total step budget."""
        r, t = self.recipe, self.recipe.train
        bs = r.data["batch_size"]
        self.steps_per_epoch = len(self.data.train) // bs
        if self.steps_per_epoch == 0:
            raise ConfigError(f"{r.source}: data.batch_size={bs} is larger than the training set ({len(self.data.train)} samples)")
        self.total_steps = t.epochs * self.steps_per_epoch
        if t.max_steps:
            self.total_steps = min(self.total_steps, t.max_steps)

    def train_loader(self, epoch: int, start_batch: int) -> DataLoader:
        """This rank's batches of `epoch`, from batch `start_batch` on (the resume point)."""
        bs = self.recipe.data["batch_size"]
        w = self.data_world
        sampler = EpochSampler(len(self.data.train), self.recipe.train.seed, epoch, start_batch * bs,
                               rank=self.data_rank, world_size=w, global_batch=bs)
        # An own generator keeps the loader's worker seeding off the global RNG, so resuming
        # mid-epoch leaves the global RNG (augmentation, dropout) exactly where it was.
        g = torch.Generator().manual_seed(self.recipe.train.seed * 1_000_003 + epoch)
        return DataLoader(self.data.train, batch_size=bs // w, sampler=sampler, drop_last=True, num_workers=self.recipe.data["num_workers"],
                          collate_fn=self.data.collate_fn, generator=g)

    @property
    def metrics_file(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    # ------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict[str, Any]:
        s = self.state
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": dist_utils.gather_objects(ckpt.rng_state(), self.dist),  # one state per rank
            "progress": {"epoch": s.epoch, "step_in_epoch": s.step_in_epoch, "global_step": s.global_step, "best": s.best, "elapsed": s.elapsed},
        }

    def save(self, which: str = "last") -> None:
        """Called on every rank (the RNG states are gathered); rank 0 writes."""
        self.check_finite()
        state = self.trainer_state() if which == "last" else None
        if self.dist.is_main:
            meta = {"global_step": self.state.global_step, "epoch": self.state.epoch, "model": self.recipe.model["name"]}
            ckpt.save_checkpoint(self.run_dir / "checkpoint" / which, self.model, state, meta)
        dist_utils.barrier(self.dist)

    def _save_last(self) -> None:
        """The `last` checkpoint with the time trained so far (a resumed run keeps counting from it)."""
        self.state.elapsed = time.perf_counter() - self._t_start
        self.save("last")

    def restore(self) -> None:
        d = ckpt.find_resumable(self.run_dir)
        zoo.load_weights(self.model, d / ckpt.MODEL_FILE)
        st = ckpt.load_trainer_state(d)
        try:
            self.optimizer.load_state_dict(st["optimizer"])
            self.scheduler.load_state_dict(st["scheduler"])
            rngs = st["rng"]
            ckpt.set_rng_state(rngs[self.dist.rank] if len(rngs) == self.dist.world_size else rngs[0])
            p = st["progress"]
            self.state = Progress(p["epoch"], p["step_in_epoch"], p["global_step"], p["best"], p["elapsed"])
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:  # another run's optimizer, a foreign file
            raise ArtifactError(
                f"{d / ckpt.STATE_FILE}: this trainer state does not fit the run being resumed ({type(e).__name__}: {e}); "
                "resume with the recipe the run was started with, or start a fresh run dir"
            ) from None
        self._truncate_metrics(self.state.global_step)

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric lines written after the checkpoint we resume from (they will be redone)."""
        import json

        f = self.metrics_file
        if not f.exists():
            return
        keep = []
        for line in f.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the kill
            if isinstance(rec, dict) and isinstance(rec.get("step", 0), (int, float)) and rec.get("step", 0) <= step:
                keep.append(line)
        write_text(f, "".join(k + "\n" for k in keep))

    # -------------------------------------------------------------------- fit
    def fit(self) -> dict[str, Any]:
        """Train until the step budget is spent: epochs, validation at epoch ends, `last` after each.

        SIGINT finishes the current step, saves `last` and raises KeyboardInterrupt (resumable)."""
        self._start_run_dir()
        old_handler = signal.signal(signal.SIGINT, self._on_sigint) if _is_main_thread() else None
        val: dict[str, float] = {}
        self._t_start = time.perf_counter() - self.state.elapsed
        try:
            with self._progress_bar() as bar:
                task = bar.add_task("train", total=self.total_steps, completed=self.state.global_step, info="")
                while self.state.global_step < self.total_steps and not self._stop_requested:
                    self.train_epoch(bar, task)
                    self.check_finite()
                    if self._stop_requested:
                        break
                    if self._validation_due():
                        val = self.validate()
                    self._save_last()
        except BaseException:
            self.loggers.close()
            raise
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
        if self._stop_requested:
            self.loggers.close()
            self._save_last()
            raise KeyboardInterrupt(f"training interrupted at step {self.state.global_step}; resume with --resume {self.run_dir}")
        try:
            summary = self.finish(val, time.perf_counter() - self._t_start) if self.dist.is_main else {}
        finally:
            self.loggers.close()
        dist_utils.barrier(self.dist)
        return summary

    def _start_run_dir(self) -> None:
        """A fresh run writes its resolved config and an empty metrics log; a resumed one keeps both.
        Rank 0 opens the `train.loggers` (metrics.jsonl, TensorBoard); the others log nothing."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.resume and self.dist.is_main:
            write_text(self.run_dir / "config.yaml", self.recipe.to_yaml())
            self.metrics_file.write_text("")
        self.loggers = (build_loggers(self.recipe.train.loggers, self.run_dir, self.state.global_step if self.resume else None)
                        if self.dist.is_main else Loggers([]))
        dist_utils.barrier(self.dist)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self._stop_requested = True

    def _progress_bar(self) -> Any:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        return RichProgress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), console=self.console, disable=not (self.recipe.train.progress and self.dist.is_main),
        )

    # ------------------------------------------------------------ train epoch
    def train_epoch(self, bar: Any, task: Any) -> None:
        """Run the current epoch's remaining steps, up to the step budget or a stop request.

        Logs a train line every `log_every` steps, saves `last` every `checkpoint_every` steps
        inside the epoch, and moves to the next epoch when this one is complete."""
        s, t = self.state, self.recipe.train
        self.forward_model.train()
        t0, seen, window = time.perf_counter(), 0, {}
        if s.global_step >= self.total_steps or self._stop_requested:
            return
        for batch in self.train_loader(s.epoch, s.step_in_epoch):
            progress = s.epoch + s.step_in_epoch / self.steps_per_epoch
            inform_progress(self.model, progress)
            self.objective.set_progress(progress, s.global_step)
            batch = to_device(batch, self.device)
            loss, logs = self.loss_step(batch)
            self.optimizer_step(loss, logs)
            s.global_step += 1
            s.step_in_epoch += 1
            seen += _batch_size(batch) * self.data_world
            for k, v in logs.items():
                window.setdefault(k, []).append(v)
            if s.global_step % t.log_every == 0 or s.global_step == self.total_steps:
                self.check_finite()
                if self.dist.is_main:
                    self._log_train(window, seen / max(1e-9, time.perf_counter() - t0), bar, task)
                window = {}
            if self._warmup_steps:  # compilation (and CUDA-graph recording) is not training throughput
                self._warmup_steps -= 1
                if not self._warmup_steps:
                    t0, seen = time.perf_counter(), 0
            bar.update(task, completed=s.global_step)
            if t.checkpoint_every and s.global_step % t.checkpoint_every == 0 and s.step_in_epoch < self.steps_per_epoch:
                self._save_last()
            if t.measures and s.global_step % t.measure_every == 0 and self.dist.is_main:
                from efficient.metrics import measure

                self.loggers.log({"step": s.global_step, "epoch": s.epoch, "measures": measure(t.measures, self.model, batch)})
            # stop before fetching the next batch: fetching runs augmentation, which draws RNG
            if s.global_step >= self.total_steps or self._stop_requested:
                break
        if s.step_in_epoch >= self.steps_per_epoch:
            s.epoch += 1
            s.step_in_epoch = 0

    def loss_step(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """The objective's loss and logs on one batch (already on the device). Whether the loss is
        finite is checked at the next log line or checkpoint (`check_finite`), not here: a check per
        step would make the host wait for the device every step."""
        graphs = self.compile_mode == "reduce-overhead"
        if graphs:  # a new step: the previous step's graph outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(self.amp):
            loss, logs = self.objective.loss(self.forward_model, batch)
        if graphs:  # logged values must outlive the next replay, which reuses the graph's output memory
            logs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in logs.items()}
        self._unchecked.append((self.state.global_step, loss.detach().clone() if graphs else loss.detach()))
        return loss, logs

    def check_finite(self) -> None:
        """Stop the run at the first non-finite loss since the last check (one host read for all of
        them). Every checkpoint is preceded by this check, so none holds weights a bad step wrote."""
        if not self._unchecked:
            return
        steps, losses = zip(*self._unchecked)
        self._unchecked = []
        bad = ~torch.isfinite(torch.stack(losses).float())
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise TrainingError(
                f"loss became {losses[i].item()} at step {steps[i]} (epoch {self.state.epoch}); the last good checkpoint is in "
                f"{self.run_dir / 'checkpoint' / 'last'}. Lower optim.lr or set train.grad_clip."
            )

    def optimizer_step(self, loss: torch.Tensor, logs: dict[str, Any]) -> None:
        """Backward, optional gradient clipping (its norm joins `logs`), optimizer and LR schedule step."""
        self.optimizer.zero_grad(set_to_none=True)
        # with train.optimizer_in_backward each parameter is updated inside backward, and step() has nothing left to do
        with self.optimizer.stepping() if isinstance(self.optimizer, InBackwardOptimizer) else nullcontext():
            loss.backward()
        if self.recipe.train.grad_clip:
            logs["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.train.grad_clip).detach()
        self.optimizer.step()
        self.scheduler.step()

    def _log_train(self, window: dict[str, list[Any]], rate: float, bar: Any, task: Any) -> None:
        """One train line in metrics.jsonl: the means of the logs since the last line, lr, throughput."""
        s = self.state
        row = window_means(window)
        self.loggers.log({"step": s.global_step, "epoch": s.epoch, "lr": self.scheduler.get_last_lr()[0], "samples_per_s": rate, **row})
        info = " ".join(f"{k} {v:.4g}" for k, v in row.items() if k in ("loss", "acc")) + f" {rate:.0f} samples/s"
        bar.update(task, info=info)

    # --------------------------------------------------------------- evaluate
    def evaluate(self, model: nn.Module | None = None) -> dict[str, float]:
        """Validation metrics of `model` (default: the model as training calls it), see `evaluate()`."""
        return evaluate(model or self.forward_model, self.objective, val_loader(self.recipe, self.data), self.device,
                        amp=self.amp, max_batches=self.recipe.eval.max_batches)

    def _validation_due(self) -> bool:
        """At the end of every `eval_every`-th epoch, and after the last step."""
        s = self.state
        epoch_done = s.step_in_epoch == 0
        return (epoch_done and s.epoch % self.recipe.train.eval_every == 0) or s.global_step >= self.total_steps

    def validate(self) -> dict[str, float]:
        """Evaluate, log the val line and keep the `best` checkpoint; every rank returns the metrics.

        Rank 0 evaluates the unwrapped model (no collectives) and broadcasts its result."""
        s = self.state
        val = dist_utils.broadcast_object(self.evaluate(self.model) if self.dist.is_main else {}, self.dist)
        if self.dist.is_main:
            self.loggers.log({"step": s.global_step, "epoch": s.epoch, "split": "val", **val})
        pm = val.get(self.objective.primary_metric)
        if pm is not None and self._better(pm):
            s.best = pm
            self.save("best")
        return val

    def _better(self, value: float) -> bool:
        best = self.state.best
        if best is None:
            return True
        return value > best if self.objective.higher_is_better else value < best

    # ----------------------------------------------------------------- finish
    def record_memory(self) -> None:
        """memory.json: activation bytes one training step keeps at this run's level and at `none`
        (one batch of the training data; `efficient report` shows it)."""
        from efficient.memory.measure import write_run_memory

        batch = to_device(next(iter(self.train_loader(self.state.epoch, 0))), self.device)
        write_run_memory(self.run_dir, self.model, batch, self.memory_plan.level)

    def finish(self, val: dict[str, float], train_time: float) -> dict[str, Any]:
        """Write summary.json, report.md and report.html (with the cost profile, also kept whole in
        profile.json, when `profile.enabled`; memory.json at a memory level, when `profile.memory`);
        return the summary."""
        summary: dict[str, Any] = {
            "model": self.recipe.model["name"],
            "steps": self.state.global_step,
            "epochs": self.state.epoch,
            "train_time_s": round(train_time, 2),
            "val": val,
            "best": {self.objective.primary_metric: self.state.best},
            "params": zoo.count_params(self.model),
            "memory": {"level": self.memory_plan.level, "summary": self.memory_plan.summary()},
            "compile": self.compile_mode or False,
            "environment": environment(self.device),
        }
        report_md = ""
        if self.recipe.profile.enabled:
            rep = self.cost_profile()
            summary["cost"], report_md = dict(rep.totals), rep.to_markdown()
            rep.to_json(self.run_dir / "profile.json")
            self.loggers.log_profile(rep, self.state.global_step)
        if self.memory_plan.level != "none" and not self.memory_plan.note and self.recipe.profile.memory:
            self.record_memory()
        write_json(self.run_dir / "summary.json", summary)
        write_text(self.run_dir / "report.md", render_report_md(self.recipe, summary, report_md))
        from efficient.report.html import write_run_report

        write_run_report(self.run_dir)
        return summary

    def cost_report(self) -> tuple[dict[str, Any], str]:
        """The cost profile's totals and markdown (see `cost_profile`)."""
        rep = self.cost_profile()
        return dict(rep.totals), rep.to_markdown()

    def cost_profile(self) -> Any:
        """Profile the trained model on a few validation inputs (per-sample costs); an early-exit
        model also gets its exit distribution on them."""
        from efficient.profiler import profile
        from efficient.profiler.run import validation_inputs

        x = to_device(validation_inputs(self.data, self.recipe.profile.samples), self.device)  # as `efficient profile RUN`
        self.model.eval()
        return profile(self.model, inputs=x, data=[x] if hasattr(self.model, "exit_layers") else None,
                       energy=self.recipe.profile.energy, flops_per_mac=self.recipe.profile.flops_per_mac)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return 0


def render_report_md(recipe: Recipe, summary: dict[str, Any], profile_md: str) -> str:
    lines = [f"# Run report: {summary['model']}", "", f"Recipe: `{recipe.source}`", ""]
    lines += ["| metric | value |", "|---|---|"]
    for k, v in summary["val"].items():
        lines.append(f"| val {k} | {v:.4f} |")
    lines += [f"| train time (s) | {summary['train_time_s']} |", f"| steps | {summary['steps']} |", f"| params | {summary['params']:,} |"]
    if profile_md:
        lines += ["", profile_md]
    return "\n".join(lines) + "\n"
