"""Users' own datasets: a JSONL file of {"prompt": str, "answer": str} lines.

    import random
    from workers.tlt.tasks.jsonl import JsonlTask, load_jsonl
    rows = load_jsonl("data/train.jsonl")     # [(prompt, answer)]; JsonlError names file:line
    task = JsonlTask("data/train.jsonl", tokenizer="models/smollm2-135m")
    prompts = task.sample_prompts(8, random.Random(0))

Prompts are wrapped in the model's chat format and graded with the same checker as the math task.
Blank lines are skipped; numeric answers (`"answer": 42`) are accepted and read as text.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from tokenizers import Tokenizer

from workers.tlt.tasks.chat import ChatFormat, ChatTask

log = logging.getLogger(__name__)


class JsonlError(ValueError):
    """A dataset line is malformed; the message starts with `path:line:`."""


def _parse_line(line: str, where: str) -> tuple[str, str]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise JsonlError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(row, dict):
        raise JsonlError(f"{where}: expected an object with \"prompt\" and \"answer\", got {type(row).__name__}")
    missing = [key for key in ("prompt", "answer") if key not in row]
    if missing:
        raise JsonlError(f"{where}: missing {', '.join(repr(k) for k in missing)}")
    prompt, answer = row["prompt"], row["answer"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise JsonlError(f"{where}: \"prompt\" must be a non-empty string")
    # bool is an int subclass, but `true` is never a meant answer.
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise JsonlError(f"{where}: \"answer\" must be a non-empty string")
    return prompt, answer.strip()


def load_jsonl(path: str | Path) -> list[tuple[str, str]]:
    """All (prompt, answer) rows of a JSONL file; raises JsonlError with the 1-based line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                rows.append(_parse_line(line, f"{path}:{number}"))
    if not rows:
        raise JsonlError(f"{path}: no rows")
    log.info("loaded %d rows from %s", len(rows), path)
    return rows


class JsonlTask(ChatTask):
    """Prompts from a user's JSONL file; reward 1.0 when the final answer matches."""

    name = "jsonl"

    def __init__(self, path: str | Path, tokenizer: Tokenizer | str | Path, chat_format: ChatFormat | None = None):
        self.rows = load_jsonl(path)  # validated up front: a bad line fails the launch, not step 40
        super().__init__(tokenizer, chat_format)

    def _draw(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        # without repeats while the file has enough rows, else with
        return rng.sample(self.rows, n) if n <= len(self.rows) else rng.choices(self.rows, k=n)
