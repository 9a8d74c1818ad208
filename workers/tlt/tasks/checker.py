"""Final-answer extraction and comparison for free-text responses (math word problems, JSONL).

    from workers.tlt.tasks.checker import extract_answer, answers_match
    extract_answer("... so she pays $1,250. The answer is $1,250.")   # "1250"
    answers_match("Thus \\boxed{42}.", "42")                            # True

Where the answer is looked for, in order: the last "The answer is ...", the last \\boxed{...},
the last number anywhere. Numbers are compared by value ("3.50" == "3.5", "1,000" == "1000");
a gold answer that is not a number is compared as normalised text.
"""

from __future__ import annotations

import re
from fractions import Fraction

_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_BOXED = "\\boxed{"
# A number: optional sign, digits with optional thousands commas, optional decimals; or a bare ".5".
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced (\\boxed{\\frac{1}{2}})."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


def parse_number(text: str) -> Fraction | None:
    """The value of `text` if it is one number (with $, commas, %, trailing period), else None."""
    cleaned = text.strip().strip("$ ").rstrip(".").replace(",", "").replace("\\$", "").strip()
    cleaned = cleaned.removesuffix("\\%").removesuffix("%").strip()
    frac = re.fullmatch(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", cleaned)
    if frac and int(frac.group(2)):
        return Fraction(int(frac.group(1)), int(frac.group(2)))
    if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+|-?\d+/\d+", cleaned) and not cleaned.endswith("/0"):
        return Fraction(cleaned)
    return None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_answer(text: str) -> str | None:
    """The final answer in a response, as a canonical string ("1250", "2.5", "paris"), or None."""
    candidates: list[str] = []
    said = _ANSWER_IS.findall(text)
    if said:
        candidates.append(said[-1].split("\n")[0])
    boxed = _last_boxed(text)
    if boxed is not None:
        candidates.append(boxed)
    for candidate in candidates:
        value = parse_number(candidate)
        if value is not None:
            return _canonical(value)
        number = _last_number(candidate)
        if number is not None:  # "The answer is 12 apples."
            return _canonical(Fraction(number))
    if candidates:  # a non-numeric answer ("The answer is Paris.")
        return _normalise_text(candidates[0])
    number = _last_number(text)
    return _canonical(Fraction(number)) if number is not None else None


def answers_match(response: str, gold: str) -> bool:
    """Whether the final answer of `response` equals `gold` (by value when gold is a number)."""
    got = extract_answer(response)
    if got is None:
        return False
    gold_value = parse_number(gold)
    if gold_value is not None:
        return got == _canonical(gold_value)
    return got == _normalise_text(gold)


def _canonical(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    as_float = float(value)
    # Terminating decimals print as decimals ("2.5"); others as fractions ("1/3").
    return repr(as_float) if Fraction(repr(as_float)) == value else f"{value.numerator}/{value.denominator}"


def _normalise_text(text: str) -> str:
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    return " ".join(text.strip().strip("$*").rstrip(".").strip().lower().split())
