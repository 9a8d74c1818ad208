"""The coupling bench's figures: exact agreement of the keyed sampler's draws (the rule the product's
SD uses) and the bounds it is compared with."""

import pytest
import torch

from workers.tlt.bench.coupling import agreements, inverse_cdf_agreement
from workers.tlt.rollout.sampling import sample, sample_keys, uniforms

P = torch.tensor([[0.3, 0.6, 0.1]], dtype=torch.float64)
Q = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)


def test_the_exact_agreement_is_what_the_product_sampler_does_at_shared_uniforms():
    B = 200_000
    u = uniforms(sample_keys(11, B), torch.zeros(B, 1, dtype=torch.long))[:, 0]
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
