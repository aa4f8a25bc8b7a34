"""efficient.memory.measure: the bytes a training step keeps for backward, on cases computed by hand
(a Linear keeps its input; a storage counts once; spikes as bits count ceil(numel / 8)), the levels
ordered on a spiking transformer, the model left as it was, and the CLI and report around it."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_budget
from torch import nn

import efficient
from efficient.cli import main
from efficient.memory import optimize
from efficient.memory.measure import (
    LOSS,
    ActivationMemory,
    activation_memory,
    applied_level,
    fmt_bytes,
    measure_levels,
    step_peak_bytes,
    write_run_memory,
)
from efficient.models.neurons import LIF

pytestmark = pytest.mark.usefixtures("one_thread")

B, FEAT = 4, 10
FLOAT = 4  # bytes of a float32


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(FEAT, 3), nn.Linear(FEAT, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _sums_add_up(m: ActivationMemory) -> None:
    assert sum(m.by_module.values()) == m.total_bytes
    assert sum(m.by_block.values()) == m.total_bytes
    assert m.packed_bytes + m.dense_bytes == m.total_bytes


def test_a_linear_keeps_exactly_its_input() -> None:
    model = nn.Sequential(nn.Linear(FEAT, 3))
    for x in (torch.randn(B, FEAT), torch.randn(B, FEAT, requires_grad=True)):  # weight.t() is a parameter: not counted
        m = activation_memory(model, x)
        assert m.total_bytes == B * FEAT * FLOAT
        assert m.by_module == {"0": B * FEAT * FLOAT} and m.by_block == {"0": B * FEAT * FLOAT}
        assert (m.tensors, m.packed_bytes, m.level, m.backward) == (1, 0, "none", True)
        assert m.step_time_s is not None and m.step_time_s >= 0


def test_a_storage_counts_once_and_a_view_counts_its_storage() -> None:
    m = activation_memory(TwoHeads(), torch.randn(B, FEAT))
    assert m.total_bytes == B * FEAT * FLOAT and m.tensors == 1
    assert m.by_module == {"a": B * FEAT * FLOAT}  # the first module that saved it

    class FirstHalf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(FEAT // 2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x[:, : FEAT // 2])

    m = activation_memory(FirstHalf(), torch.randn(B, FEAT))
    assert m.by_module == {"fc": B * FEAT * FLOAT}  # the slice keeps the whole [B, FEAT] storage


def test_only_what_the_graph_still_holds_counts_and_the_loss_is_its_own_entry() -> None:
    class SideBranch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.main, self.side = nn.Linear(FEAT, 3), nn.Linear(FEAT, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.side(x * 2)  # its graph (and the x * 2 it saved) is dropped before the step ends
            return self.main(x)

    assert activation_memory(SideBranch(), torch.randn(B, FEAT)).by_module == {"main": B * FEAT * FLOAT}

    y = torch.zeros(B, dtype=torch.long)
    m = activation_memory(nn.Sequential(nn.Linear(FEAT, 3)), torch.randn(B, FEAT), loss_fn=lambda out: F.cross_entropy(out, y))
    assert m.by_module["0"] == B * FEAT * FLOAT and m.by_module[LOSS] >= B * 3 * FLOAT  # log_softmax keeps its output
    assert m.by_block[LOSS] == m.by_module[LOSS]
    _sums_add_up(m)


def test_a_step_peak_can_leave_out_what_the_step_leaves_alive() -> None:
    """`without`: storages alive after the step (a parameter's gradient, say) are not counted from their
    allocation on, also where one takes the address of a block freed earlier in the step; the same
    records without leaving anything out give the plain peak."""
    MiB = 1 << 20
    kept: list[torch.Tensor] = []

    def step() -> None:
        scratch = torch.empty(MiB, dtype=torch.uint8)
        del scratch  # the kept tensor below may take its address
        kept.append(torch.empty(MiB, dtype=torch.uint8))
        temporary = torch.empty(2 * MiB, dtype=torch.uint8)
        del temporary

    assert step_peak_bytes(step) == 3 * MiB
    kept.clear()
    assert step_peak_bytes(step, without=lambda: []) == 3 * MiB
    kept.clear()
    assert step_peak_bytes(step, without=lambda: [kept[0], None]) == 2 * MiB

    # a training step without its parameters' gradients: less, by no more than the gradients' bytes
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def train_step() -> None:
        F.cross_entropy(model(x), y).backward()

    train_step()
    model.zero_grad(set_to_none=True)  # before the step, so that freeing them is not the step's
    whole = step_peak_bytes(train_step)
    grad_bytes = sum(p.grad.nbytes for p in model.parameters())
    model.zero_grad(set_to_none=True)
    bare = step_peak_bytes(train_step, without=lambda: [p.grad for p in model.parameters()])
    assert whole - grad_bytes <= bare < whole


def test_spikes_saved_by_a_linear_count_as_bits_at_level_bits() -> None:
    T, N, H = 3, 2, 5  # 30 spikes: 4 bytes packed
    model = nn.Sequential(LIF(), nn.Linear(H, 3))
    x = torch.randn(T, N, H, requires_grad=True)  # so that the neuron keeps its record for backward
    none = activation_memory(model, x, level="none")
    bits = activation_memory(model, x, level="bits")
    assert none.by_module["1"] == T * N * H * FLOAT
    assert bits.by_module["1"] == math.ceil(T * N * H / 8) == 4
    assert bits.packed_bytes == 4 and bits.packed_tensors == 1 and none.packed_bytes == 0
    assert bits.by_module["0"] == none.by_module["0"] > 0  # the neuron's own record (its membrane) stays dense
    assert bits.level == "bits" and applied_level(model) == "none" and not hasattr(model, "_efficient_memory")
    _sums_add_up(bits)


@pytest.fixture(scope="module")
def tiny() -> nn.Module:
    return efficient.zoo.create("spikformer-tiny", embed_dim=16, depth=2, num_heads=2)


def test_each_level_is_timed_after_a_step_of_its_own(tiny: nn.Module) -> None:
    """A level's first step pays its one-time costs (the bits level's first pack and rebuild took 1.4 s
    of a 0.03 s step): each measured step follows an unmeasured one at the same level."""
    seen: list[str] = []
    handle = tiny.register_forward_pre_hook(lambda *_: seen.append(applied_level(tiny)))
    try:
        measure_levels(tiny, torch.randn(1, 1, 16, 16))
    finally:
        handle.remove()
    assert seen == ["none", "none", "bits", "bits", "recompute", "recompute"]


def test_levels_keep_less_in_order_and_the_model_is_left_as_it_was(tiny: nn.Module) -> None:
    x = torch.randn(2, 1, 16, 16)
    optimize(tiny, "bits")
    tiny.eval()
    buffers = {k: v.clone() for k, v in tiny.state_dict().items()}
    try:
        res = measure_levels(tiny, x)
        as_is = activation_memory(tiny, x)  # the level it has: bits, seen through the bits hooks' observer
    finally:
        assert applied_level(tiny) == "bits" and not tiny.training
        optimize(tiny, "none")
    assert list(res) == ["none", "bits", "recompute"]
    none, bits, rec = res.values()
    assert rec.total_bytes < bits.total_bytes < none.total_bytes
    assert none.packed_bytes == 0 and bits.packed_bytes > 0  # recompute may keep no spikes at all (whole blocks rerun)
    assert (as_is.total_bytes, as_is.by_module, as_is.level) == (bits.total_bytes, bits.by_module, "bits")
    assert set(none.by_block) == {"patch_embed", "blocks.0", "blocks.1", "head"}
    assert all(any(k == b or k.startswith(b + ".") for b in none.by_block) for k in none.by_module)
    for m in res.values():
        _sums_add_up(m)
    after = tiny.state_dict()
    assert all(torch.equal(buffers[k], after[k]) for k in buffers)  # BatchNorm statistics restored
    assert all(p.grad is None for p in tiny.parameters())  # the backward wrote no .grad


def test_json_round_trip_and_table(tiny: nn.Module) -> None:
    m = activation_memory(tiny, torch.randn(1, 1, 16, 16), level="bits")
    d = json.loads(json.dumps(m.to_dict()))
    assert ActivationMemory.from_dict(d) == m
    text = m.table()
    assert fmt_bytes(m.total_bytes) in text and all(b in text for b in m.by_block)
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(12) == "12 B"


# ------------------------------------------------------------------------------------------ CLI

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _whole(name: str, text: str) -> bool:
    pattern = re.compile(rf"(?<![\w.\-]){re.escape(name)}(?![\w.\-])")
    return any(pattern.search(line) for line in text.splitlines())


def test_profile_memory_json_and_table_at_80_columns(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["profile", "spikformer-tiny", "--memory", "--batch", "2", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["batch"] == 2 and list(d["levels"]) == ["none", "bits", "recompute"]
    totals = {lv: m["total_bytes"] for lv, m in d["levels"].items()}
    assert totals["recompute"] < totals["bits"] < totals["none"] == d["none_total_bytes"]
    assert d["ratio_to_none"]["none"] == 1.0 and d["ratio_to_none"]["bits"] == pytest.approx(totals["bits"] / totals["none"])
    for m in d["levels"].values():
        assert sum(m["by_block"].values()) == m["total_bytes"]

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    assert main(["profile", "spikformer-tiny", "--memory", "--batch", "2"]) == 0
    out = _ANSI.sub("", capsys.readouterr().out)
    assert [line for line in out.splitlines() if len(line) > 80] == []
    blocks = {b for m in d["levels"].values() for b in m["by_block"]}
    assert blocks and all(_whole(b, out) for b in blocks)
    assert all(_whole(lv, out) for lv in d["levels"]) and "1.000x" in out


@needs_budget
def test_profile_memory_with_a_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """--memory-budget measures level recompute at the planned outputs: within the budget, above
    recompute without one, and the plan is in the JSON."""
    argv = ["profile", "spikformer-tiny", "--memory", "--memory-level", "recompute", "--batch", "2", "--format", "json"]
    assert main(argv) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*argv, "--memory-budget", "0.3"]) == 0
    d = json.loads(capsys.readouterr().out)
    plan = d["recompute_plan"]
    assert plan["budget"] == 0.3 and plan["keep"] and 0 <= plan["rerun_share"] < 1
    assert whole["ratio_to_none"]["recompute"] < d["ratio_to_none"]["recompute"] <= 0.3
    assert d["ratio_to_none"]["recompute"] == pytest.approx(plan["kept_fraction"])


def test_profile_memory_peaks_say_where_each_levels_step_peak_sits(capsys: pytest.CaptureFixture[str]) -> None:
    """--memory-peaks: each level's step peak of live tensors (the largest of its phases, and what
    `step_peak_bytes` measures for the same step), recompute's below bits' below none's, and recompute's
    phases: the forward and its units, largest first."""
    import torch

    from efficient.memory import optimize
    from efficient.memory.measure import step_peak_bytes
    from efficient.memory.recompute import units
    from efficient.zoo import load

    assert main(["profile", "spikformer-tiny", "--memory", "--memory-peaks", "--batch", "2", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    peaks, phases = d["step_peak_bytes"], d["step_peak_phases"]
    assert list(peaks) == ["none", "bits", "recompute"] and 0 < peaks["recompute"] < peaks["bits"] < peaks["none"]
    for lv, ph in phases.items():
        assert list(ph.values()) == sorted(ph.values(), reverse=True) and max(ph.values()) == peaks[lv]
    model = load("spikformer-tiny")
    optimize(model, "recompute")
    names = {n for n, _ in units(model)}
    assert "forward" in phases["recompute"] and set(phases["recompute"]) - {"forward", "backward"} <= names
    x = torch.rand(2, 1, 16, 16)  # the model's input shape, as the command draws it
    activation_memory(model, x, backward=True)  # a unit's first call sizes its region; the second is the step's own
    assert step_peak_bytes(lambda: activation_memory(model, x, backward=True)) == peaks["recompute"]
    assert main(["profile", "spikformer-tiny", "--memory-peaks"]) == 2
    assert "add --memory" in capsys.readouterr().err


def test_profile_memory_levels_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "spikformer-tiny", "--memory", "--memory-level", "recompute", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert list(d["levels"]) == ["recompute"] and 0 < d["ratio_to_none"]["recompute"] < 1  # none measured for the ratio
    for argv, message in ((["--memory", "--memory-level", "half"], "'half' is not a memory level"),
                          (["--memory-level", "bits"], "add --memory"),
                          (["--memory", "--compare", "spikformer-tiny"], "--compare does not apply with --memory"),
                          (["--memory", "--format", "md"], "--memory prints a table or --format json"),
                          (["--memory-budget", "0.2"], "add --memory"),
                          (["--memory", "--memory-budget", "3"], "is not a fraction in [0, 1]"),
                          (["--memory", "--memory-level", "bits", "--memory-budget", "0.2"], "add it to --memory-level")):
        assert main(["profile", "spikformer-tiny", *argv]) == 2
        assert message in capsys.readouterr().err


# --------------------------------------------------------------------------------------- report


def test_run_report_shows_the_memory_record(tiny_recipe, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_report import _page

    from efficient.config import load_recipe
    from efficient.train.engine import Trainer

    run = tmp_path / "run"
    Trainer(load_recipe(tiny_recipe, ["train.max_steps=2"]), run).fit()
    if (run / "memory.json").exists():  # a trainer that records it itself: measure here all the same
        (run / "memory.json").unlink()
    assert main(["report", str(run)]) == 0
    text = " ".join(_page(run / "report.html").sections["memory"]["text"].split())
    assert f"efficient profile {run} --memory" in text

    model = efficient.load(run)
    batch = (torch.rand(8, 1, 16, 16), torch.zeros(8, dtype=torch.long))
    path = write_run_memory(run, model, batch, "bits")
    assert path == run / "memory.json" and applied_level(model) == "none"
    rec = json.loads(path.read_text())
    bits, none = rec["levels"]["bits"], rec["levels"]["none"]
    assert (rec["level"], rec["batch_size"], rec["total_bytes"], rec["none_bytes"]) == ("bits", 8, bits["total_bytes"], none["total_bytes"])
    assert 0 < rec["ratio_to_none"] < 1

    assert main(["report", str(run)]) == 0
    page = _page(run / "report.html")
    (row,) = page.table("memory", "memory-totals")
    assert [c["text"] for c in row[:2]] == [run.name, "bits"]
    assert [c["value"] for c in row[2:]] == [8, bits["total_bytes"], none["total_bytes"], pytest.approx(rec["ratio_to_none"])]
    shown = {r[0]["text"]: (r[1]["value"], r[2]["value"]) for r in page.table("memory", "memory-blocks")}
    assert shown and all(shown[b] == (bits["by_block"][b], none["by_block"][b]) for b in shown)
    assert max(bits["by_block"], key=bits["by_block"].get) in shown

    capsys.readouterr()
    assert main(["profile", str(run), "--memory", "--memory-level", "bits", "--format", "json"]) == 0  # a run dir
    assert json.loads(capsys.readouterr().out)["levels"]["bits"]["packed_bytes"] > 0
