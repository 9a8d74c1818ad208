"""workers/tlt/models/linear.py: every kernel computes what F.linear computes, never with a stale packed
weight; the oneDNN and gemv kernels are batch-invariant (bit for bit) on real-size layers; tuning
chooses per machine and caches its choice."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from workers.tlt.models import cpu_kernels, linear
from workers.tlt.models.linear import KERNELS, MAX_FEW_ROWS, Linear, tune


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    monkeypatch.delenv("TLT_KERNEL", raising=False)
    monkeypatch.setattr(linear, "machine_busy", lambda: False)  # whatever else the test machine runs
    return tmp_path / "kernels.json"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, MAX_FEW_ROWS, MAX_FEW_ROWS + 1, 40])
def test_every_kernel_equals_f_linear_for_any_number_of_rows(rows, bias, kernel):
    torch.manual_seed(rows)
    layer = Linear(256, 320, bias=bias)
    layer.kernel = kernel
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (rows, 320)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not linear._ONEDNN, reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("bulk", linear.BULK_KERNELS)
def test_more_rows_than_a_few_take_the_bulk_kernel(bulk, monkeypatch):
    """Prefill and many-row decode are compute-bound like training products: they follow bulk_kernel,
    whatever the few-row choice, and still compute what F.linear computes."""
    ran = []
    real = linear._onednn
    monkeypatch.setattr(linear, "_onednn", lambda x2, *a: ran.append(x2.shape[0]) or real(x2, *a))
    torch.manual_seed(0)
    layer = Linear(256, 320)
    layer.kernel, layer.bulk_kernel = "linear", bulk
    x = torch.randn(3, MAX_FEW_ROWS, 256)
    with torch.inference_mode():
        got = layer(x)
        layer(x[0, :MAX_FEW_ROWS])  # a few rows: the few-row kernel ("linear")
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert ran == ([3 * MAX_FEW_ROWS] if bulk == "onednn" else [])


needs_gemv = pytest.mark.skipif(not cpu_kernels.available(), reason="the gemv kernel cannot be built here")


@pytest.mark.parametrize("kernel", ["onednn", pytest.param("gemv", marks=needs_gemv)])
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536), (4096, 576), (1001, 300)])
def test_the_tuned_kernels_give_a_row_the_same_bits_whatever_rows_come_with_it(shape, kernel):
    """SmolLM2's layer shapes (and one that fills no block or vector evenly): a decode step (one row
    per sequence) and a verify pass (several rows) must compute a row identically, or SD could
    round a near-tie the other way."""
    if kernel == "onednn" and not linear._ONEDNN:
        pytest.skip("PyTorch built without oneDNN")
    torch.manual_seed(0)
    layer = Linear(shape[1], shape[0], bias=False)
    layer.kernel = kernel
    x = torch.randn(MAX_FEW_ROWS, shape[1])
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(MAX_FEW_ROWS)])
        for rows in (2, 3, 5, 8, 17, MAX_FEW_ROWS):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


onednn_bf16_only = pytest.mark.skipif(not linear.onednn_bf16(),
                                      reason="bfloat16 takes the tuned kernels where oneDNN multiplies it natively")


@onednn_bf16_only
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536), (49152, 576)])
def test_in_bfloat16_a_row_gets_the_same_bits_beside_up_to_32_rows(shape):
    """oneDNN bf16 (AVX-512 BF16, AMX): a verify pass of up to BF16_INVARIANT_ROWS rows computes each
    row as a decode step does (beyond that oneDNN on AMX changes its blocking and rounds some rows
    otherwise). Four batches: in bfloat16 a difference shows only where it crosses a rounding step."""
    torch.manual_seed(0)
    layer = Linear(shape[1], shape[0], bias=False).to(torch.bfloat16)
    layer.kernel = "onednn"
    rows = linear.BF16_INVARIANT_ROWS
    for _ in range(4):
        x = torch.randn(rows, shape[1]).mul(3).to(torch.bfloat16)
        with torch.inference_mode():
            alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
            for n in (2, 3, 5, 8, 17, rows):
                assert torch.equal(layer(x[:n]), alone[:n]), n
            torch.testing.assert_close(alone, F.linear(x, layer.weight), rtol=1.6e-2, atol=3e-2)


@onednn_bf16_only
@pytest.mark.parametrize("kernel", ["onednn", "linear"])
def test_a_bfloat16_verify_pass_beyond_the_invariant_rows_runs_in_chunks_that_are(monkeypatch, kernel):
    """A few-row product larger than invariant_rows() (AMX: 32) is split into products of at most that
    many rows, so each row still gets its decode-step bits; larger (bulk) products are not split.
    Whichever kernel the tuner chose: PyTorch's bfloat16 linear, too, rounds a row otherwise beside
    more than 32 rows on AMX, and a 4-row tail's 9-token tree verify is 36 rows (the A/B's arms
    parted so at step 1 before its products were split)."""
    monkeypatch.setattr(linear, "BF16_INVARIANT_ROWS", 4)
    calls = []
    if kernel == "onednn":
        real = linear._onednn
        monkeypatch.setattr(linear, "_onednn", lambda x2, *a: calls.append(x2.shape[0]) or real(x2, *a))
    else:
        real = F.linear
        monkeypatch.setattr(linear.F, "linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    torch.manual_seed(0)
    layer = Linear(576, 576, bias=True).to(torch.bfloat16)
    layer.kernel = layer.bulk_kernel = kernel
    x = torch.randn(9, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(9)])
        calls.clear()
        got = layer(x)
        # the lone ninth row runs doubled in oneDNN, as a decode step's does
        assert calls == ([4, 4, 2] if kernel == "onednn" else [4, 4, 1])
        if kernel == "onednn":  # PyTorch's linear is row-invariant only on some CPUs (the tuner checks)
            assert torch.equal(got, alone)
        calls.clear()
        layer(torch.randn(MAX_FEW_ROWS + 1, 576, dtype=torch.bfloat16))
        assert calls == [MAX_FEW_ROWS + 1]


def test_bfloat16_without_onednn_support_keeps_f_linear(monkeypatch):
    monkeypatch.setattr(linear, "tuned_dtypes", lambda: (torch.float32,))
    layer = Linear(64, 96).to(torch.bfloat16)
    assert tune(layer) == {} and layer.kernel == "linear"
    layer.kernel = "onednn"  # even when asked: the product is not one the few-row kernels take
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.skipif(not linear._ONEDNN, reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_training_through_onednn_gives_f_linears_output_and_gradients(bias):
    """The product and all three gradients (input, weight, bias), on a training-sized batch with
    leading dimensions, and across an optimizer step (weights are packed at each call, never stale)."""
    torch.manual_seed(0)
    fast, ref = Linear(192, 320, bias=bias), torch.nn.Linear(192, 320, bias=bias)
    ref.load_state_dict(fast.state_dict())
    fast.bulk_kernel = "onednn"
    opt = torch.optim.SGD(fast.parameters(), lr=0.01)
    for _ in range(2):
        x = torch.randn(3, 100, 192)
        xf, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        g = torch.randn(3, 100, 320)
        yf, yr = fast(xf), ref(xr)
        assert "OneDNN" in type(yf.grad_fn.next_functions[0][0]).__name__  # the path under test ran
        torch.testing.assert_close(yf, yr, rtol=1e-5, atol=1e-4)
        (yf * g).sum().backward()
        (yr * g).sum().backward()
        torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-5, atol=1e-4)
        for pf, pr in zip(fast.parameters(), ref.parameters()):
            assert pf.grad.abs().max() > 0.1
            torch.testing.assert_close(pf.grad, pr.grad, rtol=1e-4, atol=1e-4)
        opt.step()  # changes the weights by about their own size, which the next product must see
        opt.zero_grad()
        ref.zero_grad()
        with torch.no_grad():
            ref.weight.copy_(fast.weight)  # the same weights again, without the gradients' rounding
            if bias:
                ref.bias.copy_(fast.bias)


def test_keeps_leading_dimensions():
    layer = Linear(256, 320)
    layer.kernel = "onednn"
    x = torch.randn(2, 3, 256)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["onednn", pytest.param("gemv", marks=needs_gemv)])
@pytest.mark.parametrize("update", ["in_place", "new_tensor"])
def test_a_weight_update_reaches_the_packed_kernel(update, kernel):
    """A policy weight sync changes the weight between two verify passes; the packed copy follows."""
    torch.manual_seed(0)
    layer = Linear(256, 256, bias=False)
    layer.kernel = kernel
    x = torch.randn(4, 256)
    with torch.no_grad():
        before = layer(x)
        new = torch.randn(256, 256)
        if update == "in_place":
            layer.weight.copy_(new)
        else:
            layer.weight = torch.nn.Parameter(new)
        after = layer(x)
    # outputs are sums of 256 products of magnitude ~16: fp32 accumulation order alone moves them by ~1e-5
    torch.testing.assert_close(after, x @ new.t(), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, after, rtol=1e-4, atol=1e-4)


def test_training_keeps_autograd():
    layer = Linear(8, 4)
    layer.kernel = "onednn"
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
    layer.kernel = "onednn"
    with torch.no_grad():
        layer(torch.randn(4, 256))
    assert layer._packed is not None
    copy = pickle.loads(pickle.dumps(layer))
    assert copy._packed is None and copy.kernel == "onednn"
    with torch.no_grad():
        x = torch.randn(4, 256)
        torch.testing.assert_close(copy(x), layer(x))


def test_inference_tensors_take_only_the_unpacked_path():
    """Weights made under inference_mode have no version counter to key a packed copy on."""
    with torch.inference_mode():
        layer = Linear.frozen(torch.randn(300, 256))
        layer.kernel = "onednn"
        for rows in (1, 4):
            x = torch.randn(rows, 256)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert layer._packed is None


def _model():
    return torch.nn.Sequential(Linear(256, 512), Linear(512, 256), Linear(256, 512))


def test_tuning_gives_each_shape_group_one_measured_kernel_and_caches_it(kernel_cache, monkeypatch):
    model = _model()
    chosen = tune(model)
    assert set(chosen) == {"512x256x2", "256x512x1"} and set(chosen.values()) <= set(KERNELS)
    assert model[0].kernel == model[2].kernel == chosen["512x256x2"]
    assert model[0].bulk_kernel == model[2].bulk_kernel in linear.BULK_KERNELS
    assert kernel_cache.exists() and linear.cpu_name() in kernel_cache.read_text()
    assert tune(model) == {}  # tuned once per model

    def no_timing(*a, **k):
        raise AssertionError("a cached choice was measured again")

    monkeypatch.setattr(linear, "_time_group", no_timing)
    monkeypatch.setattr(linear, "_time_bulk", no_timing)
    again = _model()
    assert tune(again) == chosen  # another process with the same CPU, torch and threads reads the file
    assert [m.bulk_kernel for m in again] == [m.bulk_kernel for m in model]


def test_a_drafter_is_tuned_at_the_rows_a_draft_step_multiplies_and_cached_apart(kernel_cache, monkeypatch):
    """A draft step multiplies a tail's few rows; a kernel that wins only at a verify pass's 16-64 rows
    must not be chosen for it, and the two choices are kept apart."""
    timed = []
    real = linear._time_group
    monkeypatch.setattr(linear, "_time_group", lambda group, kernels, rows, reps: timed.append(rows)
                        or real(group, kernels, rows, reps))
    model = _model()
    tune(model, rows=linear.DRAFT_ROWS)
    assert set(timed) == set(linear.DRAFT_ROWS) and max(linear.DRAFT_ROWS) < max(linear.TUNE_ROWS)
    assert tune(model, rows=linear.DRAFT_ROWS) == {}  # tuned for these rows already
    timed.clear()
    tune(model)  # another row mix: timed again, and cached under its own key
    assert set(timed) == set(linear.TUNE_ROWS)
    assert kernel_cache.read_text().count("512x256x2") == 4  # the kernel and the bulk kernel, per row mix


@pytest.mark.skipif(not linear._ONEDNN, reason="PyTorch built without oneDNN")
def test_tuning_chooses_only_kernels_that_give_a_row_the_same_bits_beside_others(monkeypatch):
    """A verify pass must round a draft token's logits as the decode step would: a kernel whose
    result for a row depends on the rows beside it is never chosen, however fast."""
    real = Linear.run

    def row_dependent(self, x, kernel):  # F.linear plus "rounding" that depends on the row count
        y = real(self, x, kernel)
        return y + (x.shape[0] - 1) * 1e-6 if kernel == "linear" else y

    monkeypatch.setattr(Linear, "run", row_dependent)
    layer = Linear(256, 512)
    assert not linear.row_invariant(layer, "linear") and linear.row_invariant(layer, "onednn")
    assert "linear" not in tune(_model()).values()


needs_bf16_dot = pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.bf16_dot()),
                                    reason="the bfloat16 gemv kernel needs AVX-512 BF16")


@needs_bf16_dot
@pytest.mark.parametrize("shape,bias", [((576, 576), False), ((49152, 576), False), ((1001, 301), True)])
def test_a_bfloat16_models_gemv_sums_exact_products_in_float32_and_gives_a_row_its_bits_whatever_comes_with_it(
        shape, bias):
    """csrc/dot_bf16.cpp: a bfloat16 layer's few-row products (SmolLM2's shapes; one that fills no
    block, has an odd input and a bias) are its float32 product rounded once to bfloat16 but for
    near-ties, and a row's bits are the same alone (a decode step), beside up to 64 rows (a verify
    pass) and on 1 or 2 threads (a rollout worker that takes a finished peer's core)."""
    torch.manual_seed(0)
    layer = Linear(shape[1], shape[0], bias=bias).to(torch.bfloat16)
    layer.kernel = "gemv"
    x = torch.randn(MAX_FEW_ROWS, shape[1]).mul(3).to(torch.bfloat16)
    exact = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    own = torch.get_num_threads()
    with torch.inference_mode():
        try:
            torch.set_num_threads(1)
            alone = torch.cat([layer(x[i:i + 1]) for i in range(MAX_FEW_ROWS)])
        finally:
            torch.set_num_threads(own)
        for rows in (2, 3, 5, 12, 13, 25, MAX_FEW_ROWS):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert alone.dtype == torch.bfloat16 and layer._blocked is not None
    assert (alone != exact.to(torch.bfloat16)).float().mean() < 1e-3  # sums rounded apart, not the products
    torch.testing.assert_close(alone.float(), exact, rtol=8e-3, atol=1e-2)


@needs_bf16_dot
def test_a_bfloat16_weight_update_reaches_the_gemv_kernel():
    torch.manual_seed(0)
    layer = Linear(256, 96, bias=False).to(torch.bfloat16)
    layer.kernel = "gemv"
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(-1)  # a weight sync's in-place copy
        torch.testing.assert_close(layer(x), -before)


@needs_gemv
def test_the_gemv_kernel_runs_float32_from_its_own_packed_copy_and_leaves_other_dtypes_to_f_linear(monkeypatch):
    calls = []
    real = cpu_kernels.linear
    monkeypatch.setattr(cpu_kernels, "linear", lambda x2, *a: calls.append(x2.shape[0]) or real(x2, *a))
    torch.manual_seed(0)
    layer = Linear(256, 330)
    layer.kernel = "gemv"
    x = torch.randn(2, 3, 256)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert calls == [6] and layer._blocked is not None and layer._packed is None
        layer(torch.randn(MAX_FEW_ROWS + 1, 256))  # more than a few rows: the bulk kernel
        half = Linear(256, 330).to(torch.float16)
        half.kernel = "gemv"
        xh = x.to(torch.float16)
        assert torch.equal(half(xh), F.linear(xh, half.weight, half.bias))  # float32 (and bfloat16) only
    assert calls == [6]


@needs_gemv
def test_the_draft_kernel_multiplies_by_the_weights_rounded_to_bfloat16_and_gives_a_row_its_bits_alone():
    torch.manual_seed(0)
    layer = Linear(300, 1001)
    layer.kernel = linear.DRAFT_KERNEL
    x = torch.randn(7, 300)
    rounded = F.linear(x, layer.weight.to(torch.bfloat16).float(), layer.bias)
    with torch.inference_mode():
        got = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(7)])
    torch.testing.assert_close(got, rounded, rtol=1e-5, atol=1e-5)  # float32 sums of the rounded weights
    assert (got - F.linear(x, layer.weight, layer.bias)).abs().max() > 1e-3  # not the float32 weights
    assert torch.equal(got, alone)
    assert layer._blocked[1].dtype == torch.bfloat16
    with torch.no_grad():  # an optimizer step (spot training) changes the weight: the copy follows
        layer.weight.mul_(-1)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight.to(torch.bfloat16).float(), layer.bias),
                                   rtol=1e-5, atol=1e-5)


@needs_gemv
def test_draft_in_bfloat16_switches_only_the_float32_layers_tuned_to_gemv(monkeypatch):
    monkeypatch.setenv("TLT_KERNEL", "gemv")
    model = _model()
    tune(model)
    layers = linear._linears(model)
    layers[0].kernel = "onednn"  # as if the tuner had measured another kernel faster there
    assert linear.draft_in_bfloat16(model) == len(layers) - 1
    assert [m.kernel for m in layers] == ["onednn"] + [linear.DRAFT_KERNEL] * (len(layers) - 1)
    assert linear.draft_in_bfloat16(model) == 0  # idempotent


needs_a_choice = pytest.mark.skipif(len(linear._candidates([Linear(256, 512)])) < 2,
                                    reason="one row-invariant kernel here: nothing to choose")


def _rigged_timings(monkeypatch, pick: int) -> None:
    """Timings that rank candidate `pick` (0: the first, -1: the last, of those this machine offers:
    row-invariant ones only) first, for the few-row and the bulk kernel alike."""
    def group(layers, kernels, rows, reps):
        return {k: 1.0 if k == kernels[pick] else 2.0 for k in kernels}

    def bulk_times(layer, reps):
        return {k: 1.0 if k == linear.BULK_KERNELS[pick] else 2.0 for k in linear.BULK_KERNELS}

    monkeypatch.setattr(linear, "_time_group", group)
    monkeypatch.setattr(linear, "_time_bulk", bulk_times)


def _kernels(model) -> list[tuple[str, str]]:
    return [(layer.kernel, layer.bulk_kernel) for layer in model]


@needs_a_choice
def test_the_first_choice_on_a_machine_is_every_later_processs_even_timed_in_a_crowd(kernel_cache, monkeypatch):
    """Kernels differ in their last bits: a process that kept its own choice would sample other tokens
    from the same weights. So a crowded machine's choice is cached too, and a later tuner that would
    have timed other kernels faster takes the cached ones."""
    waits = []
    monkeypatch.setattr(linear, "machine_busy", lambda: True)
    monkeypatch.setattr(linear, "_wait_for_quiet", lambda: waits.append(1))
    _rigged_timings(monkeypatch, 0)
    first = _model()
    tune(first)
    assert waits == [1] and kernel_cache.exists()  # it waited for the crowd, then cached what it timed
    monkeypatch.setattr(linear, "machine_busy", lambda: False)
    _rigged_timings(monkeypatch, -1)
    alone = copy.deepcopy(_model())
    alone_choice = tune(alone, reps=1, rows=(1, 2))  # other rows: another cache key, timed afresh
    assert _kernels(alone) != _kernels(first)  # what a quiet process would have chosen for itself
    later = _model()
    tune(later)
    assert _kernels(later) == _kernels(first) and waits == [1, 1], alone_choice


@needs_a_choice
def test_tuners_side_by_side_take_turns_and_agree(kernel_cache, monkeypatch):
    """Rollout workers tune as they start, together: under the lock the second one reads the first's
    choices instead of timing its own. Each tuner here would rank other kernels first."""
    import threading

    picks = iter([0, -1])
    real_tune_groups = linear._tune_groups
    inside = threading.Lock()

    def tune_groups(groups, reps, rows):  # the lock's holder: only one at a time may be here
        assert inside.acquire(blocking=False), "two tuners were timing at once"
        try:
            _rigged_timings(monkeypatch, next(picks))
            return real_tune_groups(groups, reps, rows)
        finally:
            inside.release()

    monkeypatch.setattr(linear, "_tune_groups", tune_groups)
    models = [_model(), _model()]
    threads = [threading.Thread(target=tune, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert next(picks, None) is None  # both tuners ran
    assert _kernels(models[0]) == _kernels(models[1])


@needs_a_choice
def test_a_worker_lent_cores_is_tuned_at_each_thread_count_it_decodes_on(kernel_cache, monkeypatch):
    """A rollout worker decodes on its own thread, then on its peers' cores too, with one kernel for
    both: the kernel chosen is the one fastest over both counts, not at its own count alone, and the
    choice is cached apart from a one-thread choice. The timings here rank the first candidate first
    by a little on one thread and the last by a lot on two."""
    seen = []

    def timed(layers, kernels, rows, reps):
        threads = torch.get_num_threads()
        seen.append(threads)
        return {k: (1.0 if k == kernels[0] else 1.1) if threads == 1 else (1.0 if k == kernels[-1] else 2.0)
                for k in kernels}

    monkeypatch.setattr(linear, "_time_group", timed)
    own = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _model()
        tune(alone)
        linear.set_decode_threads(1, 2)
        lent = _model()
        tune(lent)
        assert torch.get_num_threads() == 1  # the worker's own count, restored
    finally:
        torch.set_num_threads(own)
    first, last = linear._candidates(list(alone))[0], linear._candidates(list(alone))[-1]
    assert {m.kernel for m in alone} == {first} and {m.kernel for m in lent} == {last}
    assert sorted(set(seen)) == [1, 2]
    assert "threads 1|" in kernel_cache.read_text() and "threads 1+2|" in kernel_cache.read_text()
    with pytest.raises(ValueError, match="at least 1"):
        linear.set_decode_threads(0)


def test_kernels_set_by_hand_are_read_set_and_put_back(monkeypatch):
    """bench verify's decode_check times every layer on one kernel, then puts the tuned ones back."""
    monkeypatch.setenv("TLT_KERNEL", "linear")
    model = _model()
    tune(model)
    tuned = linear.set_kernels(model, None)  # only read
    assert tuned == ["linear"] * 3 and linear.set_kernels(model, None) == tuned
    assert set(linear.model_candidates(model)) <= set(KERNELS) and linear.model_candidates(model)
    other = next(k for k in KERNELS if k != "linear" and linear.usable(k, torch.float32))
    assert linear.set_kernels(model, other) == tuned and [m.kernel for m in model] == [other] * 3
    assert linear.set_kernels(model, tuned) == [other] * 3 and [m.kernel for m in model] == tuned
    with pytest.raises(ValueError):  # one kernel per layer, or one for all
        linear.set_kernels(model, ["linear"])


def test_a_kernel_that_cannot_run_here_is_never_tuned_or_forced(monkeypatch):
    """Where gemv cannot be built (no C++ compiler) the tuner measures the others only."""
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert not linear.usable("gemv", torch.float32) and linear.usable("linear", torch.float32)
    assert "gemv" not in tune(_model()).values()
    monkeypatch.setenv("TLT_KERNEL", "gemv")
    with pytest.raises(ValueError, match="cannot run on this machine"):
        tune(_model())


def test_a_cached_kernel_that_cannot_run_here_is_tuned_again(kernel_cache, monkeypatch):
    """A choice cached where gemv was built is not reused by a process that cannot build it (it
    would run PyTorch's linear, whose rows are not invariant everywhere)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear, "_candidates", lambda group: ("gemv",))
        tune(_model())
    assert set(tune(_model()).values()) == {"gemv"}  # cached
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert "gemv" not in tune(_model()).values()


def test_tlt_kernel_forces_one_kernel_and_a_bad_name_is_refused(monkeypatch):
    monkeypatch.setenv("TLT_KERNEL", "onednn")
    model = _model()
    tune(model)
    assert {m.kernel for m in model} == {"onednn"}
    monkeypatch.setenv("TLT_KERNEL", "fastest")
    with pytest.raises(ValueError, match="TLT_KERNEL"):
        tune(_model())


class _QKV(torch.nn.Module):
    def __init__(self, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.q, self.k, self.v = (Linear(256, n, bias=bias, dtype=dtype) for n in (320, 64, 64))
        self.qkv = linear.Fused(self.q, self.k, self.v)


@pytest.mark.skipif(not linear._ONEDNN, reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_give_each_part_its_product_and_follow_weight_updates(dtype):
    if dtype not in linear.tuned_dtypes():
        pytest.skip("oneDNN does not multiply bfloat16 on this CPU: parts run unfused")
    torch.manual_seed(0)
    m = _QKV(bias=True, dtype=dtype)
    real_layer, calls = m.qkv.layer, []
    m.qkv.layer = lambda: calls.append(1) or real_layer()  # counts the stacked products
    with torch.inference_mode():
        m.qkv(torch.randn(2, 256).to(dtype))
    assert not calls  # an untuned model (a learner's: FSDP2 weights, no version bump) never stacks
    tune(m)
    stacked = m.qkv.layer()
    assert stacked.weight.shape == (448, 256) and stacked.kernel in KERNELS  # tuned with the rest
    assert linear.chosen_kernels(m)["448x256x1"] == stacked.kernel  # and reported
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}

    def check(rows: int, fused: bool) -> None:
        x = torch.randn(2, rows, 256).to(dtype)
        calls.clear()
        with torch.inference_mode():
            got = m.qkv(x)
        assert bool(calls) == fused  # the stacked product ran, or the parts did
        for y, part in zip(got, (m.q, m.k, m.v)):
            assert y.shape == (2, rows, part.out_features)
            torch.testing.assert_close(y, F.linear(x, part.weight, part.bias), **tol)

    check(1, fused=True)
    check(MAX_FEW_ROWS // 2, fused=True)
    check(MAX_FEW_ROWS, fused=False)  # 2 x 64 rows: a prefill, the parts' bulk kernels
    with torch.no_grad():
        m.k.weight.mul_(-2)  # in place: the stacked copy is keyed by the version counter
        m.v.bias.add_(1)
    check(3, fused=True)
    m.q.weight = torch.nn.Parameter(torch.randn(320, 256).to(dtype))  # a new tensor
    check(3, fused=True)
    assert m.qkv.layer() is not stacked and m.qkv.layer().kernel == stacked.kernel  # rebuilt, as tuned
    del m.qkv.layer
    copy = pickle.loads(pickle.dumps(m))
    assert copy.qkv._layer is None and copy.qkv.parts[0] is copy.q and copy.qkv.active  # no cached copy


@pytest.mark.skipif(not linear._ONEDNN, reason="PyTorch built without oneDNN")
def test_a_copy_of_a_tuned_model_stacks_on_the_kernels_tuned_for_it(monkeypatch):
    monkeypatch.setenv("TLT_KERNEL", "onednn")
    m = _QKV(bias=False, dtype=torch.float32)
    tune(m)
    twin = copy.deepcopy(m)  # marked tuned: tune() leaves it as it is
    assert twin.qkv._layer is None and twin._tlt_tuned
    assert twin.qkv.layer().kernel == "onednn" and tune(twin) == {}
    assert pickle.loads(pickle.dumps(m)).qkv.layer().kernel == "onednn"


def test_fused_layers_train_through_their_parts():
    m = _QKV(bias=False, dtype=torch.float32)
    q, k, v = m.qkv(torch.randn(3, 256))
    (q.sum() + k.sum() + v.sum()).backward()
    assert m.qkv._layer is None and all(p.weight.grad is not None for p in (m.q, m.k, m.v))
