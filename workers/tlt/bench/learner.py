"""The learner group's benchmark: 1 rank vs 2 ranks (FSDP2, gloo), and today's object-store sync
vs the bucketed one, side by side in one invocation; the LAST stdout line is one JSON object.

    python -m workers.tlt.bench learner [--preset smollm2-mathmix-cpu] [--rows N] [--prompt-len 32]
                                        [--response-len 96] [--steps 2]
                                        [--set grpo.compute_dtype=float32]   # the preset's learner, overridden

The step is the preset's: its rows (prompts_per_step x samples_per_prompt) and its micro-batching.

It reports

    learner_tokens_per_s_1rank / _2rank   response tokens per second of a GRPO step (the same batch,
                                          after one warm-up step), the ranks splitting the machine's cores
    learner_2rank_vs_1rank                their ratio (sharding on one machine should cost little)
    max_abs_diff_2rank_vs_1rank           largest weight difference after the same steps (fp32)
    sync_s_object_store                   the old path: driver state dict -> ray.put -> every worker loads it
    sync_s                                the new one: learner ranks publish buckets, workers copy them in
    sync_speedup, sync_bytes, workers     and what was moved

Benchmarks measure; tests check correctness, never timings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import ray
import torch

log = logging.getLogger("workers.tlt.bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smollm2-mathmix-cpu", help="the config whose policy and step are benchmarked")
    p.add_argument("--rows", type=int, default=None,
                   help="samples per step (groups of 2); default: the preset's prompts_per_step x samples_per_prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=96)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--workers", type=int, default=2, help="rollout workers receiving the weights")


def _batch(vocab: int, rows: int, prompt_len: int, response_len: int, seed: int):
    from ..learn.grpo import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(rows)]
    # a long-tailed mix of lengths, every group with an advantage (rewards 1, 0)
    responses = [torch.randint(10, vocab, (max(4, response_len >> (i % 3)),), generator=g).tolist()
                 for i in range(rows)]
    return RolloutBatch(prompts=prompts, responses=responses, rewards=[float(i % 2 == 0) for i in range(rows)],
                        group_size=2)


@ray.remote(num_cpus=0)
class _Receiver:
    """A rollout worker's policy copy, for timing the two sync paths."""

    def __init__(self, policy_dir: str):
        from ..models.transformer import Transformer

        torch.set_num_threads(1)
        self.policy = Transformer.from_pretrained(policy_dir)

    def load_state(self, state) -> bool:  # today's path: the whole state dict from the object store
        self.policy.load_state_dict(state, strict=False)
        return True

    def load_manifest(self, manifest) -> int:
        from ..cluster.weight_sync import receive

        return receive(manifest, dict(self.policy.named_parameters()))

    def digest(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.policy.parameters()))


def _learner(cfg, folder, pad_id: int, world: int, batches, cores: int) -> tuple[float, dict, Any]:
    """(response tokens / s over the timed steps, full state after every step, the group)."""
    from ..cluster.learner_group import LearnerGroup

    group = LearnerGroup.start(cfg, folder, pad_id=pad_id, world=world, actor_options=[{"num_cpus": 0}] * world,
                               threads=max(1, cores // world))
    group.step(batches[0])  # warm-up (allocations, first all-gathers)
    t = time.perf_counter()
    tokens = 0.0
    for b in batches[1:]:
        metrics, _, _ = group.step(b)
        tokens += metrics["learner/tokens"]
    secs = time.perf_counter() - t
    return tokens / secs, group.full_state(), group


def cmd_learner(args: argparse.Namespace) -> int:
    from ..config import preset
    from ..models.linear import cpu_name
    from ..models.transformer import Transformer
    from ..models.policies import prepare_policy_folder
    from ..trainer import ensure_ray, resolve_dtype
    from .e2e import parse_overrides

    logging.basicConfig(level=logging.WARNING)
    cfg = resolve_dtype(preset(args.preset, parse_overrides(args.set)), "cpu")  # the learner's dtype, as a run's
    rows = args.rows or cfg.task.prompts_per_step * cfg.rollout.samples_per_prompt
    folder = prepare_policy_folder(cfg)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    cores = os.cpu_count() or 1
    started = ensure_ray(num_cpus=max(cores, 2))
    try:
        batches = [_batch(vocab, rows, args.prompt_len, args.response_len, seed=s) for s in range(args.steps + 1)]
        print(f"[bench learner] 1 rank, {cores} threads", file=sys.stderr, flush=True)
        tps1, state1, g1 = _learner(cfg, folder, 0, 1, batches, cores)
        g1.close()
        print(f"[bench learner] 2 ranks, {max(1, cores // 2)} threads each", file=sys.stderr, flush=True)
        tps2, state2, g2 = _learner(cfg, folder, 0, 2, batches, cores)
        diff = max(float((state1[k] - state2[k]).abs().max()) for k in state1)
        del state1

        print(f"[bench learner] sync to {args.workers} workers", file=sys.stderr, flush=True)
        receivers = [_Receiver.remote(str(folder)) for _ in range(args.workers)]
        ray.get([r.digest.remote() for r in receivers])
        driver = Transformer.from_pretrained(folder)
        driver.load_state_dict(state2, strict=False)  # today: the driver holds the updated policy
        t = time.perf_counter()
        ref = ray.put({k: v.detach().cpu() for k, v in driver.state_dict().items()})
        ray.get([r.load_state.remote(ref) for r in receivers])
        sync_old = time.perf_counter() - t
        del ref, driver
        g2.publish(version=0)  # the buckets exist from the first publish on (a run publishes every step)
        t = time.perf_counter()
        manifest = g2.publish(version=1)
        got = ray.get([r.load_manifest.remote(manifest) for r in receivers])
        sync_new = time.perf_counter() - t
        digests = ray.get([r.digest.remote() for r in receivers])
        g2.close()
    finally:
        if started:
            ray.shutdown()
    out = {
        "bench": "learner", "preset": args.preset, "overrides": args.set, "rows": rows, "cores": cores, "cpu": cpu_name(),
        "compute_dtype": cfg.grpo.compute_dtype,
        "learner_tokens_per_s_1rank": round(tps1, 2), "learner_tokens_per_s_2rank": round(tps2, 2),
        "learner_2rank_vs_1rank": round(tps2 / tps1, 3) if tps1 else 0.0,
        "max_abs_diff_2rank_vs_1rank": diff,
        "sync_s_object_store": round(sync_old, 4), "sync_s": round(sync_new, 4),
        "sync_speedup": round(sync_old / sync_new, 2) if sync_new else 0.0,
        "sync_bytes": int(sum(got)), "workers": args.workers,
        "workers_identical": len(set(digests)) == 1,
    }
    print(json.dumps(out))
    return 0
