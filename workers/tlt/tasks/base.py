"""What every task gives the trainer: prompts with gold answers, and a binary reward.

    import random
    from workers.tlt.tasks import make_task
    task = make_task("longtail")
    prompts = task.sample_prompts(8, random.Random(0))
    rewards = [task.reward(p, response_ids) for p, response_ids in zip(prompts, responses)]
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer


@dataclass(frozen=True)
class Prompt:
    """One question: the text shown to the model, its token ids, and the gold answer."""

    text: str
    ids: list[int] = field(repr=False)
    answer: str


@runtime_checkable
class Task(Protocol):
    """The interface the trainer uses, whatever the task.

    `reward` is 1.0 for a correct final answer and 0.0 otherwise, so the mean reward over samples
    is also the accuracy.
    """

    name: str

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]: ...

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float: ...


def cut_at_eos(response_ids: list[int], eos_id: int) -> list[int]:
    """The response up to (not including) its first EOS; everything after EOS is padding."""
    try:
        return list(response_ids[: list(response_ids).index(eos_id)])
    except ValueError:
        return list(response_ids)
