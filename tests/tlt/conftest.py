"""Fixtures shared by the TLT library tests."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Kernel choices timed on a busy test machine must not land in the user's cache (var/models), where
# benchmarks would read them: tests tune into a file of their own (Ray workers inherit it).
os.environ.setdefault("TLT_KERNEL_CACHE", os.path.join(tempfile.mkdtemp(prefix="tlt-test-kernels-"), "kernels.json"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are dominated by per-op overhead: OpenMP hand-offs cost more than the math and
    collapse on a busy machine, so these modules run torch on one thread (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
