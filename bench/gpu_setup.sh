#!/usr/bin/env bash
# Installs the package and the peer libraries the GPU checks compare against on a CUDA machine that
# reaches no package registry: its python3 already holds torch, triton, timm, scikit-learn, ...;
# spikingjelly and loguru (its logger) travel as wheels in gpu_wheels/, fetched beforehand with
#   pip download --no-deps -d gpu_wheels spikingjelly==2.0.0 loguru
#   bash bench/gpu_setup.sh            (from the repository root; PYTHON picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ls gpu_wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps gpu_wheels/*.whl
else
  echo "gpu_wheels/ holds no wheels: the spikingjelly rows will be skipped" >&2
fi
$PY -m pip install -q --no-deps --no-build-isolation -e .
$PY - <<'PY'
import importlib, torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.cuda.is_available()}")
# what bench/gpu.sh reaches: the package, spikingjelly's Spikformer, its memopt search and CUDA-graph helper
for name in ("efficient", "spikingjelly", "spikingjelly.activation_based.model.spikformer",
             "spikingjelly.activation_based.memopt", "spikingjelly.activation_based._cuda_graph"):
    try:
        importlib.import_module(name)
        print(f"{name}: ok")
    except Exception as e:  # report, do not stop: the checks that need it say so themselves
        print(f"{name}: {type(e).__name__}: {e}")
PY
