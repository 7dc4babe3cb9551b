"""vLLM's chunked carry to the GPU machine (tools/vllm_chunks.sh here, tools/gpu_vllm_unpack.sh there),
on fake wheels with vLLM's layout and a fake 'remote' checkout: the two parts reassemble the install
byte for byte, part 2 on a machine that went cold says so (exit 3), and a corrupt chunk is refused
(exit 4). Offline: every wheel the fake lock names is already in the wheels folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# path in the wheel -> where an install puts it (None: the chunks leave it out)
VLLM_FILES = {
    "vllm/__init__.py": "vllm/__init__.py",
    "vllm/_C_stable_libtorch.abi3.so": "vllm/_C_stable_libtorch.abi3.so",  # alone in chunk 2
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": (
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so"
    ),
    "vllm-0.0.1.dist-info/METADATA": "vllm-0.0.1.dist-info/METADATA",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": None,
    "vllm/_moe_C_stable_libtorch.abi3.so": None,
    "vllm/vllm-rs": None,
    "vllm/third_party/deep_gemm/include/deep_gemm.h": None,
    "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": None,
}
DEP_FILES = {
    "fakedep/__init__.py": "fakedep/__init__.py",
    "fakedep-1.0.data/purelib/fakedep_extra.py": "fakedep_extra.py",
    "fakedep-1.0.data/scripts/fakedep": None,
    "fakedep-1.0.dist-info/METADATA": "fakedep-1.0.dist-info/METADATA",
}


def _payload(name: str) -> bytes:
    """Deterministic content, large and incompressible enough for the .so files to matter."""
    size = 300_000 if name.endswith(".so") else 200
    seed = hashlib.sha256(name.encode()).digest()
    return b"".join(hashlib.sha256(seed + i.to_bytes(4, "little")).digest() for i in range(size // 32))


def _wheel(path: Path, files: dict[str, str | None]) -> str:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in files:
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 2, 3, 4, 6))
            info.external_attr = (0o755 if name.endswith("vllm-rs") else 0o644) << 16
            archive.writestr(info, _payload(name))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def chunks(tmp_path_factory):
    """(chunks folder, the site tree an install of the fake wheels gives: path -> bytes)."""
    root = tmp_path_factory.mktemp("vllm-chunks")
    wheels = root / "downloaded"
    wheels.mkdir()
    vllm = _wheel(wheels / "vllm-0.0.1-cp38-abi3-manylinux_2_28_x86_64.whl", VLLM_FILES)
    dep = _wheel(wheels / "fakedep-1.0-py3-none-any.whl", DEP_FILES)
    lock = root / "fake.lock"
    lock.write_text(f"# fake\nvllm==0.0.1 --hash=sha256:{vllm}\nfakedep==1.0 --hash=sha256:{dep}\n")
    out = root / "out"
    env = {"VLLM_LOCK": str(lock), "VLLM_CHUNKS_DIR": str(out), "VLLM_WHEELS_FROM": str(wheels)}
    built = _run(["bash", "tools/vllm_chunks.sh"], REPO, **env)
    assert built.returncode == 0, built.stdout + built.stderr
    again = _run(["bash", "tools/vllm_chunks.sh"], REPO, **env)
    assert again.returncode == 0 and "up to date" in again.stdout, again.stdout + again.stderr
    installed = {target: _payload(name) for name, target in {**VLLM_FILES, **DEP_FILES}.items() if target}
    return out, installed


def _remote(tmp_path: Path) -> tuple[Path, Path]:
    """A device-side checkout holding the unpack script (what every call's working tree brings)."""
    remote = tmp_path / "remote"
    (remote / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "gpu_vllm_unpack.sh", remote / "tools")
    return remote, tmp_path / "tmp-site"


def _carry(remote: Path, chunks_dir: Path, part: int) -> None:
    shutil.copytree(chunks_dir / f"c{part}", remote / ".vllm-chunks" / f"c{part}", dirs_exist_ok=True)


def _unpack(remote: Path, site: Path, part: int) -> subprocess.CompletedProcess:
    return _run(
        ["bash", "tools/gpu_vllm_unpack.sh", str(part)], remote, VLLM_SITE=str(site), VLLM_UNPACK_SKIP_IMPORT="1"
    )


def _field(text: str, name: str) -> str:
    return json.loads(text)[name]


def _tree(site: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(site)): path.read_bytes()
        for path in site.rglob("*")
        if path.is_file() and path.name != ".vllm-chunks.json"
    }


def test_part_2_on_a_machine_that_went_cold_exits_3_and_says_so(chunks, tmp_path):
    out, _ = chunks
    remote, site = _remote(tmp_path)
    _carry(remote, out, 2)
    done = _unpack(remote, site, 2)
    assert done.returncode == 3
    assert "part 1's files are not in" in done.stderr and "went cold" in done.stderr
    assert not (site / "vllm").exists()


def test_the_two_parts_reassemble_the_install_byte_for_byte(chunks, tmp_path):
    out, installed = chunks
    remote, site = _remote(tmp_path)
    _carry(remote, out, 1)
    first = _unpack(remote, site, 1)
    assert first.returncode == 0, first.stderr
    assert not (site / "vllm" / "_C_stable_libtorch.abi3.so").exists()  # chunk 2's one file
    _carry(remote, out, 2)  # the second call carries chunk 2; chunk 1's folder may stay or not
    shutil.rmtree(remote / ".vllm-chunks" / "c1")
    second = _unpack(remote, site, 2)
    assert second.returncode == 0, second.stderr
    assert "part 2: 1 files" in second.stdout
    assert _tree(site) == installed  # FA2, MoE, vllm-rs, headers, other Pythons' builds and scripts left out
    assert os.access(site / "vllm" / "_C_stable_libtorch.abi3.so", os.X_OK)
    # Part 1 again (a retried first call) starts from an empty folder and is then complete again.
    _carry(remote, out, 1)
    assert _unpack(remote, site, 1).returncode == 0
    assert _unpack(remote, site, 2).returncode == 0 and _tree(site) == installed


def test_a_corrupt_chunk_is_refused_with_a_clear_error(chunks, tmp_path):
    out, _ = chunks
    remote, site = _remote(tmp_path)
    _carry(remote, out, 1)
    assert _unpack(remote, site, 1).returncode == 0
    _carry(remote, out, 2)
    archive = remote / ".vllm-chunks" / "c2" / "vllm-c2.tar.xz"
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    done = _unpack(remote, site, 2)
    assert done.returncode == 4 and "vllm-c2.tar.xz is corrupt" in done.stderr
    assert not (site / "vllm" / "_C_stable_libtorch.abi3.so").exists()


def test_a_truncated_chunk_whose_record_matches_fails_to_extract_clearly(chunks, tmp_path):
    """The sha256 check passes when the record was rewritten too; xz's own check still catches it."""
    out, _ = chunks
    remote, site = _remote(tmp_path)
    _carry(remote, out, 1)
    archive = remote / ".vllm-chunks" / "c1" / "vllm-c1.tar.xz"
    archive.write_bytes(archive.read_bytes()[:-4096])
    record = archive.with_name("vllm-c1.json")
    record.write_text(
        record.read_text().replace(
            _field(record.read_text(), "sha256"), hashlib.sha256(archive.read_bytes()).hexdigest()
        )
    )
    done = _unpack(remote, site, 1)
    assert done.returncode == 4 and "could not be extracted" in done.stderr, done.stderr


def test_chunks_of_two_different_builds_are_refused(chunks, tmp_path):
    out, _ = chunks
    remote, site = _remote(tmp_path)
    _carry(remote, out, 1)
    assert _unpack(remote, site, 1).returncode == 0
    _carry(remote, out, 2)
    record = remote / ".vllm-chunks" / "c2" / "vllm-c2.json"
    record.write_text(record.read_text().replace(_field(record.read_text(), "build"), "0123456789abcdef"))
    done = _unpack(remote, site, 2)
    assert done.returncode == 4 and "chunk 2 is from build 0123456789abcdef" in done.stderr


def test_the_real_lock_pins_vllm_for_the_images_torch_with_a_hash_on_every_line():
    lines = [
        line.split("#", 1)[0].strip()
        for line in (REPO / "requirements" / "gpu-vllm.lock").read_text().splitlines()
        if line.split("#", 1)[0].strip()
    ]
    assert lines[0].startswith("vllm==0.26.0 --hash=sha256:")
    assert all(" --hash=sha256:" in line and "==" in line for line in lines)
    names = [line.split("==", 1)[0] for line in lines]
    assert len(names) == len(set(names))
    # Never carried: the image's own torch stack and numpy (vLLM 0.26.0 is built for torch 2.11.0).
    assert not {"torch", "numpy", "transformers", "tokenizers", "numba", "triton"} & set(names)
