"""The pieces every task family shares: the item record and answer parsing.

A family turns a ``random.Random`` into an :class:`Item` (a chat prompt, the
reference response and the machine-checkable answer) and judges a model's
output against it. Responses end with one ``Answer: ...`` line except in the
code family, whose answer is the code itself.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

# Text a decoder may leave at the end of an output: everything from the first
# of these on is ignored by the checkers.
EOS_MARKERS = ("<|im_end|>", "<|endoftext|>")
ANSWER_PREFIX = "Answer:"


@dataclass
class Item:
    """One problem.

    family:   name of the family that made it (key of ``FAMILIES``).
    prompt:   the user's message.
    response: the reference assistant message (no EOS).
    answer:   what the checker compares against: an int, a list, a string, or
              for code the function name and its test cases.
    meta:     how it was made (operation, parameters), for analysis only.
    """

    family: str
    prompt: str
    response: str
    answer: Any
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Item:
        return cls(d["family"], d["prompt"], d["response"], d["answer"], dict(d.get("meta") or {}))


class Family(Protocol):
    name: str

    def generate(self, rng: random.Random) -> Item: ...

    def check(self, item: Item, text: str) -> bool: ...


def strip_eos(text: str) -> str:
    """Cut ``text`` at the first EOS marker and drop trailing whitespace."""
    for marker in EOS_MARKERS:
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    return text.rstrip()


def final_answer(text: str) -> str | None:
    """The text after ``Answer:`` on the last non-empty line, or None.

    The answer line must be the last line: an output that goes on after its
    answer is wrong (ReFusion's decoder stops at EOS, so a good model ends
    there).
    """
    lines = strip_eos(text).strip().splitlines()
    if not lines:
        return None
    last = lines[-1].strip()
    if not last.startswith(ANSWER_PREFIX):
        return None
    return last[len(ANSWER_PREFIX) :].strip()


def parse_int(s: str | None) -> int | None:
    if s is None:
        return None
    s = s.strip()
    body = s[1:] if s.startswith("-") else s
    if not body.isascii() or not body.isdigit():
        return None
    return int(s)


def parse_int_list(s: str | None) -> list[int] | None:
    """``"3, 5, 8"`` -> ``[3, 5, 8]``; None unless every item is an integer."""
    if s is None:
        return None
    values = [parse_int(part) for part in s.split(",")]
    ints = [v for v in values if v is not None]
    return ints if len(ints) == len(values) else None


def join_ints(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)
