"""Progress lines of a benchmark's long setup phases (the drafter warm-up's first run takes minutes
to an hour on 2 CPU cores), on stderr: each phase's first and last line and one every `every_s`
seconds between, with the phase's own ETA from its rate so far.

    progress = PhaseProgress("[bench rollout] drafter warm-up")
    progress("answers", 128, 1920)        # [bench rollout] drafter warm-up: answers 128/1920; ETA 21.4 min
    warmup_drafter(..., on_progress=progress.warmup)   # drafter_warmup's (done, total, what) callback
"""

from __future__ import annotations

import sys
import time


class PhaseProgress:
    def __init__(self, prefix: str, every_s: float = 30.0):
        self.prefix, self.every_s = prefix, every_s
        self._phase, self._phase_start, self._last = "", 0.0, 0.0

    def __call__(self, phase: str, done: int, total: int, message: str = "") -> None:
        now = time.perf_counter()
        if self._phase == phase and now - self._last < self.every_s and done < total:
            return
        if self._phase != phase:
            self._phase, self._phase_start = phase, now
        self._last = now
        rate = done / (now - self._phase_start) if done and now > self._phase_start else 0.0
        eta = f"; ETA {(total - done) / rate / 60:.1f} min" if rate and done < total else ""
        text = f" {message}" if message else ""
        print(f"{self.prefix}: {phase} {done}/{total}{text}{eta}", file=sys.stderr, flush=True)

    def warmup(self, done: int, total: int, what: str) -> None:
        """drafter_warmup.Progress: `what` ("answers", "steps") is the phase."""
        self(what, done, total)
