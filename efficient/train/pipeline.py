"""Pipeline-parallel training of early-exit GPTs with `torch.distributed.pipelining`.

EE-LLM's setting: stage s holds a contiguous run of layers and the exits inside it. Each stage
computes its own exits' losses and backpropagates them together with the gradient that arrives
from the next stage. We attach a stage's exit loss to its output activation with an autograd
function whose backward returns 1 for the loss, so the pipeline schedule's single backward per
micro-batch also runs the exits' backward -- the same gradients as single-process training of
`final CE + sum_i w_i * exit CE_i` (the schedule averages micro-batch gradients itself:
`scale_grads` divides them by n_microbatches).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _AttachLoss(torch.autograd.Function):
    """Identity on `h`; in backward also seeds d(loss)=1 so the stage's exit losses backpropagate."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def split_points(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, balanced layer ranges [start, stop) for each stage."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} pipeline stages")
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class ExitStage(nn.Module):
    """Layers [start, stop) of an EE-GPT with the exits they contain.

    Stage inputs are token ids (first stage) or the residual stream; outputs are the residual
    stream, or the final logits on the last stage. Targets for the exit losses are queued per
    micro-batch with `set_targets` (the GPipe schedule runs micro-batch forwards in order)."""

    def __init__(self, model: nn.Module, start: int, stop: int, exit_weights: dict[int, float]) -> None:
        super().__init__()
        if model.lm_head is None or any(model.exits[str(k)].proj is None for k in model.exit_layers[:-1]):
            raise ValueError("pipeline stages need untied heads (tie_embeddings=false, exit_tied=false): "
                             "a tied exit would share the embedding across stages")
        self.model, self.start, self.stop = model, start, stop
        self.first, self.last = start == 0, stop == model.num_layers
        self.weights = {k: w for k, w in exit_weights.items() if start < k <= stop and k != model.num_layers and w}
        self._targets: deque[torch.Tensor] = deque()
        self.exit_losses: list[float] = []

    def set_targets(self, targets: torch.Tensor, n_microbatches: int) -> None:
        self._targets = deque(targets.tensor_split(n_microbatches))
        self.exit_losses = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.tok_emb(x) if self.first else x
        cos, sin = m._rope(0, h.shape[1])
        target = self._targets.popleft() if self.weights else None
        aux = h.new_zeros(())
        for i in range(self.start, self.stop):
            h, mid = m.layers[i](h, cos, sin)
            if i + 1 in self.weights:
                logits = m.exit_hidden(i + 1, h, mid) @ m.head_weight(i + 1).T
                ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
                self.exit_losses.append(ce.item())
                aux = aux + self.weights[i + 1] * ce
        out = m.norm_f(h) @ m.head_weight(m.num_layers).T if self.last else h
        return _AttachLoss.apply(out, aux) if self.weights else out


def pipeline_stage_module(model: nn.Module, rank: int, num_stages: int, exit_weights: dict[int, float]) -> ExitStage:
    """Stage `rank` of `num_stages`; it runs only its own layers (the rest of `model` stays idle)."""
    start, stop = split_points(model.num_layers, num_stages)[rank]
    return ExitStage(model, start, stop, exit_weights)


def stage_parameters(stage: ExitStage) -> dict[str, nn.Parameter]:
    """The parameters this stage owns, under the full model's names."""
    m, keep = stage.model, {}
    for name, p in m.named_parameters():
        top = name.split(".")[0]
        idx = int(name.split(".")[1]) if top in ("layers", "exits") else None
        if top == "layers" and stage.start <= idx < stage.stop:
            keep[name] = p
        elif top == "exits" and stage.start < idx <= stage.stop:
            keep[name] = p
        elif top == "tok_emb" and stage.first or top in ("norm_f", "lm_head") and stage.last:
            keep[name] = p
    return keep


def pipeline_step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, exit_weights: dict[int, float],
                  n_microbatches: int, group: Any = None) -> tuple[float | None, ExitStage]:
    """One forward+backward of a GPipe schedule over the ranks of `group` (one stage per rank).

    Every rank passes the same `idx` and `targets`; the last stage returns the mean final CE
    (other ranks return None). Gradients accumulate in the stage's parameters."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    stage_mod = pipeline_stage_module(model, rank, world, exit_weights)
    stage_mod.set_targets(targets, n_microbatches)
    # Static shapes: with them the stage skips its extra shape-inference forward, which would
    # consume a micro-batch's exit targets.
    b, S = idx.shape[0] // n_microbatches, idx.shape[1]
    if idx.shape[0] % n_microbatches:
        raise ValueError(f"batch of {idx.shape[0]} does not split into {n_microbatches} micro-batches")
    hidden = torch.empty(b, S, model.n_embd, device=idx.device, requires_grad=True)  # activations carry grads
    logits = torch.empty(b, S, model.vocab_size, device=idx.device, requires_grad=True)
    example_in = torch.empty(b, S, dtype=torch.long, device=idx.device) if stage_mod.first else hidden
    example_out = logits if stage_mod.last else hidden
    stage = PipelineStage(stage_mod, rank, world, idx.device, input_args=example_in, output_args=example_out, group=group)
    losses: list[torch.Tensor] = []

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn)
    if stage_mod.first:
        schedule.step(idx)
    elif stage_mod.last:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    final = float(sum(l.item() for l in losses)) / n_microbatches if stage_mod.last else None
    return final, stage_mod
