"""The package's imports point one way: no cycle between its files (top-level, lazy and
TYPE_CHECKING imports alike), and the graph reader finds a cycle when there is one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "bench" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", mod)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycle_in_the_package() -> None:
    graph = _graph_module()
    edges = graph.graph()
    assert "efficient.zoo" in edges and "efficient.kernels.lif" in edges and "efficient.models.spikformer" in edges
    cycles = graph.cycles(edges)
    assert not cycles, "import cycles (move the shared piece below both sides): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_sees_a_cycle_and_a_self_free_chain() -> None:
    graph = _graph_module()
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert graph.cycles(edges) == [["a", "b", "c"]]
    assert graph.cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_lazy_imports_are_edges(tmp_path: Path) -> None:
    graph = _graph_module()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    edges = {name: graph.imports_of(name, path, modules) for name, path in modules.items()}
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.a"}
    assert graph.cycles(edges) == [["pkg.a", "pkg.b"]]
