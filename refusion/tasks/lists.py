"""Operations on short lists of two-digit numbers, with the answer spelled out.

    Sort these numbers from smallest to largest: 42, 71, 19, 88
    ->
    Numbers: 42, 71, 19, 88
    Answer: 19, 42, 71, 88

The echo line depends only on the prompt (it can be written in parallel with
anything); the answer line depends on all of it.

Operations that pick out a subsequence (filter, deduplicate, count matches)
are left out on purpose: a 4M-parameter model trained on ~5M tokens got them
right only 20-50% of the time, against 75-100% for these.
"""

from __future__ import annotations

import random

from .base import Item, final_answer, join_ints, parse_int, parse_int_list

MIN_LEN, MAX_LEN = 3, 6
# Two digits each: numbers of one length compare digit by digit, which is
# easier for a small model than mixing lengths.
LOW, HIGH = 10, 99

INSTRUCTIONS = {
    "sort": "Sort these numbers from smallest to largest:",
    "reverse": "Reverse the order of these numbers:",
    "max": "Find the largest number:",
    "min": "Find the smallest number:",
}
OPS = tuple(INSTRUCTIONS)


def _solve(op: str, xs: list[int]) -> int | list[int]:
    answers: dict[str, int | list[int]] = {
        "sort": sorted(xs),
        "reverse": xs[::-1],
        "max": max(xs),
        "min": min(xs),
    }
    return answers[op]


class Lists:
    name = "lists"

    def generate(self, rng: random.Random) -> Item:
        op = rng.choice(OPS)
        xs = rng.sample(range(LOW, HIGH + 1), rng.randint(MIN_LEN, MAX_LEN))  # distinct
        answer = _solve(op, xs)
        answer_text = join_ints(answer) if isinstance(answer, list) else str(answer)
        response = f"Numbers: {join_ints(xs)}\nAnswer: {answer_text}"
        return Item(self.name, f"{INSTRUCTIONS[op]} {join_ints(xs)}", response, answer, {"op": op})

    def check(self, item: Item, text: str) -> bool:
        got = final_answer(text)
        if isinstance(item.answer, list):
            return parse_int_list(got) == list(item.answer)
        value = parse_int(got)
        return value is not None and value == int(item.answer)
