"""Stable-SNN rho study under the worst-case attack suite: natural, Gaussian and FGSM-AT training,
rho = 0 vs rho = 1, DLIF vs LIF, several seeds; robust accuracy = the suite's per-example worst case.

    .venv/bin/python bench/robust_study.py [--out runs/robust_study] [--seeds 43 44 45]
        [--regimes natural gaussian fgsm] [--neurons dlif lif] [--eps 8/255 32/255] [--checks-eps 32/255]

Arms: natural (plain classification objective, one per neuron) and, per neuron, Gaussian
(`recipes/stable_snn_digits_eps32.yaml`) and FGSM-AT (`recipes/stable_snn_digits_at_eps32.yaml`) at
rho = 0 and rho = 1, each trained once per seed with the recipe's settings (the screen's eps 32/255
budget: sigma 32/255 / FGSM step 16/255, 20 epochs, 40 % validation split). Every model gets the
suite (`efficient.attacks.worst_case`) at each --eps and the gradient-masking checks at --checks-eps.
The transfer attack's source is the same arm trained with seed + 1 (an independent model of the
same family; trained on demand, shared when seed + 1 is itself a study seed).

Resumable and runnable in pieces: a finished run dir (its checkpoint) is not retrained and a
finished evaluation (a JSON beside the run, keyed by eps, suite sizes and source) is not rerun, so
`--regimes fgsm` or `--seeds 44` can run separately and a final call with everything
(or `--summary-only`) writes the summary: `robust_study.json` and `robust_study.md` in --out, with
mean +- sample std per arm, paired differences rho 1 - rho 0 (and DLIF - LIF) over seeds with a 95 %
t-interval, the checks per model and a verdict.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the package is installed, the recipes live beside this file

RECIPES = {"gaussian": "recipes/stable_snn_digits_eps32.yaml", "fgsm": "recipes/stable_snn_digits_at_eps32.yaml"}
REGIMES = ("natural", "gaussian", "fgsm")
NEURONS = ("dlif", "lif")


def arms(regimes: list[str], neurons: list[str]) -> list[tuple[str, str, str, float | None]]:
    """(arm name, regime, neuron, rho or None for natural)."""
    out = []
    for regime in regimes:
        for neuron in neurons:
            if regime == "natural":
                out.append((f"natural_{neuron}", regime, neuron, None))
            else:
                out += [(f"{regime}_{neuron}_rho{r}", regime, neuron, float(r)) for r in (0, 1)]
    return out


def build_recipe(regime: str, neuron: str, rho: float | None, seed: int, extra: list[str]):
    from efficient.config import apply_overrides, load_yaml, validate

    path = ROOT / RECIPES["gaussian" if regime == "natural" else regime]
    data = load_yaml(path)
    overrides = [f"model.neuron={neuron}", f"train.seed={seed}", "train.progress=false", *extra]
    if regime == "natural":  # same model, data and schedule; clean images, CE only
        data["objective"] = {"name": "classification"}
        overrides = [o for o in overrides if not o.startswith("objective.")]
    else:
        overrides.append(f"objective.rho={rho}")
    return validate(apply_overrides(data, overrides), str(path))


def ensure_trained(out: Path, arm: tuple, seed: int, extra: list[str], wait_s: float = 6 * 3600) -> Path:
    """Train the run unless it finished (summary.json); an interrupted one resumes from its last
    checkpoint. A lock file lets concurrent pieces share a run (e.g. a transfer source): the one
    that gets the lock trains, the others wait for summary.json."""
    import os

    from efficient.io import write_json
    from efficient.train.engine import Trainer

    name, regime, neuron, rho = arm
    run_dir = out / f"{name}_s{seed}"
    if (run_dir / "summary.json").exists():
        return run_dir
    out.mkdir(parents=True, exist_ok=True)
    lock = out / f"{run_dir.name}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        t0 = time.monotonic()
        while not (run_dir / "summary.json").exists():
            if time.monotonic() - t0 > wait_s:
                raise SystemExit(f"{lock} held for {wait_s:.0f} s and {run_dir} is unfinished; if no other process trains it, delete the lock")
            time.sleep(10)
        return run_dir
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        t0 = time.perf_counter()
        resume = (run_dir / "checkpoint" / "last").exists()
        Trainer(build_recipe(regime, neuron, rho, seed, extra), run_dir, resume=resume).fit()
        write_json(run_dir / "study_train_s.json", {"seconds": time.perf_counter() - t0, "resumed": resume})
        print(f"trained {run_dir.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        lock.unlink(missing_ok=True)
    return run_dir


def load_run(run_dir: Path):
    from efficient import zoo

    model = zoo.load(run_dir)
    zoo.load_weights(model, run_dir / "checkpoint" / "best" / "model.safetensors")
    return model.eval()


def cache_path(run_dir: Path, source_dir: Path, eps_text: str, checks: bool, cfg: Any, check_cfg: Any, max_batches: int | None) -> Path:
    """Where one evaluation's result lives: keyed by everything that changes it."""
    key = json.dumps([eps_text, checks, repr(cfg), repr(check_cfg), source_dir.name, max_batches], sort_keys=True)
    return run_dir / f"study_eval_{eps_text.replace('/', '-')}_{hashlib.sha1(key.encode()).hexdigest()[:10]}.json"


def evaluate(run_dir: Path, source_dir: Path, regime: str, neuron: str, rho: float | None, seed: int, eps_text: str,
             checks: bool, cfg: Any, check_cfg: Any, extra: list[str], max_batches: int | None) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from efficient.attacks import masking_checks, parse_eps, worst_case
    from efficient.data import build_data
    from efficient.io import read_json, write_json

    cache = cache_path(run_dir, source_dir, eps_text, checks, cfg, check_cfg, max_batches)
    if cache.exists():
        return read_json(cache)
    torch.set_num_threads(1)
    eps = parse_eps(eps_text)
    recipe = build_recipe(regime, neuron, rho, seed, extra)
    bundle = build_data(recipe.data)
    loader = DataLoader(bundle.val, batch_size=128, shuffle=False, collate_fn=bundle.collate_fn)
    batches = [b for i, b in enumerate(loader) if max_batches is None or i < max_batches]
    model, source = load_run(run_dir), load_run(source_dir)
    suite = worst_case(model, batches, eps, cfg, source=source, seed=seed)
    res: dict[str, Any] = {"run": run_dir.name, "source": source_dir.name, "eps": eps_text, "suite": suite}
    if checks:
        res["checks"] = masking_checks(model, batches, suite, check_cfg, seed=seed)
    write_json(cache, res)
    print(f"{run_dir.name} @ {eps_text}: clean {100 * suite['clean']:.1f}, worst case {100 * suite['worst_case']:.1f}, "
          f"{suite['seconds_per_image']:.2f} s/image" + (f", checks {'pass' if res['checks']['passed'] else 'FAIL'}" if checks else ""),
          flush=True)
    return res


def t_interval(d: list[float]) -> tuple[float, float, float]:
    """Mean and 95 % t-interval of paired differences."""
    from scipy import stats

    m = statistics.mean(d)
    if len(d) < 2:
        return m, float("nan"), float("nan")
    h = stats.t.ppf(0.975, len(d) - 1) * statistics.stdev(d) / len(d) ** 0.5
    return m, m - h, m + h


def mean_sd(v: list[float]) -> str:
    sd = statistics.stdev(v) if len(v) > 1 else 0.0
    return f"{statistics.mean(v):.1f} +- {sd:.1f}"


def verdict(lo: float, hi: float) -> str:
    if lo != lo:
        return "one seed: no interval"
    return "rho = 1 better" if lo > 0 else ("rho = 1 worse" if hi < 0 else "no difference resolved")


def summarise(results: dict, arm_list: list, seeds: list[int], eps_list: list[str], checks_eps: str) -> tuple[dict, str]:
    """Tables per eps: arm rows (clean, worst case, each attack), paired rho and neuron differences, checks."""
    lines = [f"# Stable-SNN rho study under the worst-case suite", "",
             f"seeds {seeds}; accuracy (%) on the validation split, mean +- sample std over seeds; "
             "paired differences per seed with a 95 % t-interval.", ""]
    summary: dict[str, Any] = {"seeds": seeds, "eps": {}}
    for eps in eps_list:
        rows = {a[0]: [results[(a[0], s, eps)] for s in seeds if (a[0], s, eps) in results] for a in arm_list}
        rows = {k: v for k, v in rows.items() if v}
        if not rows:
            continue
        attack_names = [r["attack"] for r in next(iter(rows.values()))[0]["suite"]["attacks"] if r["acc"] is not None]
        lines += [f"## eps {eps}", "", "| arm | seeds | clean | **worst case** | " + " | ".join(attack_names) + " | checks passed |",
                  "|" + "---|" * (5 + len(attack_names))]
        table: dict[str, Any] = {}
        for arm, rs in rows.items():
            clean = [100 * r["suite"]["clean"] for r in rs]
            worst = [100 * r["suite"]["worst_case"] for r in rs]
            per = {a: [100 * next(x["acc"] for x in r["suite"]["attacks"] if x["attack"] == a) for r in rs] for a in attack_names}
            chk = [r["checks"]["passed"] for r in rs if "checks" in r]
            table[arm] = {"clean": clean, "worst_case": worst, "attacks": per, "checks_passed": chk}
            lines.append(f"| {arm} | {len(rs)} | {mean_sd(clean)} | **{mean_sd(worst)}** | " + " | ".join(mean_sd(per[a]) for a in attack_names)
                         + (f" | {sum(chk)}/{len(chk)} |" if chk else " | - |"))
        diffs = []
        lines += ["", "| paired difference | seeds | clean | worst case (95 % CI) | verdict |", "|---|---|---|---|---|"]
        pairs = [(f"{n[:-5]}_rho1", f"{n[:-5]}_rho0", "rho 1 - rho 0") for n in rows if n.endswith("_rho0")]
        pairs += [(n, n.replace("_dlif", "_lif"), "DLIF - LIF") for n in rows if "_dlif" in n]
        for a, b, what in pairs:
            if a not in rows or b not in rows:
                continue
            sa = {r["run"].rsplit("_s", 1)[1]: r for r in rows[a]}
            sb = {r["run"].rsplit("_s", 1)[1]: r for r in rows[b]}
            common = sorted(set(sa) & set(sb))
            if not common:
                continue
            dw = [100 * (sa[s]["suite"]["worst_case"] - sb[s]["suite"]["worst_case"]) for s in common]
            dc = [100 * (sa[s]["suite"]["clean"] - sb[s]["suite"]["clean"]) for s in common]
            m, lo, hi = t_interval(dw)
            v = verdict(lo, hi) if what.startswith("rho") else ("DLIF better" if lo > 0 else "DLIF worse" if hi < 0 else "no difference resolved")
            diffs.append({"a": a, "b": b, "what": what, "seeds": common, "worst_case": dw, "clean": dc, "mean": m, "ci": [lo, hi], "verdict": v})
            lines.append(f"| {a} vs {b} ({what}) | {len(common)} | {statistics.mean(dc):+.1f} | {m:+.1f} [{lo:+.1f}, {hi:+.1f}] "
                         f"({', '.join(f'{x:+.1f}' for x in dw)}) | {v} |")
        if eps == checks_eps:
            lines += ["", f"masking checks at {eps} (failed checks per model):", ""]
            for arm, rs in rows.items():
                for r in rs:
                    if "checks" in r:
                        bad = [c["check"] for c in r["checks"]["checks"] if c["passed"] is False]
                        lines.append(f"- {r['run']}: " + ("all passed" if not bad else "FAIL " + "; ".join(bad)))
        all_runs = [r for rs in rows.values() for r in rs]
        spi = [r["suite"]["seconds_per_image"] for r in all_runs]
        share = {a: statistics.median(next(x["seconds"] for x in r["suite"]["attacks"] if x["attack"] == a) / r["suite"]["seconds"]
                                      for r in all_runs) for a in attack_names}
        lines += ["", f"suite time at {eps}: median {statistics.median(spi):.2f} s per image (range {min(spi):.2f}-{max(spi):.2f}, "
                  f"{len(spi)} models; attacks run on the clean-correct images only, masking checks not included); "
                  "median share per attack: " + ", ".join(f"{a} {100 * v:.0f} %" for a, v in share.items())]
        unique = {a: sum(next(x.get("unique_breaks", 0) for x in r["suite"]["attacks"] if x["attack"] == a) for r in all_runs)
                  for a in attack_names}
        lines += ["", f"examples only one attack broke at {eps} (summed over the {len(all_runs)} models of "
                  f"{sum(r['suite']['n'] for r in all_runs)} images): " + ", ".join(f"{a} {v}" for a, v in unique.items())]
        summary["eps"][eps] = {"arms": table, "differences": diffs,
                               "seconds_per_image": {"median": statistics.median(spi), "min": min(spi), "max": max(spi)},
                               "time_share": share, "unique_breaks": unique}
        lines.append("")
    return summary, "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/robust_study")
    ap.add_argument("--seeds", type=int, nargs="+", default=[43, 44, 45])
    ap.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    ap.add_argument("--neurons", nargs="+", choices=NEURONS, default=list(NEURONS))
    ap.add_argument("--eps", nargs="+", default=["8/255", "32/255"])
    ap.add_argument("--checks-eps", default="32/255", help="the eps at which the masking checks run ('' for none)")
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides for every run (key=value), e.g. train.epochs=1")
    ap.add_argument("--max-batches", type=int, help="evaluate only the first N validation batches of 128 (smoke runs)")
    ap.add_argument("--apgd-steps", type=int, default=100)
    ap.add_argument("--apgd-restarts", type=int, default=2)
    ap.add_argument("--pgd-steps", type=int, default=100)
    ap.add_argument("--pgd-restarts", type=int, default=3)
    ap.add_argument("--pgd-step", type=float, default=0.25, help="PGD step as a fraction of eps")
    ap.add_argument("--transfer-steps", type=int, default=100)
    ap.add_argument("--square-queries", type=int, default=1000)
    ap.add_argument("--summary-only", action="store_true", help="train and attack nothing; summarise what is finished")
    args = ap.parse_args()

    import torch

    from efficient.attacks import CheckConfig, SuiteConfig
    from efficient.io import write_json, write_text

    torch.set_num_threads(1)
    cfg = SuiteConfig(apgd_steps=args.apgd_steps, apgd_restarts=args.apgd_restarts, pgd_steps=args.pgd_steps,
                      pgd_restarts=args.pgd_restarts, pgd_step=args.pgd_step, transfer_steps=args.transfer_steps, square_queries=args.square_queries)
    check_cfg = CheckConfig()
    out = Path(args.out)
    arm_list = arms(args.regimes, args.neurons)
    results: dict[tuple[str, int, str], dict] = {}
    for seed in args.seeds:  # seed-major: an interrupted study still has every arm at the first seeds
        for arm in arm_list:
            name, regime, neuron, rho = arm
            run_dir, source_dir = out / f"{name}_s{seed}", out / f"{name}_s{seed + 1}"
            if not args.summary_only:
                ensure_trained(out, arm, seed, args.set)
                ensure_trained(out, arm, seed + 1, args.set)
            for eps in args.eps:
                if args.summary_only:  # only results of this exact suite, source and checks
                    done = cache_path(run_dir, source_dir, eps, eps == args.checks_eps, cfg, check_cfg, args.max_batches)
                    if done.exists():
                        results[(name, seed, eps)] = json.loads(done.read_text())
                    continue
                results[(name, seed, eps)] = evaluate(run_dir, source_dir, regime, neuron, rho, seed, eps, eps == args.checks_eps,
                                                      cfg, check_cfg, args.set, args.max_batches)
    summary, md = summarise(results, arm_list, args.seeds, args.eps, args.checks_eps)
    summary["suite"] = repr(cfg)
    summary["command"] = " ".join(sys.argv)
    write_json(out / "robust_study.json", summary)
    write_text(out / "robust_study.md", md)
    print(md)


if __name__ == "__main__":
    main()
