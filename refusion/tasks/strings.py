"""Rewrites of short word lists.

    Write these words in capital letters: cat, moon, tree
    ->
    Words: cat, moon, tree
    - cat -> CAT
    - moon -> MOON
    - tree -> TREE
    Answer: CAT, MOON, TREE

Word-by-word rewrites (and replace) get one line per word; those lines
depend on one input word each and not on each other, and the answer collects
them. Words are comma-separated and bulleted so that each one is preceded by
a space everywhere: BPE tokens for " cat" and "cat" differ, and copying a
word should mean copying one token.
"""

from __future__ import annotations

import random

from .base import Item, final_answer
from .vocab import WORDS

MIN_LEN, MAX_LEN = 3, 6

# Rewrites applied to each word alone: shown as one "- word -> result" line each.
MAP_OPS = {
    "upper": ("Write these words in capital letters:", str.upper),
    "capitalize": ("Capitalize each word:", str.capitalize),
    "first_letter": ("Write the first letter of each word:", lambda w: w[0]),
}
OPS = (*MAP_OPS, "reverse", "replace")


def _words(rng: random.Random, repeats: bool = False) -> list[str]:
    n = rng.randint(MIN_LEN, MAX_LEN)
    if repeats:
        pool = rng.sample(WORDS, rng.randint(2, n - 1))
        return [rng.choice(pool) for _ in range(n)]
    return rng.sample(WORDS, n)


def _make(rng: random.Random, op: str):
    """(instruction, words, lines between echo and answer, answer words)."""
    if op in MAP_OPS:
        instruction, fn = MAP_OPS[op]
        ws = _words(rng)
        return instruction, ws, [f"- {w} -> {fn(w)}" for w in ws], [fn(w) for w in ws]
    if op == "reverse":
        ws = _words(rng)
        return "Reverse the order of these words:", ws, [], ws[::-1]
    if op == "replace":
        ws = _words(rng, repeats=rng.random() < 0.5)
        old = rng.choice(ws)
        new = rng.choice([w for w in WORDS if w not in ws])
        out = [new if w == old else w for w in ws]
        return f"Replace each {old} with {new}:", ws, [f"- {w} -> {o}" for w, o in zip(ws, out)], out
    raise ValueError(op)


def _parse_words(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [w.strip() for w in text.split(",")]


class Strings:
    name = "strings"

    def generate(self, rng: random.Random) -> Item:
        op = rng.choice(OPS)
        instruction, ws, middle, out = _make(rng, op)
        lines = [f"Words: {', '.join(ws)}", *middle, f"Answer: {', '.join(out)}"]
        return Item(self.name, f"{instruction} {', '.join(ws)}", "\n".join(lines), out, {"op": op})

    def check(self, item: Item, text: str) -> bool:
        # Strict on the words, their order and case; lenient only on spacing.
        return _parse_words(final_answer(text)) == list(item.answer)
