"""Worker for tests/test_pipeline.py: `python _pipeline_worker.py OUT MODE [MODE ...]` runs, for
each MODE, NPROC[MODE] ranks of a gloo group that each train every case of the mode (pipeline,
FSDP2, pipeline x data parallel) for a few optimizer steps and write the per-step logs and the
final full weights to OUT/MODE/rank{i}.pt, then OUT/MODE/done once every rank has succeeded.

The ranks are forked from this one process once it has imported everything (and before it has
run any torch op): a fresh interpreter per rank would spend seconds of CPU on imports alone."""

import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict  # noqa: F401  (efficient imports these lazily: once here, before the fork)
import torch.distributed.fsdp  # noqa: F401

from efficient import zoo
from efficient.config import OptimConfig
from efficient.objectives.exits import ExitLoss
from efficient.train.optim import build_optimizer
from efficient.train.pipeline import PipelineRunner, make_layout
from efficient.train.sharding import full_state_dict, shard_model

BASE = dict(n_layer=4, n_embd=16, n_head=2, seq_len=16, exit_layers=[1, 3], exit_head="norm")
OBJ = dict(weights=[0.5, 0.25], weight_init=0.1, warmup_iters=2, temperatures=[2.0, 0.5], dynamic_token_weights=True)
OPT = OptimConfig(name="adamw", lr=1e-3, weight_decay=0.1)
STEPS, BATCH = 3, 8
NPROC = {"pipeline": 2, "fsdp": 2, "pipeline_dp": 4}  # pipeline_dp: 2 stages x 2 replicas

# name -> (model options, objective options, schedule, micro-batches, grad clip)
PIPELINE_CASES = {
    "1f1b_tied": (dict(tie_embeddings=True, exit_tied=True), {}, "1f1b", 4, 0.5),
    "gpipe_tied": (dict(tie_embeddings=True, exit_tied=True), {}, "gpipe", 2, None),
    "1f1b_untied": (dict(tie_embeddings=False, exit_tied=False), {}, "1f1b", 2, None),
    "gpipe_untied_fused": (dict(tie_embeddings=False, exit_tied=True), dict(fused=True, chunk_size=32), "gpipe", 4, 0.5),
}
INTERLEAVED_CASES = {"interleaved_tied": (dict(tie_embeddings=True, exit_tied=True), {}, "interleaved_1f1b", 2, None)}
FSDP_CASES = {
    "fsdp_tied": (dict(tie_embeddings=True, exit_tied=True), {}, None, 1, 0.5),
    "fsdp_untied": (dict(tie_embeddings=False, exit_tied=False), dict(fused=True, chunk_size=32), None, 1, None),
}


def batches(steps: int = STEPS, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (batch, 16), generator=g), torch.randint(0, 256, (batch, 16), generator=g)) for _ in range(steps)]


def build(model_opts: dict, obj_opts: dict) -> tuple[torch.nn.Module, ExitLoss]:
    torch.manual_seed(0)
    model = zoo.create("ee-gpt-tiny", **BASE, **model_opts)
    obj = ExitLoss(**OBJ, **obj_opts)
    obj.setup(model)
    return model, obj


def run_pipeline(name: str, case: tuple, pp: int) -> dict:
    model_opts, obj_opts, schedule, m, clip = case
    model, obj = build(model_opts, obj_opts)
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    lay = make_layout(pp, chunks, model)
    local = BATCH // lay.dp
    runner = PipelineRunner(model, obj, lay, schedule, m, local // m, torch.device("cpu"))
    opt = build_optimizer(runner.shard, OPT)
    logs = []
    for step, (x, y) in enumerate(batches()):
        obj.set_progress(0.0, step)
        xs, ys = x[lay.dp_rank * local : (lay.dp_rank + 1) * local], y[lay.dp_rank * local : (lay.dp_rank + 1) * local]
        out = runner.step(xs, ys)
        if clip:
            out["grad_norm"] = runner.clip_grad_norm(clip)
        opt.step()
        logs.append(out)
    return {"logs": logs, "weights": runner.full_state_dict(), "shard": {k: v.detach().clone() for k, v in runner.shard.state_dict().items()},
            "dp_rank": lay.dp_rank, "pp_rank": lay.pp_rank}


def run_fsdp(name: str, case: tuple) -> dict:
    model_opts, obj_opts, _, _, clip = case
    model, obj = build(model_opts, obj_opts)
    shard_model(model, torch.device("cpu"), amp=False)
    opt = build_optimizer(model, OPT)
    r, w = dist.get_rank(), dist.get_world_size()
    logs = []
    for step, (x, y) in enumerate(batches()):
        obj.set_progress(0.0, step)
        local = BATCH // w
        loss, out = obj.loss(model, (x[r * local : (r + 1) * local], y[r * local : (r + 1) * local]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            n = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            out["grad_norm"] = float(n.full_tensor() if hasattr(n, "full_tensor") else n)
        opt.step()
        logs.append({k: float(v) for k, v in out.items()})  # the objective logs device tensors
    return {"logs": logs, "weights": full_state_dict(model)}


def train(out: Path, mode: str) -> None:
    """This rank's share of `mode`, written to out/rank{rank}.pt."""
    results = {}
    if mode == "pipeline":
        for name, case in {**PIPELINE_CASES, **INTERLEAVED_CASES}.items():
            results[name] = run_pipeline(name, case, pp=2)
    elif mode == "pipeline_dp":
        for name in ("1f1b_tied", "gpipe_untied_fused"):
            results[name] = run_pipeline(name, PIPELINE_CASES[name], pp=2)
    else:
        for name, case in FSDP_CASES.items():
            results[name] = run_fsdp(name, case)
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def run_group(out: Path, mode: str) -> bool:
    """Fork the mode's ranks, which meet through a file store in `out`; False if any failed (its
    traceback is on stderr), in which case the others are killed rather than left waiting in a
    collective."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "store").unlink(missing_ok=True)  # a file store left by an earlier run would mix the two
    ranks = {}
    for rank in range(NPROC[mode]):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.set_num_threads(1)
                dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=NPROC[mode],
                                        timeout=timedelta(minutes=5))
                train(out, mode)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        ranks[pid] = rank
    ok = True
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0 and ok:
            print(f"{mode}: rank {rank} failed (status {os.waitstatus_to_exitcode(status)})", file=sys.stderr)
            ok = False
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    if ok:
        (out / "done").touch()
    return ok


def main(argv: list[str]) -> int:
    out, modes = Path(argv[0]), argv[1:]
    zoo.get_entry("ee-gpt-tiny")  # the zoo's registry and its imports, loaded once before the fork
    ok = [run_group(out / mode, mode) for mode in modes]  # every mode, even after a failed one
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
