"""Worker for tests/test_pipeline.py, run under torchrun: one pipeline step, grads to a file."""

import sys

import torch
import torch.distributed as dist

from efficient import zoo
from efficient.train.pipeline import pipeline_step, stage_parameters

CFG = dict(n_layer=4, n_embd=32, n_head=2, seq_len=16, tie_embeddings=False, exit_tied=False, exit_layers=[1, 3])


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = zoo.create("ee-gpt-tiny", **CFG)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (4, 16), generator=g)
    tgt = torch.randint(0, 256, (4, 16), generator=g)
    loss, stage = pipeline_step(model, idx, tgt, {1: 0.5, 3: 0.25}, n_microbatches=2)
    grads = {k: p.grad.clone() for k, p in stage_parameters(stage).items() if p.grad is not None}
    torch.save({"loss": loss, "exit_losses": stage.exit_losses, "grads": grads}, f"{out}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
