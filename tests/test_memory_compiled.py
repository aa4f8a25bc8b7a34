"""Memory level `recompute` under `torch.compile`: the partitioner keeps each region's input (an
opaque copy, `recompute.region_input`, or its bits where it is spikes) so every region reruns from
its own input, and the compiled step trains as the eager one does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from efficient import memory
from efficient.zoo import create


def _tiny_spikformer() -> torch.nn.Module:
    torch.manual_seed(0)
    return create("spikformer-4-384", embed_dim=32, num_heads=2, depth=1).train()


def _backward_inputs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[tuple[str, torch.Size]]:
    """(name, shape) of what the compiled backward takes from the forward, as inductor's partitioner
    splits the step (the graphs run uncompiled)."""
    saved: list[tuple[str, torch.Size]] = []

    def keep(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        return gm

    def backward(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        saved.extend((n.name, n.meta["val"].shape) for n in gm.graph.nodes
                     if n.op == "placeholder" and not n.name.startswith("tangents") and isinstance(n.meta.get("val"), torch.Tensor))
        return gm

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=backward, partition_fn=min_cut_rematerialization_partition)
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        F.cross_entropy(torch.compile(model, backend=backend, fullgraph=True)(x), y)
    torch._dynamo.reset()
    return saved


def test_compiled_regions_rerun_from_their_own_inputs() -> None:
    """Every stem unit after the first (stages 0 and 1 are one: `group_stages`) keeps its input (the
    stage before's spikes) for backward, as bits, so no stage is recomputed from the image and no stage
    input is kept in fp32; each half of the block keeps its input as uint8 counts. Level none keeps neither."""
    from efficient.kernels.spike_pack import packed_nbytes

    model = _tiny_spikformer()
    x, y = torch.rand(2, 3, 32, 32), torch.tensor([1, 7])
    stage_shapes = []
    hooks = [conv.register_forward_hook(lambda m, i, o: stage_shapes.append(o.shape)) for conv in model.patch_embed.convs]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    plan = memory.optimize(model, "recompute")
    assert [u for u in plan.units if "patch_embed" in u] == [f"patch_embed.{p}" for p in ("stage0-1", "stage2", "stage3", "rpe")]
    saved = _backward_inputs(model, x, y)
    bits = [shape.numel() for name, shape in saved if name.startswith("pack_spikes")]
    # stage 1 spikes at its conv's resolution (its spikes are stage 2's input); stages 2 and 3 max-pool
    # theirs first, so units stage2, stage3 and rpe keep 3 inputs as bits; stage 0's spikes stay inside
    # the first unit
    pooled = [shape.numel() // 4 for shape in stage_shapes[2:]]  # a 2x2-stride max-pool quarters the map
    assert sorted(bits) == sorted(packed_nbytes(n) for n in [stage_shapes[1].numel(), *pooled]), bits
    assert not [name for name, shape in saved if shape in stage_shapes[:2]], saved
    # the inputs of the block's halves (the block's own and the stream after its attention), sums of spikes,
    # as uint8 counts; nothing else is copied
    assert [shape for name, shape in saved if name.startswith("region_counts")] == [torch.Size([4, 2, 64, 32])] * 2, saved
    assert not [name for name in saved if name[0].startswith("region_input")], saved
    memory.optimize(model, "none")
    assert not [n for n, _ in _backward_inputs(model, x, y) if n.startswith(("region_input", "region_counts", "pack_spikes"))]


def test_spikformer_blocks_vouch_only_for_counts_their_inputs_hold() -> None:
    """A compiled region keeps the input of a Spikformer block's halves as uint8 because the model says it
    is a count of spikes: its inputs are whole numbers from 0 to the stated bound; a STATA model (anchor,
    fused tokens) says nothing."""
    torch.manual_seed(0)
    model = create("spikformer-4-384", embed_dim=32, num_heads=2, depth=3).train()
    assert [b.recompute_count_bound for b in model.blocks] == [2, 4, 6]
    assert [b.mlp.recompute_count_bound for b in model.blocks] == [3, 5, 7]  # the stream after the attention
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.append((m.recompute_count_bound, a[0].detach())))
             for b in model.blocks for m in (b, b.mlp)]
    model(torch.randn(4, 3, 32, 32) * 3)
    for h in hooks:
        h.remove()
    assert len(seen) == 6
    for bound, x in seen:
        assert torch.equal(x, x.round()) and x.min() >= 0 and x.max() <= bound
    assert max(float(x.max()) for _, x in seen) >= 2  # the counts are not just spikes
    stata = create("spikformer-stata", embed_dim=32, num_heads=2, depth=4).train()
    assert [(b.recompute_count_bound, b.mlp.recompute_count_bound) for b in stata.blocks] == [(None, None)] * 4


def test_region_counts_rebuild_the_input_exactly() -> None:
    """The kept uint8 counts give back the fp32 and bf16 input bit for bit (whole numbers to 255),
    and the rebuilt input's gradient is the input's."""
    from efficient.memory.recompute import _from_counts, counts_to, region_counts

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randint(0, 256, (3, 5)).to(dtype).requires_grad_()
        counts = region_counts(x.detach())
        assert counts.dtype == torch.uint8
        back = _from_counts(lambda t: t, counts, x)  # a region whose unit returns its input
        assert back.dtype == dtype and torch.equal(back, x)
        g = torch.randn(3, 5).to(dtype)
        back.backward(g)
        assert torch.equal(x.grad, g)
    torch.library.opcheck(region_counts, (torch.randint(0, 9, (4, 3)).float(),))
    torch.library.opcheck(counts_to, (torch.randint(0, 9, (4, 3), dtype=torch.uint8), torch.float32))


def test_region_input_is_a_copy_with_the_gradient_passed_through() -> None:
    from efficient.memory.recompute import region_input

    x = torch.randn(3, 4, requires_grad=True)
    out = region_input(x)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    g = torch.randn(3, 4)
    out.backward(g)
    assert torch.equal(x.grad, g)
    torch.library.opcheck(torch.ops.efficient.region_input.default, (torch.randn(2, 5, requires_grad=True),))


def _ops_of_compiled_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list, list]:
    """The custom ops (with their arguments) of the compiled forward and backward graphs of one step."""
    graphs: dict[str, list] = {"fw": [], "bw": []}

    def grab(key: str):
        def compiler(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
            for n in gm.graph.nodes:  # a mutating op reaches the graph functionalized: auto_functionalized(op, ...)
                target = n.args[0] if "auto_functionalized" in str(n.target) else n.target
                if n.op == "call_function" and "efficient" in str(target):
                    graphs[key].append((target, n.args))
            return gm
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=grab("fw"), bw_compiler=grab("bw"), partition_fn=min_cut_rematerialization_partition)
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        F.cross_entropy(torch.compile(model, backend=backend, fullgraph=True)(x), y)  # backward compiled here
    torch._dynamo.reset()
    return graphs["fw"], graphs["bw"]


def test_compiled_regions_run_the_fused_unit_that_rebuilds_its_trace(monkeypatch) -> None:
    """Inside a compiled region a BatchNorm + LIF pair runs as the fused op whose backward rebuilds
    the membrane trace a chunk at a time, and a stem stage's BatchNorm + LIF + max-pool as the
    chunked op pair (as the eager rerun does), so the rerun never holds the whole trace; outside a
    region (level none) the compiler sees the BatchNorm and the LIF apart."""
    from efficient.kernels import bn_lif

    monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", 256)  # the tiny units count as large ones
    model = _tiny_spikformer()
    x, y = torch.rand(2, 3, 32, 32), torch.tensor([1, 7])
    fw, bw = _ops_of_compiled_step(model, x, y)
    assert not [t for t, _ in fw if "bn_lif" in str(t)], fw
    memory.optimize(model, "recompute")
    fw, bw = _ops_of_compiled_step(model, x, y)
    fused = [args for t, args in fw + bw if t is torch.ops.efficient.bn_lif_forward.default]
    assert fused and all(args[-1] is False for args in fused), [a[-1] for a in fused]  # keep_membrane False
    assert any(t is torch.ops.efficient.bn_lif_backward_recompute.default for t, _ in bw), bw
    assert not [t for t, _ in bw if t is torch.ops.efficient.bn_lif_backward.default]
    # the stem stages that max-pool their spikes run BatchNorm, LIF and pool as one chunked op pair
    assert any(t is torch.ops.efficient.bn_lif_max_pool_forward.default for t, _ in fw), fw
    # ... whose backward writes z's gradient into the rerun's z (a plain convolution's output)
    assert any(t is torch.ops.efficient.bn_lif_max_pool_backward_into.default for t, _ in bw), bw
    assert not [t for t, _ in bw if t is torch.ops.efficient.bn_lif_max_pool_backward.default], bw
    # the units whose input is spikes (the stem's after its first, stages 0 and 1 together) run their
    # convolution's backward from the bits the region keeps, a slice of the batch at a time, not from
    # the rerun's fp32 input
    from_bits = [t for t, _ in bw if t is torch.ops.efficient.conv2d_backward_from_bits.default]
    assert len(from_bits) == 3, bw
    memory.optimize(model, "none")  # the regions' marks go with the level
    fw, bw = _ops_of_compiled_step(model, x, y)
    assert not [t for t, _ in fw if "bn_lif" in str(t)], fw
    assert not [t for t, _ in bw if "conv2d_backward_from_bits" in str(t)], bw


@pytest.mark.slow
@pytest.mark.parametrize("arch,chunk", [("spikformer-4-384", None), ("spikformer-4-384", 256), ("sdt-2-512", 256)])
def test_a_compiled_recompute_step_equals_the_eager_none_step(arch, chunk, monkeypatch) -> None:
    """Inductor's step at level recompute: the loss and every gradient of the eager step at level
    none, within rounding (inductor fuses and reorders sums); also with chunks small enough that the
    regions' fused units rebuild their traces in backward, and on SDT (its stem's tail and its
    blocks' halves are regions too)."""
    if chunk is not None:
        from efficient.kernels import bn_lif

        monkeypatch.setattr(bn_lif, "RECOMPUTE_CHUNK", chunk)
    torch.manual_seed(0)
    model = create(arch, embed_dim=32, num_heads=2, depth=1).train()
    x, y = torch.rand(2, 3, 32, 32), torch.tensor([1, 7])
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    memory.optimize(model, "recompute")
    torch._dynamo.reset()
    compiled = torch.compile(model)
    got = F.cross_entropy(compiled(x), y)
    got.backward()
    torch._dynamo.reset()
    assert float(got.detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
    for k, g in ref.items():
        p = dict(model.named_parameters())[k]
        assert torch.allclose(p.grad, g, rtol=1e-3, atol=1e-5), k


@pytest.mark.slow
def test_a_compiled_recompute_run_trains_as_the_eager_one(tmp_path) -> None:
    """`train.compile: default` with `train.memory: recompute` on the digits STATA recipe (the level
    applied before compiling): every logged loss and kept-token count of the eager recompute run,
    within rounding."""
    from test_memory import _train

    eager = _train(tmp_path / "eager", "recompute", ["train.max_steps=8", "train.log_every=1"])
    compiled = _train(tmp_path / "compiled", "recompute", ["train.max_steps=8", "train.log_every=1", "train.compile=default"])
    assert compiled[0]["compile"] == "default" and compiled[0]["memory"]["level"] == "recompute"
    steps = lambda logs: [r for r in logs if "loss" in r and r.get("split") != "val"]  # noqa: E731
    e, c = steps(eager[2]), steps(compiled[2])
    assert len(e) == len(c) == 8
    assert [r["loss"] for r in c] == pytest.approx([r["loss"] for r in e], rel=1e-4, abs=1e-5)
    kept = lambda rows: [{k: v for k, v in r.items() if "kept" in k or "tokens" in k} for r in rows]  # noqa: E731
    assert kept(c) == kept(e)


@pytest.mark.parametrize("name", ["spikformer-tiny-stata", "sdt-v2-tiny", "sdt-v2-tiny-stata", "qkformer-tiny-stata",
                                  "spikingformer-tiny-stata"])
def test_compiled_regions_update_buffers_once_and_rerun_what_forward_ran(name: str) -> None:
    """Two SGD steps at level recompute, compiled (aot_eager: the graphs as traced, no code generated),
    against eager level none: the same losses and gradients, and BatchNorm's running statistics and batch
    counts updated once per step. STATA's pruning records its scores outside its block's region: dynamo is
    told that backward does not replay that (otherwise the region falls back to eager checkpoint, which
    replays BatchNorm's updates: batch counts doubled). Meta-SpikeFormer's RepConv reads its BatchNorm's
    running statistics after their update, which a compiled rerun would read updated once more: its unit
    runs as a plain call (gradients were 1.6 % of the largest off)."""
    from efficient.models.progress import inform_progress

    def run(level: str, compiled: bool):
        torch.manual_seed(0)
        model = create(name, timesteps=2).train()
        inform_progress(model, 100.0)
        memory.optimize(model, level)
        f = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        losses, grads = [], []
        for _ in range(2):
            x, y = torch.rand(2, 1, 16, 16, generator=g), torch.randint(0, 10, (2,), generator=g)
            out = f(x)
            loss = F.cross_entropy(out[0] if isinstance(out, tuple) else out, y)
            opt.zero_grad()
            loss.backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
            opt.step()
            losses.append(float(loss.detach()))
        torch._dynamo.reset()
        return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}

    ref, got = run("none", False), run("recompute", True)
    assert got[0] == pytest.approx(ref[0], rel=1e-6)
    for step in range(2):
        for k, g in ref[1][step].items():
            assert torch.allclose(got[1][step][k], g, rtol=1e-4, atol=1e-6), (step, k)
    for k, v in ref[2].items():
        if "num_batches_tracked" in k:
            assert torch.equal(got[2][k], v), k
        else:
            assert torch.allclose(got[2][k], v, rtol=1e-4, atol=1e-6), k
