#!/usr/bin/env bash
# On the GPU machine: join the packaged model's GGUF from the two parts tools/gguf_chunks.sh made, one per
# device call (a call carries at most 64 MiB; a warm machine keeps /tmp between calls for 30 s).
#   bash tools/gpu_gguf_unpack.sh 1   keeps part 1 in $GGUF_DIR (default /tmp/loop-gguf)
#   bash tools/gpu_gguf_unpack.sh 2   appends part 2 and checks the whole file's sha256; prints its path
# Exit codes: 3 = part 1 is not there (the machine went cold between the calls: issue both again, the
# second at once); 4 = a part is corrupt, or the parts are of different files; 2 = usage or a missing part.
#
# The two device calls (here: `make gpu-wheels gpu-model-chunks` first; nothing else may run between them):
#   call 1: carry [".gpu-wheels", ".model-chunks/c1"]
#     bash tools/gpu_gguf_unpack.sh 1 && GPU_CHECK_OUT=$OUT/gc1 bash tools/gpu_check.sh --sections offload
#   call 2 (at once, within the 30 s warm window): carry [".model-chunks/c2"] (with .gpu-wheels it would be
#   over 64 MiB; call 1 installed them in /tmp/loop-gpu/site-packages, which the warm machine kept)
#     bash tools/gpu_gguf_unpack.sh 2 && PYTHONPATH=/tmp/loop-gpu/site-packages GPU_CHECK_OUT=$OUT/gc2
#       bash tools/gpu_check.sh --sections long_horizon_english
# (one line each on the device; call 1 may run any section that needs no GGUF. The sections that read it,
# real_model and long_horizon_english, take $LOOP_SMOLLM2_GGUF, default
# /tmp/loop-gguf/SmolLM2-135M-Instruct.Q4_1.gguf. The working tree travels too, and with the committed warm
# starts it is too large beside a part: run both calls after `git sparse-checkout set --no-cone '/*'
# '!/benchmarks/results/'`, and `git sparse-checkout disable` afterwards.)
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
case "$part" in
  1 | 2) ;;
  *)
    echo "usage: bash tools/gpu_gguf_unpack.sh 1|2" >&2
    exit 2
    ;;
esac
python3 - "$part" "${GGUF_DIR:-/tmp/loop-gguf}" "${MODEL_CHUNKS_DIR:-.model-chunks}" <<'PY'
import hashlib, json, pathlib, sys

part, target, chunks = int(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])


def fail(code, message):
    print(f"gpu_gguf_unpack: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


piece_path = chunks / f"c{part}" / f"smollm2.gguf.{part}"
manifest_path = piece_path.with_name(piece_path.name + ".json")
if not piece_path.is_file() or not manifest_path.is_file():
    fail(2, f"{piece_path} or its manifest is missing: carry {chunks}/c{part} in this call")
try:
    manifest = json.loads(manifest_path.read_text())
except ValueError as error:
    fail(4, f"{manifest_path} is corrupt ({error})")
piece = piece_path.read_bytes()
if hashlib.sha256(piece).hexdigest() != manifest["part_sha256"]:
    fail(4, f"{piece_path} is corrupt (its sha256 is not its manifest's): run `make gpu-model-chunks` again")
held = target / f"{manifest['sha256']}.part1"
if part == 1:
    target.mkdir(parents=True, exist_ok=True)
    held.write_bytes(piece)
    print(f"gpu_gguf_unpack: part 1 ({len(piece) / 2**20:.1f} MiB) kept in {held}", flush=True)
    sys.exit(0)
if not held.is_file():
    if any(target.glob("*.part1")):
        fail(4, f"the part 1 in {target} is of another file than this part 2 ({manifest['file']}): "
                "carry both parts from one `make gpu-model-chunks`")
    fail(3, f"part 1 is not in {target} (the machine went cold between the two calls): "
            "issue call 1 again, then call 2 at once")
whole = held.read_bytes() + piece
if len(whole) != manifest["size"] or hashlib.sha256(whole).hexdigest() != manifest["sha256"]:
    fail(4, f"the joined file is not {manifest['file']} (size or sha256 differ): carry both parts again")
out = target / manifest["file"]
out.write_bytes(whole)
held.unlink()
print(f"gpu_gguf_unpack: {out} ({len(whole) / 2**20:.1f} MiB, sha256 {manifest['sha256'][:16]}...)", flush=True)
PY
