"""Worker for tests/test_memory_tracking.py: `python _memory_fsdp_worker.py OUT PORT` runs 2 ranks
of a gloo group; each shards spikformer-tiny-stata with FSDP2 (`fully_shard` per block, then the
root) at every memory level, runs one training step on its half of a batch and rank 0 writes the
full gradients per level to OUT (torch.save)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def rank_main(rank: int, out: str, port: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from efficient import memory, zoo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    x = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(2))[rank * 2:(rank + 1) * 2]
    y = torch.tensor([0, 1, 3, 2])[rank * 2:(rank + 1) * 2]
    grads = {}
    for level in memory.LEVELS:
        torch.manual_seed(0)
        model = zoo.create("spikformer-tiny-stata", timesteps=2, img_size=16, num_classes=4).train()
        memory.optimize(model, level)  # before sharding, as the trainer does before DDP
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        F.cross_entropy(model(x), y).backward()
        grads[level] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save(grads, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1], sys.argv[2]), nprocs=2)
