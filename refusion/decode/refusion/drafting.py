"""How much a ReFusion row drafts: the widths the engine sets each step, AR blocks, and
the lossless first infilling round (docs/algorithm.md#adaptive-widths).

None of it changes what a lossless row decodes (`widths.drafts_keep_output`), only how many
forwards it takes, so it stands apart from the paper's steps (`row.py`):

- plan width: the plan drafts the first `width` tokens of the block's only slot, the rest
  stays MASK (confidence 0); the infilling window is the rule's `window`;
- an AR block: the block decoded as AR decoding would, a token in each of the step's two
  forwards, when that commits more tokens per second than drafting;
- the first infilling round verifies the plan's own drafts instead of drafting afresh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from ..rows import Feed
from ..widths import drafts_keep_output

if TYPE_CHECKING:
    from ..request import Request
    from ..widths import RowAcceptance
    from .infill import Fork
    from .provenance import NoTrace
    from .row import ReFusionRow, ToInfill
    from .rule import Rule


class DraftingRow:
    """The draft widths and AR blocks of a `row.ReFusionRow` (mixed into it: it reads the
    row's block, pending tokens and rule, declared here)."""

    req: Request
    s: int
    rule: Rule
    trace: NoTrace
    block: int
    undecoded: list[int]
    pending: list[int]
    pending_at: int
    ends_after_block: bool
    to_infill: ToInfill | None
    width: int
    acceptance: RowAcceptance | None
    ar_block: bool
    ar_next: int
    slots_per_block: int
    planned: bool

    def block_slots(self, block: int) -> list[int]:
        """The slots of a block of the region."""
        return list(range(block * self.slots_per_block, (block + 1) * self.slots_per_block))

    def set_widths(self, plan: int, window: int) -> None:
        """This step's plan width (MASKs per slot) and infilling window (0: one AR token per
        round). Only for rows whose output cannot depend on them (`widths.widths_keep_output`):
        one slot per block, so a narrower plan drafts a prefix of its only slot."""
        self.width = plan if plan < self.s else 0
        self.rule.window = window

    @property
    def plan_width(self) -> int:
        """MASKs the plan drafts per slot."""
        return self.width or self.s

    @property
    def drafting(self) -> bool:
        return not self.ar_block

    @property
    def adaptive(self) -> bool:
        # a row whose plan awaits its verification, or its infilling, keeps that plan's widths
        busy = self.planned or self.to_infill is not None
        return self.acceptance is not None and not self.ar_block and not busy

    def fed_per_forward(self) -> int:
        return 1 if self.ar_block else self.s

    # ------------------------------------------------------------------ AR blocks
    def can_start_ar_block(self) -> bool:
        """At the start of a block, whether the AR prediction of its first token is at hand:
        the prompt or a pending token to feed, or the logits the first-token check kept."""
        fresh = self.undecoded == self.block_slots(self.block) and not self.ar_block
        return fresh and bool(self.pending or self.rule.lookahead(self.undecoded[0]) is not None)

    def start_ar_block(self) -> None:
        """Decode this block a token per forward. Its first token is the AR prediction
        the first-token check kept when nothing is pending to feed."""
        self.ar_block, self.ar_next, self.to_infill = True, self.block * self.s, None
        self.req.stats.ar_blocks += 1
        if not self.pending:
            logits = self.rule.take_lookahead(self.undecoded[0])
            self._commit_ar(int(self.req.sampler.pick(logits[None])[0]))

    def ar_feed(self) -> Feed | None:
        """The pending tokens, with the logits of the last (None: the block is complete)."""
        if not self.undecoded:
            return None
        n = len(self.pending)
        return Feed(self.pending, list(range(self.pending_at, self.pending_at + n)), (n - 1, n))

    def take_ar(self, logits: torch.Tensor) -> int:
        """A token from the logits (1, V) at the last pending one; returns the entries kept."""
        kept = len(self.pending)
        self.pending = []
        self._commit_ar(int(self.req.sampler.pick(logits)[0]))
        return kept

    def _commit_ar(self, tok: int) -> None:
        self.req.commit("ar", [(self.ar_next, [tok])])
        self.pending, self.pending_at = [tok], len(self.req.prompt) + self.ar_next
        self.ar_next += 1
        slot = self.undecoded[0]
        if tok in self.req.eos_ids or self.ar_next == (slot + 1) * self.s:
            if tok in self.req.eos_ids:
                self.ends_after_block = True
            self.undecoded = []
            self.rule.committed(cast("ReFusionRow", self), [slot])  # mixed into ReFusionRow only
            self.trace.ar_committed(slot)


def plan_drafts_first(f: Fork) -> bool:
    """Whether the fork's first round verifies the plan's own drafts past its accepted
    prefix (up to a window of them) instead of drafting afresh: one forward instead of
    two. The plan drafted them from MASKs, so the token that failed global verification
    never conditioned them, and they often still pass after its correction. Only for rows
    whose output cannot depend on which drafts are verified (`drafts_keep_output`: greedy,
    every accepted token is the AR argmax; sampled, the plan's drafts are draws from the
    plan's q as any drafts are; and each round accepts one at least)."""
    if not drafts_keep_output(f.row.req.cfg) or f.row.ends(f.tokens[: f.accepted]) is not None:
        return False
    tail = f.tokens[f.accepted : f.accepted + f.row.rule.window]
    if f.row.mask_id in tail:  # a narrower plan left the rest of the slot undrafted
        tail = tail[: tail.index(f.row.mask_id)]
    eos = f.row.ends(tail)  # drafts after an EOS are never verified
    f.drafted, f.head = f.accepted + (len(tail) if eos is None else eos + 1), None
    return f.drafted > f.accepted
