"""Wall-clock accounting of a step: who generated, who waited for the tail, who trained the drafter.

Every worker reports absolute `time.time()` stamps (one clock per node; cluster nodes keep theirs
NTP-synchronised, far tighter than a rollout). From them:

    idle      = for each worker, the time between its own last generated token and the end of the
                rollout (the moment the last worker finished): it waits for the tail
    reclaimed = the part of that idle time it spent in drafter optimizer steps of updates that were
                applied (packing records, waiting for a round and dropped updates are not reclaimed)
    timeline  = per worker, segments [kind, start_s, end_s] relative to the rollout start,
                kind in generate | pack | drafter | idle (what `idle/timeline` draws)

    acct = Accounting()
    with acct.phase("rollout"): ...
    scalars, timeline = acct.rollout(t0, [WorkerTimes(...), ...])
    scalars |= acct.timings()          # timing_s/rollout, timing_s/reward, ...
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

PHASES = ("sync", "rollout", "reward", "learner")


@dataclass
class WorkerTimes:
    """One worker's stamps for one step (absolute seconds since the epoch)."""

    worker: int
    gen_start: float
    gen_end: float
    drafter: list[tuple[float, float]] = field(default_factory=list)  # optimizer time of applied updates
    pack: list[tuple[float, float]] = field(default_factory=list)  # putting its records in the object store


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def worker_timeline(w: WorkerTimes, t0: float, rollout_end: float) -> list[list]:
    """Segments of one worker from t0 to rollout_end; pack and drafter time are clipped to the idle window."""
    segs: list[list] = [["generate", w.gen_start - t0, w.gen_end - t0]]
    cursor = w.gen_end
    busy = sorted([("pack", *iv) for iv in w.pack] + [("drafter", *iv) for iv in w.drafter], key=lambda x: x[1])
    for kind, start, end in busy:
        start, end = max(start, cursor), min(end, rollout_end)
        if end <= start:
            continue
        if start > cursor:
            segs.append(["idle", cursor - t0, start - t0])
        segs.append([kind, start - t0, end - t0])
        cursor = end
    if rollout_end > cursor:
        segs.append(["idle", cursor - t0, rollout_end - t0])
    return [[k, round(s, 4), round(e, 4)] for k, s, e in segs]


class Accounting:
    """Per-step phase timings plus running totals of idle and reclaimed worker-seconds."""

    def __init__(self) -> None:
        self.idle_total = 0.0
        self.reclaimed_total = 0.0
        self._phases: dict[str, float] = {}
        self._step_start = time.perf_counter()

    def start_step(self) -> None:
        self._phases = {}
        self._step_start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - t

    def timings(self) -> dict[str, float]:
        out = {f"timing_s/{p}": self._phases.get(p, 0.0) for p in PHASES}
        for name, secs in self._phases.items():
            out.setdefault(f"timing_s/{name}", secs)
        out["timing_s/step"] = time.perf_counter() - self._step_start
        return out

    def rollout(self, t0: float, workers: list[WorkerTimes]) -> tuple[dict[str, float], list[dict]]:
        """idle/* scalars and the idle/timeline series of one rollout started at t0."""
        if not workers:
            return {"idle/worker_s": 0.0, "idle/reclaimed_s": 0.0, "idle/reclaimed_frac": 0.0}, []
        rollout_end = max(w.gen_end for w in workers)
        idle = reclaimed = 0.0
        timeline = []
        for w in sorted(workers, key=lambda w: w.worker):
            window = (w.gen_end, rollout_end)
            idle += window[1] - window[0]
            reclaimed += sum(_overlap(iv, window) for iv in w.drafter)
            timeline.append({"worker": w.worker, "segments": worker_timeline(w, t0, rollout_end)})
        reclaimed = min(reclaimed, idle)
        self.idle_total += idle
        self.reclaimed_total += reclaimed
        return {
            "idle/worker_s": idle,
            "idle/reclaimed_s": reclaimed,
            "idle/reclaimed_frac": reclaimed / idle if idle > 0 else 0.0,
            "idle/worker_s_total": self.idle_total,
            "idle/reclaimed_s_total": self.reclaimed_total,
        }, timeline

    def state_dict(self) -> dict:
        return {"idle_total": self.idle_total, "reclaimed_total": self.reclaimed_total}

    def load_state_dict(self, state: dict) -> None:
        self.idle_total = float(state.get("idle_total", 0.0))
        self.reclaimed_total = float(state.get("reclaimed_total", 0.0))
