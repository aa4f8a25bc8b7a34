"""Multi-process training on PyTorch's own engine: process groups from torchrun's environment,
DistributedDataParallel, and `--nproc N` launching through `torch.distributed.run`."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_from_env(device_type: str) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, ...); a no-op for one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend=backend)
    return info


def device_for(info: DistInfo, device: torch.device) -> torch.device:
    return torch.device("cuda", info.local_rank) if device.type == "cuda" and info.enabled else device


class DDP(nn.parallel.DistributedDataParallel):
    """DistributedDataParallel that forwards unknown attributes to the wrapped model, so objectives
    can read model attributes (e.g. `timesteps`) as they do without DDP."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def wrap(model: nn.Module, info: DistInfo, device: torch.device) -> nn.Module:
    if not info.enabled:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, find_unused_parameters=bool(int(os.environ.get("EFFICIENT_DDP_FIND_UNUSED", "0"))))


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def launch(nproc: int, argv: list[str]) -> int:
    """Re-run `efficient <argv>` under torchrun with `nproc` processes on this machine."""
    from torch.distributed.run import main as torchrun

    args = ["--standalone", f"--nproc-per-node={nproc}", "-m", "efficient", *argv]
    try:
        torchrun(args)
    except SystemExit as e:  # torchrun exits with the workers' status
        return int(e.code or 0)
    except Exception as e:  # ChildFailedError: a worker failed; its traceback was printed
        print(f"error: distributed run failed: {e}", file=sys.stderr)
        return 1
    return 0
