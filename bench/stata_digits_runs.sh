#!/usr/bin/env bash
# Digits accuracy study for BENCHMARKS.md `## stata`: 3 seeds dense vs STATA with the shipped
# recipes (8 epochs), then the ablation on seed 0 at a 4-epoch budget (alignment terms, keep ratio).
# `bench/stata_digits_runs.sh main` or `... ablation` runs one part; results: runs/stata/*/summary.json.
set -u
OUT=${OUT:-runs/stata}
PART=${1:-all}
E=".venv/bin/efficient train"
run() { name=$1; shift; [ -f "$OUT/$name/summary.json" ] || $E "$@" train.progress=false --out "$OUT/$name" > "$OUT/$name.log" 2>&1; }
if [ "$PART" != ablation ]; then
  for s in 0 1 2; do
    run dense_s$s recipes/spikformer_digits.yaml train.seed=$s
    run stata_s$s recipes/stata_digits.yaml train.seed=$s
  done
fi
if [ "$PART" != main ]; then
  A="recipes/stata_digits.yaml train.epochs=4 profile.enabled=false"
  run abl4_both $A
  run abl4_noalign $A objective.lambda_intra=0 objective.lambda_inter=0
  run abl4_intra $A objective.lambda_inter=0
  run abl4_inter $A objective.lambda_intra=0
  run abl4_keep1.0 $A model.keep_ratio=1.0
  run abl4_keep0.7 $A model.keep_ratio=0.7
  run abl4_dense recipes/spikformer_digits.yaml train.epochs=4 profile.enabled=false
fi
