"""The coupling bench's figures: exact agreement of the keyed sampler's draws (the rule the product's
SD uses) and the bounds it is compared with."""

import pytest
import torch

from workers.tlt.bench.coupling import agreements, inverse_cdf_agreement, runner_up, second_candidates
from workers.tlt.rollout.sampling import draw, sample, sample_keys

P = torch.tensor([[0.3, 0.6, 0.1]], dtype=torch.float64)
Q = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)


def test_the_exact_inverse_cdf_agreement_is_what_the_inverse_cdf_sampler_does_at_shared_uniforms():
    B = 200_000
    u = torch.rand(B, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    same = float((sample(P.float().expand(B, 3), u) == sample(Q.float().expand(B, 3), u)).double().mean())
    ids = torch.arange(3)[None]
    exact = float(inverse_cdf_agreement(P, Q, ids, ids)[0])
    assert exact == pytest.approx(0.6)  # intervals [0,.3) [.3,.9) [.9,1) vs [0,.1) [.1,.7) [.7,1)
    assert same == pytest.approx(exact, abs=0.004)


def test_the_figures_order_as_couplings_must():
    got = {k: float(v[0]) for k, v in agreements(P, Q, 2000, torch.Generator().manual_seed(0)).items()}
    assert got["maximal"] == pytest.approx(0.8) and got["keyed_argmax_first"] == pytest.approx(0.8)
    assert got["greedy_draft"] == pytest.approx(0.6) and got["p_max"] == pytest.approx(0.6)
    assert got["keyed_inverse_cdf"] <= got["gumbel"] + 0.03 and got["gumbel"] <= got["maximal"] + 0.03
    # three tokens all race one by one: the product's race is the Gumbel coupling itself
    assert got["race"] == pytest.approx(got["gumbel"], abs=0.03) and got["race"] > got["keyed_inverse_cdf"]


def test_the_race_figure_is_what_the_product_sampler_draws_from_each_distribution():
    from workers.tlt.bench.coupling import race_agreement

    keys = sample_keys(5, 4000).view(2, 2000)
    pos = torch.zeros(2000, dtype=torch.long)
    got = race_agreement(P.expand(2000, 3), Q.expand(2000, 3), keys)
    by_hand = sum((draw(P.expand(2000, 3), k, pos) == draw(Q.expand(2000, 3), k, pos)).double() for k in keys) / 2
    assert torch.equal(got, by_hand) and 0.6 < float(got.mean()) < 0.8


def test_the_runner_up_catches_the_draws_a_shifted_interval_moves_and_the_likeliest_token_does_not():
    figures, calib = second_candidates(P, Q, 4000, torch.Generator().manual_seed(0))
    # u in [.1, .3): q draws 1 ([.1, .7)), p draws 0; the runner-up across q's near lower edge is 0, while
    # q's likeliest other token is 2. Everywhere else one of the pair is p's draw.
    assert float(figures["keyed_or_runner_up"][0]) == pytest.approx(1.0)
    assert float(figures["keyed_or_likeliest"][0]) == pytest.approx(0.8, abs=0.02)
    assert calib.shape == (4000, 4) and float(calib[:, 1].mean()) == pytest.approx(0.6, abs=0.02)
    # the race's draw and q's likeliest other token miss p's draw only where p draws 0 and q raced 1 or 2
    # (the pair is then 1 and 2), or p draws 2 and q raced 0 (the pair 0 and 1): ~0.8 by simulation
    assert 0.75 < float(figures["race_or_likeliest"][0]) < 0.85


def test_the_spot_curve_measures_a_trained_copy_and_leaves_the_warmed_drafter_alone():
    from workers.tlt.bench.coupling import keyed_agreement, spot_curve
    from workers.tlt.config import ModelSection, preset
    from workers.tlt.learn.sft import build_tiny_model
    from workers.tlt.models.drafter import Drafter

    target = build_tiny_model(ModelSection(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2),
                              vocab_size=18, bos_id=1, eos_id=2, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    answers = []
    with torch.no_grad():
        for i in range(8):
            toks = torch.randint(4, 18, (12 + 3 * (i % 4),), generator=g)
            answers.append((toks, target(toks[None]).hidden[0].to(torch.float16), 4))
    drafter = Drafter.for_target(target, seed=0)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    # scored sharp (T = 0.1): at T = 1 this random target's distributions are so flat that any drafter's
    # race agrees with it ~92% of the time, trained or not
    cfg = preset("tiny-cpu", {"drafter": {"batch_tokens": 64, "spot_max_epochs": 4}, "rollout": {"temperature": 0.1}})
    start = keyed_agreement(target, drafter, answers, None, 0.1)
    curve = spot_curve(target, drafter, cfg, [answers] * 3, answers, None, lr=1e-2, optimizer=None)
    assert len(curve) == 3 and all(0.0 < a <= 1.0 for a in [start, *curve])
    assert curve[-1] > start + 0.05  # trained on the very answers it is scored on: it must fit them better
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    # resumed from another AdamW's moments (the warm-up's, in the bench), the same data trains otherwise
    warm = torch.optim.AdamW([p for p in Drafter.for_target(target, seed=0).parameters() if p.requires_grad])
    for p in (q for g in warm.param_groups for q in g["params"]):
        warm.state[p] = {"step": torch.tensor(50.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.ones_like(p)}
    resumed = spot_curve(target, drafter, cfg, [answers] * 3, answers, None, lr=1e-2, optimizer=warm.state_dict())
    assert resumed != curve


def test_chain_tokens_counts_the_emitted_token_and_the_accepted_drafts():
    from workers.tlt.bench.coupling import chain_tokens

    assert chain_tokens(1.0, 1.0, 6) == 7.0  # every draft accepted, plus the target's own token
    assert chain_tokens(0.5, 0.0, 6) == 1.5
    assert chain_tokens(0.6, 0.5, 3) == pytest.approx(1 + 0.6 * (1 + 0.5 + 0.25))


def test_recipes_are_scored_on_answers_they_never_trained_on():
    from workers.tlt.bench.coupling import recipe_scores
    from workers.tlt.config import ModelSection, preset
    from workers.tlt.learn.sft import build_tiny_model

    target = build_tiny_model(ModelSection(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2),
                              vocab_size=18, bos_id=1, eos_id=2, seed=1).eval()
    answers = []
    with torch.no_grad():
        for i in range(24):  # periodic token streams: what follows depends on the last few tokens, learnably
            period = 3 + i % 3
            toks = torch.tensor([4 + (i + j) % period for j in range(20 + i % 5)])
            answers.append((toks, target(toks[None]).hidden[0].to(torch.float16), 3))
    base = preset("tiny-cpu").drafter.model_copy(update={"warmup_lr": 1e-2, "warmup_batch_tokens": 128,
                                                         "train_vocab": 0})
    recipes = {"untrained": base.model_copy(update={"warmup_steps": 0}),
               "trained": base.model_copy(update={"warmup_steps": 80})}
    got = recipe_scores(target, answers, recipes, holdout=6, ids_size=0, temperature=1.0, depth=4, eos_ids=[2])
    assert set(got) == {"untrained", "trained"}
    for r in got.values():
        assert 0.0 < r["step1"] <= 1.0 and 0.0 < r["step2"] <= 1.0
    assert got["trained"]["step1"] > got["untrained"]["step1"] + 0.05  # it generalises to the held-out answers
    assert (got["untrained"]["steps"], got["trained"]["steps"]) == (0, 80)
    with pytest.raises(ValueError, match="holdout"):
        recipe_scores(target, answers, recipes, holdout=24, ids_size=0, temperature=1.0, depth=4, eos_ids=[2])


def test_a_recipe_trains_the_shared_step_count_unless_it_sets_its_own():
    from workers.tlt.bench.coupling import recipe_sections
    from workers.tlt.config import preset

    own_vocab = preset("smollm2-mathmix-cpu").drafter.train_vocab
    got = recipe_sections("smollm2-mathmix-cpu", ["drafter.feature_noise=0.5"],
                          ["drafter.train_vocab=2048", "drafter.train_vocab=2048,drafter.warmup_steps=5000"], 300)
    assert {k: (r.warmup_steps, r.train_vocab, r.feature_noise) for k, r in got.items()} == {
        "preset": (300, own_vocab, 0.5),
        "drafter.train_vocab=2048": (300, 2048, 0.5),
        "drafter.train_vocab=2048,drafter.warmup_steps=5000": (5000, 2048, 0.5)}
    for fixed in ("drafter.warmup_prompts=4096", "spec.threshold=8"):  # the answers, or not the drafter's recipe
        with pytest.raises(SystemExit, match=fixed.split("=")[0]):
            recipe_sections("smollm2-mathmix-cpu", [], [fixed], 3000)


def test_position_means_bucket_each_answers_positions_from_its_start():
    from workers.tlt.bench.coupling import PositionMeans

    m = PositionMeans([0, 2, 5])
    m.add(torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]))  # positions 0..6
    m.add(torch.tensor([0.0, 0.0, 0.0]))  # a second answer starts at position 0 again
    assert m.means() == {"0-2": (0.25, 4), "2-5": (0.75, 4), "5-": (0.0, 2)}
    m2 = PositionMeans([0, 128, 384])
    m2.add(torch.ones(10))
    assert m2.means() == {"0-128": (1.0, 10)}  # empty buckets are left out


def test_a_keyed_draws_runner_up_is_the_token_with_mass_across_the_nearer_edge_of_its_interval():
    probs = torch.tensor([0.4, 0.0, 1.0, 0.0, 0.6])  # unnormalised: intervals [0, .2) [.2, .7) [.7, 1) of the mass
    u = torch.tensor([0.25, 0.65, 0.1, 0.95, 0.3])
    tok, alt, gap = runner_up(probs.expand(5, 5), u)
    assert torch.equal(tok, sample(probs.expand(5, 5), u))  # the keyed draw itself, as plain sampling draws it
    assert tok.tolist() == [2, 2, 0, 4, 2]
    # below the draw, above it skipping the zero-mass token 3, above where nothing is below, below where
    # nothing is above
    assert alt.tolist() == [0, 4, 2, 2, 0]
    assert gap.tolist() == pytest.approx([0.05, 0.05, 0.1, 0.25, 0.1])
    tok, alt, gap = runner_up(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([0.3]))
    assert tok.item() == alt.item() == 1 and gap.item() == 1.0  # no other token has mass: none to offer
