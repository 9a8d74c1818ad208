"""Reward tasks: prompts with gold answers and a binary reward, behind one interface.

    import random
    from workers.tlt.tasks import make_task
    task = make_task("longtail")                                      # built-in, own tokenizer
    task = make_task("math", tokenizer="models/smollm2-135m")         # needs the model's tokenizer
    task = make_task("mathmix", tokenizer="models/smollm2-135m", hard_fraction=0.5)
    task = make_task("jsonl", tokenizer=tok, path="data/train.jsonl")
    prompts = task.sample_prompts(8, random.Random(0))
    reward = task.reward(prompts[0], response_ids)                    # 1.0 or 0.0

`kind` takes the values of `workers.tlt.config.TaskSection.kind`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from workers.tlt.tasks.base import Prompt, Task
from workers.tlt.tasks.chat import ChatFormat, ChatPrompter, chatml
from workers.tlt.tasks.checker import answers_match, extract_answer
from workers.tlt.tasks.jsonl import JsonlError, JsonlTask, load_jsonl
from workers.tlt.tasks.longtail import LongTailTask, build_longtail_tokenizer, save_tokenizer, sft_examples
from workers.tlt.tasks.mathmix import MathMixTask
from workers.tlt.tasks.wordproblems import MathTask

__all__ = [
    "ChatFormat", "ChatPrompter", "JsonlError", "JsonlTask", "LongTailTask", "MathMixTask", "MathTask", "Prompt", "Task",
    "answers_match", "build_longtail_tokenizer", "chatml", "extract_answer", "load_jsonl", "make_task",
    "save_tokenizer", "sft_examples",
]


def make_task(
    kind: str,
    *,
    tokenizer: Tokenizer | str | Path | None = None,
    path: str = "",
    chat_format: ChatFormat | None = None,
    hard_fraction: float = 0.5,
) -> Task:
    """Build the task named by `kind` (longtail | math | mathmix | jsonl).

    `tokenizer` (a Tokenizer, a tokenizer.json, or a folder with one) is the policy's tokenizer;
    math and jsonl need it, longtail brings its own and refuses another (ids would not match).
    """
    if kind == "longtail":
        if tokenizer is not None:
            raise ValueError("the longtail task uses its own tokenizer; pass tokenizer=None")
        return LongTailTask()
    if kind not in ("math", "mathmix", "jsonl"):
        raise ValueError(f"unknown task kind {kind!r}; choose longtail, math, mathmix or jsonl")
    if tokenizer is None:
        raise ValueError(f"the {kind} task needs the model's tokenizer")
    if kind == "math":
        return MathTask(tokenizer, chat_format)
    if kind == "mathmix":
        return MathMixTask(tokenizer, chat_format, hard_fraction=hard_fraction)
    if not path:
        raise ValueError("the jsonl task needs path to a JSONL file")
    return JsonlTask(path, tokenizer, chat_format)
