#!/usr/bin/env bash
# Every GPU check of the kernels and models in one run on a CUDA GPU (< 10 minutes), results under
# $OUT (default runs/gpu):
#  1. LIF: Triton-vs-reference correctness over every option and dtype, then forward+backward speed
#     vs spikingjelly's Triton LIF and the kernels' share of copy bandwidth (exit 1 on a mismatch;
#     speed targets printed as PASS/FAIL).
#  2. STATA: training step dense vs STATA vs spikingjelly's Spikformer (CIFAR, batch 32) and the
#     ImageNet-sized pair, with the Triton SSA and token-selection kernels (`auto` on CUDA).
#  3. Early-exit kernels: exit_confidence and linear_ce (Triton) vs the plain torch path, time and
#     peak memory, results checked equal.
#   bash bench/gpu.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" || true
export SJ_LIF_CUDA_IMPLEMENTATION=triton   # compare against spikingjelly's Triton LIF kernels
status=0
timeout 300 $PY bench/neurons.py --gpu --shapes 4x32x24576,8x64x65536 --repeats 20 2>&1 | tee "$OUT/neurons.txt" || status=1
timeout 150 $PY bench/stata.py --device cuda --only cifar --batch 32 --steps 10 --warmup 3 --json "$OUT/stata_cifar.json" 2>&1 | tee "$OUT/stata_cifar.txt" || status=1
timeout 90 $PY bench/stata.py --device cuda --only imagenet --imagenet-batch 8 --imagenet-steps 5 --json "$OUT/stata_imagenet.json" 2>&1 | tee "$OUT/stata_imagenet.txt" || status=1
timeout 90 $PY bench/ee_kernels.py --device cuda --repeats 10 2>&1 | tee "$OUT/ee_kernels.txt" || status=1
exit $status
