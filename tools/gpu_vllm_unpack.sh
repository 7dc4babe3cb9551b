#!/usr/bin/env bash
# On the GPU machine: reassemble vLLM from the two chunks tools/vllm_chunks.sh built, one per device
# call (a call carries at most 64 MiB; a warm machine keeps /tmp between calls for 30 s).
#   bash tools/gpu_vllm_unpack.sh 1   extracts .vllm-chunks/c1 into the site folder
#   bash tools/gpu_vllm_unpack.sh 2   extracts .vllm-chunks/c2 beside it, then checks `import vllm`
# Site folder: $VLLM_SITE (default /tmp/site). Exit codes: 3 = part 1's files are not there (the
# machine went cold between the calls: issue both calls again, the second at once); 4 = a chunk is
# corrupt or the two chunks are from different builds; 1 = vLLM does not import. Part 1 empties the
# site folder first (only one this script made). VLLM_UNPACK_SKIP_IMPORT=1 skips the import check.
#
# The two device calls (here: `make gpu-wheels gpu-vllm-chunks` first; nothing else may run between them).
# The working tree travels with each call: with the committed warm starts it is 51.6 MB, too much beside a
# chunk, so leave benchmarks/results/ out while the calls run (it is not needed there):
#   git sparse-checkout set --no-cone '/*' '!/benchmarks/results/'   ... calls ...   git sparse-checkout disable
#   call 1: carry [".gpu-wheels", ".vllm-chunks/c1"]  (~3 + ~11 + 36 MiB)
#     bash tools/gpu_vllm_unpack.sh 1 && python3 -m pip install -q --no-index --no-deps --no-compile
#       --no-cache-dir --upgrade --target /tmp/loop-gpu/site-packages .gpu-wheels/*.whl
#   call 2 (at once, within the 30 s warm window): carry [".vllm-chunks/c2"]  (~3 + 54 MiB)
#     bash tools/gpu_vllm_unpack.sh 2 && HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
#       PYTHONPATH=$PWD/src:/tmp/loop-gpu/site-packages:/tmp/site python3 -m benchmarks.gpu_check
#       --sections vllm --out $OUT/gpu-check-vllm
# (one line each on the device; /tmp/loop-gpu/site-packages is where tools/gpu_check.sh installs
# .gpu-wheels, and it comes first: its pins are the CPU lock's, the ones the battery is tested with.)
# Call 1 may run the other sections after the install, e.g. `&& GPU_CHECK_OUT=$OUT/gpu-check bash
# tools/gpu_check.sh --sections memory update loop_bf16` (vllm needs /tmp/site, so not there): the
# warm window starts when call 1 returns. Call 2's vllm section: 89 s on an H200 (2026-11-30), at most 420 s
# (`--seconds` lowers it); `python3 -m benchmarks.overlap --gpu ...` runs there too (the server's wheels are
# in the chunks).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
site=${VLLM_SITE:-/tmp/site}
chunks=${VLLM_CHUNKS_DIR:-.vllm-chunks}
case "$part" in
  1 | 2) ;;
  *)
    echo "usage: bash tools/gpu_vllm_unpack.sh 1|2" >&2
    exit 2
    ;;
esac

python3 - "$part" "$site" "$chunks" <<'EOF'
import hashlib, json, pathlib, shutil, sys, tarfile, time

part, site, chunks = int(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
marker = site / ".vllm-chunks.json"  # written after each part: the build and the parts extracted


def fail(code, message):
    print(f"gpu_vllm_unpack: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


archive = chunks / f"c{part}" / f"vllm-c{part}.tar.xz"
described = chunks / f"c{part}" / f"vllm-c{part}.json"
if not archive.is_file() or not described.is_file():
    fail(2, f"{archive} or {described.name} is missing: carry {chunks}/c{part} in this call")
try:
    expected = json.loads(described.read_text())
except ValueError as error:
    fail(4, f"{described} is corrupt ({error})")

try:
    state = json.loads(marker.read_text()) if marker.is_file() else None
except ValueError:
    state = None  # a part cut off while writing it: as if it had not run
if part == 2 and (state is None or 1 not in state["parts"]):
    fail(3, f"part 1's files are not in {site} (the machine went cold between the two calls): "
            "issue call 1 again, then call 2 at once")
if part == 2 and state["build"] != expected["build"]:
    fail(4, f"chunk 2 is from build {expected['build']}, the files in {site} from build {state['build']}: "
            "carry chunks from one `make gpu-vllm-chunks`")

started = time.perf_counter()
actual = sha256(archive)
if actual != expected["sha256"]:
    fail(4, f"{archive} is corrupt: sha256 {actual[:16]}..., its build recorded {expected['sha256'][:16]}...")
if part == 1:
    if site.exists() and any(site.iterdir()) and not marker.is_file():
        fail(2, f"{site} holds files this script did not put there: set VLLM_SITE to an empty folder")
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    state = {"build": expected["build"], "parts": []}
try:
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(site, filter="data")  # no absolute paths, no links out, no device files
except (tarfile.TarError, EOFError, OSError) as error:  # lzma.LZMAError is an OSError
    fail(4, f"{archive} could not be extracted ({type(error).__name__}: {error}): rebuild it with "
            "`make gpu-vllm-chunks` and carry it again")
state["parts"] = sorted({*state["parts"], part})
marker.write_text(json.dumps(state))
print(f"gpu_vllm_unpack: part {part}: {expected['files']} files "
      f"({expected['unpacked_bytes'] / 2**20:.0f} MiB) into {site} in {time.perf_counter() - started:.1f} s",
      flush=True)
EOF

if [ "$part" = 2 ] && [ "${VLLM_UNPACK_SKIP_IMPORT:-0}" != 1 ]; then
  # The engine's own imports, before the battery spends minutes on it: the kernels load on the
  # image's torch, the platform is CUDA, and FlashAttention 3 (what Hopper runs) is there.
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -c '
import sys, torch, vllm
from vllm import LLM, SamplingParams  # noqa: F401
import vllm._C_stable_libtorch  # noqa: F401
from vllm.platforms import current_platform
from vllm.vllm_flash_attn import flash_attn_interface as fa
print(f"gpu_vllm_unpack: vllm {vllm.__version__} from {vllm.__file__.rsplit(chr(47), 2)[0]} on torch "
      f"{torch.__version__}, platform {current_platform.device_name}, FA3 "
      f"{fa.FA3_AVAILABLE or fa.FA3_UNAVAILABLE_REASON}", flush=True)
' || { echo "gpu_vllm_unpack: vLLM does not import from $site (above)" >&2; exit 1; }
fi
