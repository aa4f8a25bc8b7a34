"""The README's NIR interop table, from a run of tests/test_nir_interop.py.

    python bench/nir_table.py            # runs the tests, prints the table (markdown)
    python bench/nir_table.py --write    # and replaces the table in README.md between its markers

Each test tags its cell (library, direction, graph) with `record_property`; a passing test (spikes
compared step by step over T) is a ✔, a strict xfail a ✘ with its reason: the library's error or the
first differing step. A failing test stops the script: the table only states what the tests show.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- nir-interop-table -->", "<!-- /nir-interop-table -->"


def run_tests(xml: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_nir_interop.py", f"--junitxml={xml}"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=False)


def cells(xml: Path) -> list[dict]:
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        tag = json.loads(props.get("nir_interop", "null") or "null")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            raise SystemExit(f"{case.get('name')} failed: {failed.get('message')}; fix it before writing the table")
        if tag is None:
            if skipped is not None and skipped.get("type") != "pytest.xfail":
                print(f"skipped: {case.get('name')}: {skipped.get('message')}", file=sys.stderr)
            continue
        if skipped is None:
            tag["result"], tag["note"] = "✔", case.get("name").removeprefix("test_")
        elif skipped.get("type") == "pytest.xfail":
            tag["result"], tag["note"] = "✘", (skipped.get("message") or "").removeprefix("xfail ").strip()
        else:
            tag["result"], tag["note"] = "–", f"not run: {skipped.get('message')}"
        out.append(tag)
    return out


def table(rows: list[dict]) -> str:
    order = {"norse": 0, "sinabs": 1, "rockpool": 2, "spikingjelly": 3, "snntorch": 4}
    rows = sorted(rows, key=lambda r: (order.get(r["library"], 9), not r["direction"].startswith("efficient"), r["graph"]))
    seen, lines = set(), ["| library | direction | graph | | test / library's error |", "|---|---|---|---|---|"]
    for r in rows:
        key = (r["direction"], r["graph"], r["result"])
        if key in seen:  # one line per cell (parametrised tests give several models the same cell)
            continue
        seen.add(key)
        note = r["note"].replace("|", "\\|")
        lines.append(f"| {r['library']} | {r['direction']} | {r['graph']} | {r['result']} | {note} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="replace the table in README.md between its markers")
    ap.add_argument("--junit", type=Path, help="read this junit xml instead of running the tests")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        xml = args.junit or Path(tmp) / "nir.xml"
        if args.junit is None:
            run_tests(xml)
        md = table(cells(xml))
    print(md)
    if args.write:
        readme = ROOT / "README.md"
        text = readme.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
        head, rest = text.split(BEGIN, 1)
        readme.write_text(head + BEGIN + "\n" + md + "\n" + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
