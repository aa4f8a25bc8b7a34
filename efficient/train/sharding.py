"""FSDP2 parameter sharding of an EE-GPT: `fully_shard` per transformer block (layers and exit
blocks), then the root (embedding, norms, heads), over every process of the run."""

from __future__ import annotations

import torch
from torch import nn


def shard_model(model: nn.Module, device: torch.device, amp: bool = False) -> nn.Module:
    """Shard `model` in place (every rank must hold the same initial weights).

    `amp` (train.amp on CUDA) computes in bf16 and reduces gradients in fp32. The objective
    reaches the model through `exit_states`, registered as a forward method so that the root's
    parameters are gathered for it as for `forward`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if amp and device.type == "cuda" else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    for head in model.exits.values():
        if head.block is not None:
            fully_shard(head.block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    register_fsdp_forward_method(model, "exit_states")
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The unsharded weights on rank 0 (CPU), None on the other ranks. Collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if dist.get_rank() == 0 else None
