"""Checkpoint manager: complete-or-ignored folders, background drafter writes, RNG round trip."""

from __future__ import annotations

import random
import threading

import numpy as np
import torch

from workers.tlt.checkpoint import COMPLETE, CheckpointManager, capture_rng, restore_rng
from workers.tlt.models.transformer import ModelConfig, Transformer, init_weights


def tiny_policy() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1))
    init_weights(m)
    return m


def test_a_checkpoint_round_trips_policy_state_and_drafter(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    policy = tiny_policy()
    drafter = {"fc.weight": torch.randn(4, 8)}
    fut = ckpt.save(3, policy=policy, state={"optimizer": {"x": 1}, "bandit": [1, 2]}, drafter_state=drafter,
                    after_drafter=lambda folder: folder / "exported.zip")
    assert fut.result() == tmp_path / "step_000003" / "exported.zip"
    latest = ckpt.latest()
    assert latest == tmp_path / "step_000003"
    data = ckpt.load(latest)
    assert data["state"]["step"] == 3 and data["state"]["bandit"] == [1, 2]
    assert torch.equal(data["drafter"]["fc.weight"], drafter["fc.weight"])
    loaded = Transformer.from_pretrained(data["policy_dir"])
    for k, v in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    ckpt.close()


def test_the_drafter_is_written_in_the_background_and_snapshotted_at_save_time(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    gate = threading.Event()
    drafter = {"w": torch.zeros(3)}
    ckpt._pool.submit(gate.wait)  # hold the writer thread: save() must not block on it
    fut = ckpt.save(1, policy=tiny_policy(), state={}, drafter_state=drafter)
    drafter["w"] += 1.0  # training goes on while the write is pending
    assert not fut.done() and ckpt.latest() is None  # not complete until the drafter has landed
    gate.set()
    ckpt.flush()
    assert torch.equal(ckpt.load(ckpt.latest())["drafter"]["w"], torch.zeros(3))
    ckpt.close()


def test_an_incomplete_checkpoint_is_ignored_and_old_ones_are_pruned(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, policy=tiny_policy(), state={}, drafter_state={"w": torch.ones(1)})
    ckpt.flush()
    (tmp_path / "step_000009").mkdir()  # a crash mid-write leaves no COMPLETE marker
    assert [p.name for p in ckpt.complete_dirs()] == ["step_000002", "step_000003"]
    assert ckpt.latest().name == "step_000003" and (ckpt.latest() / COMPLETE).exists()
    ckpt.close()


def test_rng_states_round_trip():
    state = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
