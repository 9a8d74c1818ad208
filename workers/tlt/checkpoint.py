"""Run checkpoints: policy, optimizer, RNG, step, bandit and buffer now; the drafter in the background.

Layout under the run's output folder:

    checkpoints/step_000004/policy/            config.json + model.safetensors (Transformer.save_pretrained)
    checkpoints/step_000004/learner/           the learner ranks' shards (torch.distributed.checkpoint:
                                               weights + AdamW, one file per rank, reshardable)
    checkpoints/step_000004/state.pt           optimizer, RNG states, step, bandit, buffer, accounting
    checkpoints/step_000004/drafter.pt         trainable drafter weights only (written asynchronously)
    checkpoints/step_000004/COMPLETE           written last: a folder without it is ignored on resume

    ckpt = CheckpointManager(out / "checkpoints")
    fut = ckpt.save(step, policy=model, state={...}, drafter_state=drafter.trainable_state())
    ...
    ckpt.flush()                               # wait for background writes (end of run, SIGTERM)
    latest = ckpt.latest()                     # Path of the newest complete checkpoint, or None
    data = ckpt.load(latest)                   # {"state": ..., "drafter": ..., "policy_dir": Path}

The drafter is written by one background thread (so writes stay in order); `after_drafter` runs in
that thread too (export + zip for the artifact) and its result is the future's value.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
SHARDED_POLL_S = 0.1  # how often the background thread asks whether the learner's shards are written


def capture_rng() -> dict[str, Any]:
    """Global RNG states of python, numpy and torch (CPU, plus CUDA when present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, root: str | Path, keep: int = 3):
        self.root = Path(root)
        self.keep = keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tlt-ckpt")
        self._pending: list[Future] = []

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def save(self, step: int, *, policy, state: dict[str, Any], drafter_state: dict[str, torch.Tensor] | None,
             after_drafter: Callable[[Path], Any] | None = None, sharded: Callable[[Path], None] | None = None,
             sharded_done: Callable[[], bool] | None = None) -> Future:
        """Write policy + state now; the drafter, the COMPLETE marker and `after_drafter` in the background.

        sharded(folder): starts the learner's own (asynchronous) write into the folder; the marker
        waits until sharded_done() says it has finished, so a checkpoint is COMPLETE only whole.
        """
        folder = self.step_dir(step)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        policy.save_pretrained(folder / "policy")
        torch.save({**state, "step": step}, folder / "state.pt")
        # copy now: the caller keeps training the drafter while the thread writes
        drafter_copy = {k: v.detach().cpu().clone() for k, v in (drafter_state or {}).items()}
        if sharded is not None:
            sharded(folder)
        fut = self._pool.submit(self._finish, folder, drafter_copy, after_drafter, sharded_done)
        self._pending.append(fut)
        return fut

    def _finish(self, folder: Path, drafter_state: dict, after_drafter: Callable[[Path], Any] | None,
                sharded_done: Callable[[], bool] | None = None) -> Any:
        path = folder / "drafter.pt"
        tmp = folder / "drafter.pt.tmp"
        torch.save(drafter_state, tmp)
        tmp.replace(path)
        while sharded_done is not None and not sharded_done():  # polls: never holds the learner up
            time.sleep(SHARDED_POLL_S)
        (folder / COMPLETE).write_text(json.dumps({"drafter": bool(drafter_state)}))
        self._prune()
        return after_drafter(folder) if after_drafter is not None and drafter_state else None

    def _prune(self) -> None:
        done = self.complete_dirs()
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def completed(self) -> list[Any]:
        """Results of background writes that have finished since the last call (re-raises their errors)."""
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        return [f.result() for f in done]

    def flush(self) -> list[Any]:
        """Wait for every background write; returns their results."""
        out = [f.result() for f in self._pending]
        self._pending = []
        return out

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)

    def complete_dirs(self) -> list[Path]:
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step_*") if (p / COMPLETE).exists())

    def latest(self) -> Path | None:
        dirs = self.complete_dirs()
        return dirs[-1] if dirs else None

    @staticmethod
    def load(folder: str | Path) -> dict[str, Any]:
        folder = Path(folder)
        if not (folder / COMPLETE).exists():
            raise FileNotFoundError(f"{folder} is not a complete checkpoint")
        return {
            "state": torch.load(folder / "state.pt", weights_only=False),
            "drafter": torch.load(folder / "drafter.pt", weights_only=True),
            "policy_dir": folder / "policy",
        }
