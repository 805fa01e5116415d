"""Multi-step arithmetic word problems with a worked solution.

    Mia has 23 apples. Mia buys 15 more. Mia gives 9 to Leo. How many apples
    does Mia have now?
    ->
    Start: 23.
    Add 15: 23 + 15 = 30 + 8 = 38.
    Take away 9: 38 - 9 = 30 - 1 = 29.
    Answer: 29

Every step depends on the one before, so the answer depends on the whole
solution. Numbers stay in 0..99 (inputs of at most 30, products of two single
digits). Each sum or difference of two-digit numbers is worked through its
tens and units (``a + b = tens + units = result``), so every digit written
is a function of two digits already on the page: a carry or a borrow is
never computed in one's head, which is what a small model finds hard.
"""

from __future__ import annotations

import random

from .base import Item, final_answer, parse_int
from .vocab import NAMES, OBJECTS

MAX_VALUE = 99  # every running total stays in 0..MAX_VALUE
MAX_ADD = 30  # largest amount added or taken away in one step


def _worked(a: int, op: str, b: int) -> str:
    """``a op b`` worked through tens and units: "47 + 25 = 60 + 12 = 72",
    "53 - 27 = 30 - 4 = 26", "53 - 21 = 30 + 2 = 32"."""
    if op == "+":
        tens, units, result = (a // 10 + b // 10) * 10, a % 10 + b % 10, a + b
        return f"{a} + {b} = {tens} + {units} = {result}"
    tens, units, result = (a // 10 - b // 10) * 10, a % 10 - b % 10, a - b
    sign = "-" if units < 0 else "+"
    return f"{a} - {b} = {tens} {sign} {abs(units)} = {result}"


def _gain(rng: random.Random, cur: int, name: str, other: str, obj: str):
    k = rng.randint(2, min(MAX_ADD, MAX_VALUE - cur))
    sentence = rng.choice(
        (
            f"{name} buys {k} more.",
            f"{name} finds {k} more.",
            f"{other} gives {name} {k} more.",
        )
    )
    return cur + k, sentence, f"Add {k}: {_worked(cur, '+', k)}."


def _loss(rng: random.Random, cur: int, name: str, other: str, obj: str):
    k = rng.randint(2, min(MAX_ADD, cur))
    sentence = rng.choice(
        (
            f"{name} gives {k} to {other}.",
            f"{name} loses {k}.",
            f"{name} sells {k}.",
        )
    )
    return cur - k, sentence, f"Take away {k}: {_worked(cur, '-', k)}."


def _groups(m: int, k: int) -> str:
    return f"{m} x {k} = {m * k}"


def _bags(rng: random.Random, cur: int, name: str, other: str, obj: str):
    while True:
        m, k = rng.randint(2, 5), rng.randint(2, 9)
        if cur + m * k <= MAX_VALUE:
            break
    new = cur + m * k
    sentence = f"{name} buys {m} bags with {k} {obj} in each."
    return new, sentence, f"Add {m} bags of {k}: {_groups(m, k)}, {_worked(cur, '+', m * k)}."


def _share(rng: random.Random, cur: int, name: str, other: str, obj: str):
    while True:
        m, k = rng.randint(2, 5), rng.randint(2, 9)
        if m * k <= cur:
            break
    new = cur - m * k
    # m before k, as in the response and in _bags: copying keeps its order
    sentence = f"{name} gives {m} friends {k} {obj} each."
    return new, sentence, f"Take away {m} groups of {k}: {_groups(m, k)}, {_worked(cur, '-', m * k)}."


class Arithmetic:
    name = "arithmetic"

    def generate(self, rng: random.Random) -> Item:
        name, other = rng.sample(NAMES, 2)
        obj = rng.choice(OBJECTS)
        cur = rng.randint(10, 60)
        sentences = [f"{name} has {cur} {obj}."]
        lines = [f"Start: {cur}."]
        steps = []
        for _ in range(rng.choice((2, 3))):
            options = [_gain, _bags] if cur < 20 else [_gain, _loss, _bags, _share]
            if cur > MAX_VALUE - 20:
                options = [_loss, _share]
            if "bags" in steps or "share" in steps:  # one group step at most: keeps responses short
                options = [o for o in options if o in (_gain, _loss)]
            step = rng.choice(options)
            cur, sentence, line = step(rng, cur, name, other, obj)
            sentences.append(sentence)
            lines.append(line)
            steps.append(step.__name__.lstrip("_"))
        sentences.append(f"How many {obj} does {name} have now?")
        lines.append(f"Answer: {cur}")
        return Item(self.name, " ".join(sentences), "\n".join(lines), cur, {"steps": steps})

    def check(self, item: Item, text: str) -> bool:
        value = parse_int(final_answer(text))
        return value is not None and value == int(item.answer)
