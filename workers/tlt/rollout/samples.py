"""The few responses a step keeps for the run page's sample viewer (series `rollout/samples`).

    records = step_samples(prompts, tokens, from_draft, rewards, finished, decode_token, step=3, seed=0)

Up to MAX_SAMPLES per step, chosen to show what the step was like rather than at random alone: the
longest and the shortest response, a rewarded and an unrewarded one, then random others. Each
record is plain JSON:

    {"sample": 12, "prompt": "...", "tokens": ["The", " answer", ...], "from_draft": [0, 1, ...],
     "reward": 1.0, "length": 9, "truncated": false}

`tokens` are the response's tokens as text, one entry per token (so the viewer can mark the ones
`from_draft`: drafted by the drafter and accepted by the target), and `truncated` says the
response hit the length limit without its EOS.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

MAX_SAMPLES = 8


def pick(rewards: Sequence[float], lengths: Sequence[int], k: int, rng: random.Random) -> list[int]:
    """Indices of at most k samples: longest, shortest, best and worst reward, then random, in order."""
    n = len(rewards)
    order = list(range(n))
    wanted = [max(order, key=lambda i: (lengths[i], -i)), min(order, key=lambda i: (lengths[i], i)),
              max(order, key=lambda i: (rewards[i], -i)), min(order, key=lambda i: (rewards[i], i))]
    rng.shuffle(order)
    out: list[int] = []
    for i in wanted + order:
        if i not in out:
            out.append(i)
        if len(out) == min(k, n):
            break
    return out


def step_samples(prompts: Sequence[str], tokens: Sequence[Sequence[int]], from_draft: Sequence[Sequence[int]] | None,
                 rewards: Sequence[float], finished: Sequence[bool], decode_token: Callable[[int], str], *,
                 step: int, seed: int, k: int = MAX_SAMPLES) -> list[dict]:
    """The step's sample records (module doc); prompts[i] is sample i's prompt text."""
    chosen = pick(rewards, [len(t) for t in tokens], k, random.Random(seed * 1_000_003 + step))
    out = []
    for i in chosen:
        flags = list(from_draft[i]) if from_draft is not None and from_draft[i] is not None else [0] * len(tokens[i])
        out.append({"sample": i, "prompt": prompts[i], "tokens": [decode_token(t) for t in tokens[i]],
                    "from_draft": [int(f) for f in flags], "reward": float(rewards[i]), "length": len(tokens[i]),
                    "truncated": not finished[i]})
    return out


def prompt_lengths(prompts: Sequence[str], lengths: Sequence[int], group_size: int) -> list[dict]:
    """Per prompt of the step (groups of `group_size` consecutive samples): a stable id (the text's
    hash, so a prompt is recognised across steps), the start of its text and its samples' lengths;
    series `rollout/prompt_lengths`, from which the platform finds the prompts that run longest."""
    import hashlib

    out = []
    for g in range(0, len(lengths), group_size):
        text = prompts[g]
        out.append({"prompt": hashlib.sha1(text.encode()).hexdigest()[:12], "text": text[:160],
                    "lengths": [int(n) for n in lengths[g:g + group_size]]})
    return out
