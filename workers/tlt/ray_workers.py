"""Ray actors of a TLT run: rollout workers and the spot-training coordinator.

The driver (trainer.py) owns the data flow of a step; these actors own models:

    RolloutWorker   one per GPU (num_gpus=1) or CPU slot (num_cpus=1): a policy copy, a drafter copy,
                    the SD bandit. `rollout()` generates its shard and returns it at once; when spot
                    training is on, a background thread then packs the harvested records, reports
                    idle to the coordinator and trains the drafter until `preempt()` (the driver
                    calls it when the last shard is in; the training loop reads a local flag, no
                    remote call per micro-batch), and `spot_result()` collects the records and the
                    training's times after the rollout (so the last worker's results never wait
                    for that bookkeeping).
    Coordinator     num_cpus=0: the one master drafter of the step, the online buffer's references,
                    the rounds of spot training. Stops handing out work the moment the last worker
                    reports its rollout done; `finish()` closes the step's last round.

Spot training keeps ONE drafter. Training happens in rounds: a worker `fetch`es the master weights
(version v) and a disjoint slice of the buffer, trains `drafter.spot_update_steps` optimizer steps from them,
and `submit`s the result. Workers that fetched v form round v; when every member has submitted,
the master becomes the parameter average of their results (version v+1). A preempted member drops
its partial work; the round closes with the whole updates that were submitted. An update is thus
applied whole or not at all, and idle workers never drift apart. The driver collects the master at
the end of the rollout and ships it to every worker with the next weight sync.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import ray
import torch

from .drafter_train import average_state_dicts

log = logging.getLogger(__name__)

FETCH_RETRY_S = 0.005  # poll interval of a worker waiting for the round to close or for data
STEP_WAIT_S = 60.0  # longest a worker's report waits for the driver's begin_step of its step


class CoordinatorImpl:
    """Master drafter, preemption flag and buffer references of one run (see the module doc).

    A plain class so tests can drive it directly; `Coordinator` is its Ray actor (threaded, so a
    report waiting for its step's `begin_step`, or a worker polling `round_open`, never blocks the
    others' calls).
    """

    def __init__(self, num_workers: int, seed: int = 0):
        self.num_workers = num_workers
        self.seed = seed
        self._lock = threading.Lock()
        # the driver does not wait for begin_step (it goes out with the rollouts): a worker's
        # report_done for that step may overtake it on this threaded actor, and waits for it here
        self._step_begun = threading.Condition(self._lock)
        self.step = 0
        self.master: dict[str, torch.Tensor] = {}
        self.version = 0
        self.preempted = True  # nothing to train until begin_step
        self.done: dict[int, float] = {}
        self.data_refs: list[Any] = []  # ObjectRefs of record lists (previous buffer + this step's)
        self._round: dict[str, Any] | None = None
        self.stats: dict[str, Any] = {}
        self.history: list[int] = []  # versions applied this step (for tests/diagnostics)

    # --- driver side --------------------------------------------------------------------------

    def begin_step(self, step: int, drafter_state: dict[str, torch.Tensor], data_refs: list[Any]) -> None:
        with self._step_begun:
            self.step = step
            self.master = drafter_state
            self.version = 0
            self.preempted = False
            self.done = {}
            self.data_refs = list(data_refs)
            self._round = None
            self.history = []
            self.stats = {"steps": 0, "updates": 0, "dropped": 0, "loss": [], "accuracy": [], "preempt_at": None}
            self._step_begun.notify_all()

    def preempt(self) -> None:
        with self._lock:
            self._preempt_locked()

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The master drafter after this step's spot training, and its stats (call after preemption)."""
        with self._lock:
            self._preempt_locked()
            if self._round is not None:
                r = self._round  # members still training: their updates are dropped with the round
                self.stats["dropped"] += len(r["members"]) - len(r["submitted"]) - len(r["left"])
                self._close_round_locked()
            s = self.stats
            out = {
                "drafter/steps": float(s["steps"]),
                "drafter/updates": float(s["updates"]),
                "drafter/dropped_updates": float(s["dropped"]),
                "drafter/version": float(self.version),
            }
            if s["loss"]:
                out["drafter/loss"] = float(sum(s["loss"][-8:]) / len(s["loss"][-8:]))
            if s["accuracy"]:
                out["drafter/accuracy"] = float(sum(s["accuracy"][-8:]) / len(s["accuracy"][-8:]))
            return self.master, out

    # --- worker side --------------------------------------------------------------------------

    def report_done(self, worker: int, step: int, records_ref: list[Any]) -> bool:
        """A worker finished its rollout of `step`; its harvested records join the buffer. True if it may train."""
        with self._step_begun:
            if not self._step_begun.wait_for(lambda: self.step >= step, timeout=STEP_WAIT_S):
                raise TimeoutError(f"worker {worker} reported step {step}, but the driver never began it")
            if self.step != step:  # a straggler from a step already finished: nothing to train for
                return False
            self.done[worker] = time.time()
            self.data_refs.extend(records_ref)
            if len(self.done) >= self.num_workers:
                self._preempt_locked()  # the last worker is done: the rollout is over
            return not self.preempted

    def should_stop(self) -> bool:
        return self.preempted

    def fetch(self, worker: int) -> dict[str, Any] | str | None:
        """Join the open round: master weights, version, this member's data slice. None: preempted.

        "wait" when the open round already has submissions (join the next one) or no data yet.
        """
        with self._lock:
            if self.preempted:
                return None
            if not self.data_refs:
                return "wait"
            r = self._round
            if r is None:
                r = self._round = {"version": self.version, "members": [], "submitted": {}, "left": set(),
                                   "refs": list(self.data_refs)}
            elif r["submitted"] or worker in r["members"]:
                return "wait"
            rank = len(r["members"])
            r["members"].append(worker)
            stride = self.num_workers
            return {
                "version": r["version"],
                "state": self.master,
                "refs": r["refs"],
                # disjoint within a round (rank), rotating over rounds so one member sees all data
                "slice": ((rank + r["version"]) % stride, stride),
                "seed": hash((self.seed, self.step, r["version"], rank)) & 0x7FFFFFFF,
            }

    def submit(self, worker: int, version: int, state: dict[str, torch.Tensor] | None,
               stats: dict[str, Any]) -> bool:
        """A member's whole update (state) or its withdrawal (state None, after preemption)."""
        with self._lock:
            r = self._round
            if r is None or r["version"] != version or worker not in r["members"]:
                return False
            if state is None:
                r["left"].add(worker)
                self.stats["dropped"] += 0 if stats.get("empty") else 1
            else:
                r["submitted"][worker] = (state, stats)
            if len(r["submitted"]) + len(r["left"]) == len(r["members"]):
                self._close_round_locked()
            return state is not None

    def round_open(self, version: int) -> bool:
        with self._lock:
            return self._round is not None and self._round["version"] == version

    # --- internals ----------------------------------------------------------------------------

    def _preempt_locked(self) -> None:
        if not self.preempted:
            self.preempted = True
            self.stats["preempt_at"] = time.time()

    def _close_round_locked(self) -> None:
        r = self._round
        self._round = None
        if r is None or not r["submitted"]:
            return
        states = [s for s, _ in r["submitted"].values()]
        self.master = average_state_dicts(states)
        self.version += 1
        self.history.append(self.version)
        for _, st in r["submitted"].values():
            self.stats["steps"] += int(st.get("steps", 0))
            self.stats["updates"] += 1
            if "loss" in st:
                self.stats["loss"].append(float(st["loss"]))
            if "accuracy" in st:
                self.stats["accuracy"].append(float(st["accuracy"]))


Coordinator = ray.remote(num_cpus=0, max_concurrency=64)(CoordinatorImpl)


def _trainable_state(drafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}


def spot_train(worker: int, coordinator, drafter, trainer, chunk_steps: int, should_stop: Callable[[], bool],
               record_cache: dict | None = None, on_update=None,
               started: float | None = None) -> tuple[list[tuple[float, float]], int]:
    """Train the drafter in whole updates until preempted; returns (intervals, steps).

    `coordinator` is an actor handle (or a CoordinatorImpl in tests: calls go through `_call`).
    `should_stop` is polled between micro-batches, so it must be cheap: the worker's own preemption
    flag (set by the driver when the rollout ends), never a remote call. Each update (`chunk_steps`
    optimizer steps) starts from the master weights of its round; only whole updates are
    submitted. `started`: when the worker began its drafter work (default: now).
    """
    from .buffer import DrafterBuffer

    record_cache = {} if record_cache is None else record_cache
    intervals: list[tuple[float, float]] = []
    steps_done = 0
    t_start = time.time() if started is None else started
    while not should_stop():
        job = _call(coordinator, "fetch", worker)
        if job is None:
            break
        if job == "wait":
            time.sleep(FETCH_RETRY_S)
            continue
        records = []
        for ref in job["refs"]:
            key = ref.hex() if hasattr(ref, "hex") else id(ref)
            if key not in record_cache:
                record_cache[key] = ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref
            records.extend(record_cache[key])
        start, stride = job["slice"]
        mine = records[start::stride] or records
        if not mine:  # nothing harvested yet (e.g. hidden states off): leave the round, poll again
            _call(coordinator, "submit", worker, job["version"], None, {"empty": True})
            time.sleep(FETCH_RETRY_S)
            continue
        buf = DrafterBuffer(max_tokens=max(sum(len(r["tokens"]) for r in mine), 1))
        for r in mine:
            buf.add(r["tokens"], r["hidden"], r["response_start"], r["step"])
        drafter.load_state_dict(job["state"])
        trainer.rng = random.Random(job["seed"])
        done = int(trainer.train(buf, max_steps=chunk_steps, should_stop=should_stop))
        if should_stop():
            # the rollout ended first: this update is dropped whole (the coordinator's finish() counts
            # it), and no remote call competes with the learner, which starts now
            break
        if done < chunk_steps:  # nothing trainable in this slice: leave the round
            _call(coordinator, "submit", worker, job["version"], None, {})
            break
        steps_done += done
        last = getattr(trainer, "last_metrics", {}) or {}
        _call(coordinator, "submit", worker, job["version"], _trainable_state(drafter),
              {"steps": done, "loss": last.get("loss", 0.0), "accuracy": last.get("accuracy", 0.0)})
        if on_update is not None:
            on_update(job["version"], _trainable_state(drafter))
        # wait for the other members so the next update starts from the averaged master
        while _call(coordinator, "round_open", job["version"]) and not should_stop():
            time.sleep(FETCH_RETRY_S)
    intervals.append((t_start, time.time()))
    return intervals, steps_done


def _lowest_cpu_priority() -> None:
    """Spot training runs on cycles nobody else wants: the calling thread gets the lowest CPU priority
    (Linux: per-thread nice 19), so where cores are shared it never slows generation or the learner."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: training still runs, just not yielding
        log.debug("could not lower the spot-training thread's CPU priority")


def _call(handle, method: str, *args):
    """Call a coordinator method on an actor handle (blocking) or a local CoordinatorImpl."""
    if isinstance(handle, CoordinatorImpl):
        return getattr(handle, method)(*args)
    return ray.get(getattr(handle, method).remote(*args))


class RolloutWorkerImpl:
    """One rollout worker: policy + drafter copies, the SD bandit, spot drafter training."""

    def __init__(self, worker_id: int, model_config, cfg, coordinator, device: str = "cpu", threads: int = 1):
        from .drafter import Drafter
        from .model import Transformer

        torch.set_num_threads(threads)
        self.id = worker_id
        self.cfg = cfg
        self.coordinator = coordinator
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
        self._spot_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tlt-spot-w{worker_id}",
                                             initializer=_lowest_cpu_priority)
        self._spot: Future | None = None  # this step's spot training (runs until preempted)
        self._preempted = threading.Event()  # set by preempt(): a flag the training loop reads for free

    def _engine(self):
        """The vLLM engine over this worker's current weights, exported once to local folders."""
        if self.engine is None:
            from .export import export_drafter, export_policy

            rc = self.cfg.rollout
            root = self._engine_dir = Path(tempfile.mkdtemp(prefix=f"tlt-vllm-w{self.id}-"))
            policy_dir = export_policy(self.policy, root / "policy")
            drafter_dir = export_drafter(self.drafter, root / "drafter") if self.cfg.run.tlt else None
            kw: dict[str, Any] = {"max_num_seqs": rc.vllm_max_num_seqs,
                                  "max_model_len": min(self.policy.config.max_position_embeddings,
                                                       rc.max_new_tokens + rc.vllm_max_prompt_len)}
            if rc.vllm_gpu_memory_utilization is not None:
                kw["gpu_memory_utilization"] = rc.vllm_gpu_memory_utilization
            self.engine = self.engine_factory(self.cfg, policy_dir, drafter_dir, **kw)
            log.info("worker %d: vLLM engine over %s (hidden states: %s)", self.id, root,
                     getattr(self.engine, "returns_hidden", False))
        return self.engine

    def close(self) -> bool:
        """Shut the vLLM engine down and remove its exported folders (a policy copy each)."""
        engine, self.engine = self.engine, None
        try:
            self._join_spot()
            if engine is not None and hasattr(engine, "close"):
                engine.close()
        finally:
            if getattr(self, "_engine_dir", None) is not None:
                shutil.rmtree(self._engine_dir, ignore_errors=True)
                self._engine_dir = None
        return True

    @staticmethod
    def engine_factory(cfg, policy_dir, drafter_dir, **kw):
        """Builds the vLLM engine (tests put an object with the same small interface here)."""
        from .vllm_engine import VllmRolloutEngine

        return VllmRolloutEngine.from_config(cfg, policy_dir, drafter_dir, **kw)

    # --- weights ------------------------------------------------------------------------------

    def load_weights(self, policy, drafter) -> int:
        """The step's weights: weight_sync manifests (buckets the learner / the driver published), or
        plain state dicts (tests, tools). Strict: a sync that does not cover the model fails here.
        A drafter manifest whose version this worker already holds is skipped. Returns bytes read."""
        from .weight_sync import Manifest, receive

        self._join_spot()  # the last step's spot training was preempted; it may not touch the new weights
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
        self._record_cache.clear()
        return nbytes

    def worker_state(self) -> dict[str, Any]:
        """What a resumed run needs from this worker, as plain picklable data for checkpoints: the SD
        bandit (windows of rewards, its RNG) and the spot trainer (its AdamW moments and step count;
        the weights it holds are replaced by the master drafter at the next sync anyway)."""
        trainer = self._trainer
        return {"bandit": self._bandit, "drafter_trainer": trainer.state_dict() if trainer is not None else None}

    def load_worker_state(self, state: dict[str, Any] | None) -> bool:
        state = state or {}
        self._bandit = state.get("bandit")
        if state.get("drafter_trainer") is not None:
            self._get_trainer().load_state_dict(state["drafter_trainer"])
        return True

    def _spec_policy(self, tlt: bool):
        from .rollout import SpecPolicy

        # baseline: never speculate, but still measure the tail at the same threshold
        return SpecPolicy.from_config(self.cfg.spec, enabled=tlt)

    def _get_trainer(self):
        if self._trainer is None:
            from .drafter_train import DrafterTrainer

            self._trainer = DrafterTrainer(self.drafter, self.cfg.drafter, seed=self.cfg.run.seed + self.id)
        return self._trainer

    # --- a step -------------------------------------------------------------------------------

    def _generate(self, prompts: list[list[int]], eos_ids: list[int], seed: int, tlt: bool):
        from .rollout import generate
        from .sampling import sampling_params

        rc = self.cfg.rollout
        params = sampling_params(rc)
        if rc.engine == "vllm":  # its own SD switch (dynamic by batch size) and EAGLE drafter
            return self._engine().generate(prompts, params, max_new_tokens=rc.max_new_tokens, eos_ids=eos_ids,
                                           seed=seed)
        spec = self._spec_policy(tlt)
        if tlt and self._bandit is None:  # one bandit per worker, learning over the whole run
            self._bandit = spec.new_bandit(True, seed=self.cfg.run.seed + 1000 * self.id)
        return generate(
            self.policy, prompts, params, max_new_tokens=rc.max_new_tokens, eos_ids=eos_ids,
            drafter=self.drafter if tlt else None, spec=spec, bandit=self._bandit if tlt else None,
            seed=seed, harvest_hidden=tlt and self.spot,
        )

    def rollout(self, step: int, prompts: list[list[int]], eos_ids: list[int], seed: int, tlt: bool) -> dict[str, Any]:
        """Generate one sample per prompt row; then, with TLT on, spot-train until preempted."""
        gen_start = time.time()
        res = self._generate(prompts, eos_ids, seed, tlt)
        gen_end = time.time()
        out: dict[str, Any] = {
            "worker": self.id,
            "tokens": [list(map(int, t)) for t in res.tokens],
            "logprobs": [lp.tolist() for lp in res.logprobs],
            "lengths": [int(n) for n in res.lengths],
            "finished": [bool(f) for f in res.finished],
            "from_draft": [f.int().tolist() for f in res.from_draft] if res.from_draft is not None else None,
            "metrics": res.metrics.to_dict(),
            "gen_start": gen_start,
            "gen_end": gen_end,
            "records": None,
            "harvested": res.hidden is not None,  # False: the driver harvests from the learner's pass
            "drafter_intervals": [],
            "drafter_steps": 0,
            "drafter_version": self.drafter_version,  # the drafter this rollout drafted with
        }
        if tlt and self.spot:  # the rollout goes to the driver now; records and spot training follow in the background
            self._preempted.clear()
            self._spot = self._spot_pool.submit(self._after_rollout, step, prompts, res)
        return out

    def preempt(self) -> bool:
        """The step's rollout is over (the driver calls this when the last worker's shard is in):
        stop spot training at the next micro-batch; the update in progress is dropped whole."""
        self._preempted.set()
        return True

    def _after_rollout(self, step: int, prompts: list[list[int]], res) -> dict[str, Any]:
        """Spot-training thread: put the harvested records in the object store, report idle, and
        train the drafter until preempted (the driver's `preempt()` once the last shard is in).

        Packing the records is the first part of this worker's drafter training (it builds the
        training data), so the reported drafter interval starts here, not at the first optimizer step.
        """
        started = time.time()
        refs = []
        if res.hidden is not None:
            records = []
            for p, toks, hid in zip(prompts, res.tokens, res.hidden):
                if not len(toks):
                    continue
                # hidden[i] is h_i for positions 0..L-2 (the last token was never fed to the target):
                # keep the tokens those states belong to, so tokens and hidden align
                seq = torch.tensor(list(p) + list(toks), dtype=torch.long)
                records.append({"tokens": seq[: hid.shape[0]], "hidden": hid.to(torch.float16).cpu(),
                                "response_start": len(p), "step": step})
            refs = [ray.put(records)]
        intervals: list[tuple[float, float]] = []
        steps = 0
        # preempted already (the last shard, or nearly): the step's training is over, no need to report
        if not self._preempted.is_set() and _call(self.coordinator, "report_done", self.id, step, refs):
            intervals, steps = spot_train(self.id, self.coordinator, self.drafter, self._get_trainer(),
                                          self.cfg.drafter.spot_update_steps, self._preempted.is_set,
                                          record_cache=self._record_cache, started=started)
        # nested: the driver receives the reference, not the tensors
        return {"records": refs or None, "drafter_intervals": intervals, "drafter_steps": steps}

    def spot_result(self) -> dict[str, Any]:
        """This step's records and spot training, once preempted: {"records", "drafter_intervals", "drafter_steps"}."""
        return self._join_spot()

    def _join_spot(self) -> dict[str, Any]:
        self._preempted.set()  # joining ends the step's spot training, even without the driver's preempt
        spot, self._spot = self._spot, None
        return spot.result() if spot is not None else {"records": None, "drafter_intervals": [], "drafter_steps": 0}


RolloutWorker = ray.remote(num_cpus=1)(RolloutWorkerImpl)
