"""A model's output for one sample, as the runner records and scores it.

Below the runner and the protocols alike: a generate function's outputs become
`Completion`s here, and the `paper` protocol builds its own after cutting the text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

STAT_FIELDS = ("nfe", "tpf", "tokens", "wall_time", "tps")


@dataclasses.dataclass
class Completion:
    text: str
    stats: dict | None = None
    error: str | None = None  # why there is no output (the sample counts as wrong)


def as_completion(output: Any) -> Completion:
    """A generate function's output (a string, or anything with `.text` and optionally
    `.stats`, a dict or an object with the `STAT_FIELDS`) as a Completion."""
    if isinstance(output, str):
        return Completion(output)
    stats = getattr(output, "stats", None)
    if stats is not None and not isinstance(stats, dict):
        stats = {k: getattr(stats, k, None) for k in STAT_FIELDS}
    return Completion(output.text, stats)
