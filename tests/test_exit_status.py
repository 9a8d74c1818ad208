"""early_exit.py (tests/conftest.py's hooks) ends the pytest process itself once pytest has
reported: the process still exits with pytest's status, and a crash in the interpreter's teardown
no longer turns a passing run into a failing one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

# a native crash while Python frees its modules, as Ray's core worker can (ray-project/ray#31145)
CRASH_AT_TEARDOWN = "import atexit, ctypes\natexit.register(ctypes.string_at, 0)\n"


def pytest_status(tmp_path: Path, body: str, teardown: str = "", plugin: str = "early_exit") -> int:
    """The exit status of pytest run on one test (`body`) with the early_exit plugin (or without:
    plugin="no:early_exit")."""
    folder = tmp_path / f"probe{len(list(tmp_path.iterdir()))}"  # a fresh folder: no stale bytecode
    folder.mkdir()
    (folder / "test_probe.py").write_text(f"{teardown}\n\ndef test_probe():\n    {body}\n")
    # -c /dev/null: none of the repository's pytest settings (Django's among them) reach the probe
    run = subprocess.run([sys.executable, "-m", "pytest", "-c", "/dev/null", "-p", "no:cacheprovider",
                          "-p", "no:django", "-p", plugin, "--rootdir", str(folder), str(folder / "test_probe.py")],
                         cwd=folder, env={**os.environ, "PYTHONPATH": str(TESTS)}, capture_output=True, text=True,
                         timeout=120)
    return run.returncode


@pytest.mark.parametrize(("body", "status"), [("assert 1 == 1", 0), ("assert 1 == 2", 1)])
def test_the_process_exits_with_pytests_own_status(tmp_path, body, status):
    assert pytest_status(tmp_path, body) == status


def test_a_crash_in_the_interpreters_teardown_no_longer_decides_the_status(tmp_path):
    # without the plugin the crash is the process's status, whatever pytest found
    assert pytest_status(tmp_path, "assert 1 == 1", teardown=CRASH_AT_TEARDOWN, plugin="no:early_exit") < 0
    assert pytest_status(tmp_path, "assert 1 == 1", teardown=CRASH_AT_TEARDOWN) == 0
    assert pytest_status(tmp_path, "assert 1 == 2", teardown=CRASH_AT_TEARDOWN) == 1
