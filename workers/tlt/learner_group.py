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
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0  # a rank that waits this long for its peers fails (a dead rank's peers too)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class LearnerRankImpl:
    """One rank: its shard of the policy (and reference), its shard of AdamW, the GRPO loss."""

    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): rank 0's answer is every rank's rendezvous."""
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, rank: int, world: int, addr: str, port: int, policy_folder: str, cfg, pad_id: int,
              device: str, threads: int) -> bool:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from .grpo import GRPOLearner
        from .model import Transformer
        from .sampling import sampling_params

        torch.set_num_threads(threads)
        self.rank, self.world, self.cfg = rank, world, cfg
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # checkpoints write in the background with their own collectives: a group of their own
        self._ckpt_group = dist.new_group(backend="gloo")
        self.mesh = init_device_mesh(device, (world,))
        self.sync_dtype = getattr(torch, cfg.model.dtype)  # what the rollout workers hold
        self.policy = self._sharded(Transformer.from_pretrained(policy_folder, dtype=torch.float32,
                                                                device=self.device))
        ref = None
        if cfg.grpo.kl_coef > 0:
            ref = self._sharded(Transformer.from_pretrained(policy_folder, dtype=torch.float32, device=self.device))
        self.learner = GRPOLearner(self.policy, cfg.grpo, pad_id=pad_id, sampling=sampling_params(cfg.rollout),
                                   ref=ref, rank=rank, world=world)
        self._publisher = None
        self._saving = None
        return True

    def _sharded(self, model):
        """fully_shard each decoder layer, then the root (embedding, final norm and the tied LM head)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.device.type == "cuda" and self.sync_dtype == torch.bfloat16:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()  # fp32 throughout
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp)
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        return model

    def step(self, batch, harvest_hidden: bool) -> dict[str, Any]:
        metrics = self.learner.step(batch, harvest_hidden=harvest_hidden)
        hidden = self.learner.last_hidden
        self.learner.last_hidden = None
        return {"metrics": metrics, "hist": self.learner.last_mismatch_hist,
                "hidden": {i: h for i, h in enumerate(hidden or []) if h is not None}}

    def _full_params(self):
        """(name, full tensor in the workers' dtype), one parameter at a time: all-gathering is a
        collective, so every rank walks the same list."""
        for name, p in self.policy.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, full.detach().to(self.sync_dtype)

    def publish(self, version: int, bucket_bytes: int, shared_memory: bool) -> Any:
        """Rank 0 writes the full weights into buckets and returns their manifest; the others take
        part in the all-gathers only."""
        if self.rank != 0:
            for _ in self._full_params():
                pass
            return None
        from .weight_sync import BucketPublisher

        if self._publisher is None:
            self._publisher = BucketPublisher("policy", bucket_bytes, shared_memory=shared_memory)
        return self._publisher.publish(version, self._full_params())

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The whole policy state on rank 0 (CPU), e.g. for the HF folder of a checkpoint; None elsewhere."""
        out = {n: t.cpu() for n, t in self._full_params()}
        return out if self.rank == 0 else None

    # --- checkpoints (torch.distributed.checkpoint) ---------------------------------------------

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.policy, self.learner.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, folder: str) -> bool:
        """Start a sharded write (each rank its shards); the step goes on while it writes."""
        import torch.distributed.checkpoint as dcp

        self.wait_saved()
        self._saving = dcp.async_save(self._state(), checkpoint_id=folder, process_group=self._ckpt_group)
        return True

    def saved(self) -> bool:
        """True when no sharded write is in progress (re-raises a failed one)."""
        if self._saving is not None and self._saving.done():
            self.wait_saved()
        return self._saving is None

    def wait_saved(self) -> bool:
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.result()
        return True

    def load(self, folder: str) -> bool:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(self.policy, self.learner.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return True

    def close(self) -> bool:
        import torch.distributed as dist

        self.wait_saved()
        if self._publisher is not None:
            self._publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True


LearnerRank = ray.remote(LearnerRankImpl)


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
        return get_all([getattr(r, method).remote(*args) for r in self.ranks], self.timeout_s,
                       what or f"learner {method}")

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
            get_all([r.close.remote() for r in self.ranks], 60.0, "closing the learner ranks")
        except Exception as exc:  # noqa: BLE001 - a dead rank: kill the rest anyway
            log.warning("closing learner ranks: %s", exc)
        for r in self.ranks:
            ray.kill(r)
        self.ranks = []
