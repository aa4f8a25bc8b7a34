"""Energy of a trained dense / STATA pair and of an ImageNet-size pair under every counting
convention, compute only and with memory access (Lemaire et al.'s model), and the STATA saving under
each: how much of a reported saving is the method and how much is the convention.

    python bench/profiler_conventions.py --dense runs/spikformer_digits --stata runs/stata_digits [--imagenet] [--json F]

Digits runs are profiled as their own cost report does (their first `profile.samples` validation
inputs). `--imagenet`: spikformer-8-512 and spikformer-8-512-stata (rho 0.7, blocks 4, 6, 8) on one
seeded 224 px input, sharing weights drawn with gain `--gain` / sqrt(fan-in) so that every layer
fires (a fresh model is nearly silent; the mean firing rate is printed beside it).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch import nn

from efficient.profiler import CONVENTIONS, profile, profile_run
from efficient.zoo import create


def _row(rep) -> dict[str, float]:
    t = rep.totals
    n = t.get("batch_size") or 1
    return {
        "macs": t["macs"] / n, "sops": t["sops"] / n, "energy_uj": t["energy_pj"] / n / 1e6,
        "memory_uj": t.get("energy_memory_pj", float("nan")) / n / 1e6, "total_uj": t.get("energy_total_pj", float("nan")) / n / 1e6,
        "firing_rate": t.get("mean_firing_rate", float("nan")),
    }


def _table(title: str, dense: dict, stata: dict) -> list[dict]:
    print(f"\n{title}\n")
    print("| convention | dense: MACs M | SOPs M | compute uJ | + memory uJ | STATA: MACs M | SOPs M | compute uJ | + memory uJ "
          "| STATA saving, compute | STATA saving, with memory |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for c in CONVENTIONS:
        d, s = dense[c], stata[c]
        sc, st = 1 - s["energy_uj"] / d["energy_uj"], 1 - s["total_uj"] / d["total_uj"]
        print(f"| {c} | {d['macs'] / 1e6:.3f} | {d['sops'] / 1e6:.3f} | {d['energy_uj']:.3f} | {d['total_uj']:.2f} "
              f"| {s['macs'] / 1e6:.3f} | {s['sops'] / 1e6:.3f} | {s['energy_uj']:.3f} | {s['total_uj']:.2f} | {100 * sc:.1f} % | {100 * st:.1f} % |")
        rows.append({"convention": c, "dense": d, "stata": s, "saving_compute": sc, "saving_total": st})
    fr = dense["efficient"]["firing_rate"], stata["efficient"]["firing_rate"]
    print(f"\nmean firing rate: dense {fr[0]:.4f}, STATA {fr[1]:.4f}")
    return rows


def digits(dense_run: str, stata_run: str) -> list[dict]:
    out = {}
    for name, run in (("dense", dense_run), ("stata", stata_run)):
        out[name] = {c: _row(profile_run(run, convention=c, memory_access=True)) for c in CONVENTIONS}
    return _table(f"trained digits pair: {dense_run} vs {stata_run} (their validation inputs)", out["dense"], out["stata"])


def _scaled(model: nn.Module, gain: float, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * gain / math.sqrt(m.weight[0].numel()))
    return model


def imagenet(gain: float) -> list[dict]:
    dense = _scaled(create("spikformer-8-512"), gain, 0).eval()
    stata = create("spikformer-8-512-stata").eval()
    missing = stata.load_state_dict(dense.state_dict(), strict=False).missing_keys  # same weights; STATA adds its anchor
    assert all("anchor" in k for k in missing), missing
    with torch.no_grad():  # the anchor at its trained scale (std 1, as initialised)
        for name, p in stata.named_parameters():
            if "anchor" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    out = {n: {c: _row(profile(m, inputs=x, convention=c, memory_access=True)) for c in CONVENTIONS}
           for n, m in (("dense", dense), ("stata", stata))}
    return _table(f"spikformer-8-512 vs spikformer-8-512-stata, one 224 px input, weights gain {gain}", out["dense"], out["stata"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense")
    ap.add_argument("--stata")
    ap.add_argument("--imagenet", action="store_true")
    ap.add_argument("--gain", type=float, default=5.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    if bool(a.dense) != bool(a.stata):
        ap.error("give both --dense and --stata (a trained pair), or neither")
    res = {}
    if a.dense:
        res["digits"] = digits(a.dense, a.stata)
    if a.imagenet:
        res["imagenet"] = imagenet(a.gain)
    if not res:
        ap.error("nothing to do: give --dense/--stata and/or --imagenet")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
