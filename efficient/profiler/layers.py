"""Per-layer counts: what counting accumulates for a module and what a report shows for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerCounts:
    """One module's name, class and operation counts (dense, real-operand and spike-operand)."""

    name: str
    type: str
    dense_macs: int = 0
    macs: int = 0
    sops: int = 0


@dataclass
class LayerStat(LayerCounts):
    """One module that issued matmul/conv ops, or one spiking neuron."""

    energy_pj: float = 0.0
    input_firing_rate: float | None = None  # nonzero fraction of the spike operand feeding SOPs
    output_firing_rate: float | None = None  # neurons: spikes per neuron per time step
    firing_rate_per_step: list[float] | None = None
    neuron: str | None = None
    ops: str = ""
    params: int = 0
    neuron_outputs: int = 0  # neuron-step outputs observed (weights the mean firing rate)
    int_operand_macs: int = 0  # MACs charged for integer-valued operand units (part of macs)
    int_operand_acs: int = 0  # accumulates charged for integer-valued operand units (part of sops)
    real_operand_macs: int = 0  # MACs of real-valued operand units (this layer sees real-valued input)
    memory_pj: float | None = None  # memory-access energy, when the memory model is on

    @property
    def is_neuron(self) -> bool:
        return self.neuron is not None
