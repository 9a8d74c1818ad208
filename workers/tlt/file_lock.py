"""An exclusive lock between the processes on one machine, held through an open file (fcntl.flock).

The kernel drops it when its holder dies, however it dies (a cancelled run's workers are killed),
so no process can leave it taken; a lock that is a file's existence (torch's FileBaton) can.

    with file_lock.held(path):   # waits for any other holder
        ...
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def held(path: Path) -> Iterator[bool]:
    """Hold the lock at `path` (created, with its folder, if missing). Yields True; False where the
    folder cannot be written, then without a lock (the caller cannot write a cache there either)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = path.open("a")
    except OSError:
        yield False
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
