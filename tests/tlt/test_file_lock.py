"""file_lock: a lock between processes that a killed holder cannot leave taken, and the CPU kernels'
build, which a load killed halfway used to leave locked for every later process."""

from __future__ import annotations

import fcntl
import subprocess
import sys

import pytest

from workers.tlt import file_lock
from workers.tlt.models import cpu_kernels
from workers.tlt.models.policies import REPO_ROOT

HOLD = "import sys, time; from pathlib import Path; from workers.tlt import file_lock\n" \
       "with file_lock.held(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(120)"


def _free(path) -> bool:
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


def test_a_killed_holder_leaves_the_lock_free(tmp_path):
    path = tmp_path / "sub" / "x.lock"  # the folder is made
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not _free(path)  # taken while its holder lives
        holder.kill()
        holder.wait(timeout=30)
        assert _free(path)
        with file_lock.held(path) as locked:
            assert locked and not _free(path)
        assert _free(path)
    finally:
        holder.kill()


def test_an_unwritable_folder_gives_no_lock_and_no_error(tmp_path):
    (tmp_path / "file").write_text("")
    with file_lock.held(tmp_path / "file" / "x.lock") as locked:  # its folder is a file: cannot be made
        assert locked is False


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels cannot be built here")
def test_a_load_killed_holding_torchs_build_lock_does_not_hang_later_ones():
    # torch's lock is a file's existence: a process killed holding it (a cancelled run's worker)
    # left every later process waiting on it for ever, without a word
    baton = REPO_ROOT / "var" / "build" / f"tlt_kernels_{cpu_kernels.build_tag()}" / cpu_kernels.TORCH_BATON
    baton.touch()
    try:
        load = subprocess.run([sys.executable, "-c", "from workers.tlt.models import cpu_kernels; "
                               "print(cpu_kernels.available())"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=600)  # a hang guard: the build itself takes about a minute, once
        left = baton.exists()
    finally:
        baton.unlink(missing_ok=True)
    assert load.stdout.strip().splitlines()[-1] == "True", load.stderr[-2000:]
    assert not left
