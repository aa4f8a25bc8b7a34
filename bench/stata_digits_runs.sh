#!/usr/bin/env bash
# Digits accuracy study for BENCHMARKS.md `## stata`: 3 seeds dense vs STATA with the shipped
# recipes (8 epochs), then the ablation on seed 0 with the same recipe (alignment terms, keep ratio;
# "both" at rho 0.5 is stata_s0), then keep ratio 0.4 on three seeds, then the energy of the trained
# checkpoints (lean inference path, and every row computed). `bench/stata_digits_runs.sh main`,
# `... ablation` or `... energy` runs one part; results: runs/stata/*/summary.json and stdout.
set -u
OUT=${OUT:-runs/stata}
PART=${1:-all}
E=".venv/bin/efficient train"
run() { name=$1; shift; [ -f "$OUT/$name/summary.json" ] || $E "$@" train.progress=false --out "$OUT/$name" > "$OUT/$name.log" 2>&1; }
if [ "$PART" = all ] || [ "$PART" = main ]; then
  for s in 0 1 2; do
    run dense_s$s recipes/spikformer_digits.yaml train.seed=$s
    run stata_s$s recipes/stata_digits.yaml train.seed=$s
  done
fi
if [ "$PART" = all ] || [ "$PART" = ablation ]; then
  A=recipes/stata_digits.yaml
  run abl_noalign $A objective.lambda_intra=0 objective.lambda_inter=0
  run abl_intra $A objective.lambda_inter=0
  run abl_inter $A objective.lambda_intra=0
  run abl_keep1.0 $A model.keep_ratio=1.0
  run abl_keep0.7 $A model.keep_ratio=0.7
  for s in 0 1 2; do run stata04_s$s $A model.keep_ratio=0.4 train.seed=$s; done
fi
if [ "$PART" = all ] || [ "$PART" = energy ]; then
  R="$OUT/dense_s0 $OUT/dense_s1 $OUT/dense_s2 $OUT/stata_s0 $OUT/stata_s1 $OUT/stata_s2"
  .venv/bin/python bench/stata_energy.py $R $OUT/stata04_s0 $OUT/stata04_s1 $OUT/stata04_s2
  .venv/bin/python bench/stata_energy.py --no-lean $R
fi
