"""The losslessness audit: the greedy spot check and the log-prob mismatch histogram."""

from __future__ import annotations

import pytest
import torch

from workers.tlt.audit import mismatch_histogram, spot_check
from workers.tlt.models.drafter import Drafter
from workers.tlt.models.transformer import ModelConfig, Transformer, init_weights
from workers.tlt.rollout.engine import SpecPolicy

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_histogram_bins_on_log_spaced_edges():
    h = mismatch_histogram([0.0, 3e-7, -2e-3, 0.5, 50.0])
    assert h["counts"][0] == 1 and h["counts"][1] == 1  # 0, then [1e-7, 1e-6)
    assert h["counts"][5] == 1 and h["counts"][7] == 1 and h["counts"][-1] == 1  # 2e-3, 0.5, 50
    assert sum(h["counts"]) == 5 and mismatch_histogram([])["counts"] == [0] * len(h["counts"])


def test_the_spot_check_finds_sd_equal_to_plain_decoding_and_measures_acceptance():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = Transformer(cfg)
    init_weights(model, 0.3)
    model.eval()
    checks = spot_check(model, Drafter.for_target(model), [[1, 5, 9], [1, 7]], eos_ids=[3],
                        spec=SpecPolicy(arm="d3k1v3", threshold=1), max_new_tokens=12)
    assert checks["audit/greedy_identical"] == 1.0 and checks["audit/greedy_prompts"] == 2.0
    assert checks["audit/acceptance_length"] >= 1.0
