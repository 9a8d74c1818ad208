"""Fixtures shared by the TLT library tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are dominated by per-op overhead: OpenMP hand-offs cost more than the math and
    collapse on a busy machine, so these modules run torch on one thread (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
