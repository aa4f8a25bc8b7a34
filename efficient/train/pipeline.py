"""Pipeline-parallel training of early-exit GPTs on `torch.distributed.pipelining`.

EE-LLM's setting: stage s holds a contiguous run of layers and the exits inside it. Each stage
computes its own exits' losses (the `exits` objective's weights and ramp, temperatures, dynamic
token weights, fused linear-CE) inside its forward and attaches them to its output with an
autograd function whose backward adds d(exit loss) = 1, so the schedule's one backward per
micro-batch also runs the exits' backward. The last stage's `loss_fn` is the final head's CE.
With gradients divided by the micro-batch count afterwards, a step gives the gradients of
single-process `final CE + sum_i w_i * exit CE_i` on the whole batch.

Tied weights (the input embedding read by the final head, or a final head read by tied exits
on earlier stages) are kept as one copy on every stage that reads them; their gradients are
summed over those stages every step (Megatron's embedding group), so the copies stay equal.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from efficient.objectives.exits import ExitLoss, token_ce

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class _AttachLoss(torch.autograd.Function):
    """Identity on `h`; its backward also seeds d(loss) = 1, so a stage's exit losses backpropagate
    with the gradient that arrives from the next stage."""

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


def stage_modules(model: nn.Module, start: int, stop: int) -> dict[str, nn.Module]:
    """The top-level modules of `model` that layers [start, stop) and their exits read, under the
    model's own names (so a stage's parameter names are the full model's)."""
    L = model.num_layers
    exits = [k for k in model.exit_layers[:-1] if start < k <= stop]
    reads_head = stop == L or any(model.exits[str(k)].proj is None for k in exits)
    tied = model.lm_head is None
    mods: dict[str, nn.Module] = {}
    if start == 0 or (reads_head and tied):
        mods["tok_emb"] = model.tok_emb
    mods["layers"] = nn.ModuleDict({str(i): model.layers[i] for i in range(start, stop)})
    if exits:
        mods["exits"] = nn.ModuleDict({str(k): model.exits[str(k)] for k in exits})
    if stop == L:
        mods["norm_f"] = model.norm_f
    if reads_head and not tied:
        mods["lm_head"] = model.lm_head
    return mods


class ExitStage(nn.Module):
    """Layers [start, stop) of an EE-GPT with the exits after them, as one pipeline stage.

    Input: token ids (first stage) or the residual stream. Output: the residual stream, or the
    final normed hidden state on the last stage (its `loss_fn` applies the head). Each
    micro-batch's targets are queued with `set_targets`; every schedule runs a stage's forwards
    in micro-batch order. `exit_losses` holds the detached exit CEs of the last step."""

    def __init__(self, model: nn.Module, start: int, stop: int, objective: ExitLoss, amp: bool = False) -> None:
        super().__init__()
        for name, mod in stage_modules(model, start, stop).items():
            self.add_module(name, mod)
        object.__setattr__(self, "model", model)  # the modules above are its; not registered twice
        self.start, self.stop, self.amp = start, stop, amp
        self.first, self.last = start == 0, stop == model.num_layers
        self.objective = objective
        self._targets: deque[torch.Tensor] = deque()
        self.exit_losses: dict[int, list[torch.Tensor]] = {}

    def set_targets(self, targets: torch.Tensor, n_microbatches: int) -> None:
        self._targets = deque(targets.tensor_split(n_microbatches))
        self.exit_losses = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, obj = self.model, self.objective
        target = self._targets.popleft()
        w = obj.weights()
        temp = dict(zip(obj.layers, obj.temps))
        active = {k for k, wk in w.items() if wk != 0 and self.start < k <= self.stop}  # weight-0 exits are not computed
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp):
            h = m.tok_emb(x) if self.first else x
            cos, sin = m._rope(0, h.shape[1])
            aux = None
            for i in range(self.start, self.stop):
                h, mid = m.layers[i](h, cos, sin)
                if i + 1 in active:
                    # the exit temperature divides the logits on the training path only (EE-LLM)
                    ce = token_ce(m.exit_hidden(i + 1, h, mid) / temp[i + 1], m.head_weight(i + 1), target,
                                  obj.dynamic, obj.fused, obj.chunk_size)
                    self.exit_losses.setdefault(i + 1, []).append(ce.detach())
                    aux = w[i + 1] * ce if aux is None else aux + w[i + 1] * ce
            out = m.norm_f(h) if self.last else h
        return out if aux is None else _AttachLoss.apply(out, aux)


def final_loss_fn(model: nn.Module, objective: ExitLoss, amp: bool = False) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last stage's loss: the final head's token-mean CE on its normed hidden state."""

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            return token_ce(hidden, model.head_weight(model.num_layers), target, False, objective.fused, objective.chunk_size)

    return loss_fn


def shared_names(model: nn.Module, ranges: list[tuple[int, int]]) -> dict[str, list[int]]:
    """Parameters read by more than one stage (tied embeddings / heads) -> the stages holding them."""
    held: dict[str, list[int]] = {}
    for s, (a, b) in enumerate(ranges):
        for name in ("tok_emb", "lm_head"):
            if name in stage_modules(model, a, b):
                held.setdefault(f"{name}.weight", []).append(s)
    return {k: v for k, v in held.items() if len(v) > 1}


class TimedStage(PipelineStage):
    """A `PipelineStage` whose compute time (forward and backward chunks) is summed in `busy`, so
    that step time minus busy time is the stage's pipeline bubble."""

    busy = 0.0

    def forward_one_chunk(self, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return super().forward_one_chunk(*a, **k)
        finally:
            self.busy += _elapsed(t, self.device)

    def backward_one_chunk(self, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return super().backward_one_chunk(*a, **k)
        finally:
            self.busy += _elapsed(t, self.device)


def _elapsed(t0: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


@dataclass
class PipelineLayout:
    """Who runs what: `pp` stages x `dp` replicas; rank = replica * pp + stage position."""

    pp: int
    dp: int
    rank: int
    chunks: int = 1  # model chunks (stages) per rank: 2 for the interleaved schedule
    pp_group: Any = None
    dp_group: Any = None
    shared_groups: dict[str, Any] = field(default_factory=dict)

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp

    @property
    def n_stages(self) -> int:
        return self.pp * self.chunks

    def stage_ids(self) -> list[int]:
        """This rank's stages: pp_rank, pp_rank + pp, ... (the looped placement of interleaved 1F1B)."""
        return [self.pp_rank + j * self.pp for j in range(self.chunks)]


def make_layout(pp: int, chunks: int, model: nn.Module) -> PipelineLayout:
    """Process groups for `pp` stages x (world / pp) replicas, and for every tied weight the ranks of
    each replica that hold a copy of it. Collective: every rank calls it in the same order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lay = PipelineLayout(pp, world // pp, rank, chunks)
    for d in range(lay.dp):
        g = dist.new_group([d * pp + s for s in range(pp)])
        if d == lay.dp_rank:
            lay.pp_group = g
    for s in range(pp):
        g = dist.new_group([d * pp + s for d in range(lay.dp)])
        if s == lay.pp_rank:
            lay.dp_group = g
    ranges = split_points(model.num_layers, lay.n_stages)
    for name, stages in sorted(shared_names(model, ranges).items()):
        positions = sorted({s % pp for s in stages})
        if len(positions) < 2:
            continue  # every copy lives on one rank: one parameter, nothing to sum
        for d in range(lay.dp):
            g = dist.new_group([d * pp + p for p in positions])
            if d == lay.dp_rank and lay.pp_rank in positions:
                lay.shared_groups[name] = g
    return lay


class RankShard(nn.Module):
    """Every module this rank's stages hold, under the full model's names: the optimizer's
    parameters, and the state dict that checkpoints save and the consolidated model merges."""

    def __init__(self, stages: list[ExitStage]) -> None:
        super().__init__()
        for st in stages:
            for name, mod in st.named_children():
                if isinstance(mod, nn.ModuleDict) and hasattr(self, name):
                    getattr(self, name).update(mod)
                elif isinstance(mod, nn.ModuleDict):
                    self.add_module(name, nn.ModuleDict(dict(mod.items())))
                else:
                    self.add_module(name, mod)


class PipelineRunner:
    """This rank's pipeline stages and schedule for an EE-GPT; `step` runs one training step's
    forward and backward over `n_microbatches` and leaves the step's gradients in `shard`.

    Gradients end up as single-process training's: divided by the micro-batch count, summed over
    the copies of tied weights, averaged over data-parallel replicas."""

    def __init__(self, model: nn.Module, objective: ExitLoss, layout: PipelineLayout, schedule: str,
                 n_microbatches: int, microbatch_size: int, device: torch.device, amp: bool = False,
                 seq_len: int | None = None) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
        self.model, self.objective, self.layout, self.m = model, objective, layout, n_microbatches
        ranges = split_points(model.num_layers, layout.n_stages)
        self.stage_mods = [ExitStage(model, *ranges[s], objective, amp) for s in layout.stage_ids()]
        self.shard = RankShard(self.stage_mods)
        # the duplicates of tied weights that the global gradient norm must not count twice
        owners = {name: min(stages) for name, stages in shared_names(model, ranges).items()}
        self.norm_skip = {n for n in owners if owners[n] not in layout.stage_ids()}
        S, C = seq_len or model.seq_len, model.n_embd
        self.stages = []
        for s, mod in zip(layout.stage_ids(), self.stage_mods):
            # static shapes: the stage then skips a shape-inference forward (it would pop targets)
            hidden = torch.empty(microbatch_size, S, C, device=device, requires_grad=True)  # activations carry grads
            ex_in = torch.empty(microbatch_size, S, dtype=torch.long, device=device) if mod.first else hidden
            self.stages.append(TimedStage(mod, s, layout.n_stages, device, input_args=ex_in, output_args=hidden, group=layout.pp_group))
        self.seq_len, self.mb = S, microbatch_size
        loss_fn = self._timed(final_loss_fn(model, objective, amp))
        if schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(self.stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
        self.has_first = any(m.first for m in self.stage_mods)
        self.has_last = any(m.last for m in self.stage_mods)
        self.busy = 0.0

    def _timed(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def timed(*a: Any) -> torch.Tensor:
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                self.busy += _elapsed(t, a[0].device)

        return timed

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Forward and backward of one batch (this replica's); returns this rank's logs: the final
        CE (last stage), its exits' CEs, and `busy_s` / `step_s` for the bubble fraction."""
        if x.shape[1] != self.seq_len or x.shape[0] != self.mb * self.m:
            raise ValueError(f"pipeline stages are built for batches of [{self.mb * self.m}, {self.seq_len}] tokens, got {list(x.shape)}")
        for mod in self.stage_mods:
            mod.set_targets(y, self.m)
        for st in self.stages:
            st.busy = 0.0
        self.busy = 0.0
        for p in self.shard.parameters():
            p.grad = None
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        args = (x,) if self.has_first else ()
        self.schedule.step(*args, target=y if self.has_last else None, losses=losses if self.has_last else None,
                           return_outputs=False)
        step_s = _elapsed(t0, x.device)
        busy = self.busy + sum(st.busy for st in self.stages)
        logs: dict[str, float] = {"step_s": step_s, "busy_s": min(busy, step_s)}
        if self.has_last:
            logs["loss_final"] = float(torch.stack([l.detach().float() for l in losses]).mean())
        for mod in self.stage_mods:
            for k, ces in mod.exit_losses.items():
                logs[f"loss_exit{k}"] = float(torch.stack(ces).float().mean())
        self._finish_grads()
        return logs

    @torch.no_grad()
    def _finish_grads(self) -> None:
        """Micro-batch mean, sum over tied copies, mean over data-parallel replicas."""
        named = dict(self.shard.named_parameters())
        grads = [p.grad for p in named.values() if p.grad is not None]
        if self.m > 1:
            torch._foreach_div_(grads, float(self.m))
        for name, g in self.layout.shared_groups.items():
            p = named[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=g)
        if self.layout.dp > 1:
            grads = [p.grad for p in named.values() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.layout.dp_group)
            flat /= self.layout.dp
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """`torch.nn.utils.clip_grad_norm_` over the whole pipeline: the squared norms of every
        stage's gradients (tied copies counted once) summed over the stages."""
        named = dict(self.shard.named_parameters())
        grads = [p.grad for n, p in named.items() if p.grad is not None and n not in self.norm_skip]
        dev = next(iter(named.values())).device
        sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=dev)
        dist.all_reduce(sq, group=self.layout.pp_group)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        all_grads = [p.grad for p in named.values() if p.grad is not None]
        if all_grads:
            torch._foreach_mul_(all_grads, coef.to(all_grads[0].device))
        return float(total)

    @torch.no_grad()
    def eval_sums(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Summed CE of the exits on this rank's stages (the final head's as `loss`), as the `exits`
        objective's `evaluate` computes them: the stages run in order, each receiving the residual
        stream from the previous stage's rank and sending its own to the next."""
        m, lay = self.model, self.layout
        ranks = [lay.dp_rank * lay.pp + p for p in range(lay.pp)]  # this replica's ranks, by pipeline position
        out: dict[str, float] = {}
        for s, mod in zip(lay.stage_ids(), self.stage_mods):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mod.amp):
                if mod.first:
                    h = m.tok_emb(x)
                else:
                    h = torch.empty(*x.shape, m.n_embd, device=x.device)
                    dist.recv(h, src=ranks[(s - 1) % lay.pp])
                cos, sin = m._rope(0, x.shape[1])
                for i in range(mod.start, mod.stop):
                    h, mid = m.layers[i](h, cos, sin)
                    k = i + 1
                    if k in m.exit_layers:  # the final head is the last exit
                        logits = m.exit_hidden(k, h, mid) @ m.head_weight(k).T
                        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                        ce = torch.nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum")
                        out["loss" if k == m.num_layers else f"loss_exit{k}"] = float(ce)
                if not mod.last:
                    dist.send(h.float().contiguous(), dst=ranks[(s + 1) % lay.pp])
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (None elsewhere), merged from replica 0's stages."""
        own = {k: v.detach().cpu() for k, v in self.shard.state_dict().items()} if self.layout.dp_rank == 0 else {}
        parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None  # type: ignore[assignment]
        dist.gather_object(own, parts, dst=0)
        if dist.get_rank() != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for p in parts:
            merged.update(p)
        return merged
