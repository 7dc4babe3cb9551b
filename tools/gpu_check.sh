#!/usr/bin/env bash
# `make gpu-check`: the GPU battery (benchmarks/gpu_check.py), results in $GPU_CHECK_OUT.
# On the GPU machine (CUDA torch in python3, no network) the wheels tools/gpu_wheels.sh brought in
# .gpu-wheels/ are installed beside the image's packages with --no-index --target. Without CUDA the
# battery runs in CPU mode in this checkout's .venv, and says so in its first line.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-gpu-check-out}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  if ! python3 -c 'import trl, datasets' 2>/dev/null; then
    [ -d .gpu-wheels ] || { echo "gpu-check: trl/datasets are missing and there is no .gpu-wheels/: run 'bash tools/gpu_wheels.sh' where there is network and carry .gpu-wheels" >&2; exit 2; }
    # The folder's name must contain "site-packages": dill (datasets' fingerprints) pickles modules by
    # value from any other path, and fails on pyarrow's types.
    site="${GPU_SITE:-/tmp/loop-gpu/site-packages}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu-wheels/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  exec env PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m benchmarks.gpu_check --out "$out" "$@"  # src/: no install of this checkout here
fi
bash tools/ensure_venv.sh
exec .venv/bin/python -m benchmarks.gpu_check --out "$out" --mode cpu "$@"
