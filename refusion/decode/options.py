"""The rule a ReFusion row decodes by: the paper's (`PaperRule`), or the paper's with the
decoding options beyond it (`BeyondPaper`).

The decoder (`refusion.py`) asks its row's rule at each point where an option departs
from the paper, and `PaperRule` answers there as the paper does, so a row without options
decodes exactly what the authors' decoder does. A row gets one rule, built from its
`DecodeConfig` by `rule_for`; rows of any rules share a batch, since each rule reads only
its own row's logits.

The four options are `DecodeConfig` fields, off by default:

- `ar_correction`: in infilling, the first token that fails verification is replaced by
  the AR prediction its verify pass made for it and accepted. The paper re-drafts it from
  MASK and accepts that draft unchecked: a prediction made with less context than the one
  the verify pass had. The corrected token's KV entry, computed with the failed draft, is
  not kept: the token is fed again, also when it completes the slot. The first slot of a
  global verify pass that fails is corrected by that pass already (its logits there saw
  just what its fork will see), which saves the fork a round.
- `first_token_check`: the paper never checks a slot's first token (its plan confidence
  selected it), though the AR prediction for it is known once the slot to its left is
  committed. So the AR logits at the last token of each whole committed slot (and at the
  prompt's last token) are kept; a selected slot whose left neighbour they belong to has
  its plan draft for the first token checked against them, and replaced when it fails. In
  global verification, a slot's first token is scored like any other when the slot before
  it in the feed is its left neighbour.
- `infill_window`: each infilling round drafts and verifies at most that many tokens past
  a slot's accepted prefix. A round costs in proportion to what it feeds, and the drafts
  far past the first failure are wasted; attention is causal, so the drafts a window makes
  are the ones a whole slot of MASKs would give. With ar_correction, the token after a
  window's drafts is the AR prediction of its last one.
- `left_check`: only the leftmost undecoded slot of a block, and the slots verified in one
  causal pass right after it, are committed. Every other slot a step completes (in
  infilling, or in global verification behind a gap) is held, its tokens and not its KV
  entries, and verified again once its left neighbour is final: fed after it, it keeps
  the entries of that pass if it passes whole, and is filled again from its first failing
  token otherwise (in the same step, when it was fed right after the committed run). The
  leftmost slot is always selected, so every step commits a slot.

With one slot per block and token_threshold >= 0.5, greedy decoding with ar_correction
and first_token_check equals greedy AR decoding of the same weights (every accepted token
is the AR argmax): ReFusion becomes a lossless drafter for its own AR head, and the plan's
MDM drafts only decide the speed. With left_check as well, that holds for any slot
layout: every committed entry was computed with the whole left context and nothing else.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..settings.decode import DecodeConfig
from .sampling import token_probs


class ReFusionRow(Protocol):
    """What a rule reads and changes of the row it serves (`refusion.ReFusionRow`)."""

    req: Any  # the row's Request: its sampler picks replacement tokens, its trace notes them
    plan: Any  # this step's Plan: drafts (n_undecoded, s), conf
    undecoded: list[int]  # slot indices of the current block, ascending
    selected: list[int]  # indices into `undecoded` chosen by the plan
    block: int
    mask_id: int  # the plan's MASK: the undrafted rest of a slot under a narrower plan
    acceptance: Any  # counts its verify passes for the engine's draft widths (widths.Acceptance), or None

    def ends(self, toks: list[int]) -> int | None: ...


class Fork(Protocol):
    """What a rule reads and changes of a slot being infilled (`refusion.Fork`)."""

    row: ReFusionRow
    slot: int  # the slot's index in the region
    tokens: list[int]  # the slot's tokens; tokens[:accepted] are final
    accepted: int
    drafted: int  # tokens[accepted:drafted] are this round's drafts


class PaperRule:
    """The paper's answer at each hook: the plan reads no logits but the MASKs', a slot's
    first token keeps its plan confidence, an infilling round drafts the rest of the slot,
    its first not-yet-accepted token passes, and nothing is kept from one step for the next."""

    # logits rows a verify pass wants past the ones that score its fed tokens (the last fed
    # token's, which predict the token after the feed): global, and in infilling
    global_next = 0
    infill_next = 0

    def __init__(self, cfg: DecodeConfig) -> None:
        self.s, self.tau = cfg.slot_size, cfg.token_threshold
        self.window = cfg.slot_size  # tokens an infilling round drafts past the accepted prefix, at most

    # ------------------------------------------------------------------ plan
    def plan_head(self, feeds_head: bool, slot: int) -> int:
        """Logits rows the plan wants at the last token it feeds before the MASKs (the
        prompt's, or an AR block's last), which predicts the first token of `slot`."""
        return 0

    def take_plan_head(self, logits: torch.Tensor) -> torch.Tensor:
        """The plan's logits (n, V) less the rows `plan_head` asked for."""
        return logits

    def select(self, row: ReFusionRow) -> None:
        """The plan's selection (`row.selected`) stands, with the plan's drafts."""

    def check_selected(self, row: ReFusionRow) -> list[int]:
        """The selected slots' plan drafts are verified as drafted; returns the indices
        (into `row.undecoded`) of the slots whose first token was checked here: none."""
        return []

    # ------------------------------------------------------------------ verify
    def first_scored(self, slots: list[int]) -> list[bool]:
        """Which of the selected slots (in feed order) have their first token scored by the
        global verify pass: none, each keeps its plan confidence, which selected it."""
        return [False] * len(slots)

    def whole_slots_verified(self, slots: list[int], logits: torch.Tensor, last: range) -> None:
        """`slots` are whole and final (they are committed next); logits[last[i]] (V,) are
        this pass's logits at slots[i]'s last token."""

    def before_infill(
        self, row: ReFusionRow, logits: torch.Tensor, chunks: list[list[int]], per_slot: list[int]
    ) -> None:
        """Global verification left the selection to infill: `chunks` and `per_slot` (the
        slots' drafts and passing prefixes) go to the forks as they are."""

    def committed(self, row: ReFusionRow, slots: list[int]) -> None:
        """`slots` left the row's undecoded list."""

    def split(self, row: ReFusionRow, path: str, slots: list[int], toks: list[list[int]]) -> int:
        """`slots` (position order) are complete, by global verification (`path` "fast") or
        infilling: how many of them, from the first, are committed now. All of them."""
        return len(slots)

    def waits(self, row: ReFusionRow, slots: list[int]) -> list[bool]:
        """Which selected slots that global verification left to infill keep what they
        hold instead: none."""
        return [False] * len(slots)

    def refill(
        self,
        row: ReFusionRow,
        logits: torch.Tensor,
        slots: list[int],
        chunks: list[list[int]],
        passed: list[int],
        k: int,
    ) -> tuple[int, bool] | None:
        """Global verification committed slots[:k] and the rest of the selection goes back
        to planning (None), as the paper has it."""
        return None

    def commits(self, row: ReFusionRow, slot: int) -> bool:
        """Whether a slot being infilled is committed once complete (so an EOS it accepts
        ends the row's text): always."""
        return True

    # ------------------------------------------------------------------ infill
    def passing(self, f: Fork, pred: torch.Tensor, off: int, scores: list[float]) -> tuple[int, int | None]:
        """The fork's accepted length after a verify pass, and the index of the token the
        rule replaced (None: none): the first not-yet-accepted token passes, so that every
        round accepts one token at least, then every drafted token that scores above the
        threshold. pred[n - off] (V,) and scores[n - off] are slot token n's."""
        return self.passes_from(f, min(f.accepted + 1, f.drafted), off, scores), None

    def passes_from(self, f: Fork, n: int, off: int, scores: list[float]) -> int:
        """The accepted length: n, then every drafted token from n on whose AR probability
        exceeds the threshold."""
        while n < f.drafted and scores[n - off] > self.tau:
            n += 1
        return n


class BeyondPaper(PaperRule):
    """The paper's rule with ar_correction, first_token_check and infill_window, each
    where it applies (this module's docstring says what each does)."""

    def __init__(self, cfg: DecodeConfig) -> None:
        super().__init__(cfg)
        self.corrects, self.checks_first, self.left = cfg.ar_correction, cfg.first_token_check, cfg.left_check
        self.window = cfg.infill_window or cfg.slot_size
        self.global_next = int(self.checks_first)  # predicts the next slot's first token
        self.infill_next = int(
            self.checks_first or self.corrects
        )  # ... or corrects the token after the drafts
        self.slots_per_block = cfg.slots_per_block
        self.n_slots = cfg.serial_blocks * cfg.slots_per_block
        # first_token_check: slot -> the AR logits (V,) that predict its first token, read at
        # the last token of the slot to its left when that was committed (the prompt's, for slot 0)
        self.lookahead: dict[int, torch.Tensor] = {}
        self.ends: dict[int, torch.Tensor] = {}  # whole verified slot -> logits (V,) at its last token
        self.head: int | None = None  # the slot whose first token this step's first plan logits predict
        # left_check: slot -> its tokens (up to an EOS), decided while its left neighbour was not final
        self.held: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ first_token_check
    def plan_head(self, feeds_head: bool, slot: int) -> int:
        self.head = slot if feeds_head and self.checks_first else None  # they predict its first token
        return int(self.head is not None)

    def take_plan_head(self, logits: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            # a copy: not a view pinning the step's logits
            self.lookahead[self.head], logits = logits[0].clone(), logits[1:]
        return logits

    def check_selected(self, row: ReFusionRow) -> list[int]:
        """A selected slot whose left neighbour is committed has its first token scored by
        the AR prediction read there; one that fails (probability <= token_threshold) is
        replaced by that prediction. Returns the indices of the slots checked."""
        checked = []
        for i in row.selected:
            ahead = self.lookahead.get(row.undecoded[i])
            if ahead is None:
                continue
            checked.append(i)
            draft = row.plan.drafts[i, :1]  # (1,)
            if float(token_probs(ahead[None], draft)[0]) <= self.tau:
                old = int(draft[0])  # before the view below changes
                row.plan.drafts[i, 0] = row.req.sampler.pick(ahead[None])[0]
                replaced(row, row.undecoded[i] * self.s, old, int(row.plan.drafts[i, 0]))
        return checked

    def first_scored(self, slots: list[int]) -> list[bool]:
        """A slot's first token is scored like any other when the slot before it in the
        feed is its left neighbour: the logits there predict it."""
        if not self.checks_first:
            return super().first_scored(slots)
        return [i > 0 and slots[i - 1] == slots[i] - 1 for i in range(len(slots))]

    def whole_slots_verified(self, slots: list[int], logits: torch.Tensor, last: range) -> None:
        if self.checks_first:
            for j, i in zip(slots, last):
                self.ends[j] = logits[i].clone()  # a copy: not a view pinning the pass's logits

    def committed(self, row: ReFusionRow, slots: list[int]) -> None:
        """The committed slots' predictions are no longer needed; each whole one's logits
        at its last token predict the first token of the slot to its right."""
        for j in slots:
            self.lookahead.pop(j, None)
            self.held.pop(j, None)
        for j in slots:
            end = self.ends.pop(j, None)
            if end is not None:
                self._keep_lookahead(row, j, end)
        self.ends.clear()  # those of slots dropped after an EOS

    def _keep_lookahead(self, row: ReFusionRow, slot: int, logits: torch.Tensor) -> None:
        later_block = slot + 1 >= (row.block + 1) * self.slots_per_block
        if slot + 1 < self.n_slots and (later_block or slot + 1 in row.undecoded):
            self.lookahead[slot + 1] = logits

    # ------------------------------------------------------------------ ar_correction
    def before_infill(
        self, row: ReFusionRow, logits: torch.Tensor, chunks: list[list[int]], per_slot: list[int]
    ) -> None:
        """The first slot of the feed failed at token p, and this pass's logits at token
        p - 1 saw just what its infilling fork will see (the committed cache and the slot's
        own passing prefix): its AR prediction replaces token p and is accepted, as the
        fork's first verify pass would correct it. (A later slot's logits saw the
        unverified drafts fed before it, so its fork corrects it.)"""
        if self.corrects:
            p, old = per_slot[0], chunks[0][per_slot[0]]
            chunks[0][p] = int(row.req.sampler.pick(logits[p - 1 : p])[0])
            per_slot[0] = p + 1
            replaced(row, row.undecoded[row.selected[0]] * self.s + p, old, chunks[0][p])

    def passing(self, f: Fork, pred: torch.Tensor, off: int, scores: list[float]) -> tuple[int, int | None]:
        """The first not-yet-accepted token is scored too, and the first token that fails,
        or the one after the drafts (an infill window short of the slot's end), is replaced
        by this round's AR prediction for it and accepted; not past an accepted EOS."""
        if not self.corrects:
            return super().passing(f, pred, off, scores)
        n = self.passes_from(f, f.accepted, off, scores)
        if f.row.acceptance is not None and f.drafted > f.accepted:  # for the engine's draft widths
            f.row.acceptance.infill.add(n - f.accepted, f.drafted - f.accepted)
        if n == self.s or f.row.ends(f.tokens[:n]) is not None:
            return n, None
        old, f.tokens[n] = f.tokens[n], int(f.row.req.sampler.pick(pred[n - off : n - off + 1])[0])
        replaced(f.row, f.slot * self.s + n, old, f.tokens[n])
        return n + 1, n

    # ------------------------------------------------------------------ left_check
    def select(self, row: ReFusionRow) -> None:
        """The leftmost undecoded slot, and the held slots right after it (up to one that
        ends in an EOS), are selected, with their held tokens as drafts; so are the plan's
        choices that hold nothing. A held slot whose left neighbour is not final is not
        filled again: it waits."""
        if not self.left:
            return
        und, held = row.undecoded, self.held
        chosen = [0]
        while (
            chosen[-1] + 1 < len(und)
            and und[chosen[-1] + 1] == und[chosen[-1]] + 1
            and und[chosen[-1] + 1] in held
            and (und[chosen[-1]] not in held or row.ends(held[und[chosen[-1]]]) is None)
        ):
            chosen.append(chosen[-1] + 1)
        row.selected = sorted(set(chosen) | {i for i in row.selected if und[i] not in held})
        for i in row.selected:
            toks = held.get(und[i])
            if toks is not None:
                row.plan.drafts[i, : len(toks)] = torch.tensor(toks, device=row.plan.drafts.device)

    def split(self, row: ReFusionRow, path: str, slots: list[int], toks: list[list[int]]) -> int:
        """With left_check, only slots decided with a final left neighbour are committed:
        in global verification the run fed right after the committed ones, in infilling the
        leftmost slot's fork (no fork sees its siblings). The others are held."""
        if not self.left:
            return len(slots)
        first = min(row.undecoded + slots)  # the leftmost undecoded slot (an EOS it took dropped it)
        if path == "fast":
            n = next((i for i, j in enumerate(slots) if j != first + i), len(slots))
        else:
            n = int(bool(slots) and slots[0] == first)
        for j, t in zip(slots[n:], toks[n:]):
            self.held[j] = list(t)
        return n

    def waits(self, row: ReFusionRow, slots: list[int]) -> list[bool]:
        """Held slots behind the leftmost one keep their tokens: their left neighbour is not
        final yet, so filling them again would decide them without it once more."""
        return [self.left and i > 0 and j in self.held for i, j in enumerate(slots)]

    def commits(self, row: ReFusionRow, slot: int) -> bool:
        return not self.left or slot == min(row.undecoded, default=slot)

    def refill(
        self,
        row: ReFusionRow,
        logits: torch.Tensor,
        slots: list[int],
        chunks: list[list[int]],
        passed: list[int],
        k: int,
    ) -> tuple[int, bool] | None:
        """With left_check, the slot fed right after the committed run (now the leftmost)
        was scored in AR's context, so it is filled again from its first failing token in
        this step's infilling rather than planned again: returns its accepted length and
        whether its last accepted token is this pass's AR prediction in place of the
        failing one (with ar_correction, as `passing` would; else the paper's first token
        passes)."""
        if not self.left or k >= len(slots) or slots[k] != slots[k - 1] + 1 or passed[k] >= self.s:
            return None
        n = passed[k]
        if not self.corrects:
            return max(n, 1), False
        i = k * self.s + n - 1  # the logits that predict slot token n
        old, chunks[k][n] = chunks[k][n], int(row.req.sampler.pick(logits[i : i + 1])[0])
        replaced(row, slots[k] * self.s + n, old, chunks[k][n])
        return n + 1, True


def replaced(row: ReFusionRow, offset: int, old: int, new: int) -> None:
    """Note, when the trace wants the steps, a token at generation offset `offset` that the
    rule replaced by its AR prediction: a draft (rejected), or a MASK no plan drafted."""
    if row.req.traces_steps:
        if old != row.mask_id:
            row.req.note("rejected", [(offset, [old])])
        row.req.note("correction", [(offset, [new])])


def rule_for(cfg: DecodeConfig) -> PaperRule:
    """The rule of a row decoded with `cfg`: the paper's unless an option is set."""
    if cfg.ar_correction or cfg.first_token_check or cfg.infill_window is not None or cfg.left_check:
        return BeyondPaper(cfg)
    return PaperRule(cfg)
