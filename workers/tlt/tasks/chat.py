"""Chat prompts for pretrained instruct models (SmolLM2 and other ChatML models).

    from workers.tlt.tasks.chat import ChatPrompter
    prompter = ChatPrompter("models/smollm2-135m")          # folder with tokenizer.json, or a Tokenizer
    text, ids = prompter("Tom has 3 apples ...")
    prompter.eos_id                                          # <|im_end|>: the model's end of turn

A `tokenizers.Tokenizer` has no chat template, so the ChatML layout SmolLM2 uses is written out here;
pass `chat_format` (messages -> text) for a model with another template.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer

from workers.tlt.tasks.base import Prompt, cut_at_eos
from workers.tlt.tasks.checker import answers_match

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
ChatFormat = Callable[[Messages], str]

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # SmolLM2's default
# "<number>", not "N": a 135M model copies a letter from the instruction into its last line
INSTRUCTION = "Solve the problem step by step. End your reply with: The answer is <number>."
# Tried in order; the first present in the vocabulary ends a turn (ChatML, then generic names).
EOS_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<eos>")
# Padding is kept distinct from EOS where possible, so a mask `ids != pad` never hides the EOS.
PAD_CANDIDATES = ("<|endoftext|>", "<pad>", "<|finetune_right_pad_id|>", "<unk>")


def chatml(messages: Messages) -> str:
    """ChatML with the assistant turn opened, as in SmolLM2's template (add_generation_prompt)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def load_tokenizer(source: Tokenizer | str | Path) -> Tokenizer:
    """A Tokenizer as given, or loaded from a tokenizer.json file or a folder holding one."""
    if isinstance(source, Tokenizer):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(path))


def _first_id(tokenizer: Tokenizer, names: tuple[str, ...]) -> int | None:
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


class ChatPrompter:
    """Turns a question into (chat text, token ids) for one model; knows its EOS and PAD ids."""

    def __init__(
        self,
        tokenizer: Tokenizer | str | Path,
        chat_format: ChatFormat | None = None,
        system_prompt: str | None = SYSTEM_PROMPT,
        instruction: str = INSTRUCTION,
    ):
        self.tokenizer = load_tokenizer(tokenizer)
        self.chat_format = chat_format or chatml
        self.system_prompt = system_prompt
        self.instruction = instruction
        eos_id = _first_id(self.tokenizer, EOS_CANDIDATES)
        if eos_id is None:
            raise ValueError(f"tokenizer has none of the end-of-turn tokens {EOS_CANDIDATES}")
        self.eos_id: int = eos_id
        pad_id = _first_id(self.tokenizer, PAD_CANDIDATES)
        self.pad_id: int = eos_id if pad_id is None or pad_id == eos_id else pad_id

    def messages(self, question: str) -> Messages:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": f"{question}\n{self.instruction}"}]

    def __call__(self, question: str) -> tuple[str, list[int]]:
        text = self.chat_format(self.messages(question))
        # The template already holds every special token; a post-processor must not add a BOS.
        return text, self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, response_ids: list[int]) -> str:
        return self.tokenizer.decode(list(response_ids), skip_special_tokens=True)


class ChatTask:
    """Shared body of the chat-formatted tasks: prompts from (question, answer) pairs, graded by
    the final-answer checker. Subclasses only say how to draw the pairs (`_draw`)."""

    name = "chat"

    def __init__(self, tokenizer: Tokenizer | str | Path, chat_format: ChatFormat | None = None,
                 system_prompt: str | None = SYSTEM_PROMPT):
        self._prompter = ChatPrompter(tokenizer, chat_format, system_prompt=system_prompt)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._prompter.tokenizer

    @property
    def eos_id(self) -> int:
        return self._prompter.eos_id

    @property
    def pad_id(self) -> int:
        return self._prompter.pad_id

    def _draw(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        raise NotImplementedError

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        prompts = []
        for question, answer in self._draw(n, rng):
            text, ids = self._prompter(question)
            prompts.append(Prompt(text=text, ids=ids, answer=str(answer)))
        return prompts

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        text = self._prompter.decode(cut_at_eos(response_ids, self.eos_id))
        return 1.0 if answers_match(text, prompt.answer) else 0.0
