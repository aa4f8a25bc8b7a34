"""Interop: NIR export/import of spiking networks and checkpoints in other libraries' layouts.

    graph = efficient.export.to_nir(model, sample_input)     # nir.NIRGraph of one time step
    efficient.export.write_nir(graph, "model.nir")
    net = efficient.load("model.nir")                        # NIRNetwork on our kernels, [T, B, ...]

The time-step convention (`dt`, tau in steps vs seconds) is in `efficient.export.neurons`.
"""

from __future__ import annotations

from efficient.export.from_nir import NIRNetwork, from_nir, load_nir, read_nir
from efficient.export.neurons import DEFAULT_DT
from efficient.export.to_nir import to_nir, write_nir

__all__ = ["DEFAULT_DT", "NIRNetwork", "from_nir", "load_nir", "read_nir", "to_nir", "write_nir"]
