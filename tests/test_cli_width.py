"""The CLI's output in an 80-column pipe: no line wider than the console (a single unbreakable word,
such as a long path, aside), and every name a user copies (model, layer, metric) whole on one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import efficient
from efficient.cli import main

WIDTH = 80
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def run80(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`run80(*args) -> stdout` of `efficient ARGS` as in a pipe with COLUMNS=80 (the suite sets 200)."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.delenv("FORCE_COLOR", raising=False)

    def run(*args: str) -> str:
        capsys.readouterr()
        assert main(list(args)) == 0
        return _ANSI.sub("", capsys.readouterr().out)

    return run


def too_wide(text: str, width: int = WIDTH) -> list[str]:
    """Lines wider than `width`, except a line that is one word (nothing to wrap it at)."""
    return [line for line in text.splitlines() if len(line) > width and " " in line.strip()]


def whole(name: str, text: str) -> bool:
    """`name` appears on one line, not as part of a longer name."""
    pattern = re.compile(rf"(?<![\w.\-]){re.escape(name)}(?![\w.\-])")
    return any(pattern.search(line) for line in text.splitlines())


def test_zoo_fits_80_columns_one_line_per_model(run80) -> None:
    out = run80("zoo")
    assert too_wide(out) == []
    names = efficient.list_models()
    first_words = [line.split()[0] for line in out.splitlines() if line.split()]
    assert all(n in first_words for n in names), [n for n in names if n not in first_words]
    assert len(out.splitlines()) < len(names) + 10  # one line per model, no wrapped titles
    assert "Zhou+ ICLR'23" in out and "Zhuge+ ICML'24" in out


def test_zoo_show_fits_80_columns(run80) -> None:
    out = run80("zoo", "show", "spikformer-tiny-stata")
    assert too_wide(out) == []
    assert "Towards Efficient Spiking Transformer" in " ".join(out.split())  # the full title is here
    for word in ("config.keep_warmup_epochs", "runs/zoo/spikformer-tiny-stata-saccade-digits", "recipes/stata_digits.yaml"):
        assert whole(word, out), word


def test_profile_fits_80_columns_with_every_layer_name_whole(run80, monkeypatch: pytest.MonkeyPatch) -> None:
    from efficient.profiler.report import Report

    reports: list[Report] = []
    to_table = Report.to_table

    def keep(self: Report, *args, **kwargs):
        reports.append(self)
        return to_table(self, *args, **kwargs)

    monkeypatch.setattr(Report, "to_table", keep)
    out = run80("profile", "spikformer-stata", "--layers", "1000")
    assert too_wide(out) == []
    (report,) = reports
    missing = [layer.name for layer in report.layers if not whole(layer.name, out)]
    assert missing == []
    assert all(whole(r["name"], out) for r in report.top_modules(1))
    assert "warning (spikformer-stata):" in out  # the silent-network warning, wrapped to the width


def test_profile_tables_keep_names_whole_when_narrow() -> None:
    from rich.console import Console

    from efficient.profiler import profile

    rep = profile(efficient.zoo.create("spikformer-tiny"), batch=1)
    for width in (40, 60, 100):
        console = Console(width=width, record=True)
        for t in rep.to_table(max_layers=len(rep.layers)):
            console.print(t)
        console.print(rep.compare(rep).to_table())
        text = console.export_text()
        assert too_wide(text, width) == [], width
        assert all(whole(layer.name, text) for layer in rep.layers), width
        assert whole("dense MACs / sample", text) and whole("mean firing rate", text)


def test_summaries_and_messages_fit_80_columns(run80, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               tiny_recipe: Path) -> None:
    from rich.console import Console

    from efficient.commands import print_values
    from efficient.commands.train import print_summary

    run_dir = tmp_path / "a-run-dir-whose-name-is-long-enough-to-matter"
    run_dir.mkdir()
    (run_dir / "report.html").write_text("")
    summary = {"model": "spikformer-tiny-stata", "val": {"acc": 0.5, "loss_final_exit_weighted": 1.25},
               "train_time_s": 12.0, "params": 164162,
               "cost": {"batch_size": 2, "dense_macs": 1e8, "macs": 1e6, "sops": 1e5, "energy_pj": 1e7, "mean_firing_rate": 0.1}}
    print_summary(Console(), summary, run_dir)
    print_values(f"{run_dir} (best)", {"acc": 0.5, "a_metric_with_a_rather_long_name_for_a_table": 0.25}, "metric", "value")
    out = _ANSI.sub("", capsys.readouterr().out)
    assert too_wide(out) == []
    for name in ("val loss_final_exit_weighted", "a_metric_with_a_rather_long_name_for_a_table", "dense MACs / sample"):
        assert whole(name, out), name
    out = run80("validate", str(tiny_recipe))
    assert too_wide(out) == [] and "ok" in out


def test_short_citation() -> None:
    from efficient.commands.zoo import short_citation

    assert short_citation("Spikformer: When Spiking Neural Network Meets Transformer (Zhou et al., ICLR 2023)") == "Zhou+ ICLR'23"
    assert short_citation("Monotone, Bi-Lipschitz, and Polyak-Lojasiewicz Networks (Wang & Manchester, ICML 2024)") == "Wang+ ICML'24"
    assert short_citation("A Paper (Smith, NeurIPS 2021)") == "Smith NeurIPS'21"
    assert short_citation("A Paper (Smith, 2020)") == "Smith '20"
    assert short_citation("") == "-"
    assert short_citation("an unparsed reference") == "an unparsed reference"
