"""The draft widths an engine sets each step (docs/algorithm.md#adaptive-widths): the policy
object the engine asks before its forwards, and tells how long each step took.

Only rows whose output cannot depend on the widths take part (`widths.widths_keep_output`);
the others draft at their settings' widths. On a model split over processes each rank
would time its own forwards and choose apart, so an engine there keeps widths fixed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..settings.decode import DecodeConfig
from .widths import Drafting, choose, lone_drafts, widths_keep_output


class WidthPolicy:
    """Chooses the plan width and infilling window of the rows at the start of a block,
    from the forward cost and draft acceptance measured on this model (`Drafting`), and
    measures each step's own time outside its forwards (`widths.StepOverhead`)."""

    def __init__(self, drafting: Drafting, adaptive: bool) -> None:
        self.drafting, self.adaptive = drafting, adaptive
        self._last_step_end = 0.0  # when the last step ended, while requests remained
        self.steps = 0  # steps timed so far: what a row's blocks count their steps by
        self._not_step = 0.0  # seconds of this step that are no step's own work (a calibration)

    def describe(self) -> str:
        """The widths in force, in words (a server's startup line and its settings)."""
        if self.adaptive:
            return (
                "adaptive: lossless ReFusion rows draft as wide as pays at the batch's load, "
                "a row alone at its settings' widths or as AR blocks, whichever its blocks "
                "measure faster (--no-adaptive-drafts: fixed)"
            )
        return "fixed: every row drafts at its settings' widths (--adaptive-drafts: adaptive)"

    def follows(self, cfg: DecodeConfig) -> bool:
        """Whether a row of these settings drafts at the widths this policy chooses."""
        return self.adaptive and widths_keep_output(cfg)

    def choose(self, rows: Sequence[Any], lengths: Sequence[int], time_shapes: Callable, batch: int) -> None:
        """Each group of rows with adaptive widths at the start of a block (same slot size
        and widest window) gets the plan width and infilling window that commit the most
        tokens per second with the batch as it is (`widths.choose`); the forward cost is
        timed at first use and again later, a shape a step (`ForwardCost.calibrate`). A row
        inside an AR block does not choose: it runs to the block's end, a token in each plan
        and verification forward, and waits through the drafting rows' infilling, so it is
        priced as such a rider.
        `lengths[b]`: entries in row b's cache; `batch`: the engine's max_batch_size."""
        if len(rows) == 1:
            self._lone_infilling(rows[0])
        groups: dict[tuple[int, int], list[Any]] = {}
        cached: dict[int, int] = {}  # id(row) -> entries in its cache row
        for b, r in enumerate(rows):
            if r.adaptive:
                groups.setdefault((r.s, r.req.cfg.infill_window or r.s), []).append(r)
                cached[id(r)] = lengths[b]
        if not groups:
            return
        cost = self.drafting.cost
        if cost.stale():
            t0 = time.perf_counter()
            cost.calibrate(time_shapes, batch)
            self._not_step += time.perf_counter() - t0  # a one-off: not the step's own work
        for (s, window), group in groups.items():
            self._choose_group(rows, group, s, window, cached)

    def _lone_infilling(self, row: Any) -> None:
        """A row alone and infilling whose own infilling drafts pass too rarely to pay for the
        forward that drafts them (fewer than one of a window, by its own count) infills the
        rest of its block a token per forward, as AR decoding does: its window goes to 0 until
        the next block's widths are chosen. Its tokens stay the same (`widths_keep_output`)."""
        acceptance = getattr(row, "acceptance", None)
        if acceptance is None or not row.infills() or not row.rule.window:
            return
        own = acceptance.own_infill
        if own.reached and own.expected(row.rule.window)[0] < 1:
            row.rule.window = 0

    def _choose_group(self, rows: Sequence[Any], group: list[Any], s: int, window: int, cached: dict) -> None:
        member = {id(r) for r in group}
        rest = [r for r in rows if id(r) not in member]
        fed = sum(r.fed_per_forward() for r in rest)
        # the rows' mean cache length: attention's share of a forward's cost
        context = sum(cached[id(r)] for r in group) // len(group)
        at = functools.partial(self.drafting.cost, context=context)
        d = self.drafting
        overheads = (d.overhead.seconds(len(rows)), d.ar_overhead.seconds(len(rows)))
        one = functools.partial(self.drafting.cost.alone, context=context)  # a forward of one row
        for r in group:
            self._close_block(r, one)
        alone = len(group) == 1 and not rest
        drafts = self._lone_drafts(group[0], one) if alone else True
        p, w = choose(
            len(group), len(rest), fed, s, window, d.acceptance, at, overheads=overheads, alone_drafts=drafts
        )
        for r in group:
            if p == 0 and r.can_start_ar_block():
                r.start_ar_block()  # counted in its request's stats (ar_blocks), as drafting steps are
            else:
                r.set_widths(max(p, 1), w)
            self._open_block(r, alone)

    def _lone_drafts(self, row: Any, at: Callable[[float], float]) -> bool:
        """Whether a row alone drafts its next block (`widths.lone_drafts`): judged by its
        own drafting blocks once it has one, before that by the model's lone rows'. An AR
        block's token costs a one-token forward and an AR step's own time."""
        d = self.drafting
        ar_rate = 1.0 / max(at(1) + d.ar_overhead.seconds(1), 1e-12)
        own = row.acceptance
        if own.drafted.rate() is not None:
            return lone_drafts(own.drafted, own.probe, ar_rate)
        return lone_drafts(d.lone, d.lone_probe, ar_rate)

    def _open_block(self, row: Any, alone: bool) -> None:
        """Note where the row's block began (once per block: a row re-planned inside its
        block keeps its start). A prompt's prefill counts as fed before the block: AR
        decoding feeds it too."""
        acc = row.acceptance
        if acc.started is not None and acc.started[0] == row.block:
            return
        st = row.req.stats
        fed = st.fed + (len(row.req.prompt) if st.nfe == 0 else 0)
        acc.started = (row.block, row.req.prefix_len, st.nfe, fed, self.steps, row.drafting, alone)

    def _close_block(self, row: Any, at: Callable[[float], float]) -> None:
        """A drafting block the row has finished goes into its record (and, begun alone,
        the model's lone record), priced as AR blocks are: its forwards at the tokens they
        fed on average and its steps at a drafting step's own time (`StepOverhead`), both
        at one row (`ForwardCost.alone`). The average prices a block's wide plan forward and
        narrow infilling ones alike: close where a forward's cost grows slowly with its
        tokens, which is where drafting can pay at all."""
        acc = row.acceptance
        if acc.started is None or acc.started[0] == row.block:
            return
        _, tokens, nfe, fed, steps, drafting, alone = acc.started
        acc.started = None
        st = row.req.stats
        forwards = st.nfe - nfe
        if not drafting or forwards <= 0:
            return
        per = max(st.fed - fed, forwards) / forwards  # tokens fed per forward
        seconds = forwards * at(per) + (self.steps - steps) * self.drafting.overhead.seconds(1)
        acc.drafted.add(row.req.prefix_len - tokens, seconds)
        if alone:
            self.drafting.lone.add(row.req.prefix_len - tokens, seconds)

    def timed(self, start: float, forward_seconds: float, rows: int, drafted: bool, more: bool) -> None:
        """A step that began at `start` spent `forward_seconds` in forwards with `rows` rows
        (`drafted`: a row drafted in it); its time outside them, and the driver's since the
        last step (at most the step's own length: a longer gap is a driver waiting for
        work), is counted per kind of step (infilling's bookkeeping, or AR blocks and AR
        rows only). `more`: requests remain."""
        end = time.perf_counter()
        self.steps += 1
        if self.adaptive and rows:
            gap = min(start - self._last_step_end, end - start) if self._last_step_end else 0.0
            outside = end - start - forward_seconds - self._not_step + gap
            kind = self.drafting.overhead if drafted else self.drafting.ar_overhead
            kind.add(rows, outside)
        self._last_step_end, self._not_step = (end if more else 0.0), 0.0
