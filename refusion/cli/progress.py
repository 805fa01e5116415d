"""A live count of a CLI decode on stderr: tokens final so far and forwards run, so that a
long generation (a 135M model on a CPU takes seconds per token) is not silent.

Quiet for short runs: nothing in the first `QUIET_S` seconds. After that, on a terminal,
one line rewritten in place (and erased at the end, before the text is printed); on a pipe
or a log file, a plain line every `LOG_EVERY_S` seconds, so a log does not fill with
carriage returns.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

QUIET_S = 2.0  # a decode shorter than this shows nothing
REDRAW_S = 0.2  # the terminal line is redrawn at most this often
LOG_EVERY_S = 10.0  # off a terminal: one line this often

OnOutput = Callable[[int, Any], None]  # generate's on_output: (prompt index, its RequestOutput)


class Progress:
    """Counts what `generate`'s `on_output` reports, per prompt, and draws the sum.
    `limit`: the most tokens the prompts may take (their gen_lengths)."""

    def __init__(
        self,
        limit: int,
        label: str = "decoding",
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit, self.label, self.clock = limit, label, clock
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = clock()
        self.drawn_at: float | None = None
        self.tokens: dict[int, int] = {}  # prompt -> tokens of its final prefix
        self.nfe: dict[int, int] = {}  # prompt -> forwards it took part in

    def __call__(self, i: int, out: Any) -> None:
        self.tokens[i], self.nfe[i] = len(out.token_ids), out.stats.nfe
        now = self.clock()
        if now - self.start < QUIET_S:
            return
        wait = REDRAW_S if self.tty else LOG_EVERY_S
        if self.drawn_at is None or now - self.drawn_at >= wait:
            self._draw(now)

    def line(self, now: float) -> str:
        """What is drawn: forwards is the largest count of a prompt (a batch shares them)."""
        return (
            f"{self.label}: {sum(self.tokens.values())} of at most {self.limit} tokens, "
            f"{max(self.nfe.values(), default=0)} forwards, {now - self.start:.0f}s"
        )

    def _draw(self, now: float) -> None:
        text = self.line(now)
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.drawn_at = now

    def close(self) -> None:
        """Erase the terminal line (the text comes next); off a terminal, nothing to undo."""
        if self.tty and self.drawn_at is not None:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def chained(*callbacks: OnOutput | None) -> OnOutput | None:
    """One `on_output` that calls each callback given (None when none is)."""
    given = [c for c in callbacks if c is not None]
    if not given:
        return None

    def each(i: int, out: Any) -> None:
        for c in given:
            c(i, out)

    return each
