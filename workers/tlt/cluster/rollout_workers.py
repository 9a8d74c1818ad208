"""Ray actors of a TLT run: the rollout workers.

The driver (trainer.py) owns the data flow of a step, spot training's schedule included
(spot.py: it waits on the rollouts with ray.wait and sends each idle worker its next update);
these actors own models:

    RolloutWorker   one per GPU or CPU slot (its bundle of the run's placement group): a policy copy,
                    a drafter copy, the SD bandit. `rollout()` generates its shard and returns it at
                    once; `pack()` puts the harvested (tokens, hidden) records in the object store;
                    `spot_update(job)` trains the drafter for one whole update from the round's master
                    weights, on a low-priority thread, until done or `preempt()`ed (a call of its own
                    concurrency group, so it lands while an update runs; the training loop reads a
                    local flag, no remote call per micro-batch). On CPUs, `lend_cores(step, n)` (also
                    "control") lets a worker still decoding take the cores of peers whose shards are in.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
import torch

from ..memory import return_freed_memory
from ..models.linear import chosen_kernels
from .placement import sleeps_while_learning

log = logging.getLogger(__name__)


def _trainable_state(drafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}


def _lowest_cpu_priority() -> None:
    """Spot training runs on cycles nobody else wants: the calling thread gets the lowest CPU priority
    (Linux: per-thread nice 19), so where cores are shared it never slows generation or the learner."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: training still runs, just not yielding
        log.debug("could not lower the spot-training thread's CPU priority")


class RolloutWorkerImpl:
    """One rollout worker: policy + drafter copies, the SD bandit, spot drafter training."""

    def __init__(self, worker_id: int, model_config, cfg, device: str = "cpu", threads: int = 1,
                 max_threads: int = 1):
        from ..models.drafter import Drafter
        from ..models.linear import set_decode_threads
        from ..models.transformer import Transformer

        torch.set_num_threads(threads)
        if device == "cpu" and max_threads > threads:  # kernels chosen for the lent cores too (linear.tune)
            set_decode_threads(threads, max_threads)
        self.threads = threads  # its own intra-op threads; up to max_threads while it decodes on lent cores
        self._cores = threads  # the threads the decode loop may take now (lend_cores)
        self._step: int | None = None  # the step whose rollout runs (a late lend for another is ignored)
        self.id = worker_id
        self.cfg = cfg
        self.device = torch.device(device)
        dtype = getattr(torch, cfg.model.dtype)
        self.policy = Transformer(model_config).to(device=self.device, dtype=dtype).eval()
        for p in self.policy.parameters():
            p.requires_grad_(False)
        self.drafter = Drafter(model_config, self.policy).to(device=self.device, dtype=dtype)
        self._trainer = None
        self.spot = cfg.run.tlt and cfg.drafter.spot_training
        if self.spot:
            self._get_trainer()  # the optimizer's first construction imports a lot: not on the idle clock
        self._bandit = None
        self.drafter_version = 0  # the version of the last drafter manifest loaded (0: none)
        self._record_cache: dict = {}
        self.engine = None  # rollout.engine vllm: built on first use (vLLM is imported only then)
        self._asleep = False  # sleep() .. wake(): the engine's device memory is the learner's
        self._kv_asleep = False  # wake() .. load_weights(): weights back, KV cache not yet
        self._spot_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tlt-spot-w{worker_id}",
                                             initializer=_lowest_cpu_priority)
        self._preempted = threading.Event()  # set by preempt(): a flag the training loop reads for free
        self._last: tuple[int, list[list[int]], Any] | None = None  # (step, prompts, result) to pack

    def _engine(self):
        """The vLLM engine over this worker's current weights, exported once to local folders."""
        if self.engine is None:
            from ..models.export import export_drafter, export_policy

            rc = self.cfg.rollout
            root = self._engine_dir = Path(tempfile.mkdtemp(prefix=f"tlt-vllm-w{self.id}-"))
            policy_dir = export_policy(self.policy, root / "policy")
            drafter_dir = export_drafter(self.drafter, root / "drafter") if self.cfg.run.tlt else None
            kw: dict[str, Any] = {"max_num_seqs": rc.vllm_max_num_seqs,
                                  "max_model_len": min(self.policy.config.max_position_embeddings,
                                                       rc.max_new_tokens + rc.vllm_max_prompt_len)}
            if rc.vllm_gpu_memory_utilization is not None:
                kw["gpu_memory_utilization"] = rc.vllm_gpu_memory_utilization
            if sleeps_while_learning(self.cfg, gpu=self.device.type == "cuda"):
                kw["sleep_mode"] = True
            self.engine = self.engine_factory(self.cfg, policy_dir, drafter_dir, **kw)
            log.info("worker %d: vLLM engine over %s (hidden states: %s)", self.id, root,
                     getattr(self.engine, "returns_hidden", False))
        return self.engine

    def close(self) -> bool:
        """Shut the vLLM engine down and remove its exported folders (a policy copy each)."""
        engine, self.engine = self.engine, None
        try:
            self._preempted.set()
            if engine is not None and hasattr(engine, "close"):
                engine.close()
        finally:
            if getattr(self, "_engine_dir", None) is not None:
                shutil.rmtree(self._engine_dir, ignore_errors=True)
                self._engine_dir = None
        return True

    # --- the learner phase on a shared device -----------------------------------------------------

    def sleep(self) -> float:
        """Give the device's memory to the colocated learner until wake(); seconds taken."""
        t = time.perf_counter()
        if not self._asleep:
            if self.engine is not None:
                self.engine.sleep()
            elif self.device.type == "cuda":  # the built-in engine's KV caches are freed after each rollout
                torch.cuda.empty_cache()
            self._asleep = True
        return time.perf_counter() - t

    def wake(self) -> float:
        """Undo sleep() before the next weight sync, the engine's weights only: its KV cache comes
        back once load_weights has written the new ones, so the update never needs both at once.
        Seconds taken (0 when awake)."""
        t = time.perf_counter()
        if self._asleep:
            if self.engine is not None:
                self.engine.wake_up(["weights"])
                self._kv_asleep = True
            self._asleep = False
        return time.perf_counter() - t

    @staticmethod
    def engine_factory(cfg, policy_dir, drafter_dir, **kw):
        """Builds the vLLM engine (tests put an object with the same small interface here)."""
        from ..rollout.vllm_engine import VllmRolloutEngine

        return VllmRolloutEngine.from_config(cfg, policy_dir, drafter_dir, **kw)

    # --- weights ------------------------------------------------------------------------------

    def load_weights(self, policy, drafter) -> int:
        """The step's weights: weight_sync manifests (buckets the learner / the driver published), or
        plain state dicts (tests, tools). Strict: a sync that does not cover the model fails here.
        A drafter manifest whose version this worker already holds is skipped. Returns bytes read."""
        from .weight_sync import Manifest, receive

        nbytes = 0
        if isinstance(policy, Manifest):
            nbytes += receive(policy, dict(self.policy.named_parameters()))
        elif policy is not None:
            self.policy.load_state_dict(policy, strict=True)
        if policy is not None and self.policy.config.tie_word_embeddings:
            self.policy.lm_head.weight = self.policy.model.embed_tokens.weight
        drafter_changed = False
        if isinstance(drafter, Manifest):
            if drafter.version != self.drafter_version:
                nbytes += receive(drafter, self.drafter.state_dict())
                self.drafter_version, drafter_changed = drafter.version, True
        elif drafter:
            self.drafter.load_state_dict(drafter)
            drafter_changed = True
        if self.engine is not None:  # in place, no restart; the drafter after each step's spot training
            if policy is not None:
                self.engine.update_policy(self.policy)
            if drafter_changed and self.cfg.run.tlt:
                self.engine.update_drafter(self.drafter)
            if self._kv_asleep:  # the new weights are in: now the KV cache may take its memory back
                self.engine.wake_up(["kv_cache"])
                self._kv_asleep = False
        self._record_cache.clear()
        return nbytes

    def worker_state(self) -> dict[str, Any]:
        """What a resumed run needs from this worker, as plain picklable data for checkpoints: the SD
        bandit (windows of passes, its RNG) and the spot trainer (its AdamW moments and step count;
        the weights it holds are replaced by the master drafter at the next sync anyway)."""
        trainer = self._trainer
        return {"bandit": self._bandit, "drafter_trainer": trainer.state_dict() if trainer is not None else None}

    def load_worker_state(self, state: dict[str, Any] | None) -> bool:
        state = state or {}
        bandit = state.get("bandit")
        # a bandit pickled by an older version (per-pass rates, no `passes`; or `passes` a list by
        # bucket, before arms were rated per thread count) starts afresh: it relearns its arms within
        # a few dozen passes, where its old layout would fail at the first select
        self._bandit = bandit if isinstance(getattr(bandit, "passes", None), dict) else None
        if state.get("drafter_trainer") is not None:
            self._get_trainer().load_state_dict(state["drafter_trainer"])
        return True

    def _spec_policy(self, tlt: bool):
        from ..rollout.engine import SpecPolicy

        # baseline: never speculate, but still measure the tail at the same threshold
        return SpecPolicy.from_config(self.cfg.spec, enabled=tlt)

    def _get_trainer(self):
        if self._trainer is None:
            from ..learn.drafter_train import DrafterTrainer

            self._trainer = DrafterTrainer(self.drafter, self.cfg.drafter, seed=self.cfg.run.seed + self.id)
        return self._trainer

    # --- a step -------------------------------------------------------------------------------

    def _generate(self, prompts: list[list[int]], eos_ids: list[int], seed: int, tlt: bool):
        from ..rollout.engine import generate
        from ..rollout.sampling import sampling_params

        rc = self.cfg.rollout
        params = sampling_params(rc)
        if rc.engine == "vllm":  # its own SD switch (dynamic by batch size) and EAGLE drafter
            return self._engine().generate(prompts, params, max_new_tokens=rc.max_new_tokens, eos_ids=eos_ids,
                                           seed=seed)
        spec = self._spec_policy(tlt)
        if tlt and self._bandit is None:  # one bandit per worker, learning over the whole run
            self._bandit = spec.new_bandit(True, seed=self.cfg.run.seed + 1000 * self.id)
        lends = self.device.type == "cpu" and rc.lend_idle_cores
        return generate(
            self.policy, prompts, params, max_new_tokens=rc.max_new_tokens, eos_ids=eos_ids,
            drafter=self.drafter if tlt else None, spec=spec, bandit=self._bandit if tlt else None,
            seed=seed, harvest_hidden=tlt and self.spot, threads=(lambda: self._cores) if lends else None,
        )

    def rollout(self, step: int, prompts: list[list[int]], eos_ids: list[int], seed: int, tlt: bool) -> dict[str, Any]:
        """Generate one sample per prompt row; the records (pack) and spot training follow as their own calls."""
        self._preempted.clear()  # a new step: spot training may run again once this shard is in
        self._step, self._cores = step, self.threads
        torch.set_num_threads(self.threads)  # on this thread: the last rollout may have ended on lent cores
        gen_start = time.time()
        res = self._generate(prompts, eos_ids, seed, tlt)
        if self.device.type == "cpu":
            return_freed_memory()  # the rollout's KV caches: the learner's step comes next on this machine
        gen_end = time.time()
        self._last = (step, prompts, res)
        return {
            "worker": self.id,
            "tokens": [list(map(int, t)) for t in res.tokens],
            "logprobs": [lp.tolist() for lp in res.logprobs],
            "lengths": [int(n) for n in res.lengths],
            "finished": [bool(f) for f in res.finished],
            "from_draft": [f.int().tolist() for f in res.from_draft] if res.from_draft is not None else None,
            "metrics": res.metrics.to_dict(),
            "gen_start": gen_start,
            "gen_end": gen_end,
            "harvested": res.hidden is not None,  # False: the driver harvests from the learner's pass
            "drafter_version": self.drafter_version,  # the drafter this rollout drafted with
            # the few-row kernels it decoded with: an A/B's arms are only as fair as these (bench e2e)
            "kernels": {"policy": chosen_kernels(self.policy), **({"drafter": chosen_kernels(self.drafter)} if tlt else {})},
        }

    def pack(self) -> dict[str, Any]:
        """The last rollout's harvested records in the object store: {"records": [ref] or None,
        "tokens": their trainable tokens, "interval": (start, end)} (the worker's "pack" slice of the
        timeline)."""
        from ..learn.buffer import trainable_tokens

        start = time.time()
        step, prompts, res = self._last or (0, [], None)
        self._last = None
        refs, tokens = None, 0
        if res is not None and res.hidden is not None:
            records = []
            for p, toks, hid in zip(prompts, res.tokens, res.hidden):
                if not len(toks):
                    continue
                # hidden[i] is h_i for positions 0..L-2 (the last token was never fed to the target):
                # keep the tokens those states belong to, so tokens and hidden align
                seq = torch.tensor(list(p) + list(toks), dtype=torch.long)
                records.append({"tokens": seq[: hid.shape[0]], "hidden": hid.to(torch.float16).cpu(),
                                "response_start": len(p), "step": step})
            if records:
                refs = [ray.put(records)]  # nested: the driver receives the reference only
                tokens = sum(trainable_tokens(len(r["tokens"]), r["response_start"]) for r in records)
        return {"records": refs, "tokens": tokens, "interval": (start, time.time())}

    @ray.method(concurrency_group="control")
    def lend_cores(self, step: int, threads: int) -> bool:
        """Peers' shards are in (the driver calls this): step `step`'s rollout may decode on `threads`
        threads from its next decode step on, where that keeps every bit (generate's `threads`)."""
        if step == self._step:
            self._cores = max(self.threads, threads)
        return True

    @ray.method(concurrency_group="control")
    def preempt(self) -> bool:
        """The step's rollout is over (the driver calls this when the last worker's shard is in):
        stop spot training at the next micro-batch; the update in progress is dropped whole."""
        self._preempted.set()
        return True

    def spot_update(self, job: dict[str, Any]) -> dict[str, Any]:
        """One whole drafter update of a round (spot.SpotRounds' job), on the low-priority thread.

        Returns {"version", "state" (None: dropped or nothing to train), "steps", "loss", "accuracy",
        "interval" (the optimizer time), "dropped" (preempted mid-update)}.
        """
        return self._spot_pool.submit(self._spot_update, job).result()

    def _spot_update(self, job: dict[str, Any]) -> dict[str, Any]:
        from ..learn.buffer import DrafterBuffer

        out: dict[str, Any] = {"version": job["version"], "state": None, "steps": 0}
        if self._preempted.is_set():
            return out
        records = []
        for ref in job["refs"]:
            key = ref.hex() if hasattr(ref, "hex") else id(ref)
            if key not in self._record_cache:
                self._record_cache[key] = ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref
            records.extend(self._record_cache[key])
        start, stride = job["slice"]
        mine = records[start::stride] or records
        if not mine:
            return {**out, "empty": True}
        buf = DrafterBuffer(max_tokens=max(sum(len(r["tokens"]) for r in mine), 1))
        for r in mine:
            buf.add(r["tokens"], r["hidden"], r["response_start"], r["step"])
        state = job["state"]
        torch.set_num_threads(self.threads)  # this thread's own count: a peer may be decoding on the rest
        self.drafter.load_state_dict(ray.get(state) if isinstance(state, ray.ObjectRef) else state)
        trainer = self._get_trainer()
        trainer.rng = random.Random(job["seed"])
        t0 = time.time()
        done = int(trainer.train(buf, max_steps=job["steps"], should_stop=self._preempted.is_set))
        t1 = time.time()
        if self._preempted.is_set() or done < job["steps"]:  # cut short, or nothing trainable: dropped whole
            return {**out, "dropped": self._preempted.is_set(), "interval": (t0, t1)}
        last = getattr(trainer, "last_metrics", {}) or {}
        return {**out, "state": _trainable_state(self.drafter), "steps": done, "interval": (t0, t1),
                "loss": float(last.get("loss", 0.0)), "accuracy": float(last.get("accuracy", 0.0))}


def worker_actor(cls: type) -> Any:
    """A rollout worker class as a Ray actor: concurrency group "control" lets preempt() run beside a
    spot_update in progress (the other methods take turns)."""
    return ray.remote(num_cpus=1, concurrency_groups={"control": 1})(cls)


RolloutWorker = worker_actor(RolloutWorkerImpl)
