"""One learner rank (no Ray at import: a bare GPU node runs it in-process, see bench/gpu_check.py).

learner_group.py makes it a Ray actor and describes the group; this is its body: FSDP2 over an
explicit device mesh, the GRPO step on this rank's share, publish, and DCP checkpoints.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

import torch

from ..memory import return_freed_memory

COLLECTIVE_TIMEOUT_S = 300.0  # a rank that waits this long for its peers fails (a dead rank's peers too)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class LearnerRankImpl:
    """One rank: its shard of the policy (and reference), its shard of AdamW, the GRPO loss."""

    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): rank 0's answer is every rank's rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, rank: int, world: int, addr: str, port: int, policy_folder: str, cfg, pad_id: int,
              device: str, threads: int) -> bool:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from ..learn.grpo import GRPOLearner
        from ..models.linear import tune
        from ..models.transformer import Transformer
        from ..rollout.sampling import sampling_params

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
        policy = Transformer.from_pretrained(policy_folder, dtype=torch.float32, device=self.device)
        tune(policy)  # this CPU's fastest kernels, for the training products too (a no-op on GPUs)
        self.policy = self._sharded(policy)
        ref = None
        if cfg.grpo.kl_coef > 0:
            ref = self._sharded(Transformer.from_pretrained(policy_folder, dtype=torch.float32, device=self.device))
        self.learner = GRPOLearner(self.policy, cfg.grpo, pad_id=pad_id, sampling=sampling_params(cfg.rollout),
                                   ref=ref, rank=rank, world=world, accumulate_unsharded=self._keep_gathered)
        self._publisher = None
        self._saving = None
        return True

    @property
    def _keep_gathered(self) -> bool:
        """Ranks sharing one CPU machine: memory is plentiful and gloo's TCP traffic competes with the
        step for the same cores, so a layer's gathered weights stay until its backward (no second
        all-gather) and gradients are reduced once per optimizer step, not per micro-batch (2 ranks on
        2 cores, the headline preset's 32-row step: 45.6 -> 35.6 s per two steps in a profile; bench
        learner: 0.91-0.92x of one rank's tokens/s on one VM, 1.17x on a slower one). Not on GPU,
        where both cost a full unsharded copy per rank, nor at one rank, where there is no traffic to
        save and the copies would only add memory (the headline preset's 1024-token rows already take
        ~9 GB there)."""
        return self.device.type == "cpu" and self.world > 1

    def _sharded(self, model):
        """fully_shard each decoder layer, then the root (embedding, final norm and the tied LM head)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.device.type == "cuda" and self.sync_dtype == torch.bfloat16:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()  # fp32 throughout
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp, reshard_after_forward=not self._keep_gathered)
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        return model

    def step(self, batch, harvest_hidden: bool) -> dict[str, Any]:
        wall, cpu = time.perf_counter(), time.process_time()
        metrics = self.learner.step(batch, harvest_hidden=harvest_hidden)
        if self.device.type == "cpu":
            # what share of its cores' time the step got: well below 1, the step waited for cores
            # that other processes held (or, with several ranks, for its peers), not for its own work
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            metrics["learner/cpu_share"] = cpu / max(wall * torch.get_num_threads(), 1e-9)
            return_freed_memory()  # the step's activations and logits: GBs the rollout's workers need next
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
