"""workers/tlt/linear.py: the few-row CPU kernels compute what F.linear computes, and never with a
stale packed weight. Layers meant to take the fast paths are >= 256 x 256, above MIN_WEIGHT_NUMEL."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from workers.tlt.linear import MAX_FEW_ROWS, MIN_WEIGHT_NUMEL, Linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, MAX_FEW_ROWS, MAX_FEW_ROWS + 1, 40])
def test_equals_f_linear_for_any_number_of_rows(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(256, 320, bias=bias)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (rows, 320)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_keeps_leading_dimensions():
    layer = Linear(256, 320)
    x = torch.randn(2, 3, 256)  # 6 rows: the packed path
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("update", ["in_place", "new_tensor"])
def test_a_weight_update_reaches_the_packed_kernel(update):
    """A policy weight sync changes the weight between two verify passes; the packed copy follows."""
    layer = Linear(256, 256, bias=False)
    x = torch.randn(4, 256)
    with torch.no_grad():
        before = layer(x)
        new = torch.randn(256, 256)
        if update == "in_place":
            layer.weight.copy_(new)
        else:
            layer.weight = torch.nn.Parameter(new)
        after = layer(x)
    torch.testing.assert_close(after, x @ new.t(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_training_keeps_autograd():
    layer = Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_frozen_wraps_a_weight_without_copying_it():
    w = torch.randn(10, 6)
    head = Linear.frozen(w)
    assert head.weight.data_ptr() == w.data_ptr() and head.bias is None and not head.weight.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(head(torch.randn(1, 6) * 0 + 1), w.sum(1)[None], rtol=1e-5, atol=1e-5)


def test_pickles_without_its_packed_cache():
    layer = Linear(256, 256)
    with torch.no_grad():
        layer(torch.randn(4, 256))
    copy = pickle.loads(pickle.dumps(layer))
    with torch.no_grad():
        x = torch.randn(4, 256)
        torch.testing.assert_close(copy(x), layer(x))


def test_inference_tensors_take_only_the_unpacked_paths():
    """Weights made under inference_mode have no version counter to key a packed copy on."""
    with torch.inference_mode():
        layer = Linear.frozen(torch.randn(300, 256))
        for rows in (1, 4):
            x = torch.randn(rows, 256)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert layer._packed is None


def test_small_weights_and_the_packed_path_are_told_apart():
    small, big = Linear(64, 64), Linear(256, 256)
    assert small.weight.numel() < MIN_WEIGHT_NUMEL <= big.weight.numel()
    with torch.no_grad():
        small(torch.randn(4, 64))
        big(torch.randn(4, 256))
    assert small._packed is None and big._packed is not None
