#!/usr/bin/env bash
# Every GPU check of the kernels and models in one run on a CUDA GPU (about 9 minutes on an H200),
# in this order (correctness before speed; each part has its own time limit, so a slow part cannot
# take the others down):
#  lif     Triton LIF/PLIF/DLIF vs the torch reference over every option, dtype, T in {1, 4, 16},
#          odd and strided inputs; fwd+bwd speed vs spikingjelly 2.0 (its Triton and torch paths)
#          and torch.compile; the kernels' share of copy bandwidth            (bench/neurons.py)
#  stata   SSA + token selection vs their references at CIFAR/ImageNet/N=1024 shapes, whole-model
#          gradients with Triton vs torch kernels (bench/stata_kernels.py); training steps of
#          spikingjelly's Spikformer vs ours vs STATA at CIFAR b64 and ImageNet b32, fp32 and bf16
#          autocast (bench/stata.py)
#  ee      ee-gpt-small trained with recipes/ee_gpt_small.yaml for a fixed time, then decoding speed
#          per exit strategy and threshold (bench/early_exit.py) and the exit kernels
#          (bench/ee_kernels.py)
#
#   bash bench/gpu.sh [all|lif|stata|ee ...]      (from the repository root)
#   GPU_DRY=1 bash bench/gpu.sh                    (rehearsal on CPU: tiny shapes, Triton interpreter)
#
# Logs and JSON go to $WORK (default runs/gpu) and, where $OUT is set, are packed into
# $OUT/gpu_results.tar.gz, with the combined log beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
WORK=${WORK:-runs/gpu}
DRY=${GPU_DRY:-0}
PARTS=${*:-all}
mkdir -p "$WORK"
LOG="$WORK/gpu.log"
status=0

pack() {
  if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/gpu_results.tar.gz" --exclude="*.safetensors" --exclude="*.pt" -C "$WORK" . 2>/dev/null || true
    cp "$LOG" "$OUT/gpu.log" 2>/dev/null || true
  fi
}
trap pack EXIT

# whole-run budget: a part gets at most what is left of it, so the results are packed before any
# outer time limit (a lent GPU's, a job scheduler's) ends the run
BUDGET=${GPU_BUDGET_S:-575}

# part NAME LIMIT_S CMD...: runs one check under its own time limit, logging to $WORK/NAME.txt
part() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS - 5))
  if [ "$left" -lt 15 ]; then
    echo "=== $name: skipped, ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"
    status=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.txt" >>"$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$LOG"
  tail -n 25 "$WORK/$name.txt"
  [ "$rc" = 0 ] || status=1
  pack
}
want() { [[ " $PARTS " == *" all "* || " $PARTS " == *" $1 "* ]]; }

if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
  DEV=cpu
  echo "dry run on CPU (Triton interpreter, tiny shapes)" | tee -a "$LOG"
else
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')" || exit 1
  DEV=cuda
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
fi
$PY -c "import torch, triton, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"

if want lif; then
  if [ "$DRY" = 1 ]; then
    part lif 300 $PY bench/neurons.py --gpu --dry-run
  else
    part lif 110 env SJ_LIF_CUDA_IMPLEMENTATION=triton $PY bench/neurons.py --gpu --shapes 4x32x24576,8x64x65536 --repeats 20 --json "$WORK/lif.json"
  fi
fi

if want stata; then
  if [ "$DRY" = 1 ]; then
    part stata_kernels 300 $PY bench/stata_kernels.py --device cpu --dry-run
    part stata_cifar 400 $PY bench/stata.py --device cpu --only cifar --batch 2 --steps 1 --warmup 0 --amp fp32 --threads 1
    part stata_imagenet 400 $PY bench/stata.py --device cpu --only imagenet --imagenet-batch 1 --imagenet-img 64 --imagenet-steps 1 --warmup 0 --amp fp32 --threads 1
  else
    part stata_kernels 60 $PY bench/stata_kernels.py --device cuda --json "$WORK/stata_kernels.json"
    part stata_cifar 75 $PY bench/stata.py --device cuda --only cifar --batch 64 --steps 20 --warmup 3 --amp fp32,bf16 --json "$WORK/stata_cifar.json"
    part stata_imagenet 80 $PY bench/stata.py --device cuda --only imagenet --imagenet-batch 32 --imagenet-steps 20 --warmup 2 --amp fp32,bf16 --json "$WORK/stata_imagenet.json"
  fi
fi

if want ee; then
  RUN="$WORK/ee_gpt_small"
  rm -rf "$RUN"
  if [ "$DRY" = 1 ]; then
    part ee_train 300 $PY -m efficient train recipes/ee_gpt_small.yaml model.n_layer=4 model.n_embd=64 model.n_head=2 \
      model.exit_layers=[1,2] data.seq_len=64 data.batch_size=4 train.max_steps=6 train.device=cpu --out "$RUN"
    part ee_decode 300 $PY bench/early_exit.py "$RUN" --device cpu --prompts 2 --new-tokens 8 --unpaired --repeats 1 \
      --val-batches 2 --sweep recompute=auto speculative=0.5 copy=auto --targets --json "$WORK/early_exit.json"
    part ee_kernels 300 $PY bench/ee_kernels.py --device cpu --dry-run --json "$WORK/ee_kernels.json"
  else
    # a fixed GPU-time budget: SIGINT makes the trainer save its checkpoint and stop cleanly
    part ee_train 170 timeout -s INT -k 20 140 $PY -m efficient train recipes/ee_gpt_small.yaml --out "$RUN"
    part ee_decode 110 $PY bench/early_exit.py "$RUN" --device cuda --prompts 20 --new-tokens 256 --unpaired --repeats 1 \
      --val-batches 23 --sweep recompute=auto speculative=0.8,0.5 copy=auto --targets --budget-s 85 --json "$WORK/early_exit.json"
    part ee_kernels 60 $PY bench/ee_kernels.py --device cuda --repeats 20 --budget-s 40 --json "$WORK/ee_kernels.json"
  fi
  # the run's small files come back; its weights stay (hundreds of MB)
  find "$RUN" -name "*.safetensors" -delete 2>/dev/null; find "$RUN" -name "*.pt" -delete 2>/dev/null
fi
echo "gpu.sh: $( [ $status = 0 ] && echo all parts passed || echo some part failed: see the === lines )" | tee -a "$LOG"
exit $status
