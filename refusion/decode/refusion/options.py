"""The decoding options beyond the paper (docs/algorithm.md#decoding-options), each its own
small class; `rule.Rule` composes the ones a row's settings turn on and calls them at the
steps they change. All are `DecodeConfig` fields, off by default.

- `ARCorrection` (`ar_correction`): in infilling, the first token that fails verification
  is replaced by the AR prediction its verify pass made for it and accepted. The paper
  re-drafts it from MASK and accepts that draft unchecked: a prediction made with less
  context than the one the verify pass had. The corrected token's KV entry, computed with
  the failed draft, is not kept: the token is fed again, also when it completes the slot.
  The first slot of a global verify pass that fails is corrected by that pass already
  (its logits there saw just what its fork will see), which saves the fork a round.
- `FirstTokenCheck` (`first_token_check`): the paper never checks a slot's first token
  (its plan confidence selected it), though the AR prediction for it is known once the
  slot to its left is committed. So the AR logits at the last token of each whole
  committed slot (and at the prompt's last token) are kept; a selected slot whose left
  neighbour they belong to has its plan draft for the first token checked against them,
  and replaced when it fails. In global verification, a slot's first token is scored like
  any other when the slot before it in the feed is its left neighbour.
- `infill_window` (a number, `Rule.window`): each infilling round drafts and verifies at
  most that many tokens past a slot's accepted prefix. A round costs in proportion to what
  it feeds, and the drafts far past the first failure are wasted; attention is causal, so
  the drafts a window makes are the ones a whole slot of MASKs would give. With
  ar_correction, the token after a window's drafts is the AR prediction of its last one.
- `LeftCheck` (`left_check`): only the leftmost undecoded slot of a block, and the slots
  verified in one causal pass right after it, are committed. Every other slot a step
  completes (in infilling, or in global verification behind a gap) is held, its tokens
  and not its KV entries, and verified again once its left neighbour is final: fed after
  it, it keeps the entries of that pass if it passes whole, and is filled again from its
  first failing token otherwise (in the same step, when it was fed right after the
  committed run). The leftmost slot is always selected, so every step commits a slot.

With one slot per block and token_threshold >= 0.5, greedy decoding with ar_correction
and first_token_check equals greedy AR decoding of the same weights (every accepted token
is the AR argmax): ReFusion becomes a lossless drafter for its own AR head, and the plan's
MDM drafts only decide the speed. With left_check as well, that holds for any slot
layout: every committed entry was computed with the whole left context and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...settings.decode import DecodeConfig

if TYPE_CHECKING:
    from .infill import Fork
    from .row import ReFusionRow


def passes_from(f: Fork, n: int, off: int, passes: list[bool]) -> int:
    """The fork's accepted length: n, then every drafted token from n on that verification
    passes (passes[i - off] for slot token i)."""
    while n < f.drafted and passes[n - off]:
        n += 1
    return n


class ARCorrection:
    """ar_correction: a failing token is replaced by its verify pass's AR prediction."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.s, self.tau = cfg.slot_size, cfg.token_threshold

    def before_infill(
        self, row: ReFusionRow, logits: torch.Tensor, chunks: list[list[int]], per_slot: list[int]
    ) -> None:
        """Global verification left its selection to infill. The first slot of the feed
        failed at token p, and this pass's logits at token p - 1 saw just what its fork
        will see (the committed cache and the slot's own passing prefix): its AR prediction
        replaces token p and is accepted, as the fork's first verify pass would correct it.
        (A later slot's logits saw the unverified drafts fed before it: its fork corrects it.)"""
        p, old = per_slot[0], chunks[0][per_slot[0]]
        chunks[0][p] = row.judge.replace(logits[p - 1 : p], row.plan.q_logits(row.selected[0], p))
        per_slot[0] = p + 1
        row.trace.replaced(row.undecoded[row.selected[0]] * self.s + p, old, chunks[0][p])

    def passing(self, f: Fork, pred: torch.Tensor, off: int, passes: list[bool]) -> tuple[int, int | None]:
        """An infilling verify pass: the first not-yet-accepted token is judged too, and the
        first token that fails, or the one after the drafts (an infill window short of the
        slot's end), is replaced by this round's AR prediction for it (`judge`: a draw from
        the residual where a draft was rejected) and accepted; not past an accepted EOS.
        Returns the accepted length and the token replaced."""
        n = passes_from(f, f.accepted, off, passes)
        if f.row.acceptance is not None and f.drafted > f.accepted:  # for the engine's draft widths
            f.row.acceptance.infill.add(n - f.accepted, f.drafted - f.accepted)
        if n == self.s or f.row.ends(f.tokens[:n]) is not None:
            return n, None
        drafted = f.q_logits[n] if n < f.drafted else None  # past the drafts: a plain AR draw
        old, f.tokens[n] = f.tokens[n], f.row.judge.replace(pred[n - off : n - off + 1], drafted)
        f.row.trace.replaced(f.slot * self.s + n, old, f.tokens[n])
        return n + 1, n


class FirstTokenCheck:
    """first_token_check: a slot's first token is checked against the AR prediction read
    at the last token of the slot to its left, once that slot is committed."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.s, self.tau = cfg.slot_size, cfg.token_threshold
        self.slots_per_block = cfg.slots_per_block
        self.n_slots = cfg.serial_blocks * cfg.slots_per_block
        # slot -> the AR logits (V,) that predict its first token, read at the last token of
        # the slot to its left when that was committed (the prompt's, for slot 0)
        self.lookahead: dict[int, torch.Tensor] = {}
        self.ends: dict[int, torch.Tensor] = {}  # whole verified slot -> logits (V,) at its last token
        self.head: int | None = None  # the slot whose first token this step's first plan logits predict

    # ------------------------------------------------------------------ plan
    def plan_head(self, feeds_head: bool, slot: int) -> int:
        """The plan feeding a head (the prompt, an AR block's last token) before its MASKs
        wants the logits there: they predict `slot`'s first token."""
        self.head = slot if feeds_head else None
        return int(self.head is not None)

    def take_plan_head(self, logits: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            # a copy: not a view pinning the step's logits
            self.lookahead[self.head], logits = logits[0].clone(), logits[1:]
        return logits

    def check_selected(self, row: ReFusionRow) -> list[int]:
        """A selected slot whose left neighbour is committed has its first token scored by
        the AR prediction read there; one that fails (probability <= token_threshold) is
        replaced by that prediction. Returns the indices (into `row.undecoded`) checked."""
        checked = []
        for i in row.selected:
            ahead = self.lookahead.get(row.undecoded[i])
            if ahead is None:
                continue
            checked.append(i)
            draft = row.plan.drafts[i, :1]  # (1,)
            q = None if row.plan.q is None else row.plan.q[i, :1]
            if not row.judge.passes(ahead[None], draft, q)[0]:
                old = int(draft[0])  # before the view below changes
                row.plan.drafts[i, 0] = row.judge.replace(ahead[None], row.plan.q_logits(i, 0))
                row.trace.replaced(row.undecoded[i] * self.s, old, int(row.plan.drafts[i, 0]))
        return checked

    # ------------------------------------------------------------------ verify
    @staticmethod
    def first_scored(slots: list[int]) -> list[bool]:
        """A slot's first token is scored like any other when the slot before it in the
        feed is its left neighbour: the logits there predict it."""
        return [i > 0 and slots[i - 1] == slots[i] - 1 for i in range(len(slots))]

    def whole_slots_verified(self, slots: list[int], logits: torch.Tensor, last: range) -> None:
        for j, i in zip(slots, last):
            self.ends[j] = logits[i].clone()  # a copy: not a view pinning the pass's logits

    # ------------------------------------------------------------------ commit
    def committed(self, row: ReFusionRow, slots: list[int]) -> None:
        """The committed slots' predictions are no longer needed; each whole one's logits
        at its last token predict the first token of the slot to its right."""
        for j in slots:
            self.lookahead.pop(j, None)
        for j in slots:
            end = self.ends.pop(j, None)
            if end is not None:
                self._keep_lookahead(row, j, end)
        self.ends.clear()  # those of slots dropped after an EOS

    def _keep_lookahead(self, row: ReFusionRow, slot: int, logits: torch.Tensor) -> None:
        later_block = slot + 1 >= (row.block + 1) * self.slots_per_block
        if slot + 1 < self.n_slots and (later_block or slot + 1 in row.undecoded):
            self.lookahead[slot + 1] = logits


class LeftCheck:
    """left_check: only slots decided with a final left neighbour are committed; the
    others are held and verified again once it is final. `corrects`: with ar_correction,
    a held slot filled again starts from its pass's AR prediction for its failing token."""

    def __init__(self, cfg: DecodeConfig, corrects: bool) -> None:
        self.s, self.corrects = cfg.slot_size, corrects
        # slot -> its tokens (up to an EOS), decided while its left neighbour was not final
        self.held: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ plan
    def select(self, row: ReFusionRow) -> None:
        """The leftmost undecoded slot, and the held slots right after it (up to one that
        ends in an EOS), are selected, with their held tokens as drafts; so are the plan's
        choices that hold nothing. A held slot whose left neighbour is not final is not
        filled again: it waits."""
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

    # ------------------------------------------------------------------ verify
    def split(self, row: ReFusionRow, path: str, slots: list[int], toks: list[list[int]]) -> int:
        """Of `slots` (complete, position order), how many from the first are committed:
        in global verification the run fed right after the committed ones, in infilling
        the leftmost slot's fork (no fork sees its siblings). The others are held."""
        first = min(row.undecoded + slots)  # the leftmost undecoded slot (an EOS it took dropped it)
        if path == "fast":
            n = next((i for i, j in enumerate(slots) if j != first + i), len(slots))
        else:
            n = int(bool(slots) and slots[0] == first)
        for j, t in zip(slots[n:], toks[n:]):
            self.held[j] = list(t)
        return n

    def waits(self, slots: list[int]) -> list[bool]:
        """Held slots behind the leftmost one keep their tokens: their left neighbour is not
        final yet, so filling them again would decide them without it once more."""
        return [i > 0 and j in self.held for i, j in enumerate(slots)]

    def refill(
        self,
        row: ReFusionRow,
        logits: torch.Tensor,
        slots: list[int],
        chunks: list[list[int]],
        passed: list[int],
        k: int,
    ) -> tuple[int, bool] | None:
        """Global verification committed slots[:k]; the slot fed right after them (now the
        leftmost) was scored in AR's context, so it is filled again from its first failing
        token in this step's infilling rather than planned again: returns its accepted
        length and whether its last accepted token is this pass's AR prediction in place
        of the failing one (with ar_correction, as its `passing` would; else the paper's
        first token passes). None: there is no such slot."""
        if k >= len(slots) or slots[k] != slots[k - 1] + 1 or passed[k] >= self.s:
            return None
        n = passed[k]
        if not self.corrects:
            return max(n, 1), False
        i = k * self.s + n - 1  # the logits that predict slot token n
        old, chunks[k][n] = chunks[k][n], row.judge.replace(logits[i : i + 1], None)
        row.trace.replaced(slots[k] * self.s + n, old, chunks[k][n])
        return n + 1, True

    # ------------------------------------------------------------------ infill and commit
    @staticmethod
    def commits(row: ReFusionRow, slot: int) -> bool:
        """A slot being infilled is committed once complete only if it is the leftmost."""
        return slot == min(row.undecoded, default=slot)

    def committed(self, slots: list[int]) -> None:
        for j in slots:
            self.held.pop(j, None)
