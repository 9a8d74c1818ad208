"""Spot drafter training, scheduled by the driver (the single controller, as in verl).

The driver waits on the step's rollouts with ray.wait; a worker whose shard is in packs its
harvested records, then is idle; `SpotRounds` decides what each idle worker trains, and the driver
sends it as one `spot_update` call. There is no coordinator actor and no polling:

    rounds = SpotRounds(num_workers, master_state, data_refs, seed=..., step=..., update_steps=...,
                        data_tokens=..., batch_tokens=..., max_epochs=...,
                        paused=not watch.should_train())   # watch: a DrafterWatch (below)
    jobs = rounds.idle(worker)                 # [(worker, job)] to send now (maybe none: wait for the round)
    jobs = rounds.add_data(refs, tokens)       # more records (a worker packed its shard)
    jobs = rounds.done(worker, result)         # an update came back (whole, or dropped when preempted)
    master, stats = rounds.finish()            # after preemption and every outstanding result

ONE drafter is trained. Training happens in rounds: the idle workers of round v start from the
master weights of version v, each on a disjoint slice of the buffer, for `update_steps` optimizer
steps; when every member has answered, the master becomes the parameter average of the whole
updates (version v+1). A worker still training when the rollout ends is preempted and its update is
dropped whole, so an update is applied whole or not at all and idle workers never drift apart.

A step's training is capped at `max_epochs` passes over the step's data (its trainable tokens over
`batch_tokens` per optimizer step; the round that crosses the cap still runs whole): one step's
answers are a few thousand tokens, and training on them for a whole long tail made the drafter fit
them and lose the warm-up's generality (held-out agreement fell; see the preset), while the
training itself slowed the decoding on the other core.

`DrafterWatch` decides whether a step trains at all (drafter.spot_stale_drop): where an idle core
has another use, spot training waits until the drafter has measurably gone stale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..learn.drafter_train import average_state_dicts


def step_budget(data_tokens: int, batch_tokens: int, max_epochs: float) -> float:
    """Optimizer steps a step's spot training may take: max_epochs passes over data_tokens trainable
    tokens at batch_tokens per step (inf: max_epochs 0, no cap)."""
    if max_epochs <= 0 or batch_tokens <= 0:
        return math.inf
    return math.ceil(max_epochs * data_tokens / batch_tokens)


class DrafterWatch:
    """Spot training on demand: whether the drafter has gone stale since it was last trained.

    On a GPU a worker whose shard is in is idle, and spot training costs nothing. CPU workers lend
    their cores to the tail instead (rollout.lend_idle_cores), so there every core-second of
    training is one the tail does not get; and over the e2e bench's 20 steps the frozen drafter
    accepted as much as the trained one while its steps ran shorter (README "Spot training on
    demand"). With `drop` > 0 a step trains only once the drafter has gone stale: each drafter
    version's acceptance is read from the steps it drafted in (spec/chain4_acceptance, the arm held
    fixed, from steps with at least MIN_PASSES chain passes), the mean of its first REFERENCE_STEPS
    readings is its fresh level, and it is stale when the mean of its RECENT_STEPS latest readings
    (all after those) falls `drop` (a fraction) below that. A trained drafter is a new version and
    starts its own readings. drop 0: every step trains (the paper's schedule).

    One step's reading is noisy: a frozen drafter's ranged 1.55-2.61 over 20 steps of the e2e bench
    (sd 0.27 around 2.14), since a step's tail holds a few answers. Averaging two readings, drop 0.2
    fired 0.6 times per 20 steps on those readings shuffled, and caught a drafter losing 3% a step
    by its ninth step (README "Spot training on demand").
    """

    REFERENCE_STEPS = 2
    RECENT_STEPS = 2
    MIN_PASSES = 50  # chain passes at draft position 1: fewer make a reading mostly noise

    def __init__(self, drop: float = 0.0):
        self.drop = drop
        self.version: int | None = None  # the drafter version the readings belong to
        self.readings: list[float] = []

    def observe(self, version: int, chain_acceptance: float, passes: int) -> None:
        """A step's reading: the drafter version it drafted with, its chain acceptance, the chain passes."""
        if version != self.version:
            self.version, self.readings = version, []
        if passes >= self.MIN_PASSES:
            self.readings.append(float(chain_acceptance))

    @property
    def reference(self) -> float | None:
        """The drafter version's fresh level: the mean of its first REFERENCE_STEPS readings."""
        first = self.readings[: self.REFERENCE_STEPS]
        return sum(first) / len(first) if len(first) == self.REFERENCE_STEPS else None

    def should_train(self) -> bool:
        if self.drop <= 0:
            return True
        ref, n = self.reference, self.RECENT_STEPS
        if ref is None or len(self.readings) < self.REFERENCE_STEPS + n:
            return False
        return sum(self.readings[-n:]) / n < (1.0 - self.drop) * ref

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "readings": list(self.readings)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.version, self.readings = state.get("version"), [float(r) for r in state.get("readings", [])]


@dataclass
class _Round:
    version: int
    members: list[int]
    answered: dict[int, dict[str, Any]] = field(default_factory=dict)


class SpotRounds:
    """The step's spot-training schedule (plain Python: the driver calls it between ray.wait's)."""

    def __init__(self, num_workers: int, master: dict[str, torch.Tensor], data_refs: list[Any], *, seed: int,
                 step: int, update_steps: int, data_tokens: int = 0, batch_tokens: int = 0,
                 max_epochs: float = 0.0, put: Callable[[Any], Any] = lambda x: x, paused: bool = False):
        self.num_workers = num_workers
        self.paused = paused  # the drafter is not stale (DrafterWatch): no round opens, the answers still pack
        self.master = master
        self.version = 0
        self.data_refs = list(data_refs)
        self.data_tokens = data_tokens  # trainable tokens of data_refs (the budget's unit)
        self.batch_tokens, self.max_epochs = batch_tokens, max_epochs  # max_epochs 0: no cap
        self.sent_steps = 0  # optimizer steps of the rounds opened so far (whole or dropped)
        self.seed, self.step, self.update_steps = seed, step, update_steps
        self._put = put  # ray.put in the driver: each version goes to the object store once
        self._master_ref = put(master)
        self.waiting: list[int] = []  # idle workers waiting for the next round
        self.round: _Round | None = None
        self.preempted = False
        self.stats = {"steps": 0, "updates": 0, "dropped": 0, "loss": [], "accuracy": []}
        self.trained_intervals: dict[int, list[tuple[float, float]]] = {}  # whole updates' optimizer time

    def idle(self, worker: int) -> list[tuple[int, dict[str, Any]]]:
        if not self.preempted and worker not in self.waiting:
            self.waiting.append(worker)
        return self._maybe_open()

    def add_data(self, refs: list[Any], tokens: int = 0) -> list[tuple[int, dict[str, Any]]]:
        self.data_refs.extend(refs)
        self.data_tokens += tokens
        return self._maybe_open()

    def budget_left(self) -> bool:
        """Whether the step's epoch cap (module doc) leaves room for another round."""
        return not self.paused and self.sent_steps < step_budget(self.data_tokens, self.batch_tokens, self.max_epochs)

    def done(self, worker: int, result: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
        """A member's answer: {"state": weights or None, "steps", "loss", "accuracy", "interval", "empty"}."""
        r = self.round
        if r is None or worker not in r.members or result.get("version") != r.version:
            return []
        r.answered[worker] = result
        if len(r.answered) == len(r.members):
            self._close()
            if not self.preempted:
                for w in r.members:
                    if w not in self.waiting:
                        self.waiting.append(w)
        return self._maybe_open()

    def preempt(self) -> None:
        """The rollout is over: nothing new starts; members still training drop their updates."""
        self.preempted = True
        self.waiting = []

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The master after this step's spot training, and drafter/* stats (call when every answer is in)."""
        self.preempt()
        if self.round is not None:  # members that never answered (a dead worker): dropped with the round
            self.stats["dropped"] += len(self.round.members) - len(self.round.answered)
            self._close()
        s = self.stats
        out = {"drafter/steps": float(s["steps"]), "drafter/updates": float(s["updates"]),
               "drafter/dropped_updates": float(s["dropped"]), "drafter/version": float(self.version),
               "drafter/data_tokens": float(self.data_tokens)}
        if s["loss"]:
            out["drafter/loss"] = float(sum(s["loss"][-8:]) / len(s["loss"][-8:]))
        if s["accuracy"]:
            out["drafter/accuracy"] = float(sum(s["accuracy"][-8:]) / len(s["accuracy"][-8:]))
        return self.master, out

    # --- internals ----------------------------------------------------------------------------

    def _maybe_open(self) -> list[tuple[int, dict[str, Any]]]:
        if self.preempted or self.round is not None or not self.waiting or not self.data_refs or not self.budget_left():
            return []
        members, self.waiting = self.waiting, []
        self.round = _Round(self.version, members)
        self.sent_steps += len(members) * self.update_steps
        stride = self.num_workers
        return [(w, {"version": self.version, "state": self._master_ref, "refs": list(self.data_refs),
                     # disjoint within a round (rank), rotating over rounds so one member sees all data
                     "slice": ((rank + self.version) % stride, stride), "steps": self.update_steps,
                     "seed": hash((self.seed, self.step, self.version, rank)) & 0x7FFFFFFF})
                for rank, w in enumerate(members)]

    def _close(self) -> None:
        r, self.round = self.round, None
        whole = [(w, a) for w, a in r.answered.items() if a.get("state") is not None]
        self.stats["dropped"] += sum(1 for a in r.answered.values() if a.get("state") is None and a.get("dropped"))
        if not whole:
            return
        self.master = average_state_dicts([a["state"] for _, a in whole])
        self.version += 1
        self._master_ref = self._put(self.master)
        for w, a in whole:
            self.stats["steps"] += int(a.get("steps", 0))
            self.stats["updates"] += 1
            if "loss" in a:
                self.stats["loss"].append(float(a["loss"]))
            if "accuracy" in a:
                self.stats["accuracy"].append(float(a["accuracy"]))
            if a.get("interval"):
                self.trained_intervals.setdefault(w, []).append(tuple(a["interval"]))
