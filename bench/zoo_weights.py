"""Retrain every shipped zoo checkpoint from its recipe and check its metrics against the recorded ones.

    python bench/zoo_weights.py                  # retrain all, compare with efficient/weights/manifest.json
    python bench/zoo_weights.py --write          # ... and ship the new files + manifest (a release refresh)
    python bench/zoo_weights.py --only stable-snn-digits:digits-rho0 --reuse

Each job runs `efficient train RECIPE [overrides] --out RUNS/NAME-TAG` (one at a time), evaluates the
best checkpoint on the validation split in fp32 and as fp16 weights, and ships fp16 when every
accuracy (clean and robust; the loss for a language model) is unchanged within FP16_TOL, else fp32. Retrained metrics must match the recorded ones
within --tol-acc (absolute) / --tol-loss (relative).
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from efficient import hub, zoo  # noqa: E402
from efficient.train.engine import evaluate_recipe  # noqa: E402

FP16_TOL = {"acc": 0.003, "loss": 0.002}  # one digits image in 360 is 0.0028; loss relative


@dataclass(frozen=True)
class Job:
    """One shipped checkpoint: zoo name, tag, recipe and its overrides."""

    name: str
    tag: str
    recipe: str
    overrides: list[str] = field(default_factory=list)
    default: bool = True

    @property
    def key(self) -> str:
        return f"{self.name}:{self.tag}"


JOBS: list[Job] = [
    Job("spikformer-tiny-stata", "digits", "recipes/stata_digits.yaml"),
    Job("spikformer-tiny", "digits", "recipes/spikformer_digits.yaml"),
    Job("stable-snn-digits", "digits", "recipes/stable_snn_digits.yaml"),  # rho = 1 (the recipe's)
    Job("stable-snn-digits", "digits-rho0", "recipes/stable_snn_digits.yaml", ["objective.rho=0"], default=False),
    Job("ee-gpt-tiny", "text", "recipes/ee_gpt_text.yaml"),
    # the event-camera simulation of digits (efficient/data/events.py): 2 polarity channels, 16x16
    Job("spikformer-tiny-stata", "saccade-digits", "recipes/stata_saccade_digits.yaml", default=False),
]


def headline(metrics: dict[str, float]) -> str:
    return "acc" if "acc" in metrics else "loss"


def close(new: float, ref: float, metric: str, tol_acc: float, tol_loss: float) -> bool:
    return abs(new - ref) <= tol_acc if metric.startswith("acc") else abs(new - ref) <= tol_loss * abs(ref)


def fp16_unchanged(m32: dict[str, float], m16: dict[str, float]) -> bool:
    """Every accuracy (clean and robust) within FP16_TOL["acc"]; a model without one, its loss within FP16_TOL["loss"]."""
    keys = [k for k in m32 if k.startswith("acc")] or ["loss"]
    return all(close(m16[k], m32[k], k, FP16_TOL["acc"], FP16_TOL["loss"]) for k in keys)


def train(job: Job, run_dir: Path, reuse: bool) -> float:
    """Train `job` into `run_dir` (skipped with `reuse` when a best checkpoint is there); seconds taken."""
    if reuse and (run_dir / "checkpoint" / "best" / "model.safetensors").exists():
        return 0.0
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists; remove it or pass --reuse")
    cmd = [sys.executable, "-m", "efficient", "train", job.recipe, *job.overrides, "--out", str(run_dir)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def build(job: Job, run_dir: Path) -> tuple[torch.nn.Module, dict, dict]:
    """(model with the run's best weights, its model options, the run's data section)."""
    from efficient.config import load_yaml

    name, options = zoo._run_dir_model(run_dir / "config.yaml")
    assert name == job.name, f"{job.recipe} trains {name}, not {job.name}"
    model = zoo.load(run_dir)
    zoo.load_weights(model, run_dir / "checkpoint" / "best" / "model.safetensors")
    return model, options, dict(load_yaml(run_dir / "config.yaml")["data"])


def fp16_copy(job: Job, model: torch.nn.Module, options: dict, out: Path) -> torch.nn.Module:
    """Save `model` with fp16 weights to `out` and load it back (fp32 compute, as users load it)."""
    half = copy.deepcopy(model).half()
    zoo.save_model(half, out, job.name, options)
    return zoo.load(job.name, pretrained=out, **options)


def run_job(job: Job, runs: Path, args: argparse.Namespace, manifest: dict) -> dict:
    run_dir = runs / f"{job.name}-{job.tag}"
    secs = train(job, run_dir, args.reuse)
    model, options, data = build(job, run_dir)
    m32 = evaluate_recipe(model, ROOT / job.recipe, job.overrides)
    metric = headline(m32)
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "w.safetensors"
        m16 = evaluate_recipe(fp16_copy(job, model, options, f16), ROOT / job.recipe, job.overrides)
        use16 = fp16_unchanged(m32, m16)
        f32 = Path(tmp) / "w32.safetensors"
        zoo.save_model(model, f32, job.name, options)
        src = f16 if use16 else f32
        shipped = m16 if use16 else m32
        target = hub.WEIGHTS_DIR / f"{job.name}-{job.tag}.safetensors"
        sha = hub.sha256_file(src)
        size = src.stat().st_size
        if args.write:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read_bytes())
    over = (" " + " ".join(shlex.quote(o) for o in job.overrides)) if job.overrides else ""
    record = {
        "file": target.name, "sha256": sha, "dataset": data.get("name", "?"), "metrics": shipped, "metric": metric,
        "recipe": job.recipe, "overrides": job.overrides,
        "command": f"efficient train {job.recipe}{over} --out runs/zoo/{job.name}-{job.tag}",
        "config": options, "data": data, "dtype": "float16" if use16 else "float32", "fp32_metrics": m32,
        "default": job.default,
    }
    old = manifest.get(job.name, {}).get(job.tag)
    ok = old is None or close(shipped[metric], old["metrics"][metric], metric, args.tol_acc, args.tol_loss)
    print(json.dumps({"job": job.key, "train_s": round(secs, 1), "fp32": m32, "fp16": m16, "shipped_dtype": record["dtype"],
                      "bytes": size, "sha256": sha, "recorded": old["metrics"] if old else None, "matches_recorded": ok}), flush=True)
    return {"record": record, "ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=str(ROOT / "runs" / "zoo"), help="where the training runs go (default runs/zoo)")
    ap.add_argument("--only", nargs="*", help="NAME:TAG jobs to run (default: all)")
    ap.add_argument("--reuse", action="store_true", help="reuse a run dir that already has a best checkpoint")
    ap.add_argument("--write", action="store_true", help="ship the new files and records into efficient/weights/")
    ap.add_argument("--tol-acc", type=float, default=0.02, help="retrained vs recorded accuracy, absolute (default 0.02)")
    ap.add_argument("--tol-loss", type=float, default=0.02, help="retrained vs recorded loss, relative (default 0.02)")
    args = ap.parse_args()
    jobs = [j for j in JOBS if not args.only or j.key in args.only]
    if args.only and len(jobs) != len(args.only):
        raise SystemExit(f"--only: known jobs are {', '.join(j.key for j in JOBS)}")
    torch.set_num_threads(1)
    manifest = json.loads(hub.MANIFEST.read_text()) if hub.MANIFEST.exists() else {}
    new = copy.deepcopy(manifest)
    failed = []
    for job in jobs:
        res = run_job(job, Path(args.runs), args, manifest)
        new.setdefault(job.name, {})[job.tag] = res["record"]
        if not res["ok"]:
            failed.append(job.key)
    if args.write:
        hub.write_manifest(new)
    print("all metrics match the recorded ones" if not failed else f"metrics differ from the recorded ones: {', '.join(failed)}")
    return 1 if failed and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
