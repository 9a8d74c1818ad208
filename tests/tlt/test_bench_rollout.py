"""The rollout benchmark end to end on the tiny model with tiny settings: JSON keys, losslessness, cache."""

import json

import pytest
import torch

from workers.tlt.bench import cli as bench

KEYS = {"tail_tokens_per_s_sd", "tail_tokens_per_s_no_sd", "tail_speedup", "acceptance_length",
        "engine_vs_hf_generate", "greedy_identical", "drafter_train_top1", "drafter_heldout_top1",
        "rollout_greedy_identical", "rollout_speedup"}


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _run(capsys, cache, *extra):
    argv = ["rollout", "--model", "tiny", "--sft-steps", "3", "--cache-dir", str(cache), "--threads", "1",
            "--train-prompts", "8", "--train-steps", "3", "--gen-batch", "8", "--tail-prompts", "1",
            "--rollout-prompts", "4", "--max-new-tokens", "24", "--arm", "d3k2v6", "--draft-vocab", "8", *extra]
    rc = bench.main(argv)
    captured = capsys.readouterr()
    return rc, json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_rollout_bench_runs_end_to_end_and_sd_is_lossless(tmp_path, capsys):
    rc, res, err = _run(capsys, tmp_path)
    # the first run warms the drafter up and says how far it is (a phase's last line always shows)
    assert "[bench rollout] drafter warm-up: answers 8/8" in err and "[bench rollout] drafter warm-up: steps 3/3" in err
    assert KEYS <= set(res), KEYS - set(res)
    assert rc == 0
    assert res["greedy_identical"] is True and res["rollout_greedy_identical"] is True
    assert res["drafter_cached"] is False and res["acceptance_length"] >= 1.0
    rc, again, err = _run(capsys, tmp_path, "--rollout-prompts", "0", "--no-hf")
    assert "drafter warm-up:" not in err  # cached: nothing to wait for
    assert rc == 0 and again["drafter_cached"] is True and again["greedy_identical"] is True
    assert again["engine_vs_hf_generate"] is None


def test_a_bfloat16_bench_reports_the_mismatch_its_weights_bring(tmp_path, capsys):
    """--dtype bfloat16: the drafter warms up on the bfloat16 policy (through float32 master weights),
    and the JSON says how far bfloat16 scores the tail's tokens from float32."""
    rc, res, _ = _run(capsys, tmp_path, "--rollout-prompts", "0", "--no-hf", "--dtype", "bfloat16")
    assert rc == 0 and res["dtype"] == "bfloat16" and res["drafter_cached"] is False
    # bfloat16 weights score the same tokens a little differently from float32 ones, never wildly
    assert 0 < res["logprob_mismatch_vs_float32"] <= res["logprob_mismatch_vs_float32_max"] < 1.0
