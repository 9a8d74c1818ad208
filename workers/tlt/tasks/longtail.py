"""The built-in reasoning task: running sums whose step count is heavy-tailed.

A prompt lists digits; the gold solution adds them one at a time, modulo 10, writing every step:

    prompt:   sum 7 3 9 4 =
    solution: 7 + 3 = 0 + 9 = 9 + 4 = 3 answer 3 <eos>

The number of additions follows a truncated power law (P(s) ~ s^-1.5, 1..40): most problems take
one to four steps, a few take twenty to forty, so solution lengths have the long tail that TLT is
built for (p99/p50 of about 10). Every token of a step is computable from the two tokens before
it and the next digit of the prompt, so a ~1M-parameter model learns it on a CPU in minutes.

    import random
    from workers.tlt.tasks.longtail import LongTailTask, sft_examples
    task = LongTailTask()
    prompt = task.sample_prompts(1, random.Random(0))[0]
    pairs = sft_examples(256, seed=0)          # [(prompt_ids, response_ids ending in EOS)]
    task.tokenizer.save("tokenizer.json")
"""

from __future__ import annotations

import logging
import random
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from workers.tlt.tasks.base import Prompt, cut_at_eos

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0..3, in this order
MODULUS = 10  # running sums stay one digit, so each step is a 10x10 table lookup
MAX_STEPS = 40  # longest problem: 40 additions = 164 response tokens (fits max_new_tokens 192)
TAIL_EXPONENT = 1.5  # P(steps = s) ~ s^-1.5; 2.0 is a thinner body, 1.0 a fatter tail
WORDS = ["sum", "=", "+", "answer"] + [str(d) for d in range(MODULUS)]


def step_weights(max_steps: int = MAX_STEPS, exponent: float = TAIL_EXPONENT) -> list[float]:
    """Unnormalised probability of 1..max_steps additions (a truncated power law)."""
    return [s**-exponent for s in range(1, max_steps + 1)]


def make_problem(rng: random.Random, max_steps: int = MAX_STEPS, exponent: float = TAIL_EXPONENT) -> list[int]:
    """The digits of one problem: a heavy-tailed number of additions, plus the starting digit."""
    steps = rng.choices(range(1, max_steps + 1), weights=step_weights(max_steps, exponent))[0]
    # Digits 1..9: adding 0 would be a step the model can copy without learning the table.
    return [rng.randint(1, MODULUS - 1) for _ in range(steps + 1)]


def prompt_text(digits: list[int]) -> str:
    """`sum 7 3 9 4 =`"""
    return "sum " + " ".join(map(str, digits)) + " ="


def solve(digits: list[int]) -> tuple[str, int]:
    """The gold step-by-step solution (without EOS) and its answer."""
    total = digits[0]
    parts = [str(total)]
    for d in digits[1:]:
        total = (total + d) % MODULUS
        parts.append(f"+ {d} = {total}")
    parts.append(f"answer {total}")
    return " ".join(parts), total


def parse_prompt(text: str) -> list[int]:
    """Inverse of prompt_text; raises ValueError on anything else."""
    words = text.split()
    if len(words) < 3 or words[0] != "sum" or words[-1] != "=":
        raise ValueError(f"not a long-tail prompt: {text!r}")
    return [int(w) for w in words[1:-1]]


def _corpus() -> list[str]:
    # A fixed seed and a line with every word make training (and so every id) reproducible.
    rng = random.Random(0)
    lines = [" ".join(WORDS)]
    for _ in range(200):
        digits = make_problem(rng)
        lines.append(prompt_text(digits) + " " + solve(digits)[0])
    return lines


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Prompts start with <bos> (encode adds it); responses are encoded with add_special_tokens=False.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    missing = [w for w in WORDS if tok.token_to_id(w) is None]
    if missing:  # cannot happen with the corpus above; guards edits to WORDS
        raise RuntimeError(f"tokenizer is missing words {missing}")
    return tok.to_str()


def build_longtail_tokenizer() -> Tokenizer:
    """A word-level tokenizer (18 tokens) trained on a fixed corpus; the same JSON every call."""
    return Tokenizer.from_str(_tokenizer_json())


def save_tokenizer(tokenizer: Tokenizer, folder: str | Path) -> Path:
    """Write `tokenizer.json` into `folder` (created if needed) and return its path."""
    path = Path(folder) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


class LongTailTask:
    """Running sums modulo 10 with heavy-tailed step counts; reward 1.0 when `answer N` is right."""

    name = "longtail"

    def __init__(self, max_steps: int = MAX_STEPS, exponent: float = TAIL_EXPONENT):
        if max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        self.max_steps = max_steps
        self.exponent = exponent
        self._tokenizer = build_longtail_tokenizer()
        self._eos_id = self._tokenizer.token_to_id(EOS)
        self._pad_id = self._tokenizer.token_to_id(PAD)
        self._answer_id = self._tokenizer.token_to_id("answer")

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def _prompt(self, digits: list[int]) -> Prompt:
        text = prompt_text(digits)
        return Prompt(text=text, ids=self._tokenizer.encode(text).ids, answer=str(solve(digits)[1]))

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        """`n` fresh problems drawn with `rng` (same seed, same prompts)."""
        return [self._prompt(make_problem(rng, self.max_steps, self.exponent)) for _ in range(n)]

    def gold_response_ids(self, prompt: Prompt) -> list[int]:
        """The gold solution's token ids, ending in EOS."""
        solution, _ = solve(parse_prompt(prompt.text))
        return self._tokenizer.encode(solution, add_special_tokens=False).ids + [self._eos_id]

    def sft_examples(self, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        """`n` (prompt_ids, response_ids) pairs of gold solutions for the supervised warm-up."""
        prompts = self.sample_prompts(n, random.Random(seed))
        return [(p.ids, self.gold_response_ids(p)) for p in prompts]

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        """1.0 when the token after the last `answer` (before EOS) is the gold digit, else 0.0.

        Only the answer is checked, not the steps: RL must be free to find other routes.
        """
        ids = cut_at_eos(response_ids, self._eos_id)
        # The answer must be the final token, so `answer 3 + 4 ...` (a run-on) is not rewarded.
        if len(ids) < 2 or ids[-2] != self._answer_id:
            return 0.0
        return 1.0 if self._tokenizer.id_to_token(ids[-1]) == prompt.answer else 0.0


def sft_examples(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`n` gold (prompt_ids, response_ids + [EOS]) pairs of the default long-tail task.

        pairs = sft_examples(1024, seed=0)
    """
    return LongTailTask().sft_examples(n, seed)
