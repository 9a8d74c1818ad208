"""Arithmetic of mixed difficulty for a small pretrained instruct model: RL's long tail, learnable.

Each step's prompts are a fixed mix of one-step drills ("What is 7 times 4?") and the multi-step
word problems of `wordproblems.py`. That is what a reasoning-RL step looks like to a 135M model:

- most answers are short: a drill ("End your reply with: The answer is <number>.") is answered in
  ~10 tokens, and SmolLM2-135M-Instruct gets about 40% of them right at temperature 0.7, so GRPO
  groups carry signal and the reward rises within tens of steps (measured: the drills' accuracy
  went from ~0.4 to ~0.9 in 30 steps);
- a few are very long: a word problem is asked step by step, the model gets ~3% of them right and
  rambles on about half of them until the length limit (measured at temperature 0.7: median ~600
  tokens, 45% reach 1024), so the tail of every rollout is a few runaway answers decoded at small
  batch while the other workers wait.

No system prompt (it only makes the prompts longer and the drills less accurate).

    task = MathMixTask("var/models/smollm2-135m", hard_fraction=0.5)
    prompts = task.sample_prompts(8, random.Random(0))   # 4 drills, 4 word problems, shuffled
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer

from workers.tlt.tasks.base import Prompt
from workers.tlt.tasks.chat import ChatFormat, ChatPrompter, ChatTask
from workers.tlt.tasks.wordproblems import make_question

DRILL_INSTRUCTION = "End your reply with: The answer is <number>."


def make_drill(rng: random.Random) -> tuple[str, int]:
    """A one-step exercise: single-digit addition or the times table."""
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    return f"What is {a} times {b}?", a * b


class MathMixTask(ChatTask):
    """Drills and word problems, `hard_fraction` of each step's prompts the latter (rounded)."""

    name = "mathmix"

    def __init__(self, tokenizer: Tokenizer | str | Path, chat_format: ChatFormat | None = None,
                 hard_fraction: float = 0.5):
        if not 0.0 <= hard_fraction <= 1.0:
            raise ValueError("hard_fraction must be in [0, 1]")
        super().__init__(tokenizer, chat_format, system_prompt=None)  # word problems: step by step
        self._drill_prompter = ChatPrompter(self.tokenizer, chat_format, system_prompt=None,
                                            instruction=DRILL_INSTRUCTION)
        self.hard_fraction = hard_fraction

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        hard = round(n * self.hard_fraction)
        kinds = [True] * hard + [False] * (n - hard)
        rng.shuffle(kinds)  # the shards of the rollout workers get a random share of each
        out = []
        for is_hard in kinds:
            question, answer = make_question(rng) if is_hard else make_drill(rng)
            text, ids = (self._prompter if is_hard else self._drill_prompter)(question)
            out.append(Prompt(text=text, ids=ids, answer=str(answer)))
        return out
