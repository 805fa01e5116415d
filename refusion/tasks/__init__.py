"""A synthetic instruction suite small models can learn, with exact checkers.

Four families of chat problems (``FAMILIES``): multi-step ``arithmetic``
word problems, ``lists`` of numbers to sort/filter/count, ``strings`` (word
list rewrites) and ``code`` (short Python functions checked by running them).
Parts of each answer depend on each other (a chain of sums) and parts do not
(an echoed list), which is what slot-parallel decoding exploits.

    from refusion.tasks import make_split, load_test_items, check, write_jsonl
    write_jsonl(make_split("train", 100_000), "train.jsonl")
    items = load_test_items()          # 600 held-out items, 150 per family
    ok = check(items[0], model_output)

The tokenizer for models trained on it is in :mod:`refusion.tasks.tokenizer`.
"""

from .base import Family, Item
from .splits import (
    FAMILIES,
    TEST_PER_FAMILY,
    TEST_SEED,
    check,
    is_test_prompt,
    load_test_items,
    make_split,
    read_jsonl,
    write_jsonl,
)

__all__ = [
    "FAMILIES",
    "TEST_PER_FAMILY",
    "TEST_SEED",
    "Family",
    "Item",
    "check",
    "is_test_prompt",
    "load_test_items",
    "make_split",
    "read_jsonl",
    "write_jsonl",
]
