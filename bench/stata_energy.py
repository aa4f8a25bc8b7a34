"""Energy of trained STATA vs dense Spikformer runs on validation images, whole model and encoder.

Counts come from `efficient.profile` (45 nm: 4.6 pJ/MAC, 0.9 pJ/SOP; only {0,1} operands count as
spikes, so layers fed by Spikformer's integer residual stream are charged as MACs) on the trained
checkpoints' validation split. "encoder" = the transformer blocks (everything under `blocks.`).
STATA models run their lean inference path (pruned tokens' queries and the last block's anchor are
never computed; bitwise the same logits); `--no-lean` computes every row, as training does.

    python bench/stata_energy.py runs/stata/dense_s0 runs/stata/stata_s0 ...   # run dirs
    python bench/stata_energy.py --base denselong runs/stata_seeds/{denselong,statalong}_s{0..9}
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import yaml

import efficient
from efficient.data import build_data


def val_images(run: Path, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    d = build_data(cfg["data"])
    n = len(d.val) if limit is None else min(limit, len(d.val))
    x = torch.stack([d.val[i][0] for i in range(n)])
    y = torch.tensor([d.val[i][1] for i in range(n)])
    return x, y


def measure(run: Path, limit: int | None, lean: bool = True) -> dict:
    model = efficient.load(run)
    if hasattr(model, "lean_inference"):
        model.lean_inference = model.lean_inference and lean
    x, y = val_images(run, limit)
    with torch.no_grad():
        acc = (model(x).argmax(-1) == y).float().mean().item()
    rep = efficient.profile(model, inputs=x)
    n = len(y)
    enc = [l for l in rep.layers if l.name.startswith("blocks.")]
    return {
        "run": str(run), "acc": acc, "images": n,
        "energy_uj": rep.totals["energy_pj"] / n / 1e6,
        "encoder_uj": sum(l.energy_pj for l in enc) / n / 1e6,
        "dense_mmacs": rep.totals["dense_macs"] / n / 1e6,
        "encoder_dense_mmacs": sum(l.dense_macs for l in enc) / n / 1e6,
        "encoder_sops_k": sum(l.sops for l in enc) / n / 1e3,
        "encoder_macs_k": sum(l.macs for l in enc) / n / 1e3,
        "tokens_in": [b["tokens_in"] for b in rep.blocks],
        "lean": bool(getattr(model, "lean_inference", False)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--limit", type=int, default=None, help="validation images (default: all)")
    ap.add_argument("--no-lean", action="store_true", help="compute every row (as training does), not the lean inference path")
    ap.add_argument("--json", default=None)
    ap.add_argument("--base", default="dense", help="run-name prefix (before _s<seed>) of the dense runs (default dense)")
    args = ap.parse_args()
    rows = [measure(r, args.limit, lean=not args.no_lean) for r in args.runs]
    print("| run | lean | val acc | tokens in per block | energy / image (uJ) | encoder energy (uJ) | encoder MACs (k) | encoder SOPs (k) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {Path(r['run']).name} | {r['lean']} | {r['acc']:.4f} | {r['tokens_in']} | {r['energy_uj']:.3f} | {r['encoder_uj']:.3f} "
              f"| {r['encoder_macs_k']:.1f} | {r['encoder_sops_k']:.1f} |")
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(Path(r["run"]).name.rsplit("_s", 1)[0], []).append(r)
    if args.base in groups:
        base = groups[args.base]
        e0 = statistics.mean(r["energy_uj"] for r in base)
        n0 = statistics.mean(r["encoder_uj"] for r in base)
        for g, rs in groups.items():
            e = statistics.mean(r["energy_uj"] for r in rs)
            n = statistics.mean(r["encoder_uj"] for r in rs)
            print(f"{g}: whole-model energy {e:.3f} uJ ({1 - e / e0:+.1%} vs dense reduction), "
                  f"encoder {n:.3f} uJ ({1 - n / n0:+.1%} reduction), n={len(rs)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
