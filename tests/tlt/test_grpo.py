"""GRPO learner: advantages, the scored distribution, mini-batches and the clip, micro-batching, the
exact zero-advantage skip under AdamW, KL and the log-prob check."""

from __future__ import annotations

import copy

import pytest
import torch

from workers.tlt.config import GRPOSection
from workers.tlt.learn.grpo import (GRPOLearner, RolloutBatch, group_advantages, micro_batches, pad_sequences,
                              response_logprobs)
from workers.tlt.models.transformer import ModelConfig, Transformer, init_weights
from workers.tlt.rollout.sampling import SamplingParams

T1 = SamplingParams(temperature=1.0)


def tiny_policy(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)
    model = Transformer(cfg)
    init_weights(model)
    return model


def make_batch(rewards=(1.0, 0.0, 0.0, 1.0, 1.0, 1.0), group_size=3) -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    prompts, responses = [], []
    for i in range(len(rewards)):
        prompts.append([1] + torch.randint(4, 20, (3 + i % 2,), generator=g).tolist())
        responses.append(torch.randint(4, 20, (2 + i,), generator=g).tolist() + [2])
    return RolloutBatch(prompts=prompts, responses=responses, rewards=list(rewards), group_size=group_size)


def scored(policy, batch, params=T1) -> list[torch.Tensor]:
    """Per row, the policy's log-probs of its response tokens (what a rollout engine records)."""
    tokens, mask = pad_sequences(batch.prompts, batch.responses, 0)
    with torch.no_grad():
        return list(response_logprobs(policy, tokens, mask, params).split(mask.sum(1).tolist()))


def with_rollout_logprobs(batch, policy, params=T1) -> RolloutBatch:
    batch.rollout_logprobs = [lp.tolist() for lp in scored(policy, batch, params)]
    return batch


def test_it_normalises_advantages_within_each_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), group_size=3)
    assert torch.allclose(adv[:3].mean(), torch.tensor(0.0), atol=1e-6)
    assert adv[0] > 0 > adv[1]
    assert torch.allclose(adv[:3].std(unbiased=False), torch.tensor(1.0), atol=1e-4)
    assert torch.equal(adv[3:], torch.zeros(3))  # zero-variance group: zero advantage


def test_it_rejects_a_batch_that_does_not_split_into_groups_of_two_or_more():
    with pytest.raises(ValueError):
        RolloutBatch(prompts=[[1]] * 5, responses=[[2]] * 5, rewards=[0.0] * 5, group_size=2)
    with pytest.raises(ValueError, match=">= 2"):  # a group of one has no relative advantage
        RolloutBatch(prompts=[[1]] * 2, responses=[[2]] * 2, rewards=[0.0, 1.0], group_size=1)


def test_pad_sequences_masks_exactly_the_response_tokens():
    tokens, mask = pad_sequences([[1, 5, 6], [1, 7]], [[8, 2], [9, 10, 2]], pad_id=0)
    assert tokens.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 10, 2]]
    assert mask.tolist() == [[False, False, True, True], [False, True, True, True]]
    assert tokens[:, 1:][mask].tolist() == [8, 2, 9, 10, 2]  # row-major: the responses in order


def test_micro_batches_respect_the_row_and_padded_token_budgets():
    lengths = [10, 300, 12, 50, 11, 9]
    chunks = micro_batches(lengths, [0, 1, 2, 3, 4, 5], max_rows=3, max_tokens=100)
    assert sorted(r for c in chunks for r in c) == [0, 1, 2, 3, 4, 5]
    assert chunks[0] == [1]  # longer than the budget: alone
    assert all(len(c) <= 3 and (len(c) == 1 or len(c) * max(lengths[r] for r in c) <= 100) for c in chunks)


def test_the_learner_scores_the_distribution_the_rollout_sampled_from():
    policy = tiny_policy()
    batch = make_batch()
    for params in (SamplingParams(temperature=0.5), SamplingParams(temperature=0.8, top_k=5)):
        with_rollout_logprobs(batch, policy, params)
        hot = scored(policy, batch, T1)
        assert any((torch.tensor(r) - h).abs().max() > 0.05 for r, h in zip(batch.rollout_logprobs, hot))
        learner = GRPOLearner(copy.deepcopy(policy), GRPOSection(), pad_id=0, sampling=params)
        m = learner.step(batch)
        assert m["rollout/logprob_mismatch"] < 1e-5 and m["rollout/logprob_mismatch_max"] < 1e-4
        assert m["learner/clip_frac"] == 0.0  # one mini-batch: the ratio is 1 up to the engines' rounding


def test_an_update_raises_the_logprob_of_rewarded_responses():
    policy = tiny_policy()
    batch = with_rollout_logprobs(make_batch(rewards=(1.0, 0.0, 0.0, 1.0, 1.0, 1.0)), policy)
    before = [float(lp.sum()) for lp in scored(policy, batch)]
    learner = GRPOLearner(policy, GRPOSection(lr=1e-2, micro_batch=4), pad_id=0)
    metrics = learner.step(batch)
    after = [float(lp.sum()) for lp in scored(policy, batch)]
    assert after[0] > before[0]  # the rewarded sample of group 0 became more likely
    assert after[1] < before[1] and after[2] < before[2]
    assert metrics["learner/grad_norm"] > 0
    assert metrics["learner/kl"] == 0.0


def test_a_bfloat16_learner_computes_in_bfloat16_and_keeps_float32_weights_and_moments():
    batch = with_rollout_logprobs(make_batch(rewards=(1.0, 0.0, 0.0, 1.0, 1.0, 1.0)), tiny_policy())
    updates, metrics = {}, {}
    for dtype in ("float32", "bfloat16"):
        policy = tiny_policy()
        before = copy.deepcopy(policy.state_dict())
        learner = GRPOLearner(policy, GRPOSection(lr=1e-3, compute_dtype=dtype), pad_id=0)
        metrics[dtype] = learner.step(batch)
        assert all(p.dtype == torch.float32 for p in policy.parameters())
        assert all(v.dtype == torch.float32 for st in learner.optimizer.state.values() for v in st.values()
                   if v.is_floating_point())
        updates[dtype] = torch.cat([(policy.state_dict()[k] - before[k]).flatten() for k in before])
    f32, bf16 = updates["float32"], updates["bfloat16"]
    assert f32.abs().max() > 1e-4  # the update is a real one
    # the same update up to bfloat16's rounding of the products: the rollout log-probs were float32's,
    # so only the bfloat16 learner sees a mismatch
    assert torch.nn.functional.cosine_similarity(f32, bf16, dim=0) > 0.98 and not torch.equal(f32, bf16)
    assert metrics["float32"]["rollout/logprob_mismatch_max"] < 1e-5 < metrics["bfloat16"]["rollout/logprob_mismatch_max"]


def test_an_unresolved_compute_dtype_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="resolve_dtype"):
        GRPOLearner(tiny_policy(), GRPOSection(compute_dtype="auto"), pad_id=0)


@pytest.mark.parametrize("rows,tokens", [(1, 4096), (2, 4096), (8, 4096), (8, 16)])
def test_micro_batching_does_not_change_the_update(rows, tokens):
    ref = tiny_policy()
    reference = GRPOLearner(ref, GRPOSection(lr=1e-2, micro_batch=64, micro_batch_tokens=10**6, grad_clip=100.0), pad_id=0)
    reference.optimizer = torch.optim.SGD(reference.params, lr=1.0)  # plain SGD: Adam's sign-like first
    reference.step(make_batch())                                      # step amplifies rounding of tiny grads
    policy = tiny_policy()
    learner = GRPOLearner(policy, GRPOSection(lr=1e-2, micro_batch=rows, micro_batch_tokens=tokens, grad_clip=100.0),
                          pad_id=0)
    learner.optimizer = torch.optim.SGD(learner.params, lr=1.0)
    learner.step(make_batch())
    for k, v in ref.state_dict().items():
        assert torch.allclose(policy.state_dict()[k], v, atol=1e-5), k


def _adamw(params, cfg: GRPOSection) -> torch.optim.AdamW:
    # eps well above float rounding: AdamW's first steps are sign-like, and would turn the rounding
    # noise of near-zero gradients (one padded batch vs micro-batches) into +-lr differences
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-4, weight_decay=0.0)


def _reference_adamw_steps(batches, cfg: GRPOSection) -> Transformer:
    """Every row of every batch, by hand: token-mean clipped loss against the rollout log-probs, AdamW."""
    policy = tiny_policy()
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = _adamw(params, cfg)
    for batch in batches:
        tokens, mask = pad_sequences(batch.prompts, batch.responses, 0)
        adv = group_advantages(torch.tensor(batch.rewards), batch.group_size)
        a = adv[:, None].expand(mask.shape)[mask]
        old = torch.cat([torch.tensor(r) for r in batch.rollout_logprobs])
        ratio = torch.exp(response_logprobs(policy, tokens, mask, T1) - old)
        loss = -torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * a).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
    return policy


def test_skipping_zero_advantage_rows_is_the_same_adamw_update_even_for_a_whole_step():
    cfg = GRPOSection(lr=1e-2, micro_batch=2, grad_clip=100.0)
    start = tiny_policy()
    first = with_rollout_logprobs(make_batch(), start)  # group 2 all rewarded: zero advantage
    policy = tiny_policy()
    learner = GRPOLearner(policy, cfg, pad_id=0)
    learner.optimizer = _adamw(learner.params, cfg)
    assert learner.step(first)["learner/rows_run"] == 3.0  # the zero-advantage group never ran
    after_first = copy.deepcopy(policy.state_dict())
    second = with_rollout_logprobs(make_batch(rewards=(1.0, 1.0, 1.0, 0.0, 0.0, 0.0)), policy)
    assert learner.step(second)["learner/rows_run"] == 0.0  # nothing to run at all
    ref = _reference_adamw_steps([first, second], cfg)
    for k, v in ref.state_dict().items():
        assert torch.allclose(policy.state_dict()[k], v, atol=1e-6), k
    # the second step did move the weights (AdamW's momentum), so the test compares real updates
    assert any(not torch.equal(policy.state_dict()[k], after_first[k]) for k in after_first)


def test_mini_batches_take_one_optimizer_step_each_and_the_clip_acts_from_the_second():
    policy = tiny_policy()
    batch = with_rollout_logprobs(make_batch(rewards=(1.0, 0.0, 0.0, 0.0, 1.0, 1.0)), policy)
    one = GRPOLearner(copy.deepcopy(policy), GRPOSection(lr=0.05, clip_eps=0.05), pad_id=0).step(batch)
    two = GRPOLearner(copy.deepcopy(policy), GRPOSection(lr=0.05, clip_eps=0.05, mini_batches=2), pad_id=0).step(batch)
    assert one["learner/optimizer_steps"] == 1.0 and two["learner/optimizer_steps"] == 2.0
    assert one["learner/clip_frac"] == 0.0
    assert two["learner/clip_frac"] > 0.0  # the second mini-batch sees the policy the first one moved


def test_rows_are_kept_when_their_hidden_states_or_a_kl_term_need_them():
    batch = make_batch()
    learner = GRPOLearner(tiny_policy(), GRPOSection(micro_batch=4), pad_id=0)
    assert learner.step(batch, harvest_hidden=True)["learner/rows_run"] == 6.0
    assert [h.shape[0] for h in learner.last_hidden] == [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    kl_learner = GRPOLearner(tiny_policy(), GRPOSection(kl_coef=0.1), pad_id=0)
    assert kl_learner.step(batch)["learner/rows_run"] == 6.0


def test_zero_variance_groups_leave_a_fresh_policy_unchanged():
    policy = tiny_policy()
    before = copy.deepcopy(policy.state_dict())
    learner = GRPOLearner(policy, GRPOSection(lr=1e-2), pad_id=0)
    metrics = learner.step(make_batch(rewards=(1.0, 1.0, 1.0, 0.0, 0.0, 0.0)))
    assert metrics["learner/grad_norm"] == 0.0
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_kl_penalty_uses_a_frozen_reference():
    policy = tiny_policy()
    learner = GRPOLearner(policy, GRPOSection(lr=1e-2, kl_coef=0.1), pad_id=0)
    ref_before = copy.deepcopy(learner.ref.state_dict())
    m1 = learner.step(make_batch())
    assert m1["learner/kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference at the first step
    m2 = learner.step(make_batch())
    assert m2["learner/kl"] > 0.0
    for k, v in learner.ref.state_dict().items():
        assert torch.equal(v, ref_before[k])


def test_it_reports_the_mismatch_between_rollout_and_learner_logprobs():
    policy = tiny_policy()
    batch = with_rollout_logprobs(make_batch(), policy)
    assert GRPOLearner(policy, GRPOSection(), pad_id=0).step(batch)["rollout/logprob_mismatch"] < 1e-5
    batch.rollout_logprobs = [[x + 0.5 for x in row] for row in batch.rollout_logprobs]
    batch.rollout_logprobs[0][0] += 1.0
    m = GRPOLearner(tiny_policy(), GRPOSection(), pad_id=0).step(batch)
    scored_tokens = sum(len(r) for r in batch.responses[:3])  # only group 0 has an advantage
    assert m["rollout/logprob_mismatch"] == pytest.approx(0.5 + 1.0 / scored_tokens, abs=1e-4)
    assert m["rollout/logprob_mismatch_max"] == pytest.approx(1.5, abs=1e-4)


def test_the_step_bins_the_log_prob_mismatch_for_the_audit():
    from workers.tlt.audit import MISMATCH_EDGES

    policy = tiny_policy()
    batch = with_rollout_logprobs(make_batch(), policy)
    batch.rollout_logprobs[0][0] += 0.5  # one token 0.5 off, the rest ~rounding
    learner = GRPOLearner(policy, GRPOSection(), pad_id=0)
    learner.step(batch)
    h = learner.last_mismatch_hist
    assert len(h["counts"]) == len(MISMATCH_EDGES) - 1 and h["edges"][-1] is None
    assert sum(h["counts"]) == sum(len(r) for r in batch.responses[:3])  # the rows the learner ran
    assert h["counts"][MISMATCH_EDGES.index(0.1)] == 1  # 0.1 <= 0.5 < 1
