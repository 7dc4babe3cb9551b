"""The console scripts (cli/entry_points.py): a Ctrl-C while a command's modules are imported, seven seconds of torch,
transformers and TRL on a CPU machine, ends in one line and exit status 130, like a Ctrl-C later on."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from loop_trainer.cli.entry_points import run_command

REPO = Path(__file__).resolve().parents[3]

# Imported first by a process started with this folder on PYTHONPATH: a SIGINT to the process when the module named
# in INTERRUPT_AT is first imported, as if the user pressed Ctrl-C then.
SITECUSTOMIZE = """
import importlib.abc, os, signal, sys

class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["INTERRUPT_AT"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
"""


def test_a_ctrl_c_while_the_command_imports_is_one_line_and_status_130(tmp_path, monkeypatch, capsys, python_sigint):
    (tmp_path / "slow_to_import.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run_command("loop-train", "slow_to_import", "run", ["--help"]) == 130
    assert capsys.readouterr().err == "loop-train: interrupted while starting; nothing was run\n"
    sys.modules.pop("slow_to_import", None)


def test_a_ctrl_c_that_a_library_drops_while_the_command_imports_still_stops_it(
    tmp_path, monkeypatch, capsys, python_sigint
):
    """CPython drops a KeyboardInterrupt raised in a __del__ (or a weak reference's callback), printing "Exception
    ignored in": once in about 20 Ctrl-Cs during the imports (benchmarks/ctrl_c.py), the command then ran on."""
    (tmp_path / "drops_it.py").write_text(
        "import os, signal, time\n"
        "class Collected:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        time.sleep(5)  # the KeyboardInterrupt ends it, and is dropped\n"
        "Collected()\n"
        "def run(argv):\n"
        "    raise AssertionError('ran')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    assert run_command("loop-train", "drops_it", "run", ["--help"]) == 130
    assert capsys.readouterr().err == "loop-train: interrupted while starting; nothing was run\n"
    assert dropped == [KeyboardInterrupt]  # where CPython prints "Exception ignored in": dropped, not raised
    sys.modules.pop("drops_it", None)


def test_a_ctrl_c_that_a_library_turns_into_another_error_while_the_command_imports_is_one_line(
    tmp_path, monkeypatch, capsys, python_sigint
):
    """Measured (benchmarks/ctrl_c.py): a KeyboardInterrupt inside a __set_name__ became a RuntimeError, which TRL's
    lazy module wrapped in another, and the Ctrl-C ended in a traceback. The same error without a Ctrl-C is raised."""
    (tmp_path / "turns_it.py").write_text(
        "import os, signal, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "except KeyboardInterrupt as error:\n"
        "    raise RuntimeError('Failed to import trl.trainer.utils') from error\n"
    )
    (tmp_path / "fails_to_import.py").write_text("raise RuntimeError('Failed to import trl.trainer.utils')\n")
    # an error of its own after a Ctrl-C that something dropped: the error, not a Ctrl-C, is what to show
    (tmp_path / "fails_after_one.py").write_text(
        "import os, signal, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "raise ImportError('No module named flash_attn')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert run_command("loop-train", "turns_it", "run", ["--help"]) == 130
        assert capsys.readouterr().err == "loop-train: interrupted while starting; nothing was run\n"
        with pytest.raises(RuntimeError, match="Failed to import"):
            run_command("loop-train", "fails_to_import", "run", ["--help"])
        with pytest.raises(ImportError, match="flash_attn"):
            run_command("loop-train", "fails_after_one", "run", ["--help"])
    finally:
        for name in ("turns_it", "fails_to_import", "fails_after_one"):
            sys.modules.pop(name, None)


def test_without_a_ctrl_c_the_command_runs_and_its_status_is_returned(tmp_path, monkeypatch):
    (tmp_path / "a_command.py").write_text("def run(argv):\n    return len(argv)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run_command("loop-train", "a_command", "run", ["a", "b", "c"]) == 3
    sys.modules.pop("a_command", None)


@pytest.mark.parametrize(
    ("program", "first_imported"),
    [
        ("loop-train", "torch"),  # the first heavy import
        ("loop-train", "transformers"),  # torch whole by then: its modules are finalised at exit
        ("loop-eval", "transformers"),
        ("loop-compare", "transformers"),
    ],
)
def test_the_installed_console_scripts_say_one_line_on_a_ctrl_c_during_the_imports(tmp_path, program, first_imported):
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert declared[program].startswith("loop_trainer.cli.entry_points:")  # the light module, not the command's own
    script = Path(sys.executable).parent / program
    assert script.is_file(), f"{script}: the checkout's venv has its console scripts (tools/checkout_venv.sh)"
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "INTERRUPT_AT": first_imported,
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [str(script), "--output_dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr == f"{program}: interrupted while starting; nothing was run\n"
    assert not (tmp_path / "run").exists()
