"""SFT of the tiny model: response-only loss, loss goes down, a tiny dataset is memorised."""

from __future__ import annotations

import pytest
import torch

from workers.tlt.config import ModelSection
from workers.tlt.models.transformer import Transformer
from workers.tlt.learn.sft import build_tiny_model, collate_examples, generate_ids, length_groups, sft

SMALL = ModelSection(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_loss_mask_covers_exactly_the_response_tokens():
    inputs, targets, mask = collate_examples([([1, 5, 6], [7, 8, 2]), ([1, 5], [2])], pad_id=0)
    assert inputs.tolist() == [[1, 5, 6, 7, 8], [1, 5, 0, 0, 0]]
    assert targets[mask].tolist() == [7, 8, 2, 2]  # what the masked positions predict: the responses
    assert mask.tolist() == [[False, False, True, True, True], [False, True, False, False, False]]


def test_length_groups_keep_every_example_within_the_padding_budget():
    examples = [([1] * n, [2]) for n in (3, 50, 4, 9, 60, 5)]
    groups = length_groups(examples, micro_tokens=100)
    assert sorted(len(p) for g in groups for p, _ in g) == [3, 4, 5, 9, 50, 60]
    assert all(len(g) == 1 or len(g) * max(len(p) + 1 for p, _ in g) <= 100 for g in groups)


def test_the_tiny_model_is_a_tied_llama_that_round_trips_through_a_hf_folder(tmp_path):
    model = build_tiny_model(ModelSection(), vocab_size=18, bos_id=1, eos_id=2)
    assert model.config.architecture == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 4
    model.save_pretrained(tmp_path)
    again = Transformer.from_pretrained(tmp_path)
    x = torch.randint(0, 18, (2, 9))
    assert torch.equal(model(x).logits, again(x).logits)


def test_a_few_dozen_steps_lower_the_loss_on_the_longtail_task():
    from workers.tlt.tasks.longtail import LongTailTask

    task = LongTailTask()
    examples = task.sft_examples(128, seed=0)
    model = build_tiny_model(SMALL, task.tokenizer.get_vocab_size(), 1, task.eos_id)
    losses = sft(model, examples, steps=40, lr=1e-2, batch_size=8, seed=0, pad_id=task.pad_id)
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_sft_memorises_a_tiny_dataset_deterministically():
    examples = [([1, 4, 5], [6, 7, 8, 2]), ([1, 5, 4], [9, 9, 2])]

    def run():
        model = build_tiny_model(SMALL, vocab_size=12, bos_id=1, eos_id=2, seed=3)
        losses = sft(model, examples, steps=50, lr=2e-2, batch_size=2, seed=0)
        return model, losses

    model, losses = run()
    assert losses[-1] < 0.1
    out = generate_ids(model, [p for p, _ in examples], max_new_tokens=8, eos_ids=[2])
    assert out == [r for _, r in examples]
    assert run()[1] == losses  # same seed, same run
