"""`bench verify`: one JSON line with a verify pass's milliseconds per token count, on the tiny preset."""

from __future__ import annotations

import json

import pytest

from workers.tlt.bench.cli import main

from test_bench_e2e import TINY  # the tiny shape whose SFT'd policy the tests cache and share


def test_verify_times_every_token_count_against_a_decode_step(capsys):
    shape = [f"model.{k}={v}" for k, v in TINY["model"].items()]
    args = ["verify", "--preset", "tiny-cpu", "--max-tokens", "4", "--passes", "2", "--keys", "12"]
    assert main(args + [x for s in shape for x in ("--set", s)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "verify" and out["keys"] == 12 and out["dtype"] == "float32"
    assert list(out["verify_ms"]) == ["1", "2", "3", "4"] and all(ms > 0 for ms in out["verify_ms"].values())
    assert out["ratio_to_decode"]["1"] == 1.0
    assert out["ratio_to_decode"]["4"] == pytest.approx(out["verify_ms"]["4"] / out["verify_ms"]["1"], rel=1e-2)


def test_the_decode_check_times_the_tuned_kernels_against_every_other_choice_and_puts_them_back(monkeypatch):
    from workers.tlt.bench.verify import decode_check
    from workers.tlt.config import preset
    from workers.tlt.models import linear

    set_back = []
    real = linear.set_kernels
    monkeypatch.setattr(linear, "set_kernels", lambda model, kernels: set_back.append(kernels) or real(model, kernels))
    check = decode_check(preset("tiny-cpu", {"model": TINY["model"]}), passes=2, keys=12)
    threads = [str(t) for t in linear.decode_threads()]
    assert list(check["decode_ms"]) == threads and "1" in threads  # a worker's own thread, and its lent cores
    for ms in check["decode_ms"].values():
        assert "tuned" in ms and set(ms) - {"tuned"} <= set(linear.KERNELS)
        assert len(ms) >= 2 and all(v > 0 for v in ms.values())
    assert check["tuned_vs_fastest"] == pytest.approx(max(
        ms["tuned"] / min(v for k, v in ms.items() if k != "tuned") for ms in check["decode_ms"].values()), abs=1e-3)
    assert isinstance(set_back[-1], list)  # the tuned kernels, put back last


def test_the_decode_check_weighs_each_kernel_by_the_passes_the_baseline_ran():
    # on AMX gemv leads at one row and oneDNN from two: a decode step alone cannot say which the
    # baseline needed, the sizes of the products it ran can
    from workers.tlt.bench.verify import decode_check
    from workers.tlt.config import preset
    from workers.tlt.models.linear import MAX_FEW_ROWS

    profile = {"1": {"1": 30, "3": 10, str(MAX_FEW_ROWS + 1): 4}, "2": {"2": 5}}
    check = decode_check(preset("tiny-cpu", {"model": TINY["model"]}), profile, passes=2, keys=12)
    ms = check["pass_ms"]
    assert set(ms["1"]) == {"1", "3"}  # a product of more rows takes the bulk kernel, whichever few-row one
    assert set(ms["2"]) == {"1", "2"} and check["decode_ms"]["2"] == ms["2"]["1"]
    assert set(check["profile_s"]) == set(ms["1"]["1"]) and "tuned" in check["profile_s"]
    for way, seconds in check["profile_s"].items():
        assert seconds == pytest.approx((30 * ms["1"]["1"][way] + 10 * ms["1"]["3"][way] + 5 * ms["2"]["2"][way]) / 1e3,
                                        abs=2e-3)
    assert check["tuned_vs_fastest"] == pytest.approx(
        check["profile_s"]["tuned"] / min(s for w, s in check["profile_s"].items() if w != "tuned"), abs=2e-3)
