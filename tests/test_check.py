"""`efficient check`: each planted bug (a neuron fed `[T*B, ...]`, a neuron that keeps its membrane,
a flip over time, a layer without surrogate gradient, graded "spikes", silent and saturated layers)
is caught by its check and the twin model without it passes; every zoo model passes; spikingjelly's
and snntorch's tutorial networks run through it; the CLI prints a table or JSON and exits 1 on a FAIL.

Margins: a check FAILs above RTOL (1e-4) relative change. The healthy models here change by exactly
0 (the same arithmetic on the same values; rounding never enters), and the bugs by 0.1 or more, so
the assertions sit three orders of magnitude from the threshold on either side.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import zoo_reference as zr
from torch import nn

import efficient
from efficient.checks import RTOL, CheckReport, check
from efficient.cli import main
from efficient.errors import ConfigError
from efficient.models.neurons import LIF
from efficient.models.stata import find_pruner

T = 4
BUG = 1e3 * RTOL  # a planted bug moves what it touches by at least this much (relative)
CLEAN = 1e-3 * RTOL  # a model without it by at most this much


class Net(nn.Module):
    """conv -> BN -> LIF -> (mid) -> linear -> LIF -> linear on `[B, 1, 8, 8]`, repeated over T
    inside (time-major), averaged over T at the end. `mid` and `neuron2` plant the bugs."""

    def __init__(self, mid: nn.Module | None = None, neuron2: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.timesteps = T
        self.conv, self.bn = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.lif1 = LIF(backend="torch")
        self.mid = mid or nn.Identity()
        self.fc = nn.Linear(8 * 8 * 8, 32)
        self.lif2 = neuron2 or LIF(backend="torch")
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(0).expand(T, *x.shape) if x.dim() == 4 else x  # [B, ...] or time-major [T, B, ...]
        y = self.bn(self.conv(x.flatten(0, 1))).unflatten(0, (T, -1))
        s = self.mid(self.lif1(y * 3))
        return self.head(self.lif2(self.fc(s.flatten(2)) * 8)).mean(0)


class FlattenedLIF(nn.Module):
    """QKFormer issue 14: a multi-step neuron called on `[T*B, ...]` takes the batch for time, so
    each sample starts from the membrane the previous sample left."""

    def __init__(self) -> None:
        super().__init__()
        self.lif = LIF(backend="torch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lif(x.flatten(0, 1)).reshape(x.shape)


class Flip(nn.Module):
    """Reverses time: step 0 sees the last step's input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(0)


class KeepsMembrane(LIF):
    """A neuron that starts each call from half the last call's final input (never reset)."""

    def __init__(self) -> None:
        super().__init__(backend="torch")
        self.v: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, return_membrane: bool = False):
        if self.v is not None and self.v.shape == x.shape[1:]:
            x = torch.cat([x[:1] + self.v, x[1:]])
        self.v = x[-1].detach() * 0.5
        return super().forward(x, return_membrane)


class _HeavisideZeroGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return (x >= 1).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(g)


class ZeroSurrogate(LIF):
    """Spikes with a backward that is zero everywhere (an integrate-and-fire without decay)."""

    def forward(self, x: torch.Tensor, return_membrane: bool = False):
        return _HeavisideZeroGrad.apply(x.cumsum(0) / 2)


class NoSurrogate(LIF):
    """Spikes by a comparison: no gradient at all."""

    def forward(self, x: torch.Tensor, return_membrane: bool = False):
        return (x.cumsum(0) / 2 >= 1).to(x.dtype)


class Graded(LIF):
    """"Spikes" of 2: the ops after it read non-binary values."""

    def forward(self, x: torch.Tensor, return_membrane: bool = False):
        return super().forward(x) * 2


def _data() -> torch.Tensor:
    return torch.rand(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))


def _only_fails(report: CheckReport, cid: str) -> None:
    failed = [r.id for r in report.failed]
    assert failed == [cid], str(report)
    assert report[cid].value is not None and report[cid].value > 0


def test_the_healthy_twin_passes_every_check_with_nothing_moved() -> None:
    report = check(Net(), _data())
    assert report.passed, str(report)
    assert [r.status for r in report.results] == ["PASS"] * 6, str(report)
    for cid in ("batch", "state", "causality"):
        assert report[cid].value <= CLEAN, str(report)
    assert report["binary"].value == 0
    assert report["surrogate"].value == 0 and "lowest fraction of nonzero input gradients" in report["surrogate"].detail
    assert [name for name, _ in report.spiking_layers] == ["lif1", "lif2"]


def test_a_neuron_fed_time_and_batch_flattened_mixes_samples() -> None:
    report = check(Net(neuron2=FlattenedLIF()), _data())
    _only_fails(report, "batch")
    batch = report["batch"]
    assert batch.value >= BUG
    assert "lif2.lif" in batch.detail and "the layer itself does it" in batch.detail
    assert "eval" in batch.detail and "train" in batch.detail
    assert [f.layer for f in batch.layers] == ["lif2.lif"]


def test_a_neuron_that_keeps_its_membrane_fails_the_state_check_only() -> None:
    report = check(Net(neuron2=KeepsMembrane()), _data())
    _only_fails(report, "state")  # the other checks compare passes from the same leftover state
    assert report["state"].value >= BUG
    assert "spikes of lif2" in report["state"].detail


def test_a_flip_over_time_is_not_causal() -> None:
    report = check(Net(mid=Flip()), _data())
    _only_fails(report, "causality")
    assert report["causality"].value >= BUG
    assert "input of lif2" in report["causality"].detail  # the op between lif1 and lif2 looks ahead


def test_a_flip_of_a_time_major_input_before_the_first_neuron_is_not_causal() -> None:
    class FlipFirst(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.flip(0))

    x = _data().unsqueeze(0).expand(T, -1, -1, -1, -1) * torch.linspace(0.5, 1.5, T).view(T, 1, 1, 1, 1)
    report = check(FlipFirst(), x, time_major=True, only=["batch", "causality"])
    assert report["batch"].status == "PASS", str(report)  # batch axis 1 of the time-major input
    assert report["causality"].status == "FAIL" and report["causality"].value >= BUG
    assert "input of lif1" in report["causality"].detail
    assert check(Net(), x, time_major=True, only=["causality"])["causality"].status == "PASS"


def test_time_mixing_declared_by_design_is_not_judged_but_what_runs_before_it_is() -> None:
    class DeclaredFlip(Flip):
        mixes_time = True  # e.g. attention over time: the model says so

    declared = check(Net(mid=DeclaredFlip()), _data(), only=["causality"])["causality"]
    assert declared.status == "SKIP" and declared.value <= CLEAN
    assert "unchanged up to the first mid (mixes_time), after lif1" in declared.detail
    net = Net(mid=Flip())
    net.head = nn.Sequential(DeclaredFlip(), net.head)  # declared after the undeclared flip
    undeclared = check(net, _data(), only=["causality"])["causality"]
    assert undeclared.status == "FAIL" and undeclared.value >= BUG and "input of lif2" in undeclared.detail


@pytest.mark.parametrize("neuron", [ZeroSurrogate, NoSurrogate])
def test_a_layer_without_surrogate_gradient_is_dead(neuron: type[LIF]) -> None:
    report = check(Net(neuron2=neuron()), _data())
    _only_fails(report, "surrogate")
    layers = {f.layer: f.note for f in report["surrogate"].layers}
    assert "passes no gradient for any input current" in layers["lif2"]
    assert "lif1" in layers  # nothing reaches the layer before it either


def test_graded_spikes_are_not_binary() -> None:
    report = check(Net(neuron2=Graded()), _data())
    _only_fails(report, "binary")
    (finding,) = report["binary"].layers
    assert finding.layer == "lif2" and "e.g. 2" in finding.note
    assert 0 < finding.value <= 1


def test_silent_and_saturated_layers() -> None:
    silent = check(Net(neuron2=LIF(v_threshold=1e9, backend="torch")), _data(), only=["rates"])
    assert silent["rates"].status == "FAIL" and "silent (1): lif2" in silent["rates"].detail
    saturated = check(Net(neuron2=LIF(v_threshold=-1e9, backend="torch")), _data(), only=["rates"])
    assert saturated["rates"].status == "FAIL" and "saturated (1): lif2" in saturated["rates"].detail
    assert {f.layer: f.value for f in saturated["rates"].layers} == {"lif2": 1.0}
    # random inputs say nothing about real ones: the same silent model is not judged on them
    net = Net(neuron2=LIF(v_threshold=1e9, backend="torch"))
    net.zoo_name = "stable-snn-digits"  # any zoo name: its input spec supplies the random input (1x8x8)
    assert check(net, only=["rates"])["rates"].status == "SKIP"


def test_the_model_is_left_as_it_was() -> None:
    net = Net()
    net.train()
    net.lif1.eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.random.get_rng_state()
    check(net, _data())
    assert net.training and not net.lif1.training and net.bn.training
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(p.grad is None for p in net.parameters())


def test_only_and_bad_arguments() -> None:
    report = check(Net(), _data(), only=["binary", "batch"])
    assert [r.id for r in report.results] == ["batch", "binary"]
    with pytest.raises(ConfigError, match="no check 'batchh'.*did you mean 'batch'"):
        check(Net(), _data(), only=["batchh"])
    with pytest.raises(ConfigError, match="give an example input"):
        check(Net())
    with pytest.raises(ConfigError, match="the model failed on the input"):
        check(Net(), torch.rand(6, 3, 8, 8))
    assert efficient.check is check
    json.dumps(check(Net(), _data()).to_dict())  # serialisable as it is


# ---------------------------------------------------------------------------------------------
# the zoo: every entry passes (untrained weights, random inputs: the rates check is skipped)


def _one_case_per_model() -> list[zr.Case]:
    seen: dict[str, zr.Case] = {}
    for c in zr.CASES:
        seen.setdefault(c.name, c)
    return list(seen.values())


def _smallest_per_family(cases: list[zr.Case]) -> set[str]:
    from efficient.zoo import get_entry, meta_param_count

    best: dict[str, tuple[int, str]] = {}
    for c in cases:
        n = meta_param_count(c.name, **{k: v for k, v in c.overrides.items() if k != "backend"})
        fam = get_entry(c.name).family or c.name
        if fam not in best or n < best[fam][0]:
            best[fam] = (n, c.name)
    return {name for _, name in best.values()}


ZOO = _one_case_per_model()
FAST = _smallest_per_family(ZOO)
ZOO = [zr.narrow(c) for c in ZOO]  # the checks look at the architecture (batch, state, causality), not the width


@pytest.mark.parametrize("case", [c if c.name in FAST else pytest.param(c, marks=pytest.mark.slow) for c in ZOO],
                         ids=[c.name for c in ZOO])
def test_every_zoo_model_passes(case: zr.Case) -> None:
    model = efficient.zoo.create(case.name, **case.overrides)
    example = None
    if efficient.zoo.get_entry(case.name).input_spec.dtype == "long":  # token models: a short sequence
        example = torch.randint(0, model.vocab_size, (3, case.seq_len), generator=torch.Generator().manual_seed(0))
    report = check(model, example)
    assert report.passed, str(report)
    spiking = bool(report.spiking_layers)
    want_pass = {"batch", "state"} | ({"causality", "surrogate", "binary"} if spiking else set())
    causality = report["causality"]
    if find_pruner(model) is not None and find_pruner(model).prune_at and causality.status == "SKIP":
        # STATA keeps one token set for every step, chosen from every step's scores: not causal by
        # design; what runs before its first selection still is
        assert "unchanged up to the first STATA token selection" in causality.detail, str(report)
        assert causality.value <= CLEAN
        want_pass.discard("causality")
    assert {r.id for r in report.results if r.status == "PASS"} == want_pass, str(report)
    for cid in ("batch", "state", "causality"):
        if report[cid].status == "PASS":
            assert report[cid].value <= CLEAN, str(report)


@pytest.mark.parametrize("name", ["stable-snn-digits", "spikformer-tiny"])
def test_shipped_weights_pass_on_their_validation_data(name: str) -> None:
    report = check(name, pretrained=True)
    assert "validation data of its weights (digits)" in report.input
    assert [r.status for r in report.results] == ["PASS"] * 6, str(report)
    rates = report["rates"].detail
    assert "no silent or saturated layer" in rates


# ---------------------------------------------------------------------------------------------
# peers: spikingjelly's and snntorch's tutorial networks


def _csnn(T: int = 4, channels: int = 8) -> nn.Module:
    """spikingjelly 2.0's `activation_based/examples/conv_fashion_mnist.py` CSNN, as written there."""
    from spikingjelly.activation_based import functional, layer, neuron, surrogate

    class CSNN(nn.Module):
        def __init__(self, T: int, channels: int) -> None:
            super().__init__()
            self.T = T
            self.conv_fc = nn.Sequential(
                layer.Conv2d(1, channels, kernel_size=3, padding=1, bias=False), layer.BatchNorm2d(channels),
                neuron.IFNode(surrogate_function=surrogate.ATan()), layer.MaxPool2d(2, 2),
                layer.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False), layer.BatchNorm2d(channels),
                neuron.IFNode(surrogate_function=surrogate.ATan()), layer.MaxPool2d(2, 2),
                layer.Flatten(), layer.Linear(channels * 7 * 7, channels * 4 * 4, bias=False),
                neuron.IFNode(surrogate_function=surrogate.ATan()),
                layer.Linear(channels * 4 * 4, 10, bias=False), neuron.IFNode(surrogate_function=surrogate.ATan()),
            )
            functional.set_step_mode(self, step_mode="m")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x_seq = x.unsqueeze(0).expand(self.T, -1, -1, -1, -1)
            return self.conv_fc(x_seq).mean(0)

    torch.manual_seed(0)
    return CSNN(T, channels)


def _fashion() -> torch.Tensor:
    return torch.rand(8, 1, 28, 28, generator=torch.Generator().manual_seed(1))


STRUCTURAL = ["batch", "state", "causality", "surrogate", "binary"]  # untrained peers: rates say nothing


def test_spikingjelly_csnn_needs_reset_net_and_is_otherwise_sound() -> None:
    from spikingjelly.activation_based import functional

    net = _csnn()
    bare = check(net, _fashion(), only=STRUCTURAL)
    assert [r.id for r in bare.failed] == ["state"], str(bare)
    assert "functional.reset_net" in bare["state"].detail and "conv_fc.2" in bare["state"].detail
    assert [k for _, k in bare.spiking_layers] == ["spikingjelly multi-step"] * 4
    reset = check(net, _fashion(), only=STRUCTURAL, reset=functional.reset_net)
    assert reset.passed and all(r.status == "PASS" for r in reset.results), str(reset)
    assert all(float(getattr(m, "v", 0.0) if not isinstance(getattr(m, "v", 0.0), torch.Tensor) else m.v.abs().sum()) == 0
               for m in net.modules() if hasattr(m, "v"))  # left at rest


def test_spikingjelly_neuron_fed_time_and_batch_flattened_mixes_samples() -> None:
    from spikingjelly.activation_based import functional, neuron

    class Flattening(nn.Module):  # what QKFormer issue 14 describes, with spikingjelly's multi-step LIF
        def __init__(self) -> None:
            super().__init__()
            self.lif = neuron.LIFNode(step_mode="m")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lif(x.flatten(0, 1)).reshape(x.shape)

    net = _csnn()
    net.conv_fc[10] = Flattening()
    report = check(net, _fashion(), only=["batch"], reset=functional.reset_net)
    assert report["batch"].status == "FAIL" and report["batch"].value >= BUG, str(report)
    assert "conv_fc.10.lif" in report["batch"].detail


def test_multi_step_model_without_T_must_say_whether_its_input_is_time_major() -> None:
    from spikingjelly.activation_based import functional

    net = _csnn().conv_fc  # the CSNN's body: reads [T, B, ...] itself, names no T
    seq = _fashion()[None].expand(4, -1, -1, -1, -1)  # [T=4, B=8, 1, 28, 28]
    with pytest.raises(ConfigError, match="time_major=True"):
        check(net, seq, only=["batch"], reset=functional.reset_net)
    report = check(net, seq, only=["batch", "causality"], reset=functional.reset_net, time_major=True)
    assert report.passed, str(report)  # samples on axis 1, steps on axis 0: both judged right
    assert report["causality"].status == "PASS"


def _snntorch_conv_net() -> nn.Module:
    """snntorch tutorial 6's convolutional network (`init_hidden=True` neurons in nn.Sequential)."""
    import snntorch as snn
    from snntorch import surrogate

    torch.manual_seed(0)
    grad = surrogate.fast_sigmoid(slope=25)
    return nn.Sequential(
        nn.Conv2d(1, 12, 5), nn.MaxPool2d(2), snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True),
        nn.Conv2d(12, 64, 5), nn.MaxPool2d(2), snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 10), snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True, output=True),
    )


class TutorialLoop(nn.Module):
    """The tutorial's `forward_pass(net, num_steps, data)`: reset, then one call per step, stacked."""

    def __init__(self, net: nn.Module, num_steps: int) -> None:
        super().__init__()
        self.net, self.num_steps = net, num_steps

    def forward(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from snntorch import utils

        utils.reset(self.net)
        spk, mem = zip(*(self.net(data) for _ in range(self.num_steps)))
        return torch.stack(spk), torch.stack(mem)


def test_snntorch_conv_net_keeps_state_unless_reset() -> None:
    from snntorch import utils

    net = _snntorch_conv_net()
    bare = check(net, _fashion(), only=STRUCTURAL)
    assert [r.id for r in bare.failed] == ["state"], str(bare)
    assert "snntorch.utils.reset" in bare["state"].detail
    assert bare["causality"].status == "SKIP"  # one call is one step: no time inside a call
    assert [k for _, k in bare.spiking_layers] == ["snntorch single-step"] * 3
    reset = check(net, _fashion(), only=STRUCTURAL, reset=utils.reset)
    assert reset["state"].status == "PASS", str(reset)


def test_snntorch_tutorial_loop_passes_and_steps_through_time() -> None:
    report = check(TutorialLoop(_snntorch_conv_net(), num_steps=6), _fashion(), only=STRUCTURAL)
    assert all(r.status == "PASS" for r in report.results), str(report)
    assert "steps <= 2" in report["causality"].detail  # T from num_steps, the output stacked over time


# ---------------------------------------------------------------------------------------------
# the command


@pytest.fixture
def cli(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """`cli(*args) -> (exit code, stdout, stderr)` through `efficient.cli.main`."""
    monkeypatch.delenv("EFFICIENT_DEBUG", raising=False)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_cli_json_of_a_passing_zoo_model(cli) -> None:
    code, out, _ = cli("check", "spikformer-tiny", "--format", "json")
    assert code == 0
    d = json.loads(out)
    assert d["model"] == "spikformer-tiny" and d["passed"] is True
    assert [c["id"] for c in d["checks"]] == ["batch", "state", "causality", "rates", "surrogate", "binary"]
    assert {c["id"]: c["status"] for c in d["checks"]}["rates"] == "SKIP"
    assert len(d["spiking_layers"]) == 19 and d["spiking_layers"][0]["kind"] == "efficient multi-step"


def test_cli_fails_with_exit_1_on_a_saturated_layer(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from efficient.io import save_model

    model = efficient.zoo.create("spikformer-tiny")
    with torch.no_grad():
        model.blocks[0].mlp.fc1.bn.bias.fill_(100.0)  # every step's current far above threshold
    weights = tmp_path / "saturated.safetensors"
    save_model(model, weights)
    code, out, _ = cli("check", str(weights), "--data", "digits", "--only", "rates,binary", "--format", "json")
    assert code == 1
    rates = json.loads(out)["checks"][0]
    assert rates["status"] == "FAIL"
    assert {"layer": "blocks.0.mlp.fc1.lif", "value": 1.0, "note": "saturated"} in rates["layers"]
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = cli("check", str(weights), "--data", "digits", "--only", "rates,binary")
    assert code == 1
    text = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert [line for line in text.splitlines() if len(line) > 80 and " " in line.strip()] == []
    assert re.search(r"silent / saturated layers\s+FAIL", text) and "blocks.0.mlp.fc1.lif" in text
    assert "1 of 2 checks failed: silent / saturated layers" in " ".join(text.split())


def test_cli_checks_a_run_dir_on_its_validation_data(cli, tiny_recipe: Path, tmp_path: Path) -> None:
    from efficient.config import load_recipe
    from efficient.io import save_model
    from efficient.train.checkpoint import MODEL_FILE

    run = tmp_path / "run"
    (run / "checkpoint" / "last").mkdir(parents=True)
    (run / "config.yaml").write_text(tiny_recipe.read_text())
    model_cfg = dict(load_recipe(tiny_recipe).model)
    save_model(efficient.zoo.create(model_cfg.pop("name"), **model_cfg), run / "checkpoint" / "last" / MODEL_FILE)
    code, out, _ = cli("check", str(run), "--batch", "5", "--only", "batch,binary", "--format", "json")
    assert code == 0, out
    d = json.loads(out)
    assert d["model"] == "run" and d["input"] == "validation data of the run, first 5 samples [5, 1, 16, 16]"
    assert [c["status"] for c in d["checks"]] == ["PASS", "PASS"]


@pytest.mark.parametrize("args, message", [
    (("check", "spikformer-tinyy"), "spikformer-tiny"),
    (("check", "runs/no-such-run"), "no such file or directory"),
    (("check", "spikformer-tiny", "--only", "rate"), "no check 'rate'"),
    (("check", "spikformer-tiny", "--batch", "0"), "--batch must be >= 1"),
    (("check", "spikformer-tiny", "--data", "nope.yaml"), "no such recipe file"),
    (("check", "spikformer-tiny", "-o", "x.json"), "add --format json"),
])
def test_cli_bad_input_exits_2_with_a_message(cli, args: tuple[str, ...], message: str) -> None:
    code, out, err = cli(*args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and "Traceback" not in err
