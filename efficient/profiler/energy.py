"""Energy per operation: named presets and user overrides for E = E_MAC * macs + E_AC * sops."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Union

from efficient.errors import ConfigError, closest


@dataclass(frozen=True)
class EnergyModel:
    """Energy of one multiply-accumulate (real operands) and one accumulate (spike operand), in pJ."""

    name: str
    e_mac_pj: float
    e_ac_pj: float
    source: str = ""

    def __post_init__(self) -> None:
        for k in ("e_mac_pj", "e_ac_pj"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
                raise ConfigError(f"energy.{k} must be a finite number >= 0, got {v!r}")

    def energy_pj(self, macs: float, sops: float) -> float:
        return self.e_mac_pj * macs + self.e_ac_pj * sops

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_HOROWITZ = "Horowitz, ISSCC 2014, 45 nm"

# E_MAC = mult + add, E_AC = add, from Horowitz's 45 nm table (fp32: 3.7 + 0.9; fp16: 1.1 + 0.4;
# int8: 0.2 + 0.03). Same constants as spikingjelly 2.0's SimpleEnergyCostConfig presets.
PRESETS: dict[str, EnergyModel] = {
    "45nm-fp32": EnergyModel("45nm-fp32", 4.6, 0.9, _HOROWITZ + " fp32"),
    "45nm-fp16": EnergyModel("45nm-fp16", 1.5, 0.4, _HOROWITZ + " fp16"),
    "45nm-int8": EnergyModel("45nm-int8", 0.23, 0.03, _HOROWITZ + " int8"),
}

EnergySpec = Union[str, EnergyModel, Mapping[str, Any]]


def resolve_energy(spec: EnergySpec | None) -> EnergyModel:
    """A preset name, an EnergyModel, or a mapping {e_mac_pj, e_ac_pj[, preset]} overriding a preset."""
    if spec is None:
        return PRESETS["45nm-fp32"]
    if isinstance(spec, EnergyModel):
        return spec
    if isinstance(spec, str):
        if spec in PRESETS:
            return PRESETS[spec]
        hint = closest(spec, list(PRESETS))
        raise ConfigError(
            f"unknown energy preset {spec!r}."
            + (f" Did you mean {hint[0]!r}?" if hint else "")
            + f" Presets: {', '.join(PRESETS)}; or pass {{'e_mac_pj': ..., 'e_ac_pj': ...}}."
        )
    if isinstance(spec, Mapping):
        allowed = {"preset", "e_mac_pj", "e_ac_pj", "name"}
        bad = sorted(set(spec) - allowed)
        if bad:
            raise ConfigError(f"energy: unknown keys {bad}; allowed keys are {sorted(allowed)}")
        base = resolve_energy(spec.get("preset", "45nm-fp32"))
        e_mac = float(spec.get("e_mac_pj", base.e_mac_pj))
        e_ac = float(spec.get("e_ac_pj", base.e_ac_pj))
        custom = (e_mac, e_ac) != (base.e_mac_pj, base.e_ac_pj)
        name = str(spec.get("name", f"custom({base.name})" if custom else base.name))
        return EnergyModel(name, e_mac, e_ac, "user override of " + base.name if custom else base.source)
    raise ConfigError(f"energy must be a preset name, an EnergyModel or a mapping, got {type(spec).__name__}")
