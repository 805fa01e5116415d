"""The rule a ReFusion row decodes by: the paper's, with the options its settings turn on.

The decoder's steps (`row.py`, `infill.py`) ask their row's `Rule` at the few points
where an option departs from the paper; each hook is named by the step it changes and
answers as the paper does unless an option is on, so a row without options decodes
exactly what the authors' decoder does. The options are small classes of their own
(`options.py`), composed here. Rows of any rules share a batch: each rule reads only its
own row's logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...settings.decode import DecodeConfig
from .options import ARCorrection, FirstTokenCheck, LeftCheck, passes_from

if TYPE_CHECKING:
    from .infill import Fork
    from .row import ReFusionRow


class Rule:
    """The paper's answer at each hook, or the options' where they are on."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.s, self.tau = cfg.slot_size, cfg.token_threshold
        self.first = FirstTokenCheck(cfg) if cfg.first_token_check else None
        self.correction = ARCorrection(cfg) if cfg.ar_correction else None
        self.left = LeftCheck(cfg, corrects=cfg.ar_correction) if cfg.left_check else None
        # tokens an infilling round drafts past the accepted prefix, at most (infill_window;
        # the engine's draft widths may narrow it)
        self.window = cfg.infill_window or cfg.slot_size
        # logits rows a verify pass wants past the ones that score its fed tokens (the last
        # fed token's, which predict the token after the feed): the next slot's first token
        # (first_token_check), the token after an infill window's drafts (ar_correction)
        self.global_next = int(self.first is not None)
        self.infill_next = int(self.first is not None or self.correction is not None)

    # ------------------------------------------------------------------ step 1-2: plan, select
    def plan_head(self, feeds_head: bool, slot: int) -> int:
        """Logits rows the plan wants at the last token it feeds before the MASKs (the
        prompt's, or an AR block's last), which predicts the first token of `slot`: none
        in the paper (the plan reads the MASKs' logits only)."""
        return self.first.plan_head(feeds_head, slot) if self.first else 0

    def take_plan_head(self, logits: torch.Tensor) -> torch.Tensor:
        """The plan's logits (n, V) less the rows `plan_head` asked for."""
        return self.first.take_plan_head(logits) if self.first else logits

    def select(self, row: ReFusionRow) -> None:
        """The plan's selection (`row.selected`) stands, with the plan's drafts, unless the
        left check selects the leftmost slot and the held ones after it."""
        if self.left:
            self.left.select(row)

    def check_selected(self, row: ReFusionRow) -> list[int]:
        """The selected slots' first tokens are verified as drafted; the first-token check
        scores them against the AR prediction where it is known. Returns the indices (into
        `row.undecoded`) of the slots whose first token was checked."""
        return self.first.check_selected(row) if self.first else []

    # ------------------------------------------------------------------ step 3: verify
    def first_scored(self, slots: list[int]) -> list[bool]:
        """Which of the selected slots (in feed order) have their first token scored by the
        global verify pass: in the paper none, each keeps its plan confidence."""
        return self.first.first_scored(slots) if self.first else [False] * len(slots)

    def whole_slots_verified(self, slots: list[int], logits: torch.Tensor, last: range) -> None:
        """`slots` are whole and final (they are committed next); logits[last[i]] (V,) are
        the pass's logits at slots[i]'s last token."""
        if self.first:
            self.first.whole_slots_verified(slots, logits, last)

    def split(self, row: ReFusionRow, path: str, slots: list[int], toks: list[list[int]]) -> int:
        """`slots` (position order) are complete, by global verification (`path` "fast") or
        infilling: how many of them, from the first, are committed now. In the paper all;
        the left check holds those decided beside a left neighbour that was not final."""
        return self.left.split(row, path, slots, toks) if self.left else len(slots)

    def refill(
        self,
        row: ReFusionRow,
        logits: torch.Tensor,
        slots: list[int],
        chunks: list[list[int]],
        passed: list[int],
        k: int,
    ) -> tuple[int, bool] | None:
        """Global verification committed slots[:k]; the rest of the selection goes back to
        planning (None), as the paper has it, unless the left check fills the next slot
        again in this step (its accepted length, and whether its last token was corrected)."""
        return self.left.refill(row, logits, slots, chunks, passed, k) if self.left else None

    def before_infill(
        self, row: ReFusionRow, logits: torch.Tensor, chunks: list[list[int]], per_slot: list[int]
    ) -> None:
        """Global verification left the selection to infill: `chunks` and `per_slot` (the
        slots' drafts and passing prefixes) go to the forks as they are, unless the AR
        correction corrects the first slot's failing token already."""
        if self.correction:
            self.correction.before_infill(row, logits, chunks, per_slot)

    def waits(self, slots: list[int]) -> list[bool]:
        """Which selected slots that global verification left to infill keep what they
        hold instead: none, unless the left check holds them."""
        return self.left.waits(slots) if self.left else [False] * len(slots)

    # ------------------------------------------------------------------ step 4: infill
    def passing(self, f: Fork, pred: torch.Tensor, off: int, passes: list[bool]) -> tuple[int, int | None]:
        """The fork's accepted length after a verify pass, and the index of the token the
        rule replaced (None: none). The paper: the first not-yet-accepted token passes, so
        that every round accepts one token at least, then every drafted token that passes
        verification (`judge`). pred[n - off] (V,) and passes[n - off] are slot token n's."""
        if self.correction:
            return self.correction.passing(f, pred, off, passes)
        return passes_from(f, min(f.accepted + 1, f.drafted), off, passes), None

    def commits(self, row: ReFusionRow, slot: int) -> bool:
        """Whether a slot being infilled is committed once complete (so an EOS it accepts
        ends the row's text): always, unless the left check holds it."""
        return self.left.commits(row, slot) if self.left else True

    # ------------------------------------------------------------------ step 5: commit
    def committed(self, row: ReFusionRow, slots: list[int]) -> None:
        """`slots` left the row's undecoded list."""
        if self.first:
            self.first.committed(row, slots)
        if self.left:
            self.left.committed(slots)

    # ------------------------------------------------------------------ AR predictions kept
    def keep_lookahead(self, slot: int, logits: torch.Tensor) -> None:
        """Keep the AR logits (V,) that predict `slot`'s first token (read before its plan:
        a row that joined by its prompt alone)."""
        if self.first is None:
            raise LookupError(f"slot {slot} has no first-token check to keep a prediction for")
        self.first.lookahead[slot] = logits.clone()  # a copy: not a view pinning the step's logits

    def lookahead(self, slot: int) -> torch.Tensor | None:
        """The AR logits (V,) kept for `slot`'s first token (first_token_check), if any."""
        return self.first.lookahead.get(slot) if self.first else None

    def take_lookahead(self, slot: int) -> torch.Tensor:
        """The logits `lookahead` gave, no longer kept (an AR block takes its first token)."""
        if self.first is None:
            raise LookupError(f"slot {slot} has no lookahead: first_token_check is off")
        return self.first.lookahead.pop(slot)
