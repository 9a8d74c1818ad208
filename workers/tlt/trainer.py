"""The driver of a TLT run: it owns the data flow of every RL step and calls the Ray actors.

    from workers.tlt.config import preset
    from workers.tlt.metrics import ConsoleSink, Tracking
    trainer = Trainer(preset("tiny-cpu"), out="runs/demo", tracking=Tracking([ConsoleSink()]))
    trainer.setup()          # models, Ray actors, drafter warm-up (or resume from the last checkpoint)
    summary = trainer.run()  # steps; metrics and artifacts go to the tracking sinks
    trainer.close()

One step:

    sync     the learner ranks publish the policy in buckets (shared memory on one node), the driver
             the drafter when it changed; the driver forwards only the manifests, workers copy in
    rollout  each worker generates its shard of prompts (SD in the tail when TLT is on); the driver
             waits with ray.wait: a worker whose shard is in packs its records and gets drafter
             updates to train (cluster/spot.py's rounds) until the last shard is in; then the driver preempts
             every update in flight. A worker that dies or hangs is replaced and the rollout rerun;
             spot training that fails leaves the run on SD without retraining (drafter/spot_failed)
    reward   the task scores every response
    learner  GRPO update in the learner group (cluster/learner_group.py: FSDP2 ranks on Ray; its forward gives
             the old log-probs, and the hidden states when the rollout engine returns none)
    buffer   the master drafter and the workers' spot-training results are collected; this step's
             harvested (tokens, hidden) records join the online buffer
    + metrics (rollout/*, spec/*, drafter/*, idle/*, timing_s/*, learner/*) and checkpoints

Ray: inside a Ray job (RAY_ADDRESS set) the driver joins that cluster; otherwise it starts a local
instance sized to the machine. One placement group holds a bundle per device (GPU + CPU on CUDA
configs, one CPU here): colocated, rollout worker i and learner rank i share bundle i (half each;
their phases take turns), separate, the ranks get bundles of their own. A run that asks for more
than the cluster has fails at once, naming what is missing.

The driver keeps a copy of the policy for the drafter warm-up and the exports only; it is refreshed
from the learner's published buckets when a checkpoint or the final export needs it.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

import numpy as np
import ray
import torch

from .cluster.accounting import Accounting, WorkerTimes
from .cluster.spot import DrafterWatch
from .checkpoint import CheckpointManager, capture_rng, restore_rng
from .config import TLTConfig
from .learn.grpo import RolloutBatch
from .metrics import Tracking
from .models.transformer import Transformer
from .models.policies import prepare_policy_folder
from .rollout.engine import RolloutMetrics
from .rollout.samples import prompt_lengths, step_samples
from .rollout.sampling import sampling_params

log = logging.getLogger(__name__)


def resolve_device(cfg: TLTConfig) -> str:
    if cfg.run.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.run.device


def resolve_dtype(cfg: TLTConfig, device: str) -> TLTConfig:
    """The config with `model.dtype: auto` and `grpo.compute_dtype: auto` made concrete for this
    device, so that the policy, the workers, the learner's weight sync and the drafter warm-up's
    cache key all see one dtype, and every learner rank computes in one."""
    if "auto" not in (cfg.model.dtype, cfg.grpo.compute_dtype):
        return cfg
    from .models.linear import bf16_pays

    dtype = "bfloat16" if device == "cuda" or bf16_pays() else "float32"
    model = cfg.model.model_copy(update={"dtype": dtype}) if cfg.model.dtype == "auto" else cfg.model
    grpo = cfg.grpo.model_copy(update={"compute_dtype": dtype}) if cfg.grpo.compute_dtype == "auto" else cfg.grpo
    return cfg.model_copy(update={"model": model, "grpo": grpo})


def make_run_task(cfg: TLTConfig, policy_folder: Path):
    from .tasks import make_task

    if cfg.task.kind == "longtail":
        return make_task("longtail")
    return make_task(cfg.task.kind, tokenizer=policy_folder, path=cfg.task.path, hard_fraction=cfg.task.hard_fraction)


# --- Ray --------------------------------------------------------------------------------------


def ensure_ray(num_cpus: int | None = None) -> bool:
    """Connect to Ray: the job's cluster when RAY_ADDRESS is set, else a fresh local instance.

    Returns True when this call started Ray (so the caller shuts it down).
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    else:
        # "local": always a fresh instance here, never a cluster some other process left running
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                 log_to_driver=True)
    return True


# --- metrics ----------------------------------------------------------------------------------


def _percentile(values: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def length_scalars(lengths: list[int]) -> dict[str, float]:
    return {
        "rollout/len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "rollout/len_p50": _percentile(lengths, 50),
        "rollout/len_p90": _percentile(lengths, 90),
        "rollout/len_p99": _percentile(lengths, 99),
        "rollout/len_max": float(max(lengths)) if lengths else 0.0,
    }


# --- the trainer ------------------------------------------------------------------------------


class WorkerFault(RuntimeError):
    """Rollout workers died or hung during a step (their indices in `workers`)."""

    def __init__(self, workers: list[int], message: str):
        super().__init__(message)
        self.workers = workers


@dataclass
class _Spot:
    """One step's spot training while its answers are still out: the schedule, the outstanding calls
    (ObjectRef -> (kind, worker)) and the packs that came back ({worker: pack()})."""

    rounds: Any  # spot.SpotRounds
    pending: dict[Any, tuple[str, int]]
    packs: dict[int, dict]


@dataclass
class StepOutput:
    step: int
    scalars: dict[str, float]
    series: dict[str, Any]
    responses: list[list[int]]
    rewards: list[float]



def lendable_cores(cfg: TLTConfig, device: str) -> int:
    """The cores CPU rollout workers share by lending them (rollout.lend_idle_cores): one thread per
    worker (Trainer._new_worker), at most the machine's; 1 where nothing is lent."""
    if device != "cpu" or cfg.rollout.engine != "builtin" or not cfg.rollout.lend_idle_cores:
        return 1
    return min(cfg.rollout.num_workers, os.cpu_count() or 1)


class Trainer:
    """Builds the run's models and actors and runs its steps (see the module doc)."""

    def __init__(self, cfg: TLTConfig, out: str | Path, tracking: Tracking, resume: bool = False,
                 progress: Callable[[int, dict[str, float]], None] | None = None, worker_actor: Any = None):
        self.device = resolve_device(cfg)
        self.cfg = cfg = resolve_dtype(cfg, self.device)
        self.out = Path(out)
        self.tracking = tracking
        self.resume = resume
        self.progress = progress
        # Ray actor class of rollout workers (default ray_workers.RolloutWorker; others: ray_workers.worker_actor(cls))
        self.worker_actor = worker_actor
        self.tlt = cfg.run.tlt  # SD in the tail
        self.spot = self.tlt and cfg.drafter.spot_training  # and the drafter trained on idle workers
        self.step = 0
        self.workers: list[Any] = []
        self._spot_failed = False  # spot training failed once: the run goes on with SD, without retraining
        self.watch = DrafterWatch(cfg.drafter.spot_stale_drop)  # whether a step's spot training runs
        self.worker_retries = 0  # rollouts run again after a worker died or hung
        self.learner_group = None  # learner_group.LearnerGroup, started with the actors
        self._pg = None  # the run's placement group
        self._policy_manifest = None  # weight_sync.Manifest of the latest published policy
        self._policy_version = -1  # the learner's update count it holds; -1: none published yet
        self._drafter_pub = None  # weight_sync.BucketPublisher of the drafter (the driver owns it)
        self._drafter_manifest = None
        self._drafter_version = 0
        self.kernels: dict[int, dict[str, dict[str, str]]] = {}  # worker -> its last rollout's kernels
        self._resume_learner: Path | None = None  # a checkpoint's learner folder, loaded once the group runs
        self.last_mismatch_hist: dict[str, list] = {}
        self._learner_updates = 0  # GRPO updates since the start (or the resumed checkpoint's step)
        self._drafter_changed = True
        self._started_ray = False
        self.ckpt = CheckpointManager(self.out / "checkpoints")
        self.acct = Accounting()
        self.history: list[StepOutput] = []
        self._stop_requested = False
        self._records_from_learner = cfg.rollout.engine == "vllm"  # set from the workers after each step
        self.setup_s: dict[str, float] = {}  # seconds of each setup part (policy, drafter_warmup, actors)
        self.warmup_info: dict[str, Any] = {}  # the drafter warm-up's summary (drafter_warmup.warmup_drafter)
        self.drafter_tokens = 0  # token budget of every drafter optimizer step so far (model card)
        self.audit: dict[str, float] = {}  # the last checkpoint's losslessness spot check (audit.spot_check)

    # --- setup --------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(cfg.to_yaml())
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        if self.device == "cpu":
            torch.set_num_threads(max(1, os.cpu_count() or 1))

        from .learn.sft import reporting_sft_steps

        t = time.perf_counter()
        sft_total = cfg.model.sft_steps if cfg.model.source == "tiny" else 1  # progress: SFT steps, or one load
        self.tracking.progress("policy", 0, sft_total, "preparing the policy")
        with reporting_sft_steps(lambda s, n, loss: self.tracking.progress(
                "policy", s, n, f"SFT step {s}/{n}, loss {loss:.3f}")):  # only when not cached
            self.policy_folder = prepare_policy_folder(cfg)
        self.tracking.progress("policy", sft_total, sft_total, "policy ready")
        self.setup_s["policy"] = time.perf_counter() - t
        self.task = make_run_task(cfg, self.policy_folder)
        dtype = getattr(torch, cfg.model.dtype)
        self.policy = Transformer.from_pretrained(self.policy_folder, dtype=dtype, device=self.device)
        self.eos_ids = sorted({self.task.eos_id, *self.policy.config.eos_ids})
        self.prompt_rng = random.Random(cfg.run.seed)

        from .learn.buffer import DrafterBuffer
        from .models.drafter import Drafter

        self.buffer = DrafterBuffer(cfg.drafter.buffer_tokens)
        self.drafter = Drafter.for_target(self.policy, seed=cfg.run.seed)
        self.worker_states: list[Any] = [None] * cfg.rollout.num_workers

        resumed = self.resume and self._load_latest()
        t = time.perf_counter()
        if not resumed and self.tlt and cfg.drafter.warmup_steps > 0:
            self._warmup_drafter()
        self.setup_s["drafter_warmup"] = time.perf_counter() - t
        self.drafter_state = {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()}
        t = time.perf_counter()
        W = cfg.rollout.num_workers
        self.tracking.progress("actors", 0, W, f"starting {W} rollout workers")
        self._start_actors()
        self.tracking.progress("actors", W, W, "rollout workers ready")
        self.setup_s["actors"] = time.perf_counter() - t
        self.tracking.progress("rl", self.step, cfg.run.steps, f"step {self.step}/{cfg.run.steps}")

    def _warmup_drafter(self) -> None:
        """Offline drafter warm-up on the starting policy's own answers (before step 1, TLT only;
        learn/drafter_warmup.py: one recipe with the rollout bench, cached across runs)."""
        from .learn.drafter_warmup import progress_scale, warmup_drafter, warmup_optimizer, weights_digest

        cfg = self.cfg
        starts, total = progress_scale(cfg.drafter)

        def report(done: int, of: int, what: str) -> None:
            self.tracking.progress("drafter_warmup", starts[what] + done, total, f"{what} {done}/{of}")

        report(0, cfg.drafter.warmup_prompts, "answers")
        drafter, info = warmup_drafter(self.policy, self.task, cfg.drafter, sampling=sampling_params(cfg.rollout),
                                       policy_key=weights_digest(self.policy_folder),
                                       max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.run.seed,
                                       on_progress=report)
        self.tracking.progress("drafter_warmup", total, total, "drafter ready" + (" (cached)" if info["cached"] else ""))
        self.drafter.load_state_dict(drafter.state_dict())
        self.drafter.eval()
        optimizer = warmup_optimizer(info["folder"])
        if cfg.drafter.spot_training and optimizer is not None:  # spot training resumes the warm-up's AdamW
            start = {"drafter": drafter.state_dict(), "optimizer": optimizer, "steps_done": 0}
            self.worker_states = [{"drafter_trainer": start} for _ in self.worker_states]
        self.warmup_info = info
        self.drafter_tokens = info["steps"] * cfg.drafter.warmup_batch_tokens

    def _start_actors(self) -> None:
        from .cluster.learner_group import LearnerGroup
        from .cluster.placement import plan_placement, sleeps_while_learning
        from .cluster.rollout_workers import RolloutWorker

        cfg = self.cfg
        W = cfg.rollout.num_workers
        self._started_ray = ensure_ray(num_cpus=max(W, os.cpu_count() or 1))
        gpu = self.device == "cuda"
        plan = plan_placement(cfg, gpu=gpu)
        self._pg = plan.reserve()  # fails fast (naming what is missing) when the cluster is too small
        self._plan, self._worker_cls = plan, RolloutWorker
        self._engines_sleep = sleeps_while_learning(cfg, gpu=gpu)
        self.workers = [self._new_worker(i) for i in range(W)]
        self.learner_group = LearnerGroup.start(
            cfg, self.policy_folder, pad_id=self.task.pad_id, world=plan.learner_ranks,
            device="cuda" if gpu else "cpu", actor_options=[plan.rank_options(self._pg, r)
                                                            for r in range(plan.learner_ranks)],
            threads=plan.rank_threads)
        if self._resume_learner is not None:
            self.learner_group.load(self._resume_learner)
        ray.get([w.load_worker_state.remote(s) for w, s in zip(self.workers, self.worker_states)])

    # --- checkpoints --------------------------------------------------------------------------

    def _load_latest(self) -> bool:
        latest = self.ckpt.latest()
        if latest is None:
            log.info("no checkpoint under %s: starting fresh", self.ckpt.root)
            return False
        data = self.ckpt.load(latest)
        st = data["state"]
        fresh = Transformer.from_pretrained(data["policy_dir"], dtype=self.policy.dtype, device=self.device)
        self.policy.load_state_dict(fresh.state_dict())
        if (latest / "learner").is_dir():  # sharded weights + AdamW (DCP), at any world size
            self._resume_learner = latest / "learner"
        else:  # a checkpoint from before the learner group: its weights only, a fresh optimizer
            log.warning("%s has no sharded learner state: resuming its weights with a fresh optimizer", latest)
            self.policy_folder = data["policy_dir"]
        self.drafter.load_state_dict(data["drafter"])
        self.step = int(st["step"])
        self._learner_updates = self.step
        self.prompt_rng.setstate(st["prompt_rng"])
        restore_rng(st["rng"])
        from .learn.buffer import DrafterBuffer

        self.buffer = DrafterBuffer.from_state_dict(st["buffer"])
        self.worker_states = st.get("worker_states") or self.worker_states
        self.acct.load_state_dict(st.get("accounting", {}))
        self.drafter_tokens = int(st.get("drafter_tokens", 0))
        self.watch.load_state_dict(st.get("drafter_watch"))
        log.info("resumed from %s (step %d)", latest, self.step)
        return True

    def save_checkpoint(self) -> None:
        self.worker_states = ray.get([w.worker_state.remote() for w in self.workers])
        self._refresh_driver_policy()  # the HF folder of the checkpoint (downloads, exports)
        state = {
            "prompt_rng": self.prompt_rng.getstate(),
            "rng": capture_rng(),
            "buffer": self.buffer.state_dict(),
            "worker_states": self.worker_states,
            "accounting": self.acct.state_dict(),
            "drafter_tokens": self.drafter_tokens,
            "drafter_watch": self.watch.state_dict(),
            "config": self.cfg.model_dump(mode="json"),
        }
        step = self.step
        # the model card's figures of this step, taken now: the export runs later in the checkpoint thread
        card = dict(rl_step=step, training_tokens=self.drafter_tokens,
                    acceptance_length=self.audit.get("audit/acceptance_length"),
                    heldout_prompts=int(self.audit.get("audit/greedy_prompts", 0)))
        export = (lambda folder: self._export_drafter(folder, card)) if self.tlt else None
        group = self.learner_group
        self.ckpt.save(step, policy=self.policy, state=state, drafter_state=self.drafter_state,
                       after_drafter=export, sharded=lambda f: group.save(f / "learner"),
                       sharded_done=group.saved)

    def _export_drafter(self, folder: Path, card: dict[str, Any]) -> tuple[str, int, Path] | None:
        """Runs in the checkpoint thread: vLLM EAGLE folder (with its model card) + zip, announced
        from the main thread. `card`: the step's figures, taken on the main thread (save_checkpoint);
        the target is this checkpoint's policy, the one the drafter was trained for."""
        from .models.drafter import Drafter
        from .models.export import export_drafter, model_card, zip_folder

        full_card = model_card(target_name=self.cfg.model.source if self.cfg.model.source != "hf" else self.cfg.model.path,
                               target_dir=folder / "policy", tokenizer_dir=self.policy_folder,
                               depth=max((d for d, _, _ in self.cfg.spec.strategies), default=1), **card)
        drafter = Drafter(self.policy.config)
        drafter.load_state_dict(torch.load(folder / "drafter.pt", weights_only=True))
        eagle = export_drafter(drafter, folder / "drafter_eagle", card=full_card)
        return ("drafter", card["rl_step"], zip_folder(Path(eagle), folder / "drafter_eagle.zip"))

    def _spot_check(self) -> dict[str, float]:
        """audit.spot_check of the policy and master drafter as they are now, on held-out prompts
        (their own generator, so never this run's training prompts' stream)."""
        from .audit import spot_check
        from .rollout.engine import SpecPolicy

        cfg = self.cfg
        self._refresh_driver_policy()  # the learner's latest weights into the driver's copy
        self.drafter.load_state_dict(self.drafter_state)
        prompts = self.task.sample_prompts(cfg.run.audit_prompts, random.Random(cfg.run.seed + 104_729 + self.step))
        return spot_check(self.policy, self.drafter, [p.ids for p in prompts], self.eos_ids,
                          SpecPolicy.from_config(cfg.spec), max_new_tokens=cfg.run.audit_max_new_tokens)

    def _announce_artifacts(self, results: list[Any]) -> None:
        for r in results:
            if r:
                kind, step, path = r
                self.tracking.artifact(kind, step, path)

    # --- a step -------------------------------------------------------------------------------

    def _publish_policy(self):
        """The learner's current weights in buckets (once per update: the sync and a checkpoint share it)."""
        if self._policy_version != self._learner_updates:
            self._policy_manifest = self.learner_group.publish(self._learner_updates)
            self._policy_version = self._learner_updates
        return self._policy_manifest

    def _refresh_driver_policy(self) -> None:
        from .cluster.weight_sync import receive

        manifest = self._publish_policy()
        receive(manifest, dict(self.policy.named_parameters()))

    def _publish_drafter(self):
        """The drafter in buckets, a new version whenever its weights changed."""
        from .cluster.weight_sync import BucketPublisher

        if self._drafter_pub is None:
            self._drafter_pub = BucketPublisher("drafter", self.cfg.grpo.sync_bucket_mb << 20)
        if self._drafter_manifest is None or self._drafter_changed:
            self._drafter_version += 1
            self._drafter_manifest = self._drafter_pub.publish(self._drafter_version, self.drafter_state.items())
            self._drafter_changed = False
        return self._drafter_manifest

    def _sync(self) -> tuple[Any, dict[str, float]]:
        """Policy and drafter to every worker, as bucket manifests (the driver never holds the policy's
        bytes); returns the drafter's object reference (spot training's master) and sync/* scalars."""
        from .cluster.learner_group import get_all

        if self._engines_sleep:  # asleep since the last rollout (a no-op for fresh workers)
            get_all([w.wake.remote() for w in self.workers], self.cfg.rollout.timeout_s, "waking the rollout engines")
        policy = self._publish_policy()
        drafter = self._publish_drafter() if self.tlt else None
        got = get_all([w.load_weights.remote(policy, drafter) for w in self.workers], self.cfg.rollout.timeout_s,
                      "weight sync to the rollout workers")
        dref = ray.put(self.drafter_state if self.tlt else None)
        return dref, {"sync/bytes": float(sum(int(g) for g in got)),
                      "sync/policy_bytes": float(policy.nbytes), "sync/buckets": float(len(policy.buckets)),
                      "drafter/published_version": float(self._drafter_version if self.tlt else 0)}

    def _prev_records_ref(self) -> tuple[list, int]:
        """Previous step's long responses (upper half by length) from the online buffer, and their
        trainable tokens; all of them when the rollout engine harvests nothing (this step's records
        then come too late)."""
        if not self.buffer.records:
            return [], 0
        last = max(r.step for r in self.buffer.records)
        recs = [r for r in self.buffer.records if r.step == last]
        median = 0.0 if self._records_from_learner else float(np.median([len(r) for r in recs]))
        keep = [r for r in recs if len(r) >= median]
        return [ray.put([{"tokens": r.tokens, "hidden": r.hidden, "response_start": r.response_start,
                          "step": r.step} for r in keep])], sum(r.trainable for r in keep)

    def run_step(self) -> StepOutput:
        cfg = self.cfg
        self.step += 1
        step = self.step
        self.acct.start_step()
        n = cfg.rollout.samples_per_prompt
        prompts = self.task.sample_prompts(cfg.task.prompts_per_step, self.prompt_rng)
        rows = [p.ids for p in prompts for _ in range(n)]  # group order: prompt g -> rows g*n..g*n+n-1

        with self.acct.phase("sync"):
            drafter_ref, sync_scalars = self._sync()

        W = len(self.workers)
        shards = [list(s) for s in np.array_split(np.arange(len(prompts)), W)]
        shard_rows = [[rows[g * n + j] for g in shard for j in range(n)] for shard in shards]
        with self.acct.phase("rollout"):
            t0 = time.time()
            results, spot = self._rollout_with_retry(step, shard_rows)
        if self._engines_sleep:
            from .cluster.learner_group import get_all

            with self.acct.phase("engine_sleep"):  # the colocated learner gets the device's memory
                get_all([w.sleep.remote() for w in self.workers], cfg.rollout.timeout_s, "putting the rollout engines to sleep")

        self.last_results = results
        self.kernels = {r["worker"]: r["kernels"] for r in results if "kernels" in r}
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        lengths: list[int] = []
        hit_eos: list[bool] = []
        from_draft: list[list[int] | None] = []
        for res in results:  # shards are contiguous prompt ranges in worker order: group order holds
            tokens.extend(res["tokens"])
            logprobs.extend(res["logprobs"])
            lengths.extend(res["lengths"])
            hit_eos.extend(res["finished"])
            from_draft.extend(res.get("from_draft") or [None] * len(res["tokens"]))

        with self.acct.phase("reward"):
            rewards = [self.task.reward(prompts[i // n], tokens[i]) for i in range(len(tokens))]

        # an engine without hidden states (vLLM): the learner's old-log-prob pass computes them anyway
        from_learner = spot is not None and not all(r["harvested"] for r in results)
        self._records_from_learner = from_learner
        with self.acct.phase("learner"):
            batch = RolloutBatch(prompts=rows, responses=tokens, rewards=rewards, group_size=n,
                                 rollout_logprobs=logprobs)
            learner_metrics, self.last_mismatch_hist, learner_hidden = self.learner_group.step(
                batch, harvest_hidden=from_learner)
            self._learner_updates += 1

        drafter_stats: dict[str, float] = {}
        with self.acct.phase("buffer"):
            packs: dict[int, dict] = {}
            if spot is not None:  # spot training's last answers and the master drafter (long done by now)
                drafter_stats, packs = self._finish_spot(spot)
                self.drafter_tokens += int(drafter_stats.get("drafter/steps", 0)) * cfg.drafter.batch_tokens
            if from_learner:  # they join the spot training of the next step
                for prompt, resp, hid in zip(rows, tokens, learner_hidden or []):
                    if resp:
                        self.buffer.add(list(prompt) + list(resp), hid, len(prompt), step)
            elif spot is not None:
                for i in range(W):  # the workers that never packed during the rollout (the last ones)
                    if i not in packs:
                        packs[i] = self._call_worker(i, "pack")
                for i in sorted(packs):
                    for ref in packs[i]["records"] or []:
                        for r in ray.get(ref):
                            self.buffer.add(r["tokens"], r["hidden"], r["response_start"], r["step"])
            if not self.spot or spot is None:
                drafter_stats.setdefault("drafter/steps", 0.0)
            if self.spot:  # the warning: spot training failed and the run goes on with SD only
                drafter_stats["drafter/spot_failed"] = 1.0 if self._spot_failed else 0.0
                drafter_stats["drafter/spot_paused"] = float(spot is not None and spot.rounds.paused)

        # --- metrics ---
        trained = spot.rounds.trained_intervals if spot is not None else {}
        times = [WorkerTimes(r["worker"], r["gen_start"], r["gen_end"], drafter=trained.get(r["worker"], []),
                             pack=[tuple(packs[r["worker"]]["interval"])] if r["worker"] in packs else [])
                 for r in results]
        idle_scalars, timeline = self.acct.rollout(t0, times)
        rollout = RolloutMetrics.merge([RolloutMetrics.from_dict(r["metrics"]) for r in results],
                                       [r["gen_start"] - t0 for r in results])
        roll_scalars, roll_series = rollout.scalars(), rollout.series()
        if self.tlt:  # the drafter version this step drafted with, and how well (spot training's trigger)
            self.watch.observe(self._drafter_version, rollout.chain_acceptance(),
                               sum(rollout.chain_attempted_by_pos[:1]))
        roll_series.pop("rollout/lengths")  # the step's own list below: in sample order
        scalars: dict[str, float] = {}
        scalars["reward/mean"] = float(np.mean(rewards)) if rewards else 0.0
        scalars["reward/accuracy"] = float(np.mean([r > 0.5 for r in rewards])) if rewards else 0.0
        scalars.update(length_scalars(lengths))
        scalars.update(roll_scalars)
        scalars.update(learner_metrics)
        scalars.update(idle_scalars)
        scalars.update(drafter_stats)  # loss/accuracy only when an update was applied: no fake zeros
        scalars.update(sync_scalars)
        # workers that drafted with another drafter than the published one (0: none; baselines draft never)
        scalars["drafter/stale_workers"] = float(sum(
            r.get("drafter_version") != self._drafter_version for r in results)) if self.tlt else 0.0
        scalars["buffer/records"] = float(len(self.buffer))
        scalars["buffer/tokens"] = float(self.buffer.num_tokens)
        interval = cfg.run.checkpoint_interval
        checkpoint = (interval and step % interval == 0) or step == cfg.run.steps
        if checkpoint and self.tlt and cfg.run.audit_prompts:
            with self.acct.phase("audit"):
                self.audit = self._spot_check()
            scalars.update(self.audit)
        scalars.update(self.acct.timings())
        series = {"rollout/lengths": lengths, "idle/timeline": timeline, **roll_series,
                  "rollout/samples": step_samples([prompts[i // n].text for i in range(len(tokens))], tokens,
                                                  from_draft, rewards, hit_eos, self._decode_token, step=step,
                                                  seed=cfg.run.seed),
                  "rollout/prompt_lengths": prompt_lengths([prompts[i // n].text for i in range(len(tokens))],
                                                           lengths, n),
                  "rollout/logprob_mismatch_hist": self.last_mismatch_hist}

        self.tracking.log(step, scalars, series)
        self.tracking.progress("rl", step, cfg.run.steps, f"step {step}/{cfg.run.steps}")
        if checkpoint:
            self.save_checkpoint()
        self._announce_artifacts(self.ckpt.completed())
        out = StepOutput(step, scalars, series, tokens, rewards)
        self.history.append(out)
        if self.progress is not None:
            self.progress(step, scalars)
        return out

    # --- the rollout, spot training and faults (the driver's control flow, with ray.wait) ----------

    def _rollout_with_retry(self, step: int, shard_rows: list[list[list[int]]]) -> tuple[list[dict], Any]:
        """The step's rollout; a rollout worker that dies or hangs (rollout.timeout_s) is replaced by
        a fresh one, the weights synced again and the step's rollout run again (same seeds, so the
        same samples), up to rollout.max_retries times; then the run fails naming the worker."""
        for attempt in range(self.cfg.rollout.max_retries + 1):
            try:
                return self._rollout(step, shard_rows)
            except WorkerFault as fault:
                for w in self.workers:  # the survivors' spot updates end now (a rerun queues behind them)
                    w.preempt.remote()
                if attempt == self.cfg.rollout.max_retries:
                    raise
                log.warning("step %d: %s; restarting worker(s) %s and retrying the step's rollout",
                            step, fault, fault.workers)
                self._restart_workers(fault.workers)
                self.worker_retries += 1
        raise AssertionError("unreachable")

    def _rollout(self, step: int, shard_rows: list[list[list[int]]]) -> tuple[list[dict], Any]:
        """Rollouts out, then ray.wait: each worker whose shard is in packs its records and trains the
        drafter in the rounds spot.SpotRounds schedules until the last shard is in; then every worker
        is preempted. Returns the results and the spot state still to collect (or None)."""
        from .cluster.spot import SpotRounds

        cfg = self.cfg
        W = len(self.workers)
        pending: dict[Any, tuple[str, int]] = {}
        for i, w in enumerate(self.workers):
            seed = (cfg.run.seed * 1_000_003 + step * 1009 + i) & 0x7FFFFFFF
            pending[w.rollout.remote(step, shard_rows[i], self.eos_ids, seed, self.tlt)] = ("rollout", i)
        rounds = None
        if self.spot and not self._spot_failed:
            refs, tokens = self._prev_records_ref()
            dc = cfg.drafter
            rounds = SpotRounds(W, self.drafter_state, refs, seed=cfg.run.seed, step=step,
                                update_steps=dc.spot_update_steps, data_tokens=tokens, batch_tokens=dc.batch_tokens,
                                max_epochs=dc.spot_max_epochs, put=ray.put, paused=not self.watch.should_train())
        spot = _Spot(rounds, pending, {}) if rounds is not None else None
        results: list[dict | None] = [None] * W
        deadline = time.monotonic() + cfg.rollout.timeout_s
        while any(r is None for r in results):
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [i for i, r in enumerate(results) if r is None]
                raise WorkerFault(late, f"rollout of step {step} still running after {cfg.rollout.timeout_s:.0f} s")
            kind, i = pending.pop(ready[0])
            try:
                out = ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                if kind == "rollout":
                    raise WorkerFault([i], f"rollout worker {i} failed: {type(exc).__name__}: {exc}") from exc
                self._spot_failure(spot, i, exc)
                continue
            if kind == "rollout":
                results[i] = out
                if spot is not None and not self._spot_failed and any(r is None for r in results):
                    pending[self.workers[i].pack.remote()] = ("pack", i)
            elif kind == "pack" and spot is not None:
                spot.packs[i] = out
                self._send(spot, rounds.add_data(out["records"] or [], out.get("tokens", 0)) + rounds.idle(i))
            elif kind == "update" and spot is not None:
                self._send(spot, rounds.done(i, out))
            self._lend_cores(step, results, training={j for k, j in pending.values() if k in ("pack", "update")})
        if spot is not None:  # the rollout is over: stop spot training now; collect it after the learner
            rounds.preempt()
            for w in self.workers:
                w.preempt.remote()
        return results, spot

    def _lend_cores(self, step: int, results: list[dict | None], training: Collection[int] = ()) -> None:
        """CPU workers (rollout.lend_idle_cores): the cores of the workers whose shards are in go to
        those still decoding, shared evenly; in the long tail one worker decodes on all of them.

        A finished worker that trains the drafter (`training`: a pack or spot update outstanding)
        keeps its core until that work is done: sharing a core, spot training and the lent decode
        both slowed, and a TLT rollout gained nothing from lending (README "Spot training and lent
        cores"). Called after every event of the rollout's wait loop, so the count can go up or down."""
        cores = lendable_cores(self.cfg, self.device)
        if cores == 1:
            return
        running = [j for j, r in enumerate(results) if r is None]
        if running:
            free = cores - sum(results[j] is not None for j in training)
            for j in running:
                self.workers[j].lend_cores.remote(step, max(1, free // len(running)))

    def _send(self, spot: "_Spot", jobs: list[tuple[int, dict]]) -> None:
        for i, job in jobs:
            spot.pending[self.workers[i].spot_update.remote(job)] = ("update", i)

    def _finish_spot(self, spot: "_Spot") -> tuple[dict[str, float], dict[int, dict]]:
        """The preempted updates' and packs' answers (each worker stops at its next micro-batch), then
        the master drafter; spot training that fails degrades the run to SD without retraining."""
        left = [ref for ref, (kind, _) in spot.pending.items() if kind in ("update", "pack")]
        if left:
            ray.wait(left, num_returns=len(left), timeout=self.cfg.rollout.timeout_s)
        for ref in left:
            kind, i = spot.pending.pop(ref)
            try:
                out = ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - failed or still hung: spot training is what fails
                self._spot_failure(spot, i, exc)
                continue
            if kind == "pack":
                spot.packs[i] = out
            else:
                spot.rounds.done(i, out)
        master, stats = spot.rounds.finish()
        if not self._spot_failed:
            self.drafter_state = master
            self._drafter_changed = stats.get("drafter/updates", 0.0) > 0
        return stats, spot.packs

    def _spot_failure(self, spot: "_Spot | None", worker: int, exc: BaseException) -> None:
        if not self._spot_failed:
            log.warning("spot drafter training failed on worker %d (%s: %s): the run goes on with SD and the "
                        "current drafter, without retraining it (drafter/spot_failed)", worker,
                        type(exc).__name__, exc)
        self._spot_failed = True
        if spot is not None:
            spot.rounds.preempt()
        for w in self.workers:
            w.preempt.remote()

    def _call_worker(self, i: int, method: str, *args) -> Any:
        from .cluster.learner_group import get_all

        return get_all([getattr(self.workers[i], method).remote(*args)], self.cfg.rollout.timeout_s,
                       f"rollout worker {i} {method}")[0]

    def _new_worker(self, i: int):
        actor = self.worker_actor or self._worker_cls
        gpu = self.device == "cuda"
        return actor.options(**self._plan.worker_options(self._pg, i)).remote(
            i, self.policy.config, self.cfg, device="cuda" if gpu else "cpu", threads=1,
            max_threads=lendable_cores(self.cfg, self.device))

    def _restart_workers(self, workers: list[int]) -> None:
        """Fresh actors in the same bundles, with the last checkpoint's worker state; the weights
        follow with a sync (the new actors hold no drafter version, so they load it too)."""
        from .cluster.learner_group import get_all

        for i in workers:
            ray.kill(self.workers[i], no_restart=True)
            self.workers[i] = self._new_worker(i)
        get_all([self.workers[i].load_worker_state.remote(self.worker_states[i]) for i in workers],
                self.cfg.rollout.timeout_s, "restarted rollout workers")
        self._sync()

    def _decode_token(self, token_id: int) -> str:
        return self.task.tokenizer.decode([token_id], skip_special_tokens=False)

    def run(self) -> dict[str, Any]:
        """Run the remaining steps (all of them, or those after the resumed checkpoint)."""
        while self.step < self.cfg.run.steps and not self._stop_requested:
            self.run_step()
        self._announce_artifacts(self.ckpt.flush())
        if self.step >= self.cfg.run.steps:
            from .models.export import export_policy, zip_folder

            self._refresh_driver_policy()
            final = export_policy(self.policy, self.out / "policy", tokenizer=self.policy_folder)
            self.tracking.artifact("policy", self.step, zip_folder(final, self.out / "policy.zip"))
        return self.summary()

    def summary(self) -> dict[str, Any]:
        steps = [h.scalars for h in self.history]

        def mean(key: str) -> float:
            vals = [s[key] for s in steps if key in s]
            return float(np.mean(vals)) if vals else 0.0

        return {"steps": self.step, "mean_step_s": mean("timing_s/step"), "reward_mean": mean("reward/mean"),
                "acceptance_length": mean("spec/acceptance_length"), "idle_reclaimed_frac": mean("idle/reclaimed_frac")}

    def request_stop(self) -> None:
        self._stop_requested = True

    def close(self) -> None:
        try:
            self.ckpt.close()
        finally:
            try:  # vLLM engines: shut down, exported folders removed (a step cut short: wait a little only)
                if self.cfg.rollout.engine == "vllm" and self.workers:
                    for w in self.workers:  # ends spot training a cut-short step never preempted
                        w.preempt.remote()
                    ray.get([w.close.remote() for w in self.workers], timeout=20)
            except Exception as exc:  # a busy, dead or stuck actor: kill it anyway
                log.warning("closing rollout workers: %s", exc)
            for w in self.workers:
                ray.kill(w)
            if self.learner_group is not None:
                self.learner_group.close()
            for pub in (self._drafter_pub,):
                if pub is not None:
                    pub.close()
            if self._pg is not None:
                ray.util.remove_placement_group(self._pg)
            self.workers, self.learner_group, self._pg, self._drafter_pub = [], None, None, None
            if self._started_ray:
                ray.shutdown()
                self._started_ray = False
