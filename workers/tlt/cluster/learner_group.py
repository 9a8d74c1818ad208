"""The GRPO learner as a worker group: N Ray actors that shard the policy with PyTorch FSDP2.

    group = LearnerGroup.start(cfg, policy_folder, pad_id=task.pad_id, world=2, placement=slots)
    metrics, hidden = group.step(batch, harvest_hidden=False)   # one GRPO update, sharded
    manifest = group.publish(version)       # full weights in buckets, for the rollout workers
    group.save(folder); group.wait_saved()  # torch.distributed.checkpoint, optimizer included
    group.load(folder)                      # resume, at this or another world size (DCP reshards)
    group.close()

The driver stays the single controller: it sends the batch (token ids and rewards, put once in the
object store) and gets the metrics back; weights, gradients and AdamW state live only in the ranks
(FSDP2 `fully_shard` per decoder layer and at the root, over an explicit device mesh: gloo on CPU,
NCCL on GPU; fp32 on CPU, bf16 compute with fp32 master weights and reductions on GPU). Every rank
computes the same row split from the same batch (grpo.split_rows), so no data moves between ranks
except FSDP's own collectives and a few metric sums.

Ranks are set up the usual way: rank 0's node address and a free port there go to every actor,
which calls init_process_group with a timeout, so a dead rank fails its peers' collectives (and
the run) instead of hanging them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import ray
import torch

from .learner_rank import LearnerRankImpl

log = logging.getLogger(__name__)


LearnerRank = ray.remote(LearnerRankImpl)  # the same class runs in-process on a bare GPU node (bench/gpu_check.py)


def get_all(refs: list, timeout: float | None, what: str) -> list:
    """ray.get of every ref, failing at the first error or after `timeout` seconds with a message
    naming what hung (ray.get on a list waits in order and forever)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise TimeoutError(f"{what}: {len(pending)} of {len(refs)} calls still running after {timeout:.0f} s")
        ray.get(ready[0])  # raises the actor's error (or RayActorError for a dead actor) now
    return ray.get(refs)


class LearnerGroup:
    """The driver's handle on the learner ranks (see the module doc)."""

    def __init__(self, ranks: list, bucket_bytes: int, shared_memory: bool, timeout_s: float):
        self.ranks = ranks
        self.world = len(ranks)
        self.bucket_bytes = bucket_bytes
        self.shared_memory = shared_memory
        self.timeout_s = timeout_s
        self.failed = False  # a call failed (a rank died or hung): close() kills instead of asking

    @classmethod
    def start(cls, cfg, policy_folder: str | Path, pad_id: int, world: int, device: str = "cpu",
              actor_options: list[dict[str, Any]] | None = None, threads: int = 1,
              shared_memory: bool = True, timeout_s: float = 1800.0) -> "LearnerGroup":
        """Start `world` ranks (actor_options[r]: Ray options of rank r, e.g. its placement-group bundle)."""
        opts = actor_options or [{"num_cpus": 1} if device == "cpu" else {"num_cpus": 1, "num_gpus": 1}] * world
        ranks = [LearnerRank.options(**o).remote() for o in opts]
        addr, port = ray.get(ranks[0].address.remote(), timeout=timeout_s)
        get_all([r.setup.remote(i, world, addr, port, str(policy_folder), cfg, pad_id, device, threads)
                 for i, r in enumerate(ranks)], timeout_s, "starting the learner ranks")
        return cls(ranks, cfg.grpo.sync_bucket_mb << 20, shared_memory, timeout_s)

    def _all(self, method: str, *args, what: str | None = None) -> list:
        try:
            return get_all([getattr(r, method).remote(*args) for r in self.ranks], self.timeout_s,
                           what or f"learner {method}")
        except Exception:
            self.failed = True  # the peers of a dead rank wait in a collective: nothing to ask them
            raise

    def step(self, batch, harvest_hidden: bool = False) -> tuple[dict[str, float], dict[str, list], list | None]:
        """One GRPO update: (metrics, mismatch histogram, hidden states per row or None)."""
        ref = ray.put(batch)  # once, whatever the world size
        outs = self._all("step", ref, harvest_hidden, what="learner step")
        hidden = None
        if harvest_hidden:
            merged: dict[int, torch.Tensor] = {}
            for o in outs:
                merged.update(o["hidden"])
            hidden = [merged.get(i) for i in range(len(batch.prompts))]
        return outs[0]["metrics"], outs[0]["hist"], hidden

    def publish(self, version: int):
        return self._all("publish", version, self.bucket_bytes, self.shared_memory, what="policy publish")[0]

    def full_state(self) -> dict[str, torch.Tensor]:
        return self._all("full_state")[0]

    def save(self, folder: str | Path) -> None:
        self._all("save", str(folder))

    def wait_saved(self) -> None:
        self._all("wait_saved")

    def saved(self) -> bool:
        return all(self._all("saved"))

    def load(self, folder: str | Path) -> None:
        self._all("load", str(folder))

    def close(self) -> None:
        try:
            if not self.failed:
                get_all([r.close.remote() for r in self.ranks], 60.0, "closing the learner ranks")
        except Exception as exc:  # noqa: BLE001 - a dead rank: kill the rest anyway
            log.warning("closing learner ranks: %s", exc)
        for r in self.ranks:
            ray.kill(r)
        self.ranks = []
