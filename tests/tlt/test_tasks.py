"""Reward tasks: the long tail, gold/corrupt rewards, tokenizers, the answer checker, JSONL errors."""

from __future__ import annotations

import json
import random
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from workers.tlt.config import TaskSection
from workers.tlt.tasks import (
    JsonlError,
    LongTailTask,
    MathTask,
    Task,
    answers_match,
    build_longtail_tokenizer,
    extract_answer,
    load_jsonl,
    make_task,
    save_tokenizer,
    sft_examples,
)
from workers.tlt.tasks.longtail import parse_prompt, solve

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def longtail() -> LongTailTask:
    return LongTailTask()


@pytest.fixture(scope="module")
def chat_tokenizer() -> Tokenizer:
    """A stand-in for SmolLM2's tokenizer: ChatML specials at ids 0-2, then one token per character."""
    vocab = {t: i for i, t in enumerate(CHATML_SPECIALS + ["<unk>"])}
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces, so any text round-trips
    tok.add_special_tokens(CHATML_SPECIALS)
    return tok


def _response(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]


def _percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the long-tail task --------------------------------------------------------------------------


def test_solution_lengths_have_a_long_tail():
    lengths = [len(response) for _, response in sft_examples(2000, seed=0)]
    p50, p99 = _percentile(lengths, 0.50), _percentile(lengths, 0.99)
    assert p99 / p50 >= 4, (p50, p99)
    assert max(lengths) <= 192  # fits the tiny-cpu preset's max_new_tokens


def test_gold_solution_writes_every_step():
    text, answer = solve([7, 3, 9, 4])
    assert text == "7 + 3 = 0 + 9 = 9 + 4 = 3 answer 3"
    assert answer == 3
    assert parse_prompt("sum 7 3 9 4 =") == [7, 3, 9, 4]


def test_gold_solutions_get_reward_one(longtail):
    for prompt in longtail.sample_prompts(200, random.Random(1)):
        response = longtail.gold_response_ids(prompt)
        assert response[-1] == longtail.eos_id
        assert longtail.reward(prompt, response) == 1.0
        # Padding after EOS is ignored.
        assert longtail.reward(prompt, response + [longtail.pad_id] * 3) == 1.0


def test_corrupted_solutions_get_reward_zero(longtail):
    tok = longtail.tokenizer
    for prompt in longtail.sample_prompts(50, random.Random(2)):
        gold = longtail.gold_response_ids(prompt)
        wrong_digit = str((int(prompt.answer) + 1) % 10)
        wrong = gold[:-2] + [tok.token_to_id(wrong_digit), longtail.eos_id]
        assert longtail.reward(prompt, wrong) == 0.0
        assert longtail.reward(prompt, gold[:-3] + [longtail.eos_id]) == 0.0  # no answer
        assert longtail.reward(prompt, gold[:-1] + tok.encode("+ 1", add_special_tokens=False).ids) == 0.0
    assert longtail.reward(prompt, []) == 0.0


def test_sft_examples_are_seeded_and_start_with_bos(longtail):
    first, again, other = sft_examples(64, seed=5), sft_examples(64, seed=5), sft_examples(64, seed=6)
    assert first == again
    assert first != other
    bos = longtail.tokenizer.token_to_id("<bos>")
    assert all(prompt[0] == bos and response[-1] == longtail.eos_id for prompt, response in first)


def test_longtail_tokenizer_round_trips_and_is_deterministic(longtail, tmp_path):
    tok = build_longtail_tokenizer()
    assert tok.to_str() == build_longtail_tokenizer().to_str()
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    assert tok.get_vocab_size() == 18
    text = "sum 7 3 9 4 = 7 + 3 = 0 + 9 = 9 + 4 = 3 answer 3"
    encoded = tok.encode(text)
    assert "<unk>" not in encoded.tokens
    assert tok.decode(encoded.ids) == text
    path = save_tokenizer(tok, tmp_path / "tok")
    assert path.name == "tokenizer.json"
    assert Tokenizer.from_file(str(path)).to_str() == tok.to_str()


# --- the interface -------------------------------------------------------------------------------


def test_make_task_covers_every_config_kind(chat_tokenizer, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    kinds = TaskSection.model_fields["kind"].annotation.__args__
    assert set(kinds) == {"longtail", "math", "mathmix", "jsonl"}
    for kind in kinds:
        task = make_task(kind, tokenizer=None if kind == "longtail" else chat_tokenizer, path=str(data))
        assert isinstance(task, Task)
        assert task.name == kind
        assert task.eos_id != task.pad_id


def test_make_task_refuses_what_it_cannot_build(chat_tokenizer):
    with pytest.raises(ValueError, match="unknown task kind"):
        make_task("chess")
    with pytest.raises(ValueError, match="tokenizer"):
        make_task("math")
    with pytest.raises(ValueError, match="path"):
        make_task("jsonl", tokenizer=chat_tokenizer)
    with pytest.raises(ValueError, match="own tokenizer"):
        make_task("longtail", tokenizer=chat_tokenizer)


@pytest.mark.parametrize("kind", ["longtail", "math", "mathmix"])
def test_seeded_sampling_is_reproducible(kind, chat_tokenizer):
    task = make_task(kind, tokenizer=None if kind == "longtail" else chat_tokenizer)
    first = task.sample_prompts(16, random.Random(3))
    assert first == task.sample_prompts(16, random.Random(3))
    assert first != task.sample_prompts(16, random.Random(4))


# --- math word problems and the checker ----------------------------------------------------------


def test_mathmix_mixes_drills_and_word_problems_in_the_configured_share(chat_tokenizer):
    task = make_task("mathmix", tokenizer=chat_tokenizer, hard_fraction=0.25)
    prompts = task.sample_prompts(8, random.Random(1))
    drills = [p for p in prompts if "What is" in p.text and "?" in p.text.split("What is")[1][:12]]
    assert len(drills) == 6 and len(prompts) == 8
    assert not any(p.text.startswith("<|im_start|>system") for p in prompts)  # no system prompt
    assert all("The answer is <number>" in p.text for p in prompts)
    assert all(("step by step" in p.text) == (p not in drills) for p in prompts)  # word problems only
    for p in drills:  # the gold answer is the drill's own arithmetic
        a, op, b = p.text.split("What is ")[1].split("?")[0].split(" ")[:3]
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) * int(b))
    assert task.reward(drills[0], _response(chat_tokenizer, f"The answer is {drills[0].answer}.")) == 1.0
    with pytest.raises(ValueError):
        make_task("mathmix", tokenizer=chat_tokenizer, hard_fraction=1.5)


def test_math_prompts_use_chatml_and_the_model_eos(chat_tokenizer):
    task = MathTask(chat_tokenizer)
    prompt = task.sample_prompts(1, random.Random(0))[0]
    assert prompt.text.startswith("<|im_start|>system\n")
    assert prompt.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "The answer is <number>" in prompt.text
    assert chat_tokenizer.decode(prompt.ids, skip_special_tokens=False) == prompt.text
    assert task.eos_id == chat_tokenizer.token_to_id("<|im_end|>")
    assert task.pad_id == chat_tokenizer.token_to_id("<|endoftext|>")


def test_math_reward_checks_the_final_answer(chat_tokenizer):
    task = MathTask(chat_tokenizer)
    for prompt in task.sample_prompts(30, random.Random(1)):
        assert int(prompt.answer) >= 0
        right = _response(chat_tokenizer, f"so {prompt.answer}. The answer is {prompt.answer}.")
        wrong = _response(chat_tokenizer, f"The answer is {int(prompt.answer) + 1}.")
        assert task.reward(prompt, right) == 1.0
        assert task.reward(prompt, wrong) == 0.0


def test_math_accepts_a_custom_chat_format(chat_tokenizer):
    task = MathTask(chat_tokenizer, chat_format=lambda messages: "Q: " + messages[-1]["content"] + "\nA:")
    assert task.sample_prompts(1, random.Random(0))[0].text.startswith("Q: ")


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("3 + 4 = 7. The answer is 7.", "7"),
        ("She pays $1,250. The answer is $1,250.", "1250"),
        ("Thus \\boxed{42}", "42"),
        ("\\boxed{\\$18}.", "18"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("The answer is: 3.50", "3.5"),
        ("The answer is 12 apples.", "12"),
        ("The answer is -5", "-5"),
        ("First 10, then 20, so 30.", "30"),
        ("The answer is 7. Wait, 5 + 3 = 8. The answer is 8.", "8"),
        ("The answer is Paris.", "paris"),
        ("I do not know", None),
        ("", None),
    ],
)
def test_extract_answer_edge_cases(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    ("response", "gold", "match"),
    [
        ("The answer is 3.5", "3.50", True),
        ("The answer is 7", "$7", True),
        ("The answer is 1,000", "1000", True),
        ("The answer is 1/2", "0.5", True),
        ("The answer is 70", "7", False),
        ("The answer is paris", "Paris", True),
        ("no answer here", "4", False),
    ],
)
def test_answers_match_compares_values(response, gold, match):
    assert answers_match(response, gold) is match


# --- JSONL datasets ------------------------------------------------------------------------------


def test_jsonl_loads_rows_and_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "2+2?", "answer": "4"}\n\n{"prompt": "Capital of France?", "answer": 7}\n')
    assert load_jsonl(path) == [("2+2?", "4"), ("Capital of France?", "7")]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["prompt", "answer"]', "expected an object"),
        ('{"prompt": "x"}', "missing 'answer'"),
        ('{"answer": "1"}', "missing 'prompt'"),
        ('{"prompt": "", "answer": "1"}', "prompt"),
        ('{"prompt": "x", "answer": null}', "answer"),
        ('{"prompt": "x", "answer": true}', "answer"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, bad_line, message):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "ok", "answer": "1"}\n\n' + bad_line + "\n")
    with pytest.raises(JsonlError, match=message) as info:
        load_jsonl(path)
    assert str(info.value).startswith(f"{path}:3:")


def test_jsonl_refuses_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(JsonlError, match="no rows"):
        load_jsonl(tmp_path / "empty.jsonl")


def test_jsonl_task_samples_and_rewards(tmp_path, chat_tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(5)))
    task = make_task("jsonl", tokenizer=chat_tokenizer, path=str(path))
    few = task.sample_prompts(5, random.Random(0))
    assert sorted(p.answer for p in few) == ["1", "2", "3", "4", "5"]  # no repeats while rows last
    assert len(task.sample_prompts(12, random.Random(0))) == 12
    prompt = few[0]
    assert "What is" in prompt.text
    assert task.reward(prompt, _response(chat_tokenizer, f"The answer is {prompt.answer}.")) == 1.0
    assert task.reward(prompt, _response(chat_tokenizer, "The answer is 99.")) == 0.0
