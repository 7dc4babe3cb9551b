#!/usr/bin/env bash
# `make gpu-check`: the GPU battery (benchmarks/gpu_check.py), results in $GPU_CHECK_OUT.
# On the GPU machine (CUDA torch in python3, no network) the wheels tools/gpu_wheels.sh brought in
# .gpu-wheels/ (TRL, datasets, DeepSpeed and what they need) are installed beside the image's packages
# with --no-index --target. DeepSpeed runs there without compiling an op (the zero3 section uses torch's
# AdamW); DS_SKIP_CUDA_CHECK keeps its op checks from refusing nvcc's CUDA version where it differs from
# torch's, and TORCH_CUDA_ARCH_LIST names the H100/H200's sm_90 for any JIT build. Without CUDA the battery
# runs in CPU mode in this checkout's .venv, and says so in its first line (its zero3 section is skipped
# there: .venv has no DeepSpeed; tests/vllm_deepspeed/test_gpu_check_zero3.py runs it in .vllm-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-gpu-check-out}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export DS_SKIP_CUDA_CHECK=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
  missing='import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("trl", "datasets", "deepspeed")))'
  if ! python3 -c "$missing" 2>/dev/null; then
    [ -d .gpu-wheels ] || { echo "gpu-check: trl/datasets/deepspeed are missing and there is no .gpu-wheels/: run 'bash tools/gpu_wheels.sh' where there is network and carry .gpu-wheels" >&2; exit 2; }
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
