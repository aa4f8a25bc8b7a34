"""Host memory `reuse` (efficient.memory.host): freed tensors come back from malloc without page
faults, the trainer applies it from the recipe, and bad values are refused. The setting is
process-wide, so it is applied in subprocesses only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from efficient.config import load_recipe
from efficient.errors import ConfigError
from efficient.memory import host

pytestmark = pytest.mark.skipif(not host.reuse_supported(), reason="host memory reuse needs glibc")

# page faults of five 64 MiB tensors written and freed in turn, after ten warm-up ones (the heap
# settles: a freed block that a small allocation split can leave the next one to grow the heap)
FAULTS = """
import resource, sys, torch
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
for _ in range(10):
    torch.ones(16 * 2**20)
f0, r0 = faults(), rss()
for _ in range(5):
    torch.ones(16 * 2**20)
print("FAULTS", faults() - f0, rss() - r0)
"""


def _faults(prelude: str, cwd: Path = ROOT) -> tuple[int, int]:
    """(page faults, RSS growth in bytes) over the five allocations after `prelude`."""
    r = subprocess.run([sys.executable, "-c", prelude + FAULTS], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("FAULTS")][-1].split()
    return int(line[1]), int(line[2])


def test_reuse_serves_freed_tensors_without_page_faults() -> None:
    system, _ = _faults("")
    reuse, grown = _faults("from efficient.memory import host\nhost.keep_freed_memory()\n")
    # glibc as it is maps and unmaps each 64 MiB block: every step faults its pages in again
    # (fewer faults where transparent huge pages back the mapping, still many more than reuse)
    assert reuse * 4 < system, (system, reuse)
    assert reuse < 2000, reuse
    assert grown < 8 * 2**20, grown  # the freed block is reused, not added to: the heap does not grow


def test_trainer_applies_train_host_memory(tiny_recipe: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    prelude = (
        "from efficient.config import load_recipe\nfrom efficient.train.engine import Trainer\n"
        f"Trainer(load_recipe({str(tiny_recipe)!r}, ['train.max_steps=2', 'train.host_memory=reuse']), "
        f"{str(run)!r}).fit()\n"
    )
    assert _faults(prelude)[0] < 2000  # the run trained, and the setting holds in its process afterwards
    assert (run / "metrics.jsonl").exists()


def test_bad_host_memory_values_are_refused(tiny_recipe: Path) -> None:
    with pytest.raises(ConfigError, match="train.host_memory"):
        load_recipe(tiny_recipe, ["train.host_memory=cache"])
    with pytest.raises(ValueError, match=r"one of \('system', 'reuse'\)"):
        host.apply("cache")
