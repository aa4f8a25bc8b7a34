"""The recipe schema (`efficient.config`) depends on the data / objective / measure registries, never
the other way round: each module imports first in a fresh interpreter, and no registry module
imports `efficient.config`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "efficient"
MODULES = ["efficient.config", "efficient.data", "efficient.objectives", "efficient.metrics", "efficient.errors", "efficient.zoo", "efficient.recipe_yaml"]
REGISTRIES = ["data", "objectives", "metrics"]


@pytest.mark.parametrize("first", MODULES)
def test_each_module_imports_first_in_a_fresh_interpreter(first: str) -> None:
    rest = [m for m in MODULES if m != first]
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({first!r})\n"
        f"for m in {rest!r}:\n"
        "    importlib.import_module(m)\n"
        "from efficient.config import parse_yaml, validate\n"
        "validate(parse_yaml('model: {name: mlp-tiny}\\ndata: {name: digits}'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def _imported_modules(path: Path) -> set[str]:
    """Every absolute `efficient...` module a file imports, at any level (functions included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("efficient")}


@pytest.mark.parametrize("package", REGISTRIES)
def test_registries_do_not_import_config(package: str) -> None:
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files
    offenders = {str(f.relative_to(PACKAGE)): sorted(m for m in _imported_modules(f) if m == "efficient.config" or m.startswith("efficient.config."))
                 for f in files}
    assert not {f: m for f, m in offenders.items() if m}, "registry modules must not import efficient.config (did_you_mean lives in efficient.errors)"


@pytest.mark.parametrize("module", ["zoo.py", "recipe_yaml.py"])
def test_zoo_and_yaml_reader_do_not_import_config(module: str) -> None:
    """The schema imports the zoo (model options); the zoo reads run configs through
    `efficient.recipe_yaml`, so the two never import each other in a cycle."""
    used = sorted(m for m in _imported_modules(PACKAGE / module) if m == "efficient.config" or m.startswith("efficient.config."))
    assert not used, f"efficient/{module} imports {used}"


def test_did_you_mean_lives_with_the_errors() -> None:
    from efficient.errors import did_you_mean

    assert did_you_mean("digts", ["digits", "cifar10"]) == " Did you mean 'digits'?"
    assert did_you_mean("zzz", ["digits"]) == ""
