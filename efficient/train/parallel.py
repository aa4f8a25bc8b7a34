"""The trainer for `train.parallel`: pipeline stages (x data-parallel replicas) or FSDP2 sharding.

It is `Trainer` with the model split across processes: every rank builds the same initial model
(one seed), keeps only its part, and steps it. Checkpoints hold the trainer state as a
`torch.distributed.checkpoint` (every rank writes its shard) beside a consolidated
`model.safetensors` that rank 0 writes, so `efficient.load`, `generate` and `eval` read the run
dir as any other. Validation runs on all ranks together (through the sharded model, or stage by
stage); rank 0 logs, and profiles the consolidated copy it keeps in host memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from efficient.config import check_parallel
from efficient.train import checkpoint as ckpt
from efficient.train import distributed as dist_utils
from efficient.train.engine import Trainer, TrainingError, build_model, seed_everything
from efficient.train.optim import build_optimizer, build_scheduler, check_optimizer_in_backward

STATE_KEYS = ("scheduler", "rng", "param_groups", "progress")  # trainer.pt; weights and optimizer moments are DCP files


class ParallelTrainer(Trainer):
    """Runs a recipe whose `train.parallel` splits the model (see efficient.train.pipeline and
    efficient.train.sharding); launched by `efficient train --nproc N` or torchrun."""

    def _setup_runtime(self) -> None:
        super()._setup_runtime()
        if not self.dist.enabled:
            from efficient.errors import ConfigError

            raise ConfigError(f"{self.recipe.source}: train.parallel splits the model over processes; run with --nproc N (or under torchrun)")
        check_parallel(self.recipe, self.dist.world_size)
        seed_everything(self.recipe.train.seed)  # one initial model on every rank: nothing is broadcast

    def _setup_optimizer(self) -> None:
        r, t = self.recipe, self.recipe.train
        par = t.parallel
        check_optimizer_in_backward(r, self.dist.world_size, parallel=True)
        self._setup_budget()
        self.amp = t.amp and self.device.type == "cuda"
        self.runner = None
        self.eval_model: nn.Module | None = None
        if par.pipeline_stages > 1:
            from efficient.train.pipeline import PipelineRunner, make_layout, split_points

            lay = make_layout(par.pipeline_stages, par.chunks_per_rank, self.model)
            mb = r.data["batch_size"] // lay.dp // par.n_microbatches
            seq_len = int(self.data.train[0][0].shape[-1])  # stages exchange activations of a fixed shape
            self.runner = PipelineRunner(self.model, self.objective, lay, par.schedule, par.n_microbatches, mb, self.device, self.amp, seq_len)
            self.data_rank, self.data_world = lay.dp_rank, lay.dp
            self.train_module: nn.Module = self.runner.shard
            ranges = split_points(self.model.num_layers, lay.n_stages)
            self._drop_other_stages([ranges[s] for s in lay.stage_ids()])
        else:
            from efficient.train.sharding import shard_model

            self.train_module = shard_model(self.model, self.device, self.amp)
        if self.dist.is_main:
            # rank 0's consolidated copy for checkpoints and the cost report, in host memory: the
            # whole model never sits on one accelerator
            with torch.random.fork_rng(devices=[]):
                self.eval_model = build_model(r, self.data)
        self.optimizer = build_optimizer(self.train_module, r.optim)
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, self.steps_per_epoch, r.optim.lr, r.schedule)
        self.forward_model = self.model
        self._synced_step = -1

    def _drop_other_stages(self, ranges: list[tuple[int, int]]) -> None:
        """Free the layers and exits that other ranks run (this rank never reads them)."""
        keep = {i for a, b in ranges for i in range(a, b)}
        for i in range(self.model.num_layers):
            if i not in keep:
                self.model.layers[i] = nn.Identity()
        for k in list(self.model.exits):
            if not any(a < int(k) <= b for a, b in ranges):
                self.model.exits[k] = nn.Identity()

    # ------------------------------------------------------------------ steps
    def loss_step(self, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        if self.runner is None:
            return super().loss_step(batch)
        x, y = batch
        logs = self._gather_logs(self.runner.step(x, y))
        if not torch.isfinite(torch.tensor(logs["loss"])):
            s = self.state
            raise TrainingError(f"loss became {logs['loss']} at step {s.global_step} (epoch {s.epoch}); the last good checkpoint is in "
                                f"{self.run_dir / 'checkpoint' / 'last'}. Lower optim.lr or set train.grad_clip.")
        return torch.tensor(logs["loss"]), logs

    def _gather_logs(self, local: dict[str, float]) -> dict[str, float]:
        """Every rank's losses and bubble fractions as one dict on every rank: each exit's CE and
        the final CE (means over replicas), `bubble_stage{p}` per pipeline position and their mean."""
        lay, obj = self.runner.layout, self.objective
        w = obj.weights()
        names = ["loss_final", *(f"loss_exit{k}" for k in obj.layers), *(f"bubble_stage{p}" for p in range(lay.pp))]
        local = {**local, f"bubble_stage{lay.pp_rank}": 1.0 - local["busy_s"] / max(local["step_s"], 1e-12)}
        vals = torch.zeros(2, len(names), dtype=torch.float64)
        for i, n in enumerate(names):
            if n in local:
                vals[0, i], vals[1, i] = local[n], 1.0
        vals = vals.to(self.device)  # NCCL reduces device tensors only
        dist.all_reduce(vals)
        vals = vals.cpu()
        out = {n: float(vals[0, i] / vals[1, i]) for i, n in enumerate(names) if vals[1, i] > 0}
        total = out["loss_final"]
        for k in obj.layers:
            if f"loss_exit{k}" in out:
                total += w[k] * out[f"loss_exit{k}"]
            out[f"w_exit{k}"] = w[k]
        out["bubble"] = sum(out[f"bubble_stage{p}"] for p in range(lay.pp)) / lay.pp
        out["loss"] = total
        return out

    def optimizer_step(self, loss: torch.Tensor, logs: dict[str, float]) -> None:
        clip = self.recipe.train.grad_clip
        if self.runner is not None:  # the pipeline's backward already ran in loss_step
            if clip:
                logs["grad_norm"] = self.runner.clip_grad_norm(clip)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
                logs["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.scheduler.step()

    # ------------------------------------------------------------ checkpoints
    def _sync_eval_model(self) -> None:
        """Refresh rank 0's whole model from the shards (collective; once per step)."""
        if self._synced_step == self.state.global_step:
            return
        if self.runner is not None:
            sd = self.runner.full_state_dict()
        else:
            from efficient.train.sharding import full_state_dict

            sd = full_state_dict(self.model)
        if self.dist.is_main:
            self.eval_model.load_state_dict(sd, strict=True)
        self._synced_step = self.state.global_step

    def _dcp_state(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The DCP part (weights and optimizer state by parameter name) and this rank's optimizer
        param groups (hyper-parameters by name, kept in trainer.pt: DCP drops tuples like betas)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.train_module, self.optimizer)
        return {"model": model_sd, "optim": {"state": optim_sd["state"]}}, optim_sd["param_groups"]

    def save(self, which: str = "last") -> None:
        """Collective. `last`: every rank writes its model and optimizer shard (DCP) and rank 0 the
        consolidated weights and the rest of the trainer state; `best`: the weights only."""
        import torch.distributed.checkpoint as dcp

        self._sync_eval_model()
        s = self.state
        meta = {"global_step": s.global_step, "epoch": s.epoch, "model": self.recipe.model["name"], "layout": self._layout_meta()}
        directory = self.run_dir / "checkpoint" / which
        if which != "last":
            if self.dist.is_main:
                ckpt.save_checkpoint(directory, self.eval_model, None, meta)
            dist_utils.barrier(self.dist)
            return
        rngs = dist_utils.gather_objects(ckpt.rng_state(), self.dist)
        state, groups = self._dcp_state()
        groups = dist_utils.gather_objects(groups, self.dist)
        tmp = ckpt.begin_checkpoint(directory) if self.dist.is_main else None
        tmp = type(directory)(dist_utils.broadcast_object(str(tmp), self.dist))
        dcp.save(state, checkpoint_id=str(tmp))
        if self.dist.is_main:
            from efficient.zoo import save_model

            save_model(self.eval_model, tmp / ckpt.MODEL_FILE)
            progress = {"epoch": s.epoch, "step_in_epoch": s.step_in_epoch, "global_step": s.global_step, "best": s.best, "elapsed": s.elapsed}
            torch.save({"scheduler": self.scheduler.state_dict(), "rng": rngs, "param_groups": groups, "progress": progress},
                       tmp / ckpt.STATE_FILE)
            ckpt.commit_checkpoint(tmp, directory, meta)
        dist_utils.barrier(self.dist)

    def _layout_meta(self) -> dict[str, Any]:
        return layout_meta(self.recipe, self.dist.world_size)

    def restore(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from efficient.train.engine import Progress

        d = ckpt.find_resumable(self.run_dir)
        check_resume_layout(d, self.recipe, self.dist.world_size)
        st = ckpt.load_trainer_state(d, STATE_KEYS)
        state, _ = self._dcp_state()
        dcp.load(state, checkpoint_id=str(d))
        optim = {"state": state["optim"]["state"], "param_groups": st["param_groups"][self.dist.rank]}
        set_state_dict(self.train_module, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim)
        self.scheduler.load_state_dict(st["scheduler"])
        ckpt.set_rng_state(st["rng"][self.dist.rank])
        p = st["progress"]
        self.state = Progress(p["epoch"], p["step_in_epoch"], p["global_step"], p["best"], p["elapsed"])
        self._synced_step = -1
        if self.dist.is_main:
            self._truncate_metrics(self.state.global_step)
        dist_utils.barrier(self.dist)

    # --------------------------------------------------------------- evaluate
    def evaluate(self, model: nn.Module | None = None) -> dict[str, float]:
        """Validation metrics of the split model, computed by every rank together (each sees the
        same batches): FSDP through the sharded model, a pipeline stage by stage."""
        if self.runner is None:
            return super().evaluate(self.model)
        from efficient.train.engine import to_device, val_loader

        obj, runner = self.objective, self.runner
        names = [*(f"loss_exit{k}" for k in obj.layers), "loss"]
        sums, n = torch.zeros(len(names), dtype=torch.float64), 0.0
        runner.shard.eval()
        try:
            for i, (x, y) in enumerate(val_loader(self.recipe, self.data)):
                if self.recipe.eval.max_batches and i >= self.recipe.eval.max_batches:
                    break
                part = runner.eval_sums(to_device(x, self.device), to_device(y, self.device))
                sums += torch.tensor([part.get(k, 0.0) for k in names], dtype=torch.float64)
                n += y.numel()
        finally:
            runner.shard.train()
        sums = sums.to(self.device)
        dist.all_reduce(sums, group=runner.layout.pp_group)  # each exit's sum lives on its stage's rank
        return {k: float(v) / max(n, 1.0) for k, v in zip(names, sums.cpu())}

    def validate(self) -> dict[str, float]:
        """As `Trainer.validate`, with the evaluation run where the split model can run it."""
        s = self.state
        val = self.evaluate()
        self.loggers.log({"step": s.global_step, "epoch": s.epoch, "split": "val", **val})  # rank 0's loggers; others have none
        pm = val.get(self.objective.primary_metric)
        if pm is not None and self._better(pm):
            s.best = pm
            self.save("best")
        return val

    def finish(self, val: dict[str, float], train_time: float) -> dict[str, Any]:
        """summary.json and report.md of the consolidated model (rank 0)."""
        model, device = self.model, self.device
        self.model, self.device = self.eval_model, next(self.eval_model.parameters()).device  # FSDP's is on the CPU
        try:
            return super().finish(val, train_time)
        finally:
            self.model, self.device = model, device


def layout_meta(recipe: Any, world_size: int) -> dict[str, Any]:
    """The process layout a checkpoint's shards belong to (kept in its meta.json)."""
    par = recipe.train.parallel
    return {"world_size": world_size, "pipeline_stages": par.pipeline_stages, "schedule": par.schedule, "fsdp": par.fsdp}


def check_resume_layout(directory: Path, recipe: Any, world_size: int) -> None:
    """Sharded trainer state resumes only on the layout that wrote it."""
    from efficient.errors import ConfigError
    from efficient.io import read_json

    saved = read_json(Path(directory) / ckpt.META_FILE, "checkpoint meta.json").get("layout")
    want = layout_meta(recipe, world_size)
    if saved != want:
        raise ConfigError(f"{directory}: written by a run with layout {saved}, resumed as {want}; "
                          "resume with the --nproc and train.parallel settings the run was started with")
