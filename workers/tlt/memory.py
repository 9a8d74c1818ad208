"""Giving freed heap memory back to the OS between a run's big phases.

glibc keeps what a process frees for its own reuse, so a process's resident size stays at its peak.
A CPU run's processes peak in different phases (the driver in the drafter warm-up, the learner in a
GRPO step, a rollout worker in a long tail's KV caches) and share one machine's memory, so each
hands its peak back once the phase is over (malloc_trim; a no-op where libc is not glibc).

Measured on a 24 GB machine (2 cores, SmolLM2-135M, the smollm2-mathmix-cpu preset): an uncached
warm-up left the driver at 7.2 GB through RL, beside the learner (7.9 GB) and two rollout workers
(3.4 GB each), and Ray killed the learner at the fifth step of a first run; later, with the
driver trimmed, the learner at 8.2 GB and the workers at 4.4 and 5.1 GB, the learner's final
checkpoint (DCP stages a copy of the weights and AdamW's moments) crossed Ray's 95% line at the
last step of the e2e bench's TLT arm.
"""

from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    """Hand the heap pages freed so far back to the OS (glibc's malloc_trim)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
