"""The rollout engine: SD is lossless (token for token, greedy and sampled; the sampled law is the target's),
harvest is exact.

Drafters used: a random EAGLE drafter (almost nothing accepted: rejection paths), an oracle that
predicts the target's own next hidden state exactly (everything accepted: long runs, and it only
works if the drafter's cache protocol is right), and a noisy oracle (partial acceptance: rollback).
"""

import json

import pytest
import torch

from workers.tlt.models import cpu_kernels, linear
from workers.tlt.models.drafter import Drafter
from workers.tlt.models.transformer import ModelConfig, Transformer, init_weights
from workers.tlt.rollout.engine import RolloutMetrics, SpecPolicy, generate
from workers.tlt.rollout.sampling import SamplingParams, process, token_logprobs

BOS = 1
GREEDY = SamplingParams(temperature=0)


pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(vocab=48, seed=0, std=0.3):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = Transformer(cfg)
    init_weights(model, std)
    return model.eval()


class OracleDrafter(torch.nn.Module):
    """Test double with the drafter interface whose prediction of h_{i+1} is the target's own.

    It runs the whole target over the tokens it is fed, in a cache shifted by one slot whose slot 0
    holds BOS (every test prompt starts with BOS). Its predictions are exact only if the engine
    keeps the drafter cache right: true tokens before dcache.lengths, draft tokens in tree slots
    with correct positions and masks. noise > 0 perturbs the predicted state (partial acceptance).
    """

    def __init__(self, target: Transformer, noise: float = 0.0, seed: int = 0):
        super().__init__()
        self._t = (target,)
        self.noise = noise
        self.gen = torch.Generator().manual_seed(seed)

    def new_cache(self, batch, max_len):
        t = self._t[0]
        cache = t.new_cache(batch, max_len + 1)
        t(torch.full((batch, 1), BOS), torch.zeros(batch, 1, dtype=torch.long), cache,
          mask=torch.ones(batch, 1, 1, dtype=torch.bool))
        return cache

    def forward(self, hidden, next_tokens, positions=None, cache=None, write_pos=None, mask=None):
        B, T, _ = mask.shape
        mask = torch.cat([torch.ones(B, T, 1, dtype=torch.bool), mask], -1)  # BOS is always visible
        wp = (write_pos + 1).clamp(max=cache.max_len - 1)
        h = self._t[0](next_tokens, positions + 1, cache, wp, mask, logits=False).hidden
        if self.noise:
            h = h + self.noise * torch.randn(h.shape, generator=self.gen).to(h.dtype)
        return h

    def logits(self, h):
        return self._t[0].lm_head(h)


@pytest.fixture(scope="module")
def model():
    return _tiny()


@pytest.fixture(scope="module")
def drafters(model):
    return {"random": Drafter.for_target(model), "oracle": OracleDrafter(model),
            "noisy": OracleDrafter(model, noise=0.6)}


def _prompts(batch):
    base = [[BOS, 5, 9, 2], [BOS, 7], [BOS, 11, 4, 4, 30, 2, 8], [BOS, 5, 9, 2]]
    return [base[i % len(base)] + [i % 5 + 10] * (i // 4) for i in range(batch)]


EOS = [3, 17]


SAMPLED = SamplingParams(temperature=1.0, top_k=30)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("arm,kind", [("d4k1v4", "random"), ("d4k1v4", "oracle"), ("d4k1v4", "noisy"),
                                      ("d3k2v6", "noisy"), ("d4k3v10", "oracle"), ("d5k3v16", "random"),
                                      ("ngram", "random"), ("ngram|d4", "noisy")])
def test_sd_emits_the_plain_decoding_tokens_token_for_token(model, drafters, arm, kind, params):
    # keyed sampling: the same seed draws the same tokens whatever drafts the target verifies
    for batch in (1, 3, 8):
        prompts = _prompts(batch)
        base = generate(model, prompts, params, max_new_tokens=24, eos_ids=EOS, seed=5)
        res = generate(model, prompts, params, max_new_tokens=24, eos_ids=EOS, drafter=drafters[kind],
                       spec=SpecPolicy(arm=arm), seed=5)
        assert res.tokens == base.tokens, (arm, kind, batch)
        assert res.finished == base.finished
        for a, b in zip(res.hidden, base.hidden):
            assert torch.allclose(a, b, atol=1e-4)
        for a, b in zip(res.logprobs, base.logprobs):
            assert torch.allclose(a, b, atol=1e-4)
        assert res.metrics.verify_passes > 0
        assert not any(f.any() for f in base.from_draft)
        for toks, fd in zip(res.tokens, res.from_draft):
            assert fd.shape == (len(toks),) and not fd[0]  # the first token comes from the prefill
        if kind == "oracle":  # everything drafted is accepted: most tokens came from drafts
            assert sum(int(f.sum()) for f in res.from_draft) > 0.6 * sum(res.lengths)


@pytest.mark.parametrize("arm", ["d4k1v4", "d3k2v6", "ngram|d4"])
def test_a_drafter_sampling_at_its_own_temperature_still_emits_the_plain_sampling_tokens(model, arm):
    prompts = _prompts(5)
    base = generate(model, prompts, SAMPLED, max_new_tokens=24, eos_ids=EOS, seed=4)
    accepted = {}
    for t in (0.0, 0.4):
        # a fresh noisy oracle per call (its noise moves between calls): close enough to the target that
        # its drafts are often accepted, so their temperature shows in which ones are
        res = generate(model, prompts, SAMPLED, max_new_tokens=24, eos_ids=EOS, drafter=OracleDrafter(model, noise=0.6),
                       spec=SpecPolicy(arm=arm, draft_temperature=t), seed=4)
        assert res.tokens == base.tokens, (arm, t)
        accepted[t] = [f.tolist() for f in res.from_draft]
    assert accepted[0.0] != accepted[0.4]  # the drafts did change: another temperature, other proposals


SUBSET = list(range(0, 48, 3)) + EOS  # a reduced draft vocabulary: the drafter never proposes other ids


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("arm,kind", [("d4k1v4", "random"), ("d4k1v4", "noisy"), ("d3k2v6", "noisy"),
                                      ("d4k3v10", "oracle")])
def test_sd_with_a_reduced_draft_vocabulary_equals_plain_decoding(model, drafters, arm, kind, params):
    # "random" is a real Drafter (sub-matrix head), the oracles go through the generic column gather
    for batch in (1, 5):
        prompts = _prompts(batch)
        base = generate(model, prompts, params, max_new_tokens=24, eos_ids=EOS, seed=2)
        res = generate(model, prompts, params, max_new_tokens=24, eos_ids=EOS, drafter=drafters[kind],
                       spec=SpecPolicy(arm=arm, draft_ids=SUBSET), seed=2)
        assert res.tokens == base.tokens, (arm, kind, batch)
        assert res.metrics.verify_passes > 0


@pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels cannot be built here")
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_drafting_from_bfloat16_copies_of_the_drafter_weights_stays_lossless(params, monkeypatch):
    monkeypatch.setenv("TLT_KERNEL", "gemv")  # every layer on gemv, so the drafter's switch to bfloat16
    target = _tiny(seed=3)
    drafter = Drafter.for_target(target)
    packed = []
    real = cpu_kernels.linear
    monkeypatch.setattr(cpu_kernels, "linear", lambda x2, p, *a: packed.append(p.dtype) or real(x2, p, *a))
    prompts = _prompts(5)
    base = generate(target, prompts, params, max_new_tokens=24, eos_ids=EOS, seed=2)
    assert set(packed) == {torch.float32}
    res = generate(target, prompts, params, max_new_tokens=24, eos_ids=EOS, drafter=drafter,
                   spec=SpecPolicy(arm="d4k1v4", draft_ids=SUBSET), seed=2)
    assert res.tokens == base.tokens and res.metrics.verify_passes > 0
    assert set(packed) == {torch.float32, torch.bfloat16}  # the target's products stay float32
    assert {m.kernel for m in linear._linears(drafter)} == {linear.DRAFT_KERNEL}
    assert linear.DRAFT_KERNEL not in {m.kernel for m in linear._linears(target)}


def test_draft_vocab_size_uses_the_drafter_token_counts(model):
    drafter = Drafter.for_target(model)
    drafter.token_counts = torch.zeros(48)
    drafter.token_counts[[40, 41, 42]] = torch.tensor([5.0, 9.0, 1.0])
    head = SpecPolicy(draft_vocab=2).draft_head(drafter, 48, eos_ids=[3])
    assert head.ids.tolist() == [3, 40, 41] and head.head.weight.shape == (3, 32)
    h = torch.randn(2, 32)
    assert torch.allclose(head.logits(h), drafter.logits(h)[:, [3, 40, 41]], atol=1e-6)
    assert SpecPolicy().draft_head(drafter, 48).ids is None  # 0: the full vocabulary
    full = generate(model, _prompts(2), GREEDY, max_new_tokens=12, eos_ids=EOS)
    res = generate(model, _prompts(2), GREEDY, max_new_tokens=12, eos_ids=EOS, drafter=drafter,
                   spec=SpecPolicy(arm="d3k1v3", draft_vocab=2))
    assert res.tokens == full.tokens


def test_responses_stop_at_eos_or_the_length_limit(model):
    res = generate(model, _prompts(8), GREEDY, max_new_tokens=24, eos_ids=EOS)
    assert any(res.finished) and not all(res.finished)  # the tests above see ragged lengths
    for toks, fin, n in zip(res.tokens, res.finished, res.lengths):
        assert len(toks) == n <= 24
        assert fin == (toks[-1] in EOS)
        assert fin or n == 24
        assert not set(toks[:-1]) & set(EOS)


def test_an_exact_drafter_is_accepted_whole_so_its_cache_protocol_is_right(model, drafters):
    prompts = _prompts(3)
    res = generate(model, prompts, GREEDY, max_new_tokens=30, drafter=drafters["oracle"], spec=SpecPolicy(arm="d5k1v5"))
    hist = res.metrics.accepted_hist
    assert hist[5] == sum(hist) > 0  # every pass accepted all 5 draft tokens
    assert res.metrics.acceptance_length == 6.0
    noisy = generate(model, prompts, GREEDY, max_new_tokens=30, drafter=drafters["noisy"],
                     spec=SpecPolicy(arm="d5k1v5")).metrics
    assert sum(1 for k, c in enumerate(noisy.accepted_hist) if c and 0 < k < 5) >= 2  # partial acceptance
    by_pos = [a / n for a, n in zip(noisy.accepted_by_pos, noisy.attempted_by_pos) if n]
    assert by_pos[0] > 0


def test_chain_acceptance_holds_the_arm_fixed_so_drafters_compare_whatever_depth_ran(model, drafters):
    prompts = _prompts(3)

    def run(arm, drafter="oracle"):
        return generate(model, prompts, GREEDY, max_new_tokens=30, drafter=drafters[drafter],
                        spec=SpecPolicy(arm=arm)).metrics

    d5, d8 = run("d5k1v5"), run("d8k1v8")
    # the exact drafter: every pass of either depth accepts all its tokens, so tokens per pass
    # depend on the depth the bandit would pick, while the fixed 4-deep chain figure does not
    assert (d5.acceptance_length, d8.acceptance_length) == (6.0, 9.0)
    assert d5.chain_acceptance() == d8.chain_acceptance() == 5.0
    assert d5.scalars()["spec/chain4_acceptance"] == 5.0

    noisy = run("d6k1v6", "noisy")  # partial acceptance: 1 + r1 + r1 r2 + ... over the first 4 rates
    # (a position no pass reached, which the kernels' rounding can decide, counts as rate 0)
    rates = [a / n if n else 0.0 for a, n in zip(noisy.chain_accepted_by_pos, noisy.chain_attempted_by_pos)]
    assert 0 < rates[0] < 1
    want = 1 + sum(torch.tensor(rates[:i + 1]).prod().item() for i in range(4))
    assert noisy.chain_acceptance() == pytest.approx(want)
    assert noisy.chain_accepted_by_pos == noisy.accepted_by_pos  # only chain passes ran

    tree = run("d4k3v10", "noisy")  # a tree's first level offers 3 candidates: not booked as a chain
    assert sum(tree.attempted_by_pos) > 0 and not any(tree.chain_attempted_by_pos)
    assert "spec/chain4_acceptance" not in tree.scalars()
    ngram = run("ngram")
    assert sum(ngram.attempted_by_pos) > 0 and not any(ngram.chain_attempted_by_pos)

    # acceptance per kind of draft: each pass books under its kind alone, and kinds merge across workers
    assert d5.acceptance_by_kind == {"chain": 6.0} and d5.scalars()["spec/acceptance_chain"] == 6.0
    assert set(tree.acceptance_by_kind) == {"tree"} and set(ngram.acceptance_by_kind) == {"ngram"}
    assert ngram.scalars()["spec/acceptance_ngram"] == ngram.acceptance_length
    both = RolloutMetrics.merge([d8, ngram], [0.0, 0.0])
    assert both.acceptance_by_kind == {"chain": 9.0, "ngram": ngram.acceptance_length}
    assert sum(both.accepted_hist) == sum(map(sum, both.accepted_hist_by_kind.values()))
    assert RolloutMetrics.from_dict(json.loads(json.dumps(both.to_dict()))).acceptance_by_kind == both.acceptance_by_kind


def test_the_hybrid_arm_drafts_n_grams_where_a_row_has_one_and_runs_the_drafter_only_elsewhere(model, drafters,
                                                                                               monkeypatch):
    from workers.tlt.rollout import engine

    drafted = []  # rows the drafter drafted for, per call

    def counted(*args, **kwargs):
        drafted.append(args[4].shape[0])
        return draft(*args, **kwargs)

    draft = engine.draft
    monkeypatch.setattr(engine, "draft", counted)
    prompts = _prompts(3)
    plain = generate(model, prompts, GREEDY, max_new_tokens=30, eos_ids=EOS)
    junk = min(set(range(model.config.vocab_size)) - {t for toks in plain.tokens for t in toks})  # never accepted

    def run(propose):
        drafted.clear()
        monkeypatch.setattr(engine, "ngram_propose", propose)
        res = generate(model, prompts, GREEDY, max_new_tokens=30, eos_ids=EOS, drafter=drafters["oracle"],
                       spec=SpecPolicy(arm="ngram|d4"))
        assert res.tokens == plain.tokens  # whoever drafts, the target decides
        return res.metrics, len(drafted)

    # no n-gram matches anywhere: every pass is the (exact) drafter's 4-deep chain, booked as hybrid
    m, calls = run(lambda ctx, others, n, depth, n_min: [])
    assert calls == m.verify_passes > 0 and m.acceptance_by_kind == {"hybrid": 5.0}
    # an n-gram draft for every row (here a wrong one): the drafter never runs, nothing is accepted
    m, calls = run(lambda ctx, others, n, depth, n_min: [junk] * depth)
    assert calls == 0 and m.verify_passes > 0 and m.acceptance_by_kind == {"hybrid": 1.0}
    # rows whose text has odd length get the n-gram draft, the others the drafter's chain, in one pass
    m, calls = run(lambda ctx, others, n, depth, n_min: [junk] * depth if len(ctx) % 2 else [])
    assert 0 < calls < m.verify_passes and 1.0 < m.acceptance_by_kind["hybrid"] < 5.0


def test_the_hybrid_arm_joins_the_bandit_only_with_a_drafter():
    policy = SpecPolicy(hybrid_depth=6)
    assert "ngram|d6" in [a.label for a in policy.arms(has_drafter=True)]
    assert "ngram|d6" not in [a.label for a in policy.arms(has_drafter=False)]
    assert "ngram|d6" not in [a.label for a in SpecPolicy().arms(has_drafter=True)]
    with pytest.raises(ValueError, match="bad arm label"):
        SpecPolicy(arm="ngram|d0").arms(has_drafter=True)


@pytest.mark.parametrize("arm", ["d4k1v4", "d4k3v10", "off"])
def test_harvested_hidden_states_and_logprobs_equal_a_fresh_forward(model, drafters, arm):
    prompts = _prompts(5)
    params = SamplingParams(temperature=0.8, top_k=20)
    res = generate(model, prompts, params, max_new_tokens=20, eos_ids=EOS,
                   drafter=drafters["noisy"], spec=SpecPolicy(arm=arm), seed=3)
    with torch.inference_mode():
        for p, toks, hid, lp in zip(prompts, res.tokens, res.hidden, res.logprobs):
            full = torch.tensor(p + toks)[None]
            out = model(full)
            assert hid.shape == (len(p) + len(toks) - 1, 32)
            assert torch.allclose(hid, out.hidden[0, :-1], atol=1e-4)
            ref = token_logprobs(out.logits[0, len(p) - 1:-1], torch.tensor(toks), params)  # what the learner scores
            assert torch.allclose(lp, ref, atol=1e-4)


def _exact_first_three(model, prompt, params):
    """P(x1, x2, x3 | prompt) under the processed target distribution, by enumeration."""
    V = model.config.vocab_size
    with torch.inference_mode():
        p1 = process(model(torch.tensor([prompt])).logits[0, -1], params)  # [V]
        x1 = torch.arange(V)
        ctx2 = torch.cat([torch.tensor(prompt).expand(V, -1), x1[:, None]], 1)
        p2 = process(model(ctx2).logits[:, -1], params)  # [V, V]
        ctx3 = torch.cat([ctx2.repeat_interleave(V, 0), x1.repeat(V)[:, None]], 1)
        p3 = process(model(ctx3).logits[:, -1], params).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi2_pvalue(counts, probs):
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("arm,kind,subset", [("d3k1v3", "noisy", None), ("d3k1v3", "random", None),
                                             ("d3k2v6", "noisy", None), ("ngram", "random", None),
                                             ("ngram|d3", "noisy", None),
                                             ("d3k1v3", "noisy", (0, 2, 3, 5)), ("d3k2v6", "noisy", (0, 3, 5))])
def test_sampling_with_sd_draws_the_target_distribution(arm, kind, subset):
    # subset: a reduced draft vocabulary (q = 0 outside it); the emitted law must still be exactly p
    model = _tiny(vocab=8, seed=4, std=0.6)
    drafter = OracleDrafter(model, noise=0.4) if kind == "noisy" else Drafter.for_target(model, seed=1)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    # a repetitive prompt (the model's own greedy text) gives the n-gram drafter something to match
    prompt = [BOS, 5, 2, 6, 5, 3, 0, 3, 0, 3, 3, 1, 2, 3, 3, 0]
    exact = _exact_first_three(model, prompt, params).flatten()
    N = 3000
    res = generate(model, [prompt] * N, params, max_new_tokens=3, drafter=drafter,
                   spec=SpecPolicy(arm=arm, threshold=N, draft_ids=subset), seed=11)
    assert res.tokens == generate(model, [prompt] * N, params, max_new_tokens=3, seed=11).tokens
    toks = torch.tensor(res.tokens)
    counts = torch.bincount(toks[:, 0] * 64 + toks[:, 1] * 8 + toks[:, 2], minlength=512).double()
    assert _chi2_pvalue(counts, exact.double()) > 1e-3
    hist = res.metrics.accepted_hist
    assert hist[0] > 0 and sum(hist[1:]) > 0.02 * sum(hist)  # drafts were really accepted, and some rejected


def test_sd_switches_on_in_the_tail_and_metrics_are_json(model, drafters):
    prompts = _prompts(8)
    seen = []
    res = generate(model, prompts, GREEDY, max_new_tokens=24, eos_ids=EOS, drafter=drafters["noisy"],
                   spec=SpecPolicy(threshold=4, epsilon=0.0), on_progress=seen.append)
    m = res.metrics
    assert all(running <= 4 for _, running, sd in m.running if sd)
    assert any(sd for _, _, sd in m.running) and m.sd_switches[0][1] is True
    assert m.switch_on_s >= 0 and m.tail_tokens_sd > 0
    assert set(m.strategy) <= {"1", "2-4", "5-20", "21+"}
    assert sum(sum(c.values()) for c in m.strategy.values()) > 0
    assert m.total_tokens == sum(res.lengths) and m.lengths == res.lengths
    assert [e["running"] for e in seen] == sorted((e["running"] for e in seen), reverse=True)
    json.dumps(m.to_dict())
    assert set(m.scalars()) >= {"spec/acceptance_length", "rollout/tail_tokens_per_s_sd"}
    json.dumps(m.series())


def test_a_shared_bandit_keeps_learning_across_rollouts(model, drafters):
    spec = SpecPolicy(threshold=8, epsilon=0.0)
    bandit = spec.new_bandit(has_drafter=True)
    for seed in range(2):
        generate(model, _prompts(2), GREEDY, max_new_tokens=16, drafter=drafters["oracle"], spec=spec,
                 bandit=bandit, seed=seed)
    tried = bandit.window_of(2, torch.get_num_threads())
    assert all(len(r) > 0 for r in tried.values())  # every arm has a pass in the bucket that ran


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def real_size(request, smollm2_shaped):
    """SmolLM2's layer shapes (2 of its 30 layers, a 4096-token vocabulary) on the packed oneDNN
    kernels every real model decodes with: decode steps (one row per sequence) and verify passes
    (several rows) must agree on those kernels too, not only on tiny layers. In bfloat16 too, where
    oneDNN multiplies it (its 8-bit logits make near-ties common: test_bit_identity)."""
    if request.param == torch.bfloat16 and not linear.onednn_bf16():
        pytest.skip("needs oneDNN bfloat16 (AVX-512 BF16 or AMX)")
    model = smollm2_shaped(request.param)
    drafter = Drafter.for_target(model, seed=1)
    for m in (model, drafter):
        for layer in m.modules():
            if hasattr(layer, "kernel"):
                layer.kernel = "onednn"
        m._tlt_tuned = True  # keep the forced kernel: no tuning
    return model, drafter, OracleDrafter(model, noise=0.3)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("arm,kind", [("d4k1v4", "noisy"), ("d3k2v6", "noisy"), ("d4k1v4", "drafter")])
def test_sd_on_real_size_layers_and_packed_kernels_emits_the_plain_decoding_tokens(real_size, arm, kind, params):
    model, drafter, noisy = real_size
    assert model.model.layers[0].mlp.down_proj.kernel == "onednn"
    for batch in (1, 3):
        prompts = _prompts(batch)
        base = generate(model, prompts, params, max_new_tokens=20, eos_ids=EOS, seed=9)
        res = generate(model, prompts, params, max_new_tokens=20, eos_ids=EOS, seed=9,
                       drafter=noisy if kind == "noisy" else drafter, spec=SpecPolicy(arm=arm))
        assert res.tokens == base.tokens, (arm, kind, batch)
        assert res.metrics.verify_passes > 0


def test_the_tail_share_and_the_arm_timeline_are_measured_and_merge_per_worker(model, drafters):
    from workers.tlt.rollout.engine import RolloutMetrics

    res = generate(model, _prompts(8), GREEDY, max_new_tokens=24, eos_ids=EOS, drafter=drafters["noisy"],
                   spec=SpecPolicy(threshold=4, epsilon=0.0))
    m = res.metrics
    assert 0.0 <= m.tail_time_frac < 1.0 and "rollout/tail_time_frac" in m.scalars()
    (timeline,) = m.arm_timeline
    assert timeline[0][1] == "off" and len({a for _, a in timeline}) > 1  # off in the bulk, arms in the tail
    assert all(t1 <= t2 for (t1, _), (t2, _) in zip(timeline, timeline[1:]))
    merged = RolloutMetrics.merge([RolloutMetrics.from_dict(m.to_dict())] * 2, [0.0, 1.5])
    assert [w[0][0] for w in merged.arm_timeline] == pytest.approx([timeline[0][0], timeline[0][0] + 1.5], abs=1e-5)
    series = merged.series()["spec/arm_timeline"]
    assert [w["worker"] for w in series] == [0, 1] and series[0]["arm"] == [a for _, a in timeline]
    # hand-made curve: 10 responses, the 9th finishes at 2 s of 10 s: the tail is 80% of the time
    hand = RolloutMetrics(wall_s=10.0, lengths=[1] * 10, running=[(0.0, 10, False), (1.0, 5, False), (2.0, 1, True)])
    assert hand.tail_time_frac == pytest.approx(0.8)


def test_every_target_pass_is_booked_at_its_thread_count_and_product_rows(model, drafters):
    # bench e2e's decode_check weighs the kernels by where the baseline's products ran
    threads = str(torch.get_num_threads())
    plain = generate(model, _prompts(8), GREEDY, max_new_tokens=24, eos_ids=EOS).metrics
    (at,) = plain.passes_by_rows.values()
    assert list(plain.passes_by_rows) == [threads]
    assert sum(at.values()) == max(plain.lengths) - 1  # one pass per token after the prefill's
    assert max(map(int, at)) <= 8 and min(map(int, at)) >= 1  # the batch, then fewer as rows finish
    # every token after a row's first (the prefill's) came from a pass over a product holding that row
    assert sum(int(r) * n for r, n in at.items()) >= sum(plain.lengths) - 8
    alone = generate(model, _prompts(1), GREEDY, max_new_tokens=24, eos_ids=EOS, drafter=drafters["noisy"],
                     spec=SpecPolicy(arm="d4k1v4")).metrics
    assert alone.passes_by_rows == {threads: {"5": alone.verify_passes}}  # a root and 4 drafted tokens each
    merged = RolloutMetrics.merge([plain, alone], [0.0, 0.0])
    assert merged.passes_by_rows == {threads: {**at, "5": at.get("5", 0) + alone.verify_passes}}
    assert merged.series()["rollout/passes_by_rows"] == merged.passes_by_rows
    assert RolloutMetrics.from_dict(json.loads(json.dumps(merged.to_dict()))).passes_by_rows == merged.passes_by_rows


@pytest.mark.parametrize("kernel", linear.KERNELS)
def test_a_worker_taking_more_threads_mid_rollout_decodes_the_same_bits(smollm2_shaped, kernel):
    # rollout workers take a finished peer's core mid-rollout (rollout.lend_idle_cores), at a moment
    # no one controls: the tokens and log-probs must be those of a rollout that never switched, or
    # the arms of an A/B (and SD against plain decoding) would part at the first near-tie
    if not linear.usable(kernel, torch.float32):
        pytest.skip(f"{kernel} cannot run here")
    model = smollm2_shaped(torch.float32)
    for layer in model.modules():
        if hasattr(layer, "kernel"):
            layer.kernel = kernel
    model._tlt_tuned = True
    invariant = linear.thread_invariant(model, 2)
    assert invariant or kernel != "gemv"  # gemv gives each output to one thread: invariant by construction
    prompts = _prompts(3)
    asked = []

    def two_after_six() -> int:
        asked.append(torch.get_num_threads())
        return 1 if len(asked) <= 6 else 2

    try:
        for spec in (None, SpecPolicy(arm="d4k1v4")):
            drafter = OracleDrafter(model, noise=0.3, seed=2) if spec else None
            kw = dict(max_new_tokens=20, eos_ids=EOS, seed=4, spec=spec)
            ref = generate(model, prompts, SAMPLED, drafter=drafter, **kw)
            if drafter is not None:
                drafter.gen.manual_seed(2)  # the same noise: the same drafts, so any difference is the threads'
            asked.clear()
            res = generate(model, prompts, SAMPLED, threads=two_after_six, drafter=drafter, **kw)
            torch.set_num_threads(1)
            # switched from inside the decode loop where that keeps the bits, kept one thread elsewhere
            assert (asked[-1] == 2 and res.metrics.borrowed_s > 0) if invariant else res.metrics.borrowed_s == 0
            assert asked[0] == 1 and len(asked) >= 7  # asked until it said 2
            assert res.tokens == ref.tokens
            assert all(torch.equal(a, b) for a, b in zip(res.logprobs, ref.logprobs))
            assert spec is None or res.metrics.accepted_hist == ref.metrics.accepted_hist
    finally:
        torch.set_num_threads(1)
