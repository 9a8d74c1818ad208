"""Fixtures shared by the TLT library tests."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Kernel choices timed on a busy test machine must not land in the user's cache (var/models), where
# benchmarks would read them: tests tune into a file of their own (Ray workers inherit it).
os.environ.setdefault("TLT_KERNEL_CACHE", os.path.join(tempfile.mkdtemp(prefix="tlt-test-kernels-"), "kernels.json"))


@pytest.fixture(autouse=True)
def own_decode_threads(monkeypatch):
    """What a test declares (linear.set_decode_threads: a rollout worker built in-process, a bench
    run through its CLI) stays in that test: later ones tune at their own thread count."""
    from workers.tlt.models import linear

    monkeypatch.setattr(linear, "_decode_threads", linear._decode_threads)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are dominated by per-op overhead: OpenMP hand-offs cost more than the math and
    collapse on a busy machine, so these modules run torch on one thread (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_shaped():
    """Build a policy with SmolLM2-135M's layer shapes (2 of its 30 layers, a 4096-token vocabulary)
    and random weights, in a dtype: real kernel shapes at a test's cost."""
    from workers.tlt.models.transformer import ModelConfig, Transformer, init_weights

    def build(dtype: torch.dtype = torch.float32) -> Transformer:
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                          num_attention_heads=9, num_key_value_heads=3)
        model = Transformer(cfg)
        init_weights(model, 0.05)
        return model.to(dtype).eval()

    return build
