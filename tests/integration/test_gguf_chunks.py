"""The packaged model's chunked carry to the GPU machine (tools/gguf_chunks.sh here, tools/gpu_gguf_unpack.sh
there) on a fake GGUF file: the two parts join to the file byte for byte, part 2 on a machine that went
cold says so (exit 3), and a corrupt part or parts of two different files are refused (exit 4)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(cwd / "tools" / script), *args], cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True
    )


def _checkout(tmp_path: Path, name: str) -> Path:
    """A fake 'remote' checkout: only the tools travel, as the device call's working tree."""
    root = tmp_path / name
    (root / "tools").mkdir(parents=True)
    for script in ("gguf_chunks.sh", "gpu_gguf_unpack.sh"):
        shutil.copy(REPO / "tools" / script, root / "tools" / script)
    return root


def test_two_parts_join_to_the_file_and_a_cold_machine_or_a_bad_part_is_refused(tmp_path):
    here = _checkout(tmp_path, "here")
    gguf = tmp_path / "Model.Q4_1.gguf"
    gguf.write_bytes(os.urandom(5 << 19))  # 2.5 MiB: parts of 1 and 1.5 MiB
    env = {"LOOP_GGUF": str(gguf), "C1_MIB": "1"}
    made = _run("gguf_chunks.sh", env=env, cwd=here)
    assert made.returncode == 0, made.stderr
    assert (here / ".model-chunks/c1/smollm2.gguf.1").stat().st_size == 1 << 20
    assert "up to date" in _run("gguf_chunks.sh", env=env, cwd=here).stdout

    remote, target = _checkout(tmp_path, "remote"), tmp_path / "device-tmp"
    device = {"GGUF_DIR": str(target)}
    shutil.copytree(here / ".model-chunks/c2", remote / ".model-chunks/c2")  # call 2 alone: the machine is cold
    assert _run("gpu_gguf_unpack.sh", "2", env=device, cwd=remote).returncode == 3
    shutil.copytree(here / ".model-chunks/c1", remote / ".model-chunks/c1")
    assert _run("gpu_gguf_unpack.sh", "1", env=device, cwd=remote).returncode == 0
    joined = _run("gpu_gguf_unpack.sh", "2", env=device, cwd=remote)
    assert joined.returncode == 0, joined.stderr
    assert (target / gguf.name).read_bytes() == gguf.read_bytes()

    part = remote / ".model-chunks/c2/smollm2.gguf.2"
    part.write_bytes(part.read_bytes()[:-1] + b"\0")  # corrupted on the way
    assert _run("gpu_gguf_unpack.sh", "2", env=device, cwd=remote).returncode == 4

    other = tmp_path / "Model.Q4_1.gguf"  # a rebuilt file, its part 2 carried after the old part 1
    assert _run("gpu_gguf_unpack.sh", "1", env=device, cwd=remote).returncode == 0
    other.write_bytes(os.urandom(5 << 19))
    assert _run("gguf_chunks.sh", env=env, cwd=here).returncode == 0
    shutil.copy(here / ".model-chunks/c2/smollm2.gguf.2", part)
    shutil.copy(here / ".model-chunks/c2/smollm2.gguf.2.json", part.with_name("smollm2.gguf.2.json"))
    mixed = _run("gpu_gguf_unpack.sh", "2", env=device, cwd=remote)
    assert mixed.returncode == 4 and "another file" in mixed.stderr
