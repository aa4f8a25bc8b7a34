"""Counting conventions: how operands are classified and charged, as named presets that reproduce
how papers count, so a number can be put beside a paper's table with the reason they differ.

    profile(model, x, convention="spikformer")      # or efficient profile MODEL --convention spikformer

Operands are classified per unit, not per tensor: a unit is one row of the operand along its
contiguous (feature) axis for matmuls, one sample for convolutions. A unit whose values are all 0
or 1 is spikes (SOPs = nonzeros x fan-out); one of small non-negative integers (spike counts,
residual sums) is charged by `integer`; any other is real-valued (MACs). All-zero units are free
in a tensor that carries spikes and dense otherwise (padding of a real input is computed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Union

from efficient.errors import ConfigError, closest

INTEGER_CHARGES = ("mac", "accumulate", "nonzero")
SPIKE_MATMUL = ("operand", "coincidence")
AFTER_FIRST = ("exact", "nonzero")
# Largest value an operand may hold to count as a small non-negative integer (spike counts over T,
# sums of a few spike maps); larger integer values (e.g. 0..255 pixels) are real-valued.
MAX_INTEGER = 255


@dataclass(frozen=True)
class Convention:
    """How the profiler charges operations. Fields:

    integer: units of small non-negative integers: "mac" (multiply-accumulates, the conservative
      default), "accumulate" (value-weighted accumulates: value x fan-out ACs, an integer n being n
      spikes), or "nonzero" (nonzeros x fan-out ACs, as if binary).
    spike_matmul: spike x spike matmul: "operand" (nonzeros of the left operand x fan-out) or
      "coincidence" (number of (1, 1) products).
    after_first: "exact" (every op classified by its operands) or "nonzero" (the first op is charged
      as counted, every later op charges nonzeros of its activation operand x fan-out as ACs, whatever
      the values: the papers' "SOPs everywhere after the first layer").
    real_rows: with after_first="nonzero", "exact" keeps real-valued units (an anchor token) as MACs.
    modules_only: charge only ops issued by nn.Linear / nn.Conv* modules (NeuroBench's
      SynapticOperations hooks those modules; attention matmuls are not counted).
    granularity: "unit" (operands split per row / sample) or "tensor" (one class per operand, its
      costliest: one real value makes the whole tensor MACs, as spikingjelly's counters decide).
    """

    name: str
    integer: str = "mac"
    spike_matmul: str = "operand"
    after_first: str = "exact"
    real_rows: str = "exact"
    modules_only: bool = False
    granularity: str = "unit"
    source: str = ""
    formula: str = ""

    def __post_init__(self) -> None:
        for key, allowed in (("integer", INTEGER_CHARGES), ("spike_matmul", SPIKE_MATMUL),
                             ("after_first", AFTER_FIRST), ("real_rows", ("exact", "nonzero")),
                             ("granularity", ("unit", "tensor"))):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"convention.{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, Convention] = {
    "efficient": Convention(
        "efficient",
        source="this profiler's default: operand-exact, integers charged as MACs (conservative)",
        formula="E = E_MAC x (MACs of real and integer units) + E_AC x (nonzeros of binary units x fan-out)",
    ),
    "accumulate": Convention(
        "accumulate", integer="accumulate",
        source="operand-exact; an integer operand n is n spikes (SEW-style residual sums as accumulates)",
        formula="E = E_MAC x (MACs of real units) + E_AC x (nonzeros of binary units + integer values) x fan-out",
    ),
    "spikingjelly": Convention(
        "spikingjelly", spike_matmul="coincidence", granularity="tensor",
        source="spikingjelly 2.0 op_counter (SynOpCounter / MACCounter): one class per operand tensor",
        formula="E = E_MAC x (MACs of ops without a binary operand tensor) + E_AC x SOPs (binary operand tensor: "
                "nonzeros x fan-out; spike x spike: coinciding (1, 1) products)",
    ),
    "spikformer": Convention(
        "spikformer", integer="nonzero", after_first="nonzero", real_rows="nonzero",
        source="Zhou et al., ICLR 2023 (Spikformer); Yao et al., NeurIPS 2023 (Spike-driven Transformer) count the same way",
        formula="E = E_MAC x FL_1 + E_AC x sum_{l>1} FL_l x fr_l x T  (fr_l: nonzero rate of layer l's input; "
                "every layer after the first is charged as accumulates, whatever its operand values)",
    ),
    "stata": Convention(
        "stata", granularity="tensor",
        source="STATA (Zhuge et al., ICML 2024) energy model, 45 nm (Horowitz, ISSCC 2014): only all-{0,1} operand "
               "tensors are spikes; anything else, integer residual sums and a tensor holding a real anchor row "
               "included, is dense MACs. This profiler's default before operand-exact counting",
        formula="E = 4.6 pJ x MAC_dense + 0.9 pJ x SOP;  MAC_dense: MACs of ops whose operand tensor is not binary; "
                "SOP_l = fr_l x MAC_l x T = nonzeros of the binary input (all T) x fan-out",
    ),
    "neurobench": Convention(
        "neurobench", modules_only=True,
        source="Yik et al., Nature Communications 2025 (NeuroBench 2.3 SynapticOperations)",
        formula="per nn.Linear/Conv call: Effective ops = #(nonzero input, nonzero weight) pairs, as ACs when every input "
                "value is in {-1, 0, 1}, else as MACs; bias excluded; attention matmuls not counted",
    ),
}

ConventionSpec = Union[str, Convention, Mapping[str, Any]]


def resolve_convention(spec: ConventionSpec | None) -> Convention:
    """A preset name, a Convention, or a mapping of fields overriding a preset ({"preset": .., "integer": ..})."""
    if spec is None:
        return PRESETS["efficient"]
    if isinstance(spec, Convention):
        return spec
    if isinstance(spec, str):
        if spec in PRESETS:
            return PRESETS[spec]
        hint = closest(spec, list(PRESETS))
        raise ConfigError(f"unknown convention {spec!r}." + (f" Did you mean {hint[0]!r}?" if hint else "")
                          + f" Presets: {', '.join(PRESETS)}.")
    if isinstance(spec, Mapping):
        allowed = {"preset", "name", "integer", "spike_matmul", "after_first", "real_rows", "modules_only", "granularity"}
        bad = sorted(set(spec) - allowed)
        if bad:
            raise ConfigError(f"convention: unknown keys {bad}; allowed keys are {sorted(allowed)}")
        base = resolve_convention(spec.get("preset", "efficient"))
        fields = {k: v for k, v in spec.items() if k not in ("preset", "name")}
        changed = any(getattr(base, k) != v for k, v in fields.items())
        name = str(spec.get("name", f"custom({base.name})" if changed else base.name))
        return replace(base, name=name, **fields)
    raise ConfigError(f"convention must be a preset name, a Convention or a mapping, got {type(spec).__name__}")
