"""What the engine asks of a row, phase by phase (docs/algorithm.md#one-step).

A step of the engine's KV cache runs two shared forwards, the plan and the verification,
then infilling for the rows that need it. Every row of the cache answers the same small
interface for each phase: what it feeds (`Feed`), and what it takes from the logits of
what it fed (returning how many of the entries it fed stay in the cache). An AR row
takes a token in each forward; a ReFusion row plans, then verifies. Rows of a method
that reuses no cache (MDM) form a group of their own, fed their whole context once a
step (`GroupRow`). So the engine runs every method through the same calls, and a new
method is a new row class (`methods.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from .request import Request


class Feed(NamedTuple):
    """What a row feeds one forward: tokens with their positions, and the entries [a, b)
    of the feed whose logits it wants back."""

    tokens: list[int]
    positions: list[int]
    logits: tuple[int, int]


class Row(Protocol):
    """A row of the engine's KV cache."""

    req: Request
    done: bool  # its decoding is over: it leaves the batch after this step
    stops_early: bool  # it may stop as soon as its output is final (EOS or gen_length)
    # it asks for the step's verification forward (ReFusion); a row that does not (AR) takes
    # part in one when another row asks, else the step is its first forward alone
    verifies: bool

    @property
    def joining(self) -> bool:
        """Whether it has fed nothing yet: its prompt goes into the cache in its first forward."""
        ...

    def plan_feed(self) -> Feed | None:
        """What it feeds the step's first forward (None: nothing)."""
        ...

    def take_plan(self, logits: torch.Tensor, feed: Feed) -> int:
        """Its logits (n, V) of that forward; returns the entries of its feed kept."""
        ...

    def join_feed(self, running: bool) -> Feed | None:
        """What it feeds the step it joins in (`Engine._join`; `running`: rows that joined
        before it are in the batch): its prompt, with what its first forward takes."""
        ...

    def take_join(self, logits: torch.Tensor, feed: Feed) -> int:
        """Its logits (n, V) of that forward; returns the entries of its feed kept."""
        ...

    def verify_feed(self) -> Feed | None:
        """What it feeds the step's second forward (None: nothing)."""
        ...

    def take_verify(self, logits: torch.Tensor, feed: Feed) -> int:
        """Its logits (n, V) of that forward; returns the entries of its feed kept."""
        ...

    def infills(self) -> bool:
        """Whether it has slots for this step's infilling (`refusion.Infill`)."""
        ...

    def end_step(self) -> None:
        """The step is over (a ReFusion row moves to its next block once one is complete)."""
        ...

    @property
    def drafting(self) -> bool:
        """Whether it drafts tokens this step (a ReFusion row outside an AR block)."""
        ...

    @property
    def adaptive(self) -> bool:
        """Whether it drafts this step at the widths the engine's policy sets
        (`width_policy.WidthPolicy`): a ReFusion row whose output they cannot change."""
        ...

    def fed_per_forward(self) -> int:
        """Tokens it feeds each of the step's two forwards, for the policy's pricing of the
        rows that share them."""
        ...


class GroupRow(Protocol):
    """A row of a method that reuses no KV cache: fed its whole context every step."""

    req: Request
    done: bool
    stops_early: bool

    def feed(self) -> Feed: ...

    def take(self, logits: torch.Tensor) -> None: ...
