"""The losslessness audit: evidence, per run, that TLT changed nothing the policy would have done.

    checks = spot_check(policy, drafter, prompts, eos_ids, spec)       # at each checkpoint
    # {"audit/greedy_identical": 1.0, "audit/greedy_prompts": 2.0, "audit/acceptance_length": 3.4}
    hist = mismatch_histogram(deltas)   # |rollout log-prob - learner log-prob| per token, binned

spot_check decodes a few held-out prompts greedily twice, plain and with SD through the run's
drafter and SD policy, and reports the share whose outputs are equal token for token (anything
below 1.0 is a losslessness failure: the run page raises an alert) and the acceptance length the
drafter reaches there (the model card's figure). mismatch_histogram bins the per-token log-prob
differences between the rollout engine and the learner on log-spaced edges, so a drift in the
engines' numerics shows as mass moving right.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

# log-spaced |delta| bin edges: 0, 1e-7 .. 1e1, inf
MISMATCH_EDGES = [0.0] + [10.0 ** e for e in range(-7, 2)] + [float("inf")]


def spot_check(policy, drafter, prompts: Sequence[Sequence[int]], eos_ids: Sequence[int], spec,
               max_new_tokens: int = 64) -> dict[str, float]:
    """Greedy SD vs plain decoding on `prompts` (one at a time: the tail's batch size)."""
    from .rollout.engine import SpecPolicy, generate
    from .rollout.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    plain = SpecPolicy(enabled=False, threshold=spec.threshold)
    same = 0
    hist: list[int] = []
    for p in prompts:
        base = generate(policy, [list(p)], greedy, max_new_tokens=max_new_tokens, eos_ids=eos_ids, spec=plain,
                        harvest_hidden=False)
        res = generate(policy, [list(p)], greedy, max_new_tokens=max_new_tokens, eos_ids=eos_ids, drafter=drafter,
                       spec=spec, harvest_hidden=False)
        same += int(res.tokens == base.tokens)
        h = res.metrics.accepted_hist
        hist = [a + b for a, b in zip(hist, h)] + (h[len(hist):] if len(h) > len(hist) else hist[len(h):])
    passes = sum(hist)
    out = {"audit/greedy_identical": same / max(1, len(prompts)), "audit/greedy_prompts": float(len(prompts))}
    if passes:
        out["audit/acceptance_length"] = sum((k + 1) * c for k, c in enumerate(hist)) / passes
    return out


def mismatch_histogram(deltas: Tensor | Sequence[float]) -> dict[str, list]:
    """{"edges": MISMATCH_EDGES, "counts": [...]} of |deltas| (counts[i]: edges[i] <= |d| < edges[i+1])."""
    d = torch.as_tensor(deltas, dtype=torch.float64).abs().flatten()
    edges = torch.tensor(MISMATCH_EDGES[1:-1], dtype=torch.float64)
    counts = torch.bincount(torch.bucketize(d, edges, right=True), minlength=len(MISMATCH_EDGES) - 1)
    return {"edges": [e if e != float("inf") else None for e in MISMATCH_EDGES], "counts": counts.tolist()}
