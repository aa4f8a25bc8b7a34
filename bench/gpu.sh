#!/usr/bin/env bash
# LIF kernels on a CUDA GPU (< 8 minutes): Triton-vs-reference correctness over every option and
# dtype, then forward+backward speed vs spikingjelly's Triton LIF and the kernels' share of copy
# bandwidth. Exit status 1 if any correctness case fails; speed targets are printed as PASS/FAIL.
#   bash bench/gpu.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
export SJ_LIF_CUDA_IMPLEMENTATION=triton   # compare against spikingjelly's Triton LIF kernels
timeout 420 $PY bench/neurons.py --gpu --shapes 4x32x24576,8x64x65536 --repeats 20
