#!/usr/bin/env bash
# `make gpu-vllm-chunks`: vLLM for the lent GPU machine, in two carry-sized chunks.
#
# vLLM's CUDA wheel (290 MiB) is larger than one device call may carry (64 MiB with the working tree),
# but a warm machine keeps its files between calls, so vLLM travels in two consecutive calls and
# tools/gpu_vllm_unpack.sh reassembles it there (its header has the two calls). This script downloads
# the wheels requirements/gpu-vllm.lock pins (version and hash; the reasons are in the lock), unpacks
# them as an install would (--no-deps: the image's torch, transformers, numpy stay), drops what the
# colocated offline engine never loads, and writes two xz tarballs:
#   .vllm-chunks/c1/vllm-c1.tar.xz  (~35 MiB) vLLM's Python, FA3, the small extensions, all dependencies
#   .vllm-chunks/c2/vllm-c2.tar.xz  (~53 MiB) vllm/_C_stable_libtorch.abi3.so (the core kernels)
# each beside a vllm-cN.json naming its build (a hash of the lock and this script) and its sha256.
# Dropped: FA2 (291 MB; Hopper runs FA3), the optional Rust front end vllm-rs, the MoE kernels
# (dense models only), DeepGEMM/FMHA JIT headers, the deep_gemm extension for other Pythons, and
# the wheels' scripts. Up to date -> nothing is done. ~6 CPU-minutes from scratch (xz).
#
# Environment: VLLM_LOCK (default requirements/gpu-vllm.lock), VLLM_CHUNKS_DIR (default .vllm-chunks),
# VLLM_WHEELS_FROM (a folder of wheels already downloaded: those whose hash the lock names are reused).
set -euo pipefail
cd "$(dirname "$0")/.."
lock=${VLLM_LOCK:-requirements/gpu-vllm.lock}
out=${VLLM_CHUNKS_DIR:-.vllm-chunks}
max_c1_mib=40 # call 1 also carries the ~3.3 MiB tree and .gpu-wheels (<= 24 MiB): 64 MiB in all
max_c2_mib=58 # call 2 carries the tree and this chunk alone
# The build: the lock and this script's code (comments do not count), so a change to either rebuilds.
build=$( (cat "$lock" && grep -v '^[[:space:]]*#' tools/vllm_chunks.sh) | sha256sum | cut -c1-16)

if [ -f "$out/.complete" ] && [ "$(cat "$out/.complete")" = "$build" ] \
  && [ -f "$out/c1/vllm-c1.tar.xz" ] && [ -f "$out/c2/vllm-c2.tar.xz" ]; then
  echo "vllm_chunks: $out is up to date (build $build): c1 $(du -m "$out/c1/vllm-c1.tar.xz" | cut -f1) MiB," \
    "c2 $(du -m "$out/c2/vllm-c2.tar.xz" | cut -f1) MiB"
  exit 0
fi
mkdir -p "$out/wheels"
rm -f "$out/.complete"

# 1. The wheels: keep those already here (or in VLLM_WHEELS_FROM) whose sha256 the lock names; fetch the rest.
missing="$out/wheels/.missing.txt"
python3 - "$lock" "$out/wheels" "${VLLM_WHEELS_FROM:-}" "$missing" <<'EOF'
import hashlib, os, pathlib, re, shutil, sys

lock, wheels, source, missing = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3], pathlib.Path(sys.argv[4])
pins = {}  # sha256 -> requirement line
for line in pathlib.Path(lock).read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        pins[re.search(r"--hash=sha256:([0-9a-f]{64})", line).group(1)] = line


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


have = set()
for wheel in sorted(wheels.glob("*.whl")):
    digest = sha256(wheel)
    if digest in pins:
        have.add(digest)
    else:
        wheel.unlink()  # a version the lock no longer names
for wheel in sorted(pathlib.Path(source).glob("*.whl")) if source else []:
    if (wheels / wheel.name).exists():
        continue
    digest = sha256(wheel)
    if digest in pins and digest not in have:
        try:
            os.link(wheel, wheels / wheel.name)
        except OSError:
            shutil.copyfile(wheel, wheels / wheel.name)
        have.add(digest)
missing.write_text("".join(line + "\n" for digest, line in pins.items() if digest not in have))
print(f"vllm_chunks: {len(have)} of {len(pins)} wheels already here")
EOF
if [ -s "$missing" ]; then
  platforms=()
  for n in 5 12 17 24 26 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --require-hashes -d "$out/wheels" -r "$missing"
fi
rm -f "$missing"

# 2. The two chunks, each member as an install puts it in site-packages (reproducible: sorted, the
#    wheel's own timestamps, root-owned), and a JSON with the build and the archive's sha256.
nice -n 10 python3 - "$lock" "$out" "$build" <<'EOF'
import calendar, hashlib, json, pathlib, re, sys, tarfile, zipfile

lock, out, build = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
hashes = [re.search(r"sha256:([0-9a-f]{64})", line).group(1)
          for line in lock.read_text().splitlines() if line.split("#", 1)[0].strip()]


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


wheels = {sha256(w): w for w in (out / "wheels").glob("*.whl")}
absent = [h for h in hashes if h not in wheels]
if absent:
    sys.exit(f"vllm_chunks: no wheel with sha256 {absent[0]} in {out / 'wheels'}")


def destination(wheel, name):
    """(chunk, path in site-packages), or None for a file the colocated offline engine never loads."""
    top, _, inside = name.partition("/")
    if top.endswith(".data"):  # the wheel's <name>.data/<kind>/... files
        kind, _, rest = inside.partition("/")
        if kind not in ("purelib", "platlib"):
            return None  # scripts, headers, data files: an install puts them outside site-packages
        name = rest
    if wheel.startswith("vllm-"):
        if name == "vllm/vllm-rs" or "_vllm_fa2_C" in name or "_moe_C_stable_libtorch" in name:
            return None
        if "/third_party/" in name and "/include/" in name:
            return None
        if re.search(r"deep_gemm/_C\.cpython-3\d+", name) and "cpython-312" not in name:
            return None
        if name.endswith("_C_stable_libtorch.abi3.so"):
            return 2, name
    return 1, name


members = {1: {}, 2: {}}  # path -> (wheel path, zip member)
for digest in hashes:
    wheel = wheels[digest]
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            target = destination(wheel.name, info.filename)
            if target is None:
                continue
            chunk, path = target
            earlier = members[1].get(path) or members[2].get(path)
            if earlier is not None:
                if earlier[1].CRC != info.CRC:
                    sys.exit(f"vllm_chunks: {path} is in both {earlier[0].name} and {wheel.name}, different")
                continue
            members[chunk][path] = (wheel, info)

for chunk, files in members.items():
    folder = out / f"c{chunk}"
    folder.mkdir(parents=True, exist_ok=True)
    archive_path = folder / f"vllm-c{chunk}.tar.xz"
    partial = archive_path.with_suffix(".partial")
    opened = {}
    with tarfile.open(partial, "w:xz", preset=6, format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files):
            wheel, info = files[path]
            archive = opened.setdefault(wheel, zipfile.ZipFile(wheel))
            entry = tarfile.TarInfo(path)
            entry.size = info.file_size
            entry.mtime = calendar.timegm((*info.date_time, 0, 0, 0))
            executable = (info.external_attr >> 16) & 0o111 or path.endswith(".so")
            entry.mode = 0o755 if executable else 0o644
            with archive.open(info) as source:
                tar.addfile(entry, source)
        size = sum(info.file_size for _, info in files.values())
    for archive in opened.values():
        archive.close()
    partial.replace(archive_path)
    (folder / f"vllm-c{chunk}.json").write_text(json.dumps({
        "part": chunk,
        "build": build,
        "sha256": sha256(archive_path),
        "files": len(files),
        "unpacked_bytes": size,
    }, indent=1) + "\n")
    print(f"vllm_chunks: c{chunk}: {len(files)} files, {size / 2**20:.0f} MiB unpacked, "
          f"{archive_path.stat().st_size / 2**20:.1f} MiB as {archive_path}", flush=True)
EOF

c1=$(du -m "$out/c1/vllm-c1.tar.xz" | cut -f1)
c2=$(du -m "$out/c2/vllm-c2.tar.xz" | cut -f1)
if [ "$c1" -ge "$max_c1_mib" ] || [ "$c2" -ge "$max_c2_mib" ]; then
  echo "vllm_chunks: c1 is $c1 MiB (limit $max_c1_mib), c2 $c2 MiB (limit $max_c2_mib): over what one call carries" >&2
  exit 1
fi
echo "$build" > "$out/.complete"
echo "vllm_chunks: done (build $build): call 1 carries $out/c1 ($c1 MiB) and .gpu-wheels, call 2 $out/c2 ($c2 MiB)"
