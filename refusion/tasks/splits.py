"""Deterministic train/test splits and JSONL export.

Held-out items never appear in training, whatever the seeds and sizes: a
prompt belongs to the test side when its SHA-256 falls in one of
``TEST_BUCKETS`` buckets, and each split keeps only its own side. On top of
that the two splits draw from differently named random streams.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from .arithmetic import Arithmetic
from .base import Family, Item
from .code import Code
from .lists import Lists
from .strings import Strings

FAMILIES: dict[str, Family] = {f.name: f for f in (Arithmetic(), Lists(), Strings(), Code())}

TEST_BUCKETS = 10  # one prompt in TEST_BUCKETS is reserved for the test split
TEST_SEED = 20251215  # seed of the fixed held-out set
TEST_PER_FAMILY = 150


def is_test_prompt(prompt: str) -> bool:
    """Whether ``prompt`` is on the held-out side of the split."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0


def _family_items(family: Family, split: str, n: int, seed: int) -> list[Item]:
    rng = random.Random(f"refusion.tasks/{split}/{seed}/{family.name}")
    want_test = split == "test"
    items: list[Item] = []
    seen: set[str] = set()
    for _ in range(1000 * (n + 10)):  # generous bound: only exhausted by a bug
        if len(items) == n:
            return items
        item = family.generate(rng)
        if is_test_prompt(item.prompt) != want_test:
            continue
        if want_test:  # the held-out set has no repeats; train may repeat
            if item.prompt in seen:
                continue
            seen.add(item.prompt)
        items.append(item)
    raise RuntimeError(f"family {family.name!r} cannot make {n} distinct {split} items")


def make_split(split: str, n: int, seed: int = 0, families: Sequence[str] | None = None) -> list[Item]:
    """``n`` items of ``split`` ('train' or 'test'), balanced across families
    (counts differ by at most one) and interleaved, so that any prefix of the
    list is balanced too. Same arguments, same items."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    names = list(FAMILIES) if families is None else list(families)
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {unknown}; known: {list(FAMILIES)}")
    k = len(names)
    per_family = [_family_items(FAMILIES[f], split, n // k + (i < n % k), seed) for i, f in enumerate(names)]
    return [per_family[i % k][i // k] for i in range(n)]


def load_test_items(n: int | None = None, families: Sequence[str] | None = None) -> list[Item]:
    """The fixed held-out set: ``TEST_PER_FAMILY`` items per family, or its
    first ``n`` (still balanced)."""
    names = list(FAMILIES) if families is None else list(families)
    items = make_split("test", TEST_PER_FAMILY * len(names), seed=TEST_SEED, families=names)
    return items if n is None else items[:n]


def check(item: Item, text: str) -> bool:
    """Whether ``text`` (a model's output) answers ``item`` correctly."""
    return FAMILIES[item.family].check(item, text)


def to_record(item: Item, fmt: str = "messages", with_answer: bool = False) -> dict:
    """One JSONL record: chat ``messages`` or ``query``/``response``, plus
    ``family`` (and ``answer``/``meta`` when asked, to check it later)."""
    if fmt == "messages":
        record: dict = {
            "messages": [
                {"role": "user", "content": item.prompt},
                {"role": "assistant", "content": item.response},
            ]
        }
    elif fmt == "query":
        record = {"query": item.prompt, "response": item.response}
    else:
        raise ValueError(f"fmt must be 'messages' or 'query', not {fmt!r}")
    record["family"] = item.family
    if with_answer:
        record["answer"] = item.answer
        record["meta"] = item.meta
    return record


def from_record(record: dict) -> Item:
    """Inverse of :func:`to_record` with ``with_answer=True``."""
    if "messages" in record:
        by_role = {m["role"]: m["content"] for m in record["messages"]}
        prompt, response = by_role["user"], by_role["assistant"]
    else:
        prompt, response = record["query"], record["response"]
    return Item(record["family"], prompt, response, record.get("answer"), dict(record.get("meta") or {}))


def write_jsonl(
    items: Iterable[Item], path: str | Path, fmt: str = "messages", with_answer: bool = False
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(to_record(item, fmt, with_answer), ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[Item]:
    with Path(path).open(encoding="utf-8") as f:
        return [from_record(json.loads(line)) for line in f if line.strip()]
