#!/usr/bin/env bash
# Every GPU check of the kernels and models in one run on a CUDA GPU (about 7 minutes on an H200).
# First every kernel against its reference at the zoo's real shapes in fp32/bf16/fp16 (a mismatch
# fails the run), then the timings; each part has its own time limit inside one whole-run budget:
#  lif_check       Triton LIF/PLIF/DLIF vs the torch reference: every option, dtype, T in {1, 4, 16},
#                  odd and strided inputs                                      (bench/neurons.py)
#  stata_kernels   SSA + token selection vs their references at CIFAR/ImageNet/N=1024 shapes, and
#                  whole-model gradients with Triton vs torch kernels      (bench/stata_kernels.py)
#  ee_kernels      exit_confidence and linear_ce vs their references, then timed (bench/ee_kernels.py)
#  lif_speed       LIF fwd+bwd vs spikingjelly 2.0 (its Triton and torch paths) and torch.compile;
#                  the kernels' share of copy bandwidth
#  stata_cifar/_imagenet  training steps of spikingjelly's Spikformer vs ours vs STATA at CIFAR b64
#                  and ImageNet b32, fp32 and bf16 autocast                      (bench/stata.py)
#  ee_train/_decode  ee-gpt-small trained with recipes/ee_gpt_small.yaml, then decoding speed per
#                  exit strategy and threshold                              (bench/early_exit.py)
# Parts are selected by group: lif, stata, ee (default: all).
#
#   bash bench/gpu.sh [all|lif|stata|ee ...]      (from the repository root)
#   GPU_DRY=1 bash bench/gpu.sh                    (rehearsal on CPU: tiny shapes, Triton interpreter)
#
# Logs and JSON go to $WORK (default runs/gpu) and, where $OUT is set, are packed into
# $OUT/gpu_results.tar.gz, with the combined log beside it; every part's JSON is merged into results.json.
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

# correctness of every kernel first (exit 1 on a mismatch), then the timings
if [ "$DRY" = 1 ]; then
  want lif && part lif_check 300 $PY bench/neurons.py --gpu --dry-run
  want stata && part stata_kernels 300 $PY bench/stata_kernels.py --device cpu --dry-run --json "$WORK/stata_kernels.json"
  want ee && part ee_kernels 300 $PY bench/ee_kernels.py --device cpu --dry-run --dtypes fp32 fp16 --json "$WORK/ee_kernels.json"
  want stata && part stata_cifar 400 $PY bench/stata.py --device cpu --only cifar --batch 2 --steps 1 --warmup 0 --amp fp32 --threads 1
  want stata && part stata_imagenet 400 $PY bench/stata.py --device cpu --only imagenet --imagenet-batch 1 --imagenet-img 64 --imagenet-steps 1 --warmup 0 --amp fp32 --threads 1
else
  want lif && part lif_check 60 $PY bench/neurons.py --gpu --check-only --json "$WORK/lif_check.json"
  want stata && part stata_kernels 60 $PY bench/stata_kernels.py --device cuda --json "$WORK/stata_kernels.json"
  want ee && part ee_kernels 70 $PY bench/ee_kernels.py --device cuda --repeats 20 --budget-s 50 --dtypes fp32 bf16 fp16 --json "$WORK/ee_kernels.json"
  want lif && part lif_speed 90 env SJ_LIF_CUDA_IMPLEMENTATION=triton $PY bench/neurons.py --gpu --speed-only --shapes 4x32x24576,8x64x65536 --repeats 20 --json "$WORK/lif.json"
  want stata && part stata_cifar 75 $PY bench/stata.py --device cuda --only cifar --batch 64 --steps 20 --warmup 3 --amp fp32,bf16 --json "$WORK/stata_cifar.json"
  want stata && part stata_imagenet 80 $PY bench/stata.py --device cuda --only imagenet --imagenet-batch 32 --imagenet-steps 20 --warmup 2 --amp fp32,bf16 --json "$WORK/stata_imagenet.json"
fi

if want ee; then
  RUN="$WORK/ee_gpt_small"
  rm -rf "$RUN"
  if [ "$DRY" = 1 ]; then
    part ee_train 300 $PY -m efficient train recipes/ee_gpt_small.yaml model.n_layer=4 model.n_embd=64 model.n_head=2 \
      model.exit_layers=[1,2] data.seq_len=64 data.batch_size=4 train.max_steps=6 train.device=cpu --out "$RUN"
    part ee_decode 300 $PY bench/early_exit.py "$RUN" --device cpu --prompts 2 --new-tokens 8 --unpaired --repeats 1 \
      --val-batches 2 --sweep recompute=auto speculative=0.5 copy=auto --targets --json "$WORK/early_exit.json"
  else
    # a fixed GPU-time budget: SIGINT makes the trainer save its checkpoint and stop cleanly
    part ee_train 170 timeout -s INT -k 20 140 $PY -m efficient train recipes/ee_gpt_small.yaml --out "$RUN"
    part ee_decode 150 $PY bench/early_exit.py "$RUN" --device cuda --prompts 20 --new-tokens 256 --unpaired --repeats 1 \
      --val-batches 23 --sweep recompute=auto speculative=0.8,0.5 copy=auto --targets --budget-s 120 --json "$WORK/early_exit.json"
  fi
  # the run's small files come back; its weights stay (hundreds of MB)
  find "$RUN" -name "*.safetensors" -delete 2>/dev/null; find "$RUN" -name "*.pt" -delete 2>/dev/null
fi
# every part's JSON in one file
$PY - "$WORK" <<'PY' || status=1
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
merged = {p.stem: json.loads(p.read_text()) for p in sorted(work.glob("*.json")) if p.name != "results.json"}
(work / "results.json").write_text(json.dumps(merged, indent=1))
print(f"results.json: {', '.join(merged)}")
PY
pack
echo "gpu.sh: $( [ $status = 0 ] && echo all parts passed || echo some part failed: see the === lines )" | tee -a "$LOG"
exit $status
