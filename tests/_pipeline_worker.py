"""Worker for tests/test_pipeline.py, run under torchrun: a few optimizer steps of every case in
CASES (pipeline or FSDP2), with the per-step logs and the final full weights written to a file."""

import sys

import torch
import torch.distributed as dist

from efficient import zoo
from efficient.config import OptimConfig
from efficient.objectives.exits import ExitLoss
from efficient.train.optim import build_optimizer

BASE = dict(n_layer=4, n_embd=16, n_head=2, seq_len=16, exit_layers=[1, 3], exit_head="norm")
OBJ = dict(weights=[0.5, 0.25], weight_init=0.1, warmup_iters=2, temperatures=[2.0, 0.5], dynamic_token_weights=True)
OPT = OptimConfig(name="adamw", lr=1e-3, weight_decay=0.1)
STEPS, BATCH = 3, 8

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
    from efficient.train.pipeline import PipelineRunner, make_layout

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
    from efficient.train.sharding import full_state_dict, shard_model

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
        logs.append(out)
    return {"logs": logs, "weights": full_state_dict(model)}


def main(out: str, mode: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
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
    torch.save(results, f"{out}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
