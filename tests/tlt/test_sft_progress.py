"""SFT reports every step to whoever asked with reporting_sft_steps (the trainer's setup progress),
without a callback threaded through the functions between the trainer and the SFT loop."""

from __future__ import annotations

from workers.tlt.config import ModelSection
from workers.tlt.learn.sft import build_tiny_model, reporting_sft_steps, sft


def _tiny():
    model = build_tiny_model(ModelSection(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), vocab_size=8,
                             bos_id=1, eos_id=2, max_positions=16)
    examples = [([1, 3, 4], [5, 6, 2]), ([1, 4], [6, 2])]
    return model, examples


def test_every_step_is_reported_inside_the_block_and_none_outside():
    model, examples = _tiny()
    heard: list[tuple[int, int]] = []
    with reporting_sft_steps(lambda step, steps, loss: heard.append((step, steps))):
        sft(model, examples, steps=3, batch_size=2)
    assert heard == [(1, 3), (2, 3), (3, 3)]
    sft(model, examples, steps=2, batch_size=2)
    assert len(heard) == 3


def test_on_progress_still_hears_every_step_too():
    model, examples = _tiny()
    own, reported = [], []
    with reporting_sft_steps(lambda step, steps, loss: reported.append(loss)):
        losses = sft(model, examples, steps=2, batch_size=2, on_progress=lambda step, loss: own.append(loss))
    assert own == reported == losses
