"""GRPO learner: advantages, loss aggregation, micro-batching, KL and the log-prob check."""

from __future__ import annotations

import copy

import pytest
import torch

from workers.tlt.config import GRPOSection
from workers.tlt.grpo import GRPOLearner, RolloutBatch, group_advantages, pad_sequences, token_logprobs
from workers.tlt.model import ModelConfig, Transformer, init_weights


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


def test_it_normalises_advantages_within_each_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), group_size=3)
    assert torch.allclose(adv[:3].mean(), torch.tensor(0.0), atol=1e-6)
    assert adv[0] > 0 > adv[1]
    assert torch.allclose(adv[:3].std(unbiased=False), torch.tensor(1.0), atol=1e-4)
    assert torch.equal(adv[3:], torch.zeros(3))  # zero-variance group: zero advantage


def test_it_rejects_a_batch_that_does_not_split_into_groups():
    with pytest.raises(ValueError):
        RolloutBatch(prompts=[[1]] * 5, responses=[[2]] * 5, rewards=[0.0] * 5, group_size=2)


def test_pad_sequences_masks_exactly_the_response_tokens():
    tokens, mask, plen = pad_sequences([[1, 5, 6], [1, 7]], [[8, 2], [9, 10, 2]], pad_id=0)
    assert tokens.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 10, 2]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert plen.tolist() == [3, 2]


def test_an_update_raises_the_logprob_of_rewarded_responses():
    policy = tiny_policy()
    batch = make_batch(rewards=(1.0, 0.0, 0.0, 1.0, 1.0, 1.0))
    tokens, mask, _ = pad_sequences(batch.prompts, batch.responses, 0)
    with torch.no_grad():
        before = (token_logprobs(policy, tokens) * mask).sum(-1)
    learner = GRPOLearner(policy, GRPOSection(lr=1e-2, micro_batch=4), pad_id=0)
    metrics = learner.step(batch)
    with torch.no_grad():
        after = (token_logprobs(policy, tokens) * mask).sum(-1)
    assert after[0] > before[0]  # the rewarded sample of group 0 became more likely
    assert after[1] < before[1] and after[2] < before[2]
    assert metrics["learner/grad_norm"] > 0
    assert metrics["learner/kl"] == 0.0


def test_micro_batching_does_not_change_the_update():
    results = []
    for mb in (1, 2, 8):
        policy = tiny_policy()
        learner = GRPOLearner(policy, GRPOSection(lr=1e-2, micro_batch=mb, grad_clip=100.0), pad_id=0)
        # plain SGD: Adam's sign-like first step would amplify float-rounding differences of tiny grads
        learner.optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        learner.step(make_batch())
        results.append(policy.state_dict())
    for other in results[1:]:
        for k in results[0]:
            assert torch.allclose(results[0][k], other[k], atol=1e-5), k


def test_skipping_zero_advantage_rows_gives_the_full_batch_update():
    # reference: the token-mean clipped loss over EVERY row (ratio 1 at the first step, so its
    # gradient is -adv * d logp / tokens), by hand
    batch = make_batch()  # group 2 all rewarded: zero advantage
    ref_policy = tiny_policy()
    tokens, mask, _ = pad_sequences(batch.prompts, batch.responses, 0)
    adv = group_advantages(torch.tensor(batch.rewards), 3)
    lp = token_logprobs(ref_policy, tokens)
    (-(torch.exp(lp - lp.detach()) * adv[:, None] * mask).sum() / mask.sum()).backward()
    with torch.no_grad():
        for p in ref_policy.parameters():
            p -= p.grad

    policy = tiny_policy()
    learner = GRPOLearner(policy, GRPOSection(micro_batch=2, grad_clip=100.0), pad_id=0)
    learner.optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    metrics = learner.step(batch)
    assert metrics["learner/rows_run"] == 3.0  # the zero-advantage group never ran
    for k, v in ref_policy.state_dict().items():
        assert torch.allclose(policy.state_dict()[k], v, atol=1e-6), k


def test_rows_are_kept_when_their_hidden_states_or_a_kl_term_need_them():
    batch = make_batch()
    learner = GRPOLearner(tiny_policy(), GRPOSection(micro_batch=4), pad_id=0)
    assert learner.step(batch, harvest_hidden=True)["learner/rows_run"] == 6.0
    assert [h.shape[0] for h in learner.last_hidden] == [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    kl_learner = GRPOLearner(tiny_policy(), GRPOSection(kl_coef=0.1), pad_id=0)
    assert kl_learner.step(batch)["learner/rows_run"] == 6.0


def test_zero_variance_groups_leave_the_policy_unchanged():
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
    batch = make_batch()
    tokens, mask, _ = pad_sequences(batch.prompts, batch.responses, 0)
    with torch.no_grad():
        lp = token_logprobs(policy, tokens)
    batch.rollout_logprobs = [lp[b][mask[b] > 0].tolist() for b in range(len(batch.prompts))]
    assert GRPOLearner(policy, GRPOSection(), pad_id=0).step(batch)["rollout/logprob_mismatch"] < 1e-5
    batch.rollout_logprobs = [[x + 0.5 for x in row] for row in batch.rollout_logprobs]
    assert GRPOLearner(tiny_policy(), GRPOSection(), pad_id=0).step(batch)["rollout/logprob_mismatch"] == pytest.approx(0.5, abs=1e-4)
