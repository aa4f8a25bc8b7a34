"""efficient.accelerate: spikingjelly and snntorch models before vs after, equal spikes, outputs,
gradients (within 1e-5) and profiler counts, over several time steps and two consecutive calls.
spikingjelly runs the same layers on the same shapes before and after, so spikes and outputs are
compared exactly; snntorch's per-step GEMMs against multi_step's one over T*B rows within the
tolerances stated beside TIE."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import efficient
from efficient.accelerate import AcceleratedSequential

sj_neuron = pytest.importorskip("spikingjelly.activation_based.neuron")
snn = pytest.importorskip("snntorch")
from snntorch import surrogate as snn_surrogate  # noqa: E402
from snntorch import utils as snn_utils  # noqa: E402
from spikingjelly.activation_based import functional, layer, surrogate  # noqa: E402

T = 4
# the uncompiled fused loop keeps these tests quick; the compiled loop ("auto" on CPU) runs the same
# code through inductor and is checked against the libraries in the `*_compiled` cases
BACKEND = "loop"


def _spike_recorder(model: nn.Module, kinds: tuple) -> list:
    out: list = []
    for m in model.modules():
        if isinstance(m, kinds):
            m.register_forward_hook(lambda mod, inp, o: out.append((o[0] if isinstance(o, tuple) else o).detach()))
    return out


def _grads(model: nn.Module, x: torch.Tensor) -> dict:
    g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    g["<input>"] = x.grad.clone()
    return g


def _assert_same(before: dict, after: dict, out_b, out_a, spikes_b: list, spikes_a: list) -> None:
    assert len(spikes_b) == len(spikes_a) > 0
    for sb, sa in zip(spikes_b, spikes_a):
        assert torch.equal(sb, sa)
    assert torch.equal(out_b, out_a)
    assert before.keys() == after.keys() and len(before) > 1
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=1e-5, atol=1e-5, msg=k)


def _run_sj(model, x, calls: int, reset: bool):
    """`calls` calls. With `reset`: forward+backward per call, reset_net after each (training steps).
    Without: the membrane carries over, and one backward runs through all calls (and the carried state)."""
    outs, grads, loss = [], [], 0.0
    xs = [x.clone().requires_grad_() for _ in range(calls)]
    model.zero_grad()
    for xi in xs:
        y = model(xi)
        loss = loss + (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
        outs.append(y.detach())
        if reset:
            loss.backward()
            grads.append(_grads(model, xi))
            functional.reset_net(model)
            model.zero_grad()
            loss = 0.0
    if not reset:
        loss.backward()
        grads = [{**_grads(model, xs[0]), "<input 2>": xs[1].grad.clone()}] * calls
    return outs, grads


def _compare_sj(model: nn.Module, x: torch.Tensor, reset: bool = True, expect_replaced: int = 1,
                backend: str = BACKEND) -> None:
    before = model
    after, report = efficient.accelerate(copy.deepcopy(model), backend=backend)
    assert len(report.replaced) >= expect_replaced and not report.skipped, str(report)
    kinds = (sj_neuron.BaseNode,)
    sb, sa = _spike_recorder(before, kinds), _spike_recorder(after, kinds)
    ob, gb = _run_sj(before, x, 2, reset)
    oa, ga = _run_sj(after, x, 2, reset)
    for i in range(2):
        _assert_same(gb[i], ga[i], ob[i], oa[i], sb, sa)


def test_spikformer_cifar10_is_unchanged():
    from spikingjelly.activation_based.model.spikformer import spikformer_cifar10

    torch.manual_seed(0)
    model = spikformer_cifar10(T=2)
    x = torch.rand(2, 3, 32, 32)
    _compare_sj(model, x, expect_replaced=10, backend="auto")


def _sj_conv(neuron_fn) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        layer.Conv2d(2, 8, 3, padding=1), layer.BatchNorm2d(8), neuron_fn(),
        layer.MaxPool2d(2), layer.Conv2d(8, 8, 3, padding=1), neuron_fn(),
        layer.Flatten(), layer.Linear(8 * 4 * 4, 10), neuron_fn(),
    )
    functional.set_step_mode(net, "m")
    return net


SJ_NEURONS = {
    "lif-hard-sigmoid": lambda: sj_neuron.LIFNode(tau=2.0, surrogate_function=surrogate.Sigmoid(alpha=3.0)),
    "lif-soft-atan-detach-nodecay": lambda: sj_neuron.LIFNode(
        tau=3.0, v_reset=None, detach_reset=True, decay_input=False, surrogate_function=surrogate.ATan()),
    "lif-vreset-triangle": lambda: sj_neuron.LIFNode(
        tau=1.5, v_threshold=0.7, v_reset=-0.2, surrogate_function=surrogate.PiecewiseQuadratic(alpha=1.5)),
    "plif": lambda: sj_neuron.ParametricLIFNode(init_tau=2.5, detach_reset=True),
    "plif-soft-nodecay": lambda: sj_neuron.ParametricLIFNode(v_reset=None, decay_input=False,
                                                              surrogate_function=surrogate.ATan(alpha=2.5)),
    "if": lambda: sj_neuron.IFNode(surrogate_function=surrogate.ATan()),
    "if-soft-store-v-seq": lambda: sj_neuron.IFNode(v_reset=None, store_v_seq=True),
}


@pytest.mark.parametrize("name", list(SJ_NEURONS))
@pytest.mark.parametrize("reset", [True, False], ids=["reset_net", "state-carried"])
def test_spikingjelly_conv_snn_is_unchanged(name, reset):
    net = _sj_conv(SJ_NEURONS[name])
    x = torch.rand(T, 2, 2, 8, 8) * 2
    _compare_sj(net, x, reset=reset, expect_replaced=3)


def test_plif_keeps_parameter_names_and_objects():
    net = _sj_conv(SJ_NEURONS["plif"])
    names = [n for n, _ in net.named_parameters()]
    params = list(net.parameters())
    out, report = efficient.accelerate(net)
    assert out is net and [n for n, _ in net.named_parameters()] == names
    assert all(a is b for a, b in zip(net.parameters(), params))
    assert "2.w" in names and isinstance(net[2], sj_neuron.ParametricLIFNode)
    assert set(net.state_dict()) == set(_sj_conv(SJ_NEURONS["plif"]).state_dict())


def test_spikingjelly_refusals_are_reported():
    net = nn.Sequential(
        sj_neuron.LIFNode(step_mode="s"),
        sj_neuron.LIFNode(step_mode="m", surrogate_function=surrogate.PiecewiseExp()),
        sj_neuron.LIFNode(step_mode="m", surrogate_function=surrogate.Sigmoid(spiking=False)),
        sj_neuron.LIFNode(step_mode="m"),
    )
    _, report = efficient.accelerate(net)
    why = {s.path: s.reason for s in report.skipped}
    assert [r.path for r in report.replaced] == ["3"]
    assert "single-step" in why["0"] and "PiecewiseExp" in why["1"] and "spiking=False" in why["2"]
    assert type(net[0]) is sj_neuron.LIFNode


# --- snntorch --------------------------------------------------------------------------------


def _snn_mlp(reset: str, per_neuron: bool) -> nn.Sequential:
    torch.manual_seed(0)
    beta = torch.linspace(0.5, 0.95, 32) if per_neuron else torch.tensor(0.85)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(2 * 8 * 8, 32),
        snn.Leaky(beta=beta, learn_beta=True, init_hidden=True, reset_mechanism=reset),
        nn.Linear(32, 10),
        snn.Leaky(beta=0.9, learn_beta=True, learn_threshold=True, threshold=0.8, init_hidden=True, output=True,
                  reset_mechanism=reset, spike_grad=snn_surrogate.sigmoid(slope=5)),
    )


def _snn_conv(reset: str, per_neuron: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1), nn.MaxPool2d(2),
        snn.Leaky(beta=0.8, learn_beta=True, init_hidden=True, reset_mechanism=reset),
        nn.Conv2d(8, 8, 3, padding=1),
        snn.Leaky(beta=torch.full((8, 4, 4), 0.7) if per_neuron else 0.7, learn_beta=True, init_hidden=True,
                  reset_mechanism=reset, spike_grad=snn_surrogate.atan(alpha=3.0)),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 10),
        snn.Leaky(beta=0.9, learn_beta=True, init_hidden=True, output=True, reset_mechanism=reset),
    )


def _snn_loop(net: nn.Module, x: torch.Tensor):
    """The snntorch idiom: reset, then one call per time step; (spikes [T, ...], membrane [T, ...])."""
    snn_utils.reset(net)
    spk, mem = zip(*(net(x[t]) for t in range(x.shape[0])))
    return torch.stack(spk), torch.stack(mem)


def _snn_multi(net: AcceleratedSequential, x: torch.Tensor):
    snn_utils.reset(net)
    return net.multi_step(x)


class _HiddenTrace:
    """Records, for every hidden (non-output) Leaky of a stack, the spikes it passes on (the input of
    the step-wise layer after it: its hook fires per step and inside multi_step alike) and, when
    snntorch's per-step forward runs, the membrane each step fired from. `take()` returns
    {index: (spikes [T*B, ...], membrane [T*B, ...] or None, threshold)} and starts afresh."""

    def __init__(self, net: nn.Sequential):
        kids = list(net)
        self.leaky = {i: k for i, k in enumerate(kids) if isinstance(k, snn.Leaky) and not k.output}
        self.spk: dict = {i: [] for i in self.leaky}
        self.mem: dict = {i: [] for i in self.leaky}
        self.handles = []
        for i, k in self.leaky.items():
            self.handles.append(kids[i + 1].register_forward_pre_hook(
                lambda m, inp, i=i: self.spk[i].append(inp[0].detach().clone())))
            self.handles.append(k.register_forward_hook(
                lambda m, inp, out, i=i: self.mem[i].append(m.mem.detach().clone())))

    def take(self) -> dict:
        out = {i: (torch.cat(self.spk[i]), torch.cat(self.mem[i]) if self.mem[i] else None,
                   k.threshold.detach().clone()) for i, k in self.leaky.items()}
        for i in self.leaky:
            self.spk[i].clear()
            self.mem[i].clear()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _run_snn(net, x, fn):
    out = []
    trace = _HiddenTrace(net)
    try:
        for _ in range(2):  # two consecutive calls (training steps)
            net.zero_grad()
            xi = x.clone().requires_grad_()
            spk, mem = fn(net, xi)
            ((spk * 0.7 + mem * torch.linspace(-1, 1, mem.numel()).view_as(mem)).sum()).backward()
            out.append((spk.detach(), mem.detach(), _grads(net, xi), trace.take()))
    finally:
        trace.remove()
    return out


# snntorch steps one [B, in] GEMM per time step, multi_step one [T*B, in] GEMM: the BLAS may block
# the two row counts differently, so pre-activations (and membranes) can differ in the last bits and
# a membrane within an ulp of threshold can fire in one run and not the other. Spikes must agree
# wherever the reference membrane is further than TIE from threshold (ulp-level differences stay
# many orders below it); a batch sample with a spike flipped at a tie leaves the membrane and
# gradient comparison, since a flip changes everything downstream of it.
TIE = 1e-4
# membranes: a few fp32 ulps of pre-activation, carried through T steps of leak, stay far below this;
# a wrong leak, threshold or reset moves them by orders of magnitude more
MEM_TOL = dict(rtol=1e-5, atol=1e-5)


def _tie_flips(s_ref, s_got, mem_ref, thr, T_: int, B_: int) -> torch.Tensor:
    """[B] mask of samples with a spike flipped at a threshold tie; fails on a flip away from one."""
    s_ref, s_got, mem_ref = (t.reshape(T_, B_, -1) for t in (s_ref, s_got, mem_ref))
    diff = s_ref != s_got
    away = (mem_ref - thr).abs() > TIE
    assert not (diff & away).any(), f"{int((diff & away).sum())} spike(s) differ away from threshold"
    return diff.any(0).any(-1)


def _assert_snn_agree(net, ref: tuple, got: tuple) -> None:
    """ref: snntorch's per-step run, got: multi_step; each (spikes, membrane, grads or None, hidden
    trace). Hidden and output spikes agree away from threshold ties; membranes of samples without a
    tie flip agree within MEM_TOL; gradients (summed over the batch) within 1e-5 when nothing flipped.
    Still catches a wrong leak / threshold / reset / surrogate (spikes away from ties, membranes or
    gradients), a GEMM on the wrong rows, or state lost between steps or calls."""
    sb, mb, gb, hb = ref
    sa, ma, ga, ha = got
    assert sb.shape == sa.shape and mb.shape == ma.shape and hb.keys() == ha.keys()
    T_, B_ = mb.shape[:2]
    flipped = torch.zeros(B_, dtype=torch.bool)
    for i, (s_ref, m_ref, thr) in hb.items():
        assert ha[i][0].shape == s_ref.shape and m_ref is not None
        flipped |= _tie_flips(s_ref, ha[i][0], m_ref, thr, T_, B_)
    flipped |= _tie_flips(sb, sa, mb, net[-1].threshold.detach(), T_, B_)
    keep = ~flipped
    assert keep.any(), "every sample had a spike flipped at a threshold tie: nothing left to compare"
    torch.testing.assert_close(ma[:, keep], mb[:, keep], **MEM_TOL)
    if gb is not None and not flipped.any():
        assert gb.keys() == ga.keys()
        for k in gb:
            torch.testing.assert_close(ga[k], gb[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("reset", ["subtract", "zero", "none"])
@pytest.mark.parametrize("build", [_snn_mlp, _snn_conv], ids=["mlp", "conv"])
@pytest.mark.parametrize("per_neuron", [False, True], ids=["scalar-beta", "per-neuron-beta"])
def test_snntorch_net_is_unchanged(build, reset, per_neuron, backend=BACKEND):
    before = build(reset, per_neuron)
    after, report = efficient.accelerate(copy.deepcopy(before), backend=backend)
    assert not report.skipped, str(report)
    assert isinstance(after, AcceleratedSequential) and isinstance(after[-1], snn.Leaky)
    x = torch.rand(T, 2, 2, 8, 8) * 1.5
    rb, ra = _run_snn(before, x, _snn_loop), _run_snn(after, x, _snn_multi)
    for ref, got in zip(rb, ra):
        _assert_snn_agree(before, ref, got)
    # per-step calls stay snntorch's step, the same computation on the same shapes: equal bits
    s1, m1 = _snn_loop(before, x)
    s2, m2 = _snn_loop(after, x)
    assert torch.equal(s1, s2) and torch.equal(m1, m2)


def test_snntorch_net_is_unchanged_compiled():
    test_snntorch_net_is_unchanged(_snn_conv, "zero", True, backend="auto")


def test_snntorch_state_continues_across_multi_step_calls():
    """Two multi_step calls without reset equal one run over both halves (state carried)."""
    net = _snn_mlp("subtract", True)
    after, _ = efficient.accelerate(copy.deepcopy(net), backend=BACKEND)
    x = torch.rand(6, 2, 2, 8, 8) * 1.5
    ref_trace, got_trace = _HiddenTrace(net), _HiddenTrace(after)
    s_all, m_all = _snn_loop(net, x)
    snn_utils.reset(after)
    s1, m1 = after.multi_step(x[:3])
    s2, m2 = after.multi_step(x[3:])
    ref = (s_all, m_all, None, ref_trace.take())
    got = (torch.cat([s1, s2]), torch.cat([m1, m2]), None, got_trace.take())
    # a state dropped between the calls would reset the membrane at step 3: far beyond the tolerance
    _assert_snn_agree(net, ref, got)


def test_snntorch_parameters_keep_names():
    net = _snn_mlp("zero", True)
    names = [n for n, _ in net.named_parameters()]
    efficient.accelerate(net)
    assert [n for n, _ in net.named_parameters()] == names and "2.beta" in names and "4.threshold" in names


def test_snntorch_refusals_are_reported():
    class Stepper(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.lif = snn.Leaky(beta=0.9)
            self.syn = snn.Synaptic(alpha=0.8, beta=0.9)
            self.fast = snn.Leaky(beta=0.9, spike_grad=snn_surrogate.fast_sigmoid())
            self.stack = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), snn.Leaky(beta=0.5, init_hidden=True))

    m = Stepper()
    _, report = efficient.accelerate(m)
    why = {s.path: s.reason for s in report.skipped}
    assert "two states" in why["syn"] and "fast_sigmoid" in why["fast"] and "per-step" in why["stack"]
    assert {r.path for r in report.replaced} == {"lif", "stack.2"}
    assert "stack" in str(report) and "BatchNorm1d" in why["stack"]


# --- profiler --------------------------------------------------------------------------------


class _Loop(nn.Module):
    """A per-step snntorch stack driven over time (before), or its multi-step run (after)."""

    def __init__(self, net: nn.Module, multi: bool):
        super().__init__()
        self.net, self.multi = net, multi

    def forward(self, x):
        return (_snn_multi if self.multi else _snn_loop)(self.net, x)[0]


def _counts(model, x):
    r = efficient.profile(model, inputs=x)
    return {k: r.totals[k] for k in ("dense_macs", "macs", "sops", "params")}


def test_profiler_counts_are_unchanged():
    x = torch.rand(T, 2, 2, 8, 8) * 2
    net = _sj_conv(SJ_NEURONS["plif"])
    before = _counts(net, x)
    functional.reset_net(net)
    efficient.accelerate(net, backend=BACKEND)
    assert _counts(net, x) == before and before["dense_macs"] > 0
    snet = _snn_conv("subtract", False)
    before = _counts(_Loop(snet, False), x)
    efficient.accelerate(snet, backend=BACKEND)
    after = _counts(_Loop(snet, True), x)
    assert {k: v for k, v in after.items() if k != "sops"} == {k: v for k, v in before.items() if k != "sops"}
    # sops count spikes: a spike flipped at a threshold tie (per-step vs [T*B]-row GEMMs, see TIE)
    # moves them by its fan-out (<= 72 here, ~1 %); counting a layer twice or missing one moves them by far more
    assert before["sops"] > 0 and abs(after["sops"] - before["sops"]) <= 0.02 * before["sops"]


# ------------------------------------------------------------------ one graph: what CUDA-graph replay needs


def _compiled_steps_equal_eager(build, fwd, reset, x: torch.Tensor, steps: int = 3) -> None:
    """`fwd(model, x)` -> output, for two models from `build()` (equal, seeded): 0 graph breaks over
    forward + loss, and `steps` training steps (reset, forward, loss, backward, SGD update) through
    torch.compile(fullgraph=True) give eager's losses and gradients. (Built twice, not copied:
    snntorch resets only the neurons its constructor registered.)"""
    def loss_of(f, m):
        y = f(m, x)
        return (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()

    model, twin = build(), build()
    reset(model)
    explained = torch._dynamo.explain(lambda: loss_of(fwd, model))()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    compiled = torch.compile(fwd, backend="aot_eager", fullgraph=True)
    for _ in range(steps):
        results = []
        for m, f in ((model, fwd), (twin, compiled)):
            reset(m)
            m.zero_grad()
            loss = loss_of(f, m)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
        (le, ge), (lc, gc) = results
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-5)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # the same update on both, so later steps start from new weights
            for p, q in zip(model.parameters(), twin.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad


@pytest.mark.parametrize("name", ["lif-hard-sigmoid", "plif"])
def test_accelerated_spikingjelly_net_compiles_to_one_graph(name):
    _compiled_steps_equal_eager(lambda: efficient.accelerate(_sj_conv(SJ_NEURONS[name]), backend=BACKEND)[0],
                                lambda m, x: m(x), functional.reset_net, torch.rand(T, 2, 2, 8, 8) * 2)


def test_accelerated_snntorch_net_compiles_to_one_graph():
    """Also: the multi-step Leaky reads nothing on the host (its graded-spike factor stays a tensor)."""
    _compiled_steps_equal_eager(lambda: efficient.accelerate(_snn_conv("subtract", True), backend=BACKEND)[0],
                                lambda m, x: m.multi_step(x)[0], snn_utils.reset, torch.rand(T, 2, 2, 8, 8) * 1.5)
