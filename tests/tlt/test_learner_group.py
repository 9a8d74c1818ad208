"""The learner as an FSDP2 worker group on Ray (gloo, 2 ranks, a tiny model): its step equals the
single-process GRPO step (weights and AdamW state), its published weights reach every worker
bit-identical, and a sharded checkpoint resumes the same update at another world size."""

from __future__ import annotations

import pytest
import ray
import torch

from workers.tlt.config import preset
from workers.tlt.learn.grpo import GRPOLearner, RolloutBatch, split_rows
from workers.tlt.cluster.learner_group import LearnerGroup
from workers.tlt.models.transformer import ModelConfig, Transformer, init_weights
from workers.tlt.rollout.sampling import sampling_params
from workers.tlt.cluster.weight_sync import BucketPublisher, receive

TOL = 1e-5  # fp32: the bound for 2 ranks vs 1


def tiny_cfg(**grpo):
    return preset("tiny-cpu", {"rollout": {"num_workers": 2, "temperature": 1.0},
                               "grpo": {"lr": 1e-2, "micro_batch": 2, "mini_batches": 2, **grpo}})


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, tie_word_embeddings=True)
    model = Transformer(cfg)
    init_weights(model)
    folder = tmp_path_factory.mktemp("policy")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ray_local():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def batch(seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]  # the last group has no advantage: skipped rows
    prompts = [[1] + torch.randint(4, 24, (3 + i % 3,), generator=g).tolist() for i in range(8)]
    responses = [torch.randint(4, 24, (2 + (5 * i) % 7,), generator=g).tolist() + [2] for i in range(8)]
    return RolloutBatch(prompts=prompts, responses=responses, rewards=rewards, group_size=2)


def single_process(policy_dir, cfg, steps: list[RolloutBatch]):
    policy = Transformer.from_pretrained(policy_dir)
    learner = GRPOLearner(policy, cfg.grpo, pad_id=0, sampling=sampling_params(cfg.rollout))
    metrics = [learner.step(b) for b in steps]
    return policy, learner, metrics


def group(cfg, policy_dir, world: int) -> LearnerGroup:
    return LearnerGroup.start(cfg, policy_dir, pad_id=0, world=world, actor_options=[{"num_cpus": 0}] * world)


def test_split_rows_deals_every_row_once_balancing_tokens():
    lengths = [9, 1, 5, 5, 3, 7]
    parts = split_rows(lengths, list(range(6)), 2)
    assert sorted(r for p in parts for r in p) == list(range(6))
    loads = [sum(lengths[r] for r in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(lengths)


@pytest.mark.parametrize("micro_batch", [2, 1])  # 1: two micro-batches per rank, gradients reduced after the last
def test_a_two_rank_step_equals_the_single_process_step(policy_dir, ray_local, micro_batch):
    cfg = tiny_cfg(micro_batch=micro_batch)
    steps = [batch(1), batch(2)]
    ref_policy, ref_learner, ref_metrics = single_process(policy_dir, cfg, steps)
    g = group(cfg, policy_dir, 2)
    try:
        metrics = [g.step(b)[0] for b in steps]
        full = g.full_state()
    finally:
        g.close()
    for name, p in ref_policy.named_parameters():
        assert (full[name] - p.detach()).abs().max() <= TOL, name
    for key in ("learner/loss", "learner/grad_norm", "learner/clip_frac", "learner/rows_run", "learner/tokens"):
        assert metrics[-1][key] == pytest.approx(ref_metrics[-1][key], abs=1e-5), key
    assert metrics[0]["learner/rows_run"] == 6  # the zero-advantage group was skipped on both ranks


def test_published_weights_reach_every_worker_bit_identical(policy_dir, ray_local):
    cfg = tiny_cfg()
    g = group(cfg, policy_dir, 2)
    workers = [Transformer.from_pretrained(policy_dir) for _ in range(2)]  # stale copies
    try:
        g.step(batch(1))
        manifest = g.publish(version=1)
        full = g.full_state()
        for w in workers:
            receive(manifest, dict(w.named_parameters()))
    finally:
        g.close()
    for name, p in workers[0].named_parameters():
        assert torch.equal(p, workers[1].get_parameter(name)), name
        assert torch.equal(p, full[name]), name


def test_a_partial_sync_is_refused():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=2)
    model = Transformer(cfg)
    pub = BucketPublisher("t", bucket_bytes=256)
    try:
        named = list(model.named_parameters())
        manifest = pub.publish(1, named[:-1])
        assert len(manifest.buckets) > 1
        with pytest.raises(ValueError, match="missing"):
            receive(manifest, dict(model.named_parameters()))
    finally:
        pub.close()


def test_a_dead_publishers_shared_memory_is_removed_by_the_next_one():
    import subprocess
    import sys
    from pathlib import Path

    live = BucketPublisher("t")  # this process's: running, so kept
    try:
        # an owner that dies without close(), as one killed for memory does
        code = ("import os, torch; from workers.tlt.cluster.weight_sync import BucketPublisher; "
                "pub = BucketPublisher('t'); pub.publish(1, [('w', torch.ones(64))]); print(pub.root, flush=True); os._exit(9)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        dead = Path(out.stdout.strip())
        assert out.returncode == 9 and (dead / "bucket_0000").is_file()
        nxt = BucketPublisher("t")
        try:
            assert not dead.exists() and live.root.is_dir() and nxt.root.is_dir()
        finally:
            nxt.close()
    finally:
        live.close()
    assert not live.root.exists()


def test_a_sharded_checkpoint_resumes_the_same_update_at_another_world_size(policy_dir, ray_local, tmp_path):
    cfg = tiny_cfg()
    g = group(cfg, policy_dir, 2)
    try:
        g.step(batch(1))
        g.save(tmp_path / "ckpt")
        g.wait_saved()
        g.step(batch(2))  # the uninterrupted run
        expected = g.full_state()
    finally:
        g.close()
    assert list((tmp_path / "ckpt").glob("*.distcp")), "a sharded checkpoint (one file per rank)"
    g = group(cfg, policy_dir, 1)
    try:
        g.load(tmp_path / "ckpt")  # resharded from 2 ranks to 1
        g.step(batch(2))
        resumed = g.full_state()
    finally:
        g.close()
    moved = 0.0
    base = Transformer.from_pretrained(policy_dir)
    for name, p in base.named_parameters():
        assert (resumed[name] - expected[name]).abs().max() <= TOL, name
        moved = max(moved, float((expected[name] - p.detach()).abs().max()))
    assert moved > 1e-3  # the updates really changed the policy
