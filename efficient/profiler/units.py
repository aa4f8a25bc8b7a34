"""Numbers as the profiler prints them: counts with K/M/G/T suffixes, energy in pJ..J, firing rates."""

from __future__ import annotations


def fmt_count(v: float | None) -> str:
    if v is None:
        return "-"
    v = float(v)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3f} {unit}"
    return f"{v:.0f}" if v == int(v) else f"{v:.3g}"


def fmt_energy(pj: float | None) -> str:
    if pj is None:
        return "-"
    for unit, scale in (("J", 1e12), ("mJ", 1e9), ("uJ", 1e6), ("nJ", 1e3)):
        if abs(pj) >= scale:
            return f"{pj / scale:.4g} {unit}"
    return f"{pj:.4g} pJ"


def fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.4f}"
