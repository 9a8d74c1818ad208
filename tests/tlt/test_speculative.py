"""Drafting and verification pieces: keyed sampling, exact losslessness of the acceptance rule, tree masks,
drafter catch-up."""

import itertools

import numpy as np
import pytest
import torch

from workers.tlt.models.drafter import Drafter
from workers.tlt.models.transformer import ModelConfig, Transformer, causal_mask, init_weights
from workers.tlt.rollout import sampling
from workers.tlt.rollout.sampling import SamplingParams, draw, process, sample, sample_keys, token_logprobs
from workers.tlt.rollout.speculative import (Tree, ancestors, catch_up, chain_tree, draft, ngram_propose, tree_from_pool,
                                     tree_mask, walk)

V = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def _target_table(seed: int) -> dict[tuple[int, ...], torch.Tensor]:
    """An explicit target: p(. | prefix) for every prefix of length <= 3 over a 4-token vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return {pre: _norm(torch.rand(V, generator=g) ** 3) for n in range(4) for pre in itertools.product(range(V), repeat=n)}


def _norm(x):
    return x / x.sum()


def _joint(table, horizon=3) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=horizon):
        p = 1.0
        for i, x in enumerate(seq):
            p *= float(table[seq[:i]][x])
        out[seq] = p
    return out


def _extend(table, prefix: tuple[int, ...], prob: float, acc: dict, horizon=3) -> None:
    """Continue an emitted prefix with the target itself up to `horizon` tokens (exactly)."""
    if len(prefix) >= horizon:
        acc[prefix[:horizon]] = acc.get(prefix[:horizon], 0.0) + prob
        return
    for x in range(V):
        _extend(table, prefix + (x,), prob * float(table[prefix][x]), acc, horizon)


def test_tree_walk_is_exactly_the_target_law():
    # tree: root -> {a=0, b=2}, a -> {c=1}; every node draws y ~ p(. | its path); enumerate all y
    p = _target_table(2)
    tokens = torch.tensor([[3, 0, 2, 1]])
    parent = torch.tensor([[-1, 0, 0, 1]])
    depth = torch.tensor([[0, 1, 1, 2]])
    prefixes = [(), (0,), (2,), (0, 1)]
    combos = list(itertools.product(range(V), repeat=4))
    B = len(combos)
    tree = Tree(tokens.expand(B, 4), parent.expand(B, 4), depth.expand(B, 4), torch.ones(B, 4, dtype=torch.bool), 2,
                False)
    y = torch.tensor(combos)
    path, n_acc, nxt = walk(tree, y)
    acc: dict = {}
    for b, ys in enumerate(combos):
        w = 1.0
        for pre, yy in zip(prefixes, ys):
            w *= float(p[pre][yy])
        emitted = tuple(int(tokens[0, path[b, j]]) for j in range(1, int(n_acc[b]) + 1)) + (int(nxt[b]),)
        _extend(p, emitted, w, acc)
    ref = _joint(p)
    assert max(abs(acc[s] - ref[s]) for s in ref) < 1e-6


def test_inverse_cdf_draws_follow_the_distribution_and_sample_keys_extend_with_the_count():
    p = _norm(torch.tensor([0.3, 0.0, 0.05, 0.65]))
    B = 200_000
    x = sample(p.expand(B, V), torch.rand(B, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
    freq = torch.bincount(x, minlength=V).double() / B
    assert (freq - p).abs().max() < 0.005 and freq[1] == 0  # ~4.5 sigma; zero mass is never drawn
    assert torch.equal(sample_keys(7, 5), sample_keys(7, 9)[:5]) and not torch.equal(sample_keys(7, 5), sample_keys(8, 5))


@pytest.mark.parametrize("racers", [2, 64])  # the block of the other tokens wins often / the head is everything
def test_keyed_race_draws_follow_the_distribution_and_depend_only_on_key_and_position(monkeypatch, racers):
    monkeypatch.setattr(sampling, "RACE_TOKENS", racers)
    g = torch.Generator().manual_seed(3)
    p = _norm(torch.rand(12, generator=g) ** 2)
    p[[1, 5, 8]] = 0.0  # zero mass is never drawn, inside the head or in the block
    p = _norm(p)
    B = 200_000
    keys = sample_keys(7, B)
    x = draw(p.expand(B, 12), keys, torch.zeros(B, dtype=torch.long))
    freq = torch.bincount(x, minlength=12).double() / B
    assert (freq - p).abs().max() < 0.005 and freq[[1, 5, 8]].sum() == 0  # ~4.5 sigma
    # the draw of (key, position) is the same in any batch and shape, next to any other rows and positions
    probs = torch.stack([p, _norm(p ** 3)])[None].expand(4, 2, 12)  # [B, J, V]
    pos = torch.tensor([[3, 9]] * 4)
    both = draw(probs, keys[:4], pos)
    assert torch.equal(both[1:3, 1], draw(probs[1:3, 1], keys[1:3], pos[1:3, 1]))
    assert torch.equal(both[:, 0], draw(probs[:, 0, None], keys[:4], pos[:, :1])[:, 0])
    # another key or another position races with other noise
    many = draw(p.expand(64, 12), keys[:64], torch.zeros(64, dtype=torch.long))
    assert not torch.equal(many, draw(p.expand(64, 12), keys[64:128], torch.zeros(64, dtype=torch.long)))
    assert not torch.equal(many, draw(p.expand(64, 12), keys[:64], torch.ones(64, dtype=torch.long)))


def test_a_subset_distribution_races_with_its_tokens_own_noise():
    """A drafter over a reduced vocabulary (ids) draws what it would draw over the whole vocabulary
    with zero mass outside it, so its draws agree with the target's exactly where both race alike."""
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([0, 2, 3, 7, 9, 40, 41, 63])
    q_sub = _norm(torch.rand(len(ids), generator=g) ** 2)
    q_full = torch.zeros(64).index_copy_(0, ids, q_sub)
    B = 5000
    keys = sample_keys(9, B)
    pos = torch.full((B,), 17)
    assert torch.equal(ids[draw(q_sub.expand(B, -1), keys, pos, ids)], draw(q_full.expand(B, -1), keys, pos))
    # a target close to q agrees with q's draws more than id-order inverse CDFs do, and as often as the race predicts
    p = _norm(q_full + 0.02 * torch.rand(64, generator=g))
    race = float((draw(p.expand(B, -1), keys, pos) == ids[draw(q_sub.expand(B, -1), keys, pos, ids)]).double().mean())
    u = torch.rand(B, generator=g, dtype=torch.float64)
    keyed = float((sample(p.expand(B, -1), u) == sample(q_full.expand(B, -1), u)).double().mean())
    assert race > keyed + 0.1 and race <= float(torch.minimum(p, q_full).sum()) + 0.02


def test_a_races_places_are_the_draw_then_the_next_racers_to_finish(monkeypatch):
    g = torch.Generator().manual_seed(8)
    probs = torch.rand(500, 12, generator=g) ** 3
    probs /= probs.sum(-1, keepdim=True)
    keys, pos = sample_keys(3, 500), torch.arange(500)
    three = draw(probs, keys, pos, places=3)
    assert torch.equal(three[:, 0], draw(probs, keys, pos))
    assert (three[:, 0] != three[:, 1]).all() and (three[:, 1] != three[:, 2]).all() and (three[:, 0] != three[:, 2]).all()
    # a close distribution's draw, where it misses this one's, is mostly this one's runner-up
    near = probs + 0.01 * torch.rand(500, 12, generator=g)  # rows need not sum to 1: the race is per row
    other = draw(near, keys, pos)
    missed = other != three[:, 0]
    assert missed.sum() > 10 and float((other[missed] == three[missed, 1]).double().mean()) > 0.6
    # behind a win of the block of unlikely tokens, the runner-up is the head's first
    monkeypatch.setattr(sampling, "RACE_TOKENS", 2)
    two = draw(probs, keys, pos, places=2)
    block_won = ~(two[:, 0, None] == probs.topk(2, -1).indices).any(-1)
    assert block_won.any() and (two[block_won, 1] != two[block_won, 0]).all()


def test_a_sampled_trees_children_are_the_first_to_finish_the_drafters_race():
    model = _tiny()
    drafter = Drafter.for_target(model)
    B, L = 2, 40
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([7, 5])
    seq = torch.randint(0, 48, (B, L), generator=g)
    hid = torch.randn(B, L, 32, generator=g)
    params, keys = SamplingParams(temperature=0.8), sample_keys(4, B)
    tree = draft(drafter, drafter.new_cache(B, L), hid, seq, lens, 7, depth=2, topk=3, verify=6, params=params, keys=keys)
    # level 1: the root's children, in the race's finishing order at the position after the pending token
    q = process(catch_up(drafter, drafter.new_cache(B, L), hid, seq, lens) @ model.lm_head.weight.T, params)
    first = tree.depth == 1
    assert torch.equal(tree.tokens[first].view(B, 3), draw(q, keys, lens + 1, places=3))
    with pytest.raises(ValueError, match="sample keys"):
        draft(drafter, drafter.new_cache(B, L), hid, seq, lens, 7, depth=2, topk=3, verify=6, params=params)


def test_tree_branching_stays_within_the_racers_one_by_one():
    from workers.tlt.config import ConfigError, preset
    from workers.tlt.rollout import spec_defaults
    from workers.tlt.rollout.engine import Arm

    assert spec_defaults.MAX_TOPK <= sampling.RACE_TOKENS
    with pytest.raises(ConfigError, match="top-k"):
        preset("tiny-cpu", {"spec": {"strategies": [(4, spec_defaults.MAX_TOPK + 1, 64)]}})
    with pytest.raises(ValueError, match="topk"):
        Arm.parse(f"d4k{spec_defaults.MAX_TOPK + 1}v64")


def test_token_logprobs_score_the_processed_distribution_and_keep_sampled_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.5, top_k=2)
    lp = token_logprobs(logits, torch.tensor([1]), params)
    assert torch.allclose(lp.exp(), process(logits, params)[:, 1])
    # a token the truncation would drop (rounding between engines) still gets a finite log-prob
    assert torch.isfinite(token_logprobs(logits, torch.tensor([3]), params)).all()
    # greedy rollouts are scored at temperature 1
    assert torch.allclose(token_logprobs(logits, torch.tensor([1]), SamplingParams(temperature=0)),
                          logits.log_softmax(-1)[:, 1])


def test_processed_distribution_applies_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    assert torch.equal(process(logits, SamplingParams(temperature=0)), torch.tensor([[1.0, 0, 0, 0, 0]]))
    assert torch.allclose(process(logits, SamplingParams(temperature=2.0)), (logits / 2).softmax(-1))
    top2 = process(logits, SamplingParams(top_k=2))
    assert torch.allclose(top2, torch.cat([logits[:, :2].softmax(-1), torch.zeros(1, 3)], 1))
    full = logits.softmax(-1)[0]
    nucleus = process(logits, SamplingParams(top_p=float(full[0] + full[1] * 0.5)))
    assert (nucleus[0, 2:] == 0).all() and torch.allclose(nucleus[0, :2], full[:2] / full[:2].sum())


def _tiny(seed=0, vocab=48):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = Transformer(cfg)
    init_weights(m, 0.3)
    return m.eval()


@torch.inference_mode()
def test_tree_verify_logits_equal_sequential_forward_of_each_path():
    model = _tiny()
    drafter = Drafter.for_target(model)
    B, L = 2, 40
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([7, 4])
    seq = torch.randint(0, 48, (B, L), generator=g)
    cache, dcache = model.new_cache(B, L), drafter.new_cache(B, L)
    out = model(seq[:, :7], torch.arange(7).expand(B, 7), cache, mask=causal_mask(cache.lengths, 7, 7))
    hid = torch.zeros(B, L, 32)
    hid[:, :7] = out.hidden
    cache.lengths = lens.clone()
    tree = draft(drafter, dcache, hid, seq, lens, 7, depth=3, topk=2, verify=6, params=SamplingParams(0))
    assert not torch.equal(tree.parent[:, 1:], torch.arange(6).expand(B, 6))  # a real tree, not a chain
    T = tree.tokens.shape[1]
    got = model(tree.tokens, lens[:, None] + tree.depth, cache, write_pos=lens[:, None] + torch.arange(T),
                mask=tree_mask(lens, ancestors(tree), 7 + T)).logits
    for b in range(B):
        for i in range(T):
            path, node = [], i
            while node >= 0:
                path.append(int(tree.tokens[b, node]))
                node = int(tree.parent[b, node])
            ref = model(torch.cat([seq[b, :int(lens[b])], torch.tensor(path[::-1])])[None]).logits[0, -1]
            assert torch.allclose(got[b, i], ref, atol=1e-4), (b, i)


@torch.inference_mode()
def test_catch_up_fills_the_drafter_cache_from_true_states_only():
    model = _tiny(1)
    drafter = Drafter.for_target(model, seed=3)
    B, L = 3, 32
    seq = torch.randint(0, 48, (B, L), generator=torch.Generator().manual_seed(1))
    hid = torch.randn(B, L, 32, generator=torch.Generator().manual_seed(2))
    dcache = drafter.new_cache(B, L)
    lengths = torch.tensor([9, 5, 12])
    catch_up(drafter, dcache, hid, seq, torch.tensor([3, 5, 2]))  # ragged earlier state
    dcache.k[0][:, 12:] = 99.0  # garbage past every row's length must not matter
    h = catch_up(drafter, dcache, hid, seq, lengths)
    for b in range(B):
        n = int(lengths[b])
        ref = drafter(hid[b:b + 1, :n], seq[b:b + 1, 1:n + 1])
        assert torch.allclose(h[b], ref[0, -1], atol=1e-5)
        fresh = drafter.new_cache(1, L)
        drafter(hid[b:b + 1, :n], seq[b:b + 1, 1:n + 1], cache=fresh, mask=causal_mask(fresh.lengths, n, n))
        assert torch.allclose(dcache.k[0][b, :n], fresh.k[0][0, :n], atol=1e-5)
    assert torch.equal(dcache.lengths, lengths)


def test_ngram_drafter_continues_the_longest_match_in_own_text_then_siblings():
    assert ngram_propose([5, 1, 2, 3, 9, 9, 1, 2, 3], [], 3, 4) == [9, 9, 1, 2]
    assert ngram_propose([7, 8, 4], [np.array([1, 7, 8, 4, 6, 6])], 3, 4) == [6, 6]
    assert ngram_propose([7, 8, 4], [np.array([1, 2])], 3, 4) == []
    # n_min: shorter matches do not count (only "4" recurs here, a 1-token match)
    assert ngram_propose([4, 6, 8, 4], [], 3, 4) == [6, 8, 4]
    assert ngram_propose([4, 6, 8, 4], [], 3, 4, n_min=2) == []
    assert ngram_propose([6, 8, 4, 2, 8, 4], [], 3, 4, n_min=2) == [2, 8, 4]
    tree = chain_tree(torch.tensor([4, 5]), [[1, 2, 3], []], 6)
    assert tree.tokens.tolist() == [[4, 1, 2, 3], [5, 0, 0, 0]]
    assert tree.valid.tolist() == [[True] * 4, [True, False, False, False]]


def test_a_kept_node_whose_parent_was_dropped_is_never_accepted():
    # pool: root children A (token 5, score -5) and B (6, -0.1); A's child C (7, -0.05), scored
    # above its parent, as rounding could do; keeping the best 2 keeps B and C but not A
    pool = dict(ptok=torch.tensor([[5, 6, 7]]), pscore=torch.tensor([[-5.0, -0.1, -0.05]]),
                ppar=torch.tensor([[-1, -1, 0]]), pdep=torch.tensor([[1, 1, 2]]))
    tree = tree_from_pool(torch.tensor([3]), **pool, verify=2, depth=2)
    assert tree.tokens.tolist() == [[3, 6, 7]] and tree.valid.tolist() == [[True, True, False]]
    # the target would emit 7 right after the root: the orphan C must not be taken for it
    y = torch.tensor([[7, 1, 1]])
    path, n_acc, nxt = walk(tree, y)
    assert n_acc.tolist() == [0] and nxt.tolist() == [7]
    # with scores in order the same pool keeps A and C, and the path root -> A -> C is accepted
    ok = tree_from_pool(torch.tensor([3]), **{**pool, "pscore": torch.tensor([[-0.1, -5.0, -0.2]])}, verify=2, depth=2)
    assert ok.tokens.tolist() == [[3, 5, 7]] and ok.valid.all()
    assert walk(ok, torch.tensor([[5, 7, 2]]))[1].tolist() == [2]
