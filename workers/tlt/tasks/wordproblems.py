"""Generated math word problems for pretrained instruct models (e.g. SmolLM2-135M-Instruct).

Two- and three-step arithmetic with small whole numbers, from templates: hard enough that a 135M
model gets only some right (so GRPO groups have reward variance), easy to check exactly.

    import random
    from workers.tlt.tasks.wordproblems import MathTask, make_question
    make_question(random.Random(0))      # ("Mia has 4 pencils and buys 7 more. ...", 11)
    task = MathTask("models/smollm2-135m")
    prompts = task.sample_prompts(4, random.Random(0))   # ChatML text + ids, answer "11"
"""

from __future__ import annotations

import random
from typing import Callable


from workers.tlt.tasks.chat import ChatTask

NAMES = ["Tom", "Mia", "Sara", "Ben", "Lily", "Omar", "Ana", "Leo", "Nina", "Sam"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "cards"]


def _buy_then_give(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    c = rng.randint(1, a + b)
    question = f"{name} has {a} {item} and buys {b} more. Then {name} gives away {c}. How many {item} does {name} have now?"
    return question, a + b - c


def _boxes(rng: random.Random) -> tuple[str, int]:
    item = rng.choice(ITEMS)
    boxes, per, extra = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 15)
    question = f"There are {boxes} boxes with {per} {item} in each box, and {extra} loose {item}. How many {item} are there?"
    return question, boxes * per + extra


def _share(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, left = rng.randint(2, 8), rng.randint(2, 10), rng.randint(0, 9)
    total = friends * each + left
    return f"{name} has {total} {item} and gives {each} to each of {friends} friends. How many {item} are left?", left


def _price(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    pens, pen_cost = rng.randint(2, 6), rng.randint(1, 5)
    books, book_cost = rng.randint(1, 4), rng.randint(3, 12)
    question = (
        f"{name} buys {pens} pens at ${pen_cost} each and {books} notebooks at ${book_cost} each. "
        f"How many dollars does {name} spend?"
    )
    return question, pens * pen_cost + books * book_cost


def _change(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    count, cost = rng.randint(2, 9), rng.randint(2, 9)
    paid = count * cost + rng.randint(0, 30)
    question = (
        f"{name} buys {count} tickets that cost ${cost} each and pays with ${paid}. "
        f"How much change, in dollars, does {name} get?"
    )
    return question, paid - count * cost


def _weeks(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    per_day, days, extra = rng.randint(2, 9), rng.randint(3, 7), rng.randint(1, 10)
    question = (
        f"{name} reads {per_day} pages every day for {days} days, then reads {extra} more pages on the last night. "
        f"How many pages did {name} read?"
    )
    return question, per_day * days + extra


def _half(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    half, more = rng.randint(2, 15), rng.randint(1, 10)
    question = f"{name} has {2 * half} {item}, gives half of them to a friend, then finds {more} more. How many {item} now?"
    return question, half + more


def _three_friends(rng: random.Random) -> tuple[str, int]:
    first, second, third = rng.sample(NAMES, 3)
    item = rng.choice(ITEMS)
    a, more, fewer = rng.randint(3, 15), rng.randint(1, 8), rng.randint(1, 3)
    b = a + more
    c = b - fewer
    return (
        f"{first} has {a} {item}. {second} has {more} more {item} than {first}. {third} has {fewer} fewer {item} "
        f"than {second}. How many {item} do they have together?",
        a + b + c,
    )


TEMPLATES: list[Callable[[random.Random], tuple[str, int]]] = [
    _buy_then_give, _boxes, _share, _price, _change, _weeks, _half, _three_friends,
]


def make_question(rng: random.Random) -> tuple[str, int]:
    """One word problem and its whole-number answer."""
    return rng.choice(TEMPLATES)(rng)


class MathTask(ChatTask):
    """Word problems in the model's chat format; reward 1.0 when the final number is right."""

    name = "math"

    def _draw(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        # fresh problems drawn with `rng`: same seed, same prompts
        return [make_question(rng) for _ in range(n)]
