"""Packaging: the wheel lists every package of the source tree (a missing one installs a CLI that fails), and a
checkout's root on sys.path does not hide other distributions' top-level names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for name, src in cfg["package-dir"].items():
        base = ROOT / src
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    missing = sorted(found - listed)
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {missing}"


def test_a_checkout_root_on_sys_path_leaves_the_name_kernels_to_the_installed_package(tmp_path):
    # `kernels/` installs as efficient.kernels; from a checkout's root it is also a top-level `kernels`, the import
    # name of Hugging Face's kernels package (a transformers dependency). The installed one must win.
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'installed'\n")
    (other / "layer.py").write_text("KIND = 'submodule'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    code = "import kernels, kernels.layer; print(kernels.WHO, kernels.layer.KIND); import efficient.kernels.lif"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["installed", "submodule"]
