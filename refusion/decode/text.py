"""Text from token prefixes as they grow: deltas that never split a UTF-8 character, and
stop strings that are never half-sent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextDeltas:
    """Turns growing token prefixes into text deltas; holds back an incomplete UTF-8
    character (decoded as U+FFFD) until the next token completes it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sent = ""

    def update(self, ids: list[int], final: bool = False) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return delta


class StopText:
    """Cuts text at the first stop string. Releases text as it comes, except a tail that
    could still grow into a stop string, so a stop string is never half-sent."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.pending = ""  # received, not yet released

    def feed(self, delta: str, final: bool) -> tuple[str, bool]:
        """(text to release now, whether a stop string was hit). A complete stop string
        only counts once no earlier start could still grow into another one."""
        self.pending += delta
        p = self.pending
        hit = min((i for s in self.stops if (i := p.find(s)) >= 0), default=None)
        partial = None if final else self._earliest_partial(p)
        if hit is not None and (partial is None or hit <= partial):
            self.pending = ""
            return p[:hit], True
        cut = len(p) if partial is None else partial
        self.pending = p[cut:]
        return p[:cut], False

    def _earliest_partial(self, p: str) -> int | None:
        """The first index from which the rest of `p` is a proper prefix of a stop string."""
        longest = max((len(s) - 1 for s in self.stops), default=0)
        for j in range(max(0, len(p) - longest), len(p)):
            if any(len(s) > len(p) - j and s.startswith(p[j:]) for s in self.stops):
                return j
        return None
