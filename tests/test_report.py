"""report.html from short real runs: every section present for a STATA run and an early-exit run, its
numbers equal to metrics.jsonl, profile.json and attacks.jsonl; two runs side by side; the page in
headless Chromium (no console errors, a non-blank screenshot)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import ROOT

from efficient.cli import main
from efficient.config import load_recipe
from efficient.report.html import SECTIONS
from efficient.train.engine import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = ["train.max_steps=4", "train.progress=false", "train.log_every=1", "train.threads=1"]
STATA = ["model.embed_dim=16", "eval.batch_size=64", "eval.max_batches=1", "profile.samples=8"]
EE = ["model.n_embd=32", "model.n_head=2", "model.seq_len=32", "data.seq_len=32", "data.max_bytes=20000",
      "data.batch_size=4", "eval.max_batches=2", "profile.samples=2"]
CHROMIUM = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and os.path.exists(p)), None)


@pytest.fixture(scope="module")
def stata_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step STATA digits run, attacked once with FGSM (so the report has robust accuracy)."""
    run = tmp_path_factory.mktemp("stata") / "run"
    Trainer(load_recipe(ROOT / "recipes" / "stata_digits.yaml", QUICK + STATA), run).fit()
    rc = main(["attack", str(run), "--attack", "fgsm", "--eps", "8/255", "--max-batches", "1", "--batch-size", "16", "--device", "cpu"])
    assert rc == 0
    assert main(["report", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def ee_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ee") / "run"
    Trainer(load_recipe(ROOT / "recipes" / "ee_gpt_text.yaml", QUICK + EE), run).fit()  # writes report.html itself
    return run


class Page(HTMLParser):
    """Sections of a report page: their text, the tables' cells (data-value floats) and SVG count."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.cur: dict | None = None
        self._tbl: list | None = None
        self.row: list | None = None
        self.cell: dict | None = None
        self.links: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("src", "href"):
            if k in a:
                self.links.append(a[k])
        if tag == "section":
            self.cur = self.sections[a["id"]] = {"text": "", "tables": [], "svgs": 0}
        elif self.cur is None:
            return
        elif tag == "svg":
            self.cur["svgs"] += 1
        elif tag == "table":
            self._tbl = []
            self.cur["tables"].append({"class": a.get("class", ""), "rows": self._tbl})
        elif tag == "tr" and self._tbl is not None:
            self.row = []
            self._tbl.append(self.row)
        elif tag in ("td", "th") and self.row is not None:
            self.cell = {"text": "", "value": float(a["data-value"]) if "data-value" in a else None}
            self.row.append(self.cell)

    def handle_endtag(self, tag):
        if tag == "section":
            self.cur = None
        elif tag == "table":
            self._tbl = None
        elif tag in ("td", "th"):
            self.cell = None

    def handle_data(self, data):
        if self.cur is not None:
            self.cur["text"] += data
        if self.cell is not None:
            self.cell["text"] += data

    def table(self, section: str, cls: str, n: int = 0) -> list[list[dict]]:
        return [t for t in self.sections[section]["tables"] if t["class"] == cls][n]["rows"][1:]


def _page(path: Path) -> Page:
    return Page(path.read_text())


def _metrics(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "lr" in r], [r for r in rows if r.get("split") == "val"]


def _last(page: Page, section: str, key: str, split: str) -> dict:
    row = next(r for r in page.table(section, "last-values") if r[0]["text"] == key and r[1]["text"] == split)
    return {"value": row[2]["value"], "step": row[3]["value"]}


def test_every_section_is_on_the_page_in_order(stata_run, ee_run):
    for run in (stata_run, ee_run):
        text = (run / "report.html").read_text()
        ids = [sid for sid, _ in SECTIONS]
        assert list(_page(run / "report.html").sections) == ids
        assert all(f'href="#{sid}"' in text for sid in ids)


def test_stata_report_numbers_equal_the_run_files(stata_run):
    page = _page(stata_run / "report.html")
    train, val = _metrics(stata_run)
    prof = json.loads((stata_run / "profile.json").read_text())
    n = prof["totals"]["batch_size"]
    for sid in ("curves", "lr", "energy", "sops", "firing", "tokens", "robust"):
        assert page.sections[sid]["svgs"] >= 1, sid
    assert _last(page, "curves", "loss", "train") == {"value": train[-1]["loss"], "step": train[-1]["step"]}
    assert _last(page, "curves", "acc", "val") == {"value": val[-1]["acc"], "step": val[-1]["step"]}
    assert _last(page, "lr", "lr", "train")["value"] == train[-1]["lr"]
    totals = {r[0]["text"]: r[1]["value"] for r in page.table("energy", "cost-totals")}
    summary = json.loads((stata_run / "summary.json").read_text())
    assert totals["energy_pj / sample"] == pytest.approx(prof["totals"]["energy_pj"] / n, rel=1e-12)
    assert totals["energy_pj / sample"] == pytest.approx(summary["cost"]["energy_pj"] / n, rel=1e-12)
    assert totals["mean_firing_rate"] == prof["totals"]["mean_firing_rate"]
    sops = {r[0]["text"]: r[2]["value"] for r in page.table("sops", "layer-sops")}
    assert sops == {x["name"]: pytest.approx(x["sops"] / n) for x in prof["layers"] if x["dense_macs"] > 0}
    rates = {r[0]["text"]: r[2]["value"] for r in page.table("firing", "layer-firing")}
    assert rates == {x["name"]: x["output_firing_rate"] for x in prof["layers"] if x["neuron"]}
    assert [r[1]["value"] for r in page.table("tokens", "tokens")] == [b["tokens_in"] for b in prof["blocks"]]
    assert prof["blocks"][-1]["tokens_in"] < prof["blocks"][0]["tokens_in"]  # STATA pruned tokens
    assert _last(page, "tokens", "stata/tokens_out", "train")["value"] == train[-1]["stata/tokens_out"]
    attack = json.loads((stata_run / "attacks.jsonl").read_text().splitlines()[-1])
    robust = {r[4]["text"]: r[7]["value"] for r in page.table("robust", "robust")}
    assert robust == {"clean": pytest.approx(100 * attack["clean"]), "fgsm": pytest.approx(100 * attack["attacks"][0]["acc"])}
    assert "not a STATA run" not in page.sections["tokens"]["text"]
    assert "no early exits in this model" in page.sections["exits"]["text"]
    assert "nearly silent" in page.sections["firing"]["text"]  # 4 steps do not make it fire: the profile says so
    assert "keep_ratio: 0.5" in page.sections["recipe"]["text"]
    env = {r[0]["text"]: r[1]["text"] for r in page.table("environment", "environment")}
    assert env["torch"] == summary["environment"]["torch"] and env["device"] == "cpu"


def test_early_exit_report_numbers_equal_the_run_files(ee_run):
    page = _page(ee_run / "report.html")
    train, val = _metrics(ee_run)
    prof = json.loads((ee_run / "profile.json").read_text())
    assert page.sections["exits"]["svgs"] == 2  # exit distribution, per-exit loss curves
    dist = {int(k): v for k, v in prof["exits"]["distribution"].items()}
    assert sum(dist.values()) == pytest.approx(1.0) and set(dist) == {1, 2, 4}
    table = {int(r[0]["value"]): r[3]["value"] for r in page.table("exits", "exits")}
    assert table == dist
    for k in (1, 2):
        assert _last(page, "exits", f"loss_exit{k}", "val")["value"] == val[-1][f"loss_exit{k}"]
        assert _last(page, "exits", f"loss_exit{k}", "train")["value"] == train[-1][f"loss_exit{k}"]
    assert _last(page, "curves", "loss", "val")["value"] == val[-1]["loss"]
    assert "no spiking neurons in this model" in page.sections["firing"]["text"]
    assert "not a STATA run" in page.sections["tokens"]["text"]
    assert "no attack results" in page.sections["robust"]["text"]
    assert page.sections["energy"]["svgs"] == 1 and "exits" in page.sections["recipe"]["text"]


def test_two_runs_side_by_side(stata_run, ee_run, tmp_path):
    out = tmp_path / "cmp.html"
    assert main(["report", str(stata_run), str(ee_run), "-o", str(out)]) == 0
    page = _page(out)
    a = json.loads((stata_run / "profile.json").read_text())
    b = json.loads((ee_run / "profile.json").read_text())
    rows = {r[0]["text"]: r for r in page.table("energy", "cost-compare")}
    ea, eb = (p["totals"]["energy_pj"] / p["totals"]["batch_size"] for p in (a, b))
    assert rows["energy_pj"][1]["value"] == pytest.approx(ea) and rows["energy_pj"][2]["value"] == pytest.approx(eb)
    assert rows["energy_pj"][3]["value"] == pytest.approx(eb / ea)
    # curves overlaid: one chart with both runs in its legend
    curves = out.read_text().split('<section id="curves">')[1].split("</section>")[0]
    assert curves.count("<svg") == 1 and "run train" in curves
    assert "model.name" in page.sections["recipe"]["text"]  # the recipes' differences


def test_report_errors_name_the_problem(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "no such run dir" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "not a run dir (no config.yaml)" in capsys.readouterr().err
    assert main(["report", "a", "b", "c"]) == 2
    assert "one run dir, or two" in capsys.readouterr().err


def test_page_is_self_contained(stata_run):
    page = _page(stata_run / "report.html")
    external = [link for link in page.links if not link.startswith("#")]
    assert external == [] and "<script" not in (stata_run / "report.html").read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on this machine (Debian package `chromium`); CI installs it")
def test_page_renders_in_headless_chromium(stata_run, tmp_path):
    from playwright.sync_api import sync_playwright

    shot = tmp_path / "report.png"
    errors: list[str] = []
    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile_dir:
        browser = p.chromium.launch_persistent_context(
            profile_dir, executable_path=CHROMIUM, viewport={"width": 1280, "height": 900},
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((stata_run / "report.html").resolve().as_uri())
            widths = page.eval_on_selector_all("section svg", "els => els.map(e => e.getBoundingClientRect().width)")
            headings = page.eval_on_selector_all("section h2", "els => els.map(e => e.textContent)")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert headings == [head for _, head in SECTIONS]
    assert len(widths) >= 8 and min(widths) > 100  # every chart laid out
    import matplotlib.image

    img = matplotlib.image.imread(str(shot))
    assert img.shape[0] > 2000 and img.std() > 0.05  # a long page with content, not a blank one
    if os.environ.get("EFFICIENT_REPORT_SCREENSHOT"):  # keep it to look at
        shutil.copy(shot, os.environ["EFFICIENT_REPORT_SCREENSHOT"])


def test_run_without_profile_says_how_to_add_one_and_the_report_then_shows_it(tiny_recipe, tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(load_recipe(tiny_recipe, ["train.max_steps=2"]), run).fit()  # the tiny recipe disables profile
    page = _page(run / "report.html")
    command = f"efficient profile {run} --format json -o {run / 'profile.json'}"
    assert command in " ".join(page.sections["energy"]["text"].split())
    assert page.sections["energy"]["svgs"] == 0
    assert main(command.split()[1:]) == 0 and main(["report", str(run)]) == 0
    assert f"report written to {run / 'report.html'}" in capsys.readouterr().out
    page = _page(run / "report.html")
    prof = json.loads((run / "profile.json").read_text())
    rates = {r[0]["text"]: r[2]["value"] for r in page.table("firing", "layer-firing")}
    assert rates == {x["name"]: x["output_firing_rate"] for x in prof["layers"] if x["neuron"]}
    assert page.sections["energy"]["svgs"] == 1


def test_a_suite_attack_on_the_run_shows_each_attack_and_the_worst_case(stata_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stata_run, run)
    rc = main(["attack", str(run), "--attack", "suite", "--eps", "8/255", "--max-batches", "1", "--batch-size", "8",
               "--device", "cpu", "--apgd-steps", "2", "--apgd-restarts", "1", "--pgd-steps", "2", "--pgd-restarts", "1",
               "--square-queries", "5", "--suite-attacks", "apgd-ce,pgd,square"])
    assert rc == 0
    entry = json.loads((run / "attacks.jsonl").read_text().splitlines()[-1])
    suite = entry["suite"]
    names = [a["attack"] for a in entry["attacks"]]
    assert names[-1] == "worst case (suite)" and len(names) >= 2
    assert entry["attacks"][-1]["acc"] == suite["worst_case"] <= min(a["acc"] for a in entry["attacks"][:-1])
    assert main(["report", str(run)]) == 0
    assert "worst case (suite)" in (run / "report.html").read_text()
