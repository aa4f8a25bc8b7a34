"""The recipe schema (`efficient.config`) depends on the data / objective / measure registries, never
the other way round: each module imports first in a fresh interpreter, and no registry module
imports `efficient.config`."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "efficient"
MODULES = ["efficient.config", "efficient.data", "efficient.objectives", "efficient.metrics", "efficient.errors", "efficient.zoo", "efficient.recipe_yaml"]
REGISTRIES = ["data", "objectives", "metrics"]

# One interpreter pays the third-party imports (torch, timm, ...) once, holding no efficient module,
# then forks a child per case: each child's efficient imports run from scratch, in the order given,
# so an import cycle or a module that fails when imported first fails there as in a fresh interpreter.
FORK_PER_CASE = r"""
import json, os, sys, threading, traceback
import numpy, safetensors, timm, torch, torchvision, yaml  # noqa: F401
held = sorted(m for m in sys.modules if m == "efficient" or m.startswith("efficient."))
assert not held, f"efficient modules imported before the fork: {held}"
# fork copies only the calling thread: a live thread pool would leave its locks held in the child
threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
assert threads == 1, f"{threads} threads running before the fork"
results = {}
for name, code in json.loads(sys.argv[1]).items():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        status = 0
        try:
            exec(code, {"__name__": "__main__"})
        except BaseException:
            status = 1
            with os.fdopen(w, "w") as f:
                f.write(traceback.format_exc())
        os._exit(status)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    results[name] = {"exit": os.waitstatus_to_exitcode(status), "err": err}
print(json.dumps(results))
"""


def first_import_code(first: str) -> str:
    rest = [m for m in MODULES if m != first]
    return (
        "import importlib\n"
        f"importlib.import_module({first!r})\n"
        f"for m in {rest!r}:\n"
        "    importlib.import_module(m)\n"
        "from efficient.config import parse_yaml, validate\n"
        "validate(parse_yaml('model: {name: mlp-tiny}\\ndata: {name: digits}'))\n"
    )


@pytest.fixture(scope="module")
def first_imports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{case: {"exit": code, "err": traceback}}: each module first, plus a planted import cycle that
    shows the harness reports a failing child."""
    cyc = tmp_path_factory.mktemp("cycle")
    (cyc / "cyc_a.py").write_text("from cyc_b import B\nA = 1\n")
    (cyc / "cyc_b.py").write_text("from cyc_a import A\nB = 2\n")
    cases = {first: first_import_code(first) for first in MODULES}
    cases["planted-cycle"] = f"import sys\nsys.path.insert(0, {str(cyc)!r})\nimport cyc_a\n"
    # single-threaded BLAS / OpenMP pools, so nothing but the main thread exists when we fork
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", FORK_PER_CASE, json.dumps(cases)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_planted_import_cycle_fails(first_imports: dict[str, dict]) -> None:
    result = first_imports["planted-cycle"]
    assert result["exit"] == 1 and "partially initialized module" in result["err"], result


@pytest.mark.parametrize("first", MODULES)
def test_each_module_imports_first_in_a_fresh_interpreter(first: str, first_imports: dict[str, dict]) -> None:
    result = first_imports[first]
    assert result["exit"] == 0, result["err"][-2000:]


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
