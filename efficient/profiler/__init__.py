"""Cost profiler: MACs, synaptic operations (SOPs), FLOPs and energy of any PyTorch model.

    report = efficient.profile(model, input_shape=(3, 32, 32))
    report.totals["energy_pj"]; report.to_markdown(); report.plot("energy.png")
    run = profile_run("runs/stata")        # a trained run, on the validation samples its report used
    run.compare(profile_run("runs/dense")).plot("compare.png")
    efficient.profile(model, x, convention="spikformer", memory_access=True, neurobench=True)

Counting happens at the operator level (a torch dispatch mode), so functional and custom ops
count, and each op is attributed to the module that issued it.
"""

from __future__ import annotations

from efficient.profiler.api import built_input_spec, parse_shape, profile
from efficient.profiler.conventions import PRESETS as CONVENTIONS
from efficient.profiler.conventions import Convention, resolve_convention
from efficient.profiler.memory_access import MemoryModel
from efficient.profiler.energy import PRESETS, EnergyModel, resolve_energy
from efficient.profiler.report import Comparison, LayerStat, Report
from efficient.profiler.run import profile_run

__all__ = ["profile", "profile_run", "Report", "LayerStat", "Comparison", "EnergyModel", "PRESETS", "resolve_energy",
           "parse_shape", "built_input_spec", "Convention", "CONVENTIONS", "resolve_convention", "MemoryModel"]
