"""Where a run's actors go: one placement-group bundle per device, declared honestly, checked first.

    plan = plan_placement(cfg, gpu=False)
    pg = plan.reserve()                      # raises PlacementError naming what the cluster lacks
    Worker.options(**plan.worker_options(pg, i))
    LearnerRank.options(**plan.rank_options(pg, r))

colocated: bundle i is device i; rollout worker i and learner rank i each take half of it (on GPU
the rollout engine releases its memory while the learner runs), so both phases fit on the
rollout's devices. separate: the learner ranks get bundles of their own after the workers'.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

RESERVE_TIMEOUT_S = 60.0  # resources the cluster has but others hold: wait this long, then fail


class PlacementError(RuntimeError):
    """The run asks for more than the cluster has (or can give within RESERVE_TIMEOUT_S)."""


@dataclass
class Placement:
    num_workers: int
    learner_ranks: int
    colocated: bool
    gpu: bool
    rank_threads: int

    @property
    def bundles(self) -> list[dict[str, float]]:
        one = {"CPU": 1.0, "GPU": 1.0} if self.gpu else {"CPU": 1.0}
        n = self.num_workers if self.colocated else self.num_workers + self.learner_ranks
        return [dict(one) for _ in range(n)]

    def _share(self) -> float:
        return 0.5 if self.colocated else 1.0

    def _options(self, pg, bundle: int) -> dict:
        share = self._share()
        opts = {"num_cpus": share, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle)}
        if self.gpu:
            opts["num_gpus"] = share
        return opts

    def worker_options(self, pg, worker: int) -> dict:
        return self._options(pg, worker)

    def rank_options(self, pg, rank: int) -> dict:
        return self._options(pg, rank if self.colocated else self.num_workers + rank)

    def reserve(self, timeout_s: float = RESERVE_TIMEOUT_S):
        """The run's placement group, once the cluster has placed it."""
        need: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
        have = ray.cluster_resources()
        short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if have.get(k, 0.0) < v}
        if short:
            what = ", ".join(f"{v:g} {k} (the cluster has {h:g})" for k, (v, h) in short.items())
            raise PlacementError(
                f"rollout.num_workers = {self.num_workers} and grpo.learner_ranks = {self.learner_ranks} "
                f"({'colocated' if self.colocated else 'separate'}) need {what}")
        pg = placement_group(self.bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise PlacementError(f"the cluster could not place {len(self.bundles)} x {self.bundles[0]} within "
                                 f"{timeout_s:.0f} s (held by other runs?)") from None
        return pg


def sleeps_while_learning(cfg, gpu: bool) -> bool:
    """Whether rollout engines release their device memory during the learner phase: the one
    decision the driver (which sleeps and wakes them) and each worker (whose vLLM engine must be built
    with sleep mode) both read."""
    if cfg.rollout.sleep_while_learning is not None:
        return cfg.rollout.sleep_while_learning
    return gpu and cfg.grpo.placement == "colocated"


def plan_placement(cfg, gpu: bool) -> Placement:
    W = cfg.rollout.num_workers
    colocated = cfg.grpo.placement == "colocated"
    ranks = cfg.grpo.learner_ranks
    if ranks == 0:  # GPU: one per device it shares (colocated) or one of its own; CPU: one rank on all cores
        # (bench learner, 2 cores: 2 gloo ranks ran at 0.91x the tokens/s of one rank with both threads on
        # one VM, 1.17x on a slower one: no clear win for more actors and collectives)
        ranks = (W if colocated else 1) if gpu else 1
    if colocated and ranks > W:
        raise PlacementError(f"grpo.learner_ranks = {ranks} colocated needs as many rollout workers "
                             f"(rollout.num_workers = {W}); use grpo.placement: separate")
    cores = os.cpu_count() or 1
    return Placement(W, ranks, colocated, gpu, rank_threads=max(1, cores // ranks) if not gpu else 1)
