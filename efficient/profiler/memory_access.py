"""Memory-access energy: the traffic a forward pass causes, priced by the size of the memory it hits,
after Lemaire et al., "An analytical estimation of spiking neural networks energy efficiency",
ICONIP 2022 (arXiv 2210.13107).

    report = profile(model, x, memory_access=True)
    report.totals["energy_memory_pj"], report.totals["energy_total_pj"]   # beside energy_pj (compute only)

Accesses are 32-bit words. Counted per op and per neuron (see `counting._record_accesses`):
weights: one read per MAC or AC (no reuse); inputs: one read per spike event, one per MAC for a
convolution's real input, one per element for a matmul's real input; potentials: a read and a
write of the target membrane per AC, and of every neuron's membrane per time step; spikes: one
write per spike; outputs: one write per output of an op computed with MACs. A word in a memory of
B bytes costs E(B), linear between Lemaire's SRAM points (8 KiB: 10 pJ, 32 KiB: 20 pJ, 1 MiB:
100 pJ per 32-bit access, 45 nm), 0 pJ at 0 B, flat above 1 MiB. The buffer of an access is the
tensor it reads or writes (a layer's weights, an input, an output, a step of membranes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

from efficient.errors import ConfigError

KINDS = ("weights", "inputs", "potentials", "spikes", "outputs")


@dataclass(frozen=True)
class MemoryModel:
    """Energy per 32-bit access as a function of the memory's size: (bytes, pJ) points, linear between."""

    name: str = "lemaire-2022"
    points: tuple[tuple[float, float], ...] = ((0.0, 0.0), (8 * 1024.0, 10.0), (32 * 1024.0, 20.0), (1024 * 1024.0, 100.0))
    source: str = ("Lemaire et al., ICONIP 2022 (arXiv 2210.13107): 32-bit SRAM access at 45 nm, "
                   "8 KiB 10 pJ, 32 KiB 20 pJ, 1 MiB 100 pJ, linear between")

    def __post_init__(self) -> None:
        xs = [p[0] for p in self.points]
        if len(self.points) < 2 or xs != sorted(set(xs)) or any(v < 0 for p in self.points for v in p):
            raise ConfigError(f"memory model points must be >= 2 (bytes, pJ) pairs, increasing in bytes, non-negative; "
                              f"got {self.points}")

    def word_pj(self, buffer_bytes: float) -> float:
        """Energy of one 32-bit access to a memory of `buffer_bytes`."""
        pts = self.points
        b = min(max(float(buffer_bytes), pts[0][0]), pts[-1][0])
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if b <= x1:
                return y0 + (y1 - y0) * (b - x0) / (x1 - x0)
        return pts[-1][1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def memory_energy(accesses: Iterable[Mapping[tuple[str, int], int]], model: MemoryModel) -> dict[str, float]:
    """Words and pJ by kind over per-layer access tables {(kind, buffer bytes): words}."""
    out: dict[str, float] = {}
    for table in accesses:
        for (kind, buf), words in table.items():
            out[f"{kind}_words"] = out.get(f"{kind}_words", 0) + words
            out[f"{kind}_pj"] = out.get(f"{kind}_pj", 0.0) + words * model.word_pj(buf)
    out["total_pj"] = sum(v for k, v in out.items() if k.endswith("_pj"))
    return out
