"""Operations on short lists of two-digit numbers, with the answer spelled out.

    Keep only the numbers greater than 50: 42, 71, 19, 88
    ->
    Numbers: 42, 71, 19, 88
    - 42 -> drop
    - 71 -> keep
    - 19 -> drop
    - 88 -> keep
    Answer: 71, 88

The echo line depends only on the prompt; each per-number line depends on
one number (so they can all be written at once); the answer depends on them.
"""

from __future__ import annotations

import random

from .base import Item, final_answer, join_ints, parse_int, parse_int_list

MIN_LEN, MAX_LEN = 3, 6
# Two digits each: numbers of one length compare digit by digit, which is
# easier for a small model than mixing lengths.
LOW, HIGH = 10, 99

OPS = ("sort", "reverse", "dedupe", "max", "count", "greater")


def _numbers(rng: random.Random, repeats: bool = False) -> list[int]:
    n = rng.randint(MIN_LEN, MAX_LEN)
    if repeats:  # draw from a small pool so that some value repeats
        pool = rng.sample(range(LOW, HIGH + 1), rng.randint(2, n - 1))
        return [rng.choice(pool) for _ in range(n)]
    return rng.sample(range(LOW, HIGH + 1), n)


def _dedupe(xs: list[int]) -> list[int]:
    seen: list[int] = []
    for x in xs:
        if x not in seen:
            seen.append(x)
    return seen


def _make(rng: random.Random, op: str):
    """(instruction, numbers, lines between echo and answer, answer)."""
    if op == "sort":
        xs = _numbers(rng)
        return "Sort these numbers from smallest to largest:", xs, [], sorted(xs)
    if op == "reverse":
        xs = _numbers(rng)
        return "Reverse the order of these numbers:", xs, [], xs[::-1]
    if op == "dedupe":
        xs = _numbers(rng, repeats=True)
        return "Remove repeated numbers, keeping the first of each:", xs, [], _dedupe(xs)
    if op == "max":
        xs = _numbers(rng)
        return "Find the largest number:", xs, [], max(xs)
    if op == "count":
        xs = _numbers(rng, repeats=True)
        target = rng.choice(xs) if rng.random() < 0.85 else rng.randint(LOW, HIGH)
        matches = [x for x in xs if x == target]
        return (f"How many times does {target} appear in:", xs,
                [f"Matches: {join_ints(matches)}"], len(matches))
    if op == "greater":
        while True:
            xs = _numbers(rng)
            c = rng.randint(20, 89)
            kept = [x for x in xs if x > c]
            if kept:
                break
        lines = [f"- {x} -> {'keep' if x > c else 'drop'}" for x in xs]
        return f"Keep only the numbers greater than {c}:", xs, lines, kept
    raise ValueError(op)


class Lists:
    name = "lists"

    def generate(self, rng: random.Random) -> Item:
        op = rng.choice(OPS)
        instruction, xs, extra, answer = _make(rng, op)
        answer_text = join_ints(answer) if isinstance(answer, list) else str(answer)
        lines = [f"Numbers: {join_ints(xs)}", *extra, f"Answer: {answer_text}"]
        return Item(self.name, f"{instruction} {join_ints(xs)}", "\n".join(lines), answer, {"op": op})

    def check(self, item: Item, text: str) -> bool:
        got = final_answer(text)
        if isinstance(item.answer, list):
            return parse_int_list(got) == list(item.answer)
        value = parse_int(got)
        return value is not None and value == int(item.answer)
