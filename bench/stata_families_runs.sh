#!/usr/bin/env bash
# Dense vs STATA on cluttered digits for the QKFormer, Spikingformer and Meta-SpikeFormer (SDT v2)
# recipes (BENCHMARKS.md `## stata`, the newer spiking transformers): seeds 0-4 (SEEDS to change),
# one thread per run, JOBS runs at a time (default 2), seed-major so that finished seeds are
# complete pairs. Results: $OUT/<recipe>_s<seed>/summary.json; then, per model,
#   python bench/stata_vs_dense.py --dense $OUT/qkformer_cluttered_s{0..4} --stata $OUT/qkformer_stata_cluttered_s{0..4}
set -u
OUT=${OUT:-runs/families}
MODELS=${MODELS:-qkformer spikingformer sdt_v2}
mkdir -p "$OUT"
for s in ${SEEDS:-0 1 2 3 4}; do
  for m in $MODELS; do
    for r in ${m}_cluttered ${m}_stata_cluttered; do
      [ -f "$OUT/${r}_s$s/summary.json" ] || echo "$r $s"
    done
  done
done | xargs -P "${JOBS:-2}" -L 1 sh -c \
  '.venv/bin/efficient train recipes/$0.yaml train.seed=$1 train.progress=false --out '"$OUT"'/$0_s$1 > '"$OUT"'/$0_s$1.log 2>&1; echo "$0 seed $1 exit $?"'
