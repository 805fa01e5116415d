"""Step 4, parallel autoregressive infilling (docs/algorithm.md#infilling), for every row
that needs it: one forked cache row per selected slot, draft then verify until every
slot is complete; then each slot's own KV entries are appended to its owner's row (KV
reuse, no recomputation).

- Draft: each fork feeds its slot with the not-yet-accepted tokens replaced by MASK (up
  to the rule's window of them) and takes the predictions there as new drafts.
- Verify: each fork feeds its drafted slot causally; a token passes when its AR
  probability exceeds the threshold, and the rule says how the first ones pass
  (`Rule.passing`: the paper's first not-yet-accepted token always does). The verify
  pass's entries of accepted tokens are kept; the last accepted token is fed again while
  the slot is incomplete, so its logits can score the next draft.
- An EOS accepted ends the slot, drops the slots after it (when the rule commits it), and
  ends the row after its block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...model.kv_cache import KVCache
from ..forward import Forward
from .drafting import plan_drafts_first

if TYPE_CHECKING:
    from .row import ReFusionRow, ToInfill


@dataclass
class Fork:
    """One selected slot in parallel AR infilling: its own copy of the committed cache."""

    row: ReFusionRow
    slot: int  # the slot's index in the region
    tokens: list[int]  # (s,) current drafts; tokens[:accepted] are final
    accepted: int  # >= 1
    base: int  # committed length of the owner's cache when forked
    drafted: int = 0  # tokens[accepted:drafted] are this round's drafts, to verify
    head: torch.Tensor | None = None  # (V,) this round's draft-pass logits at tokens[accepted - 1]
    kept: int = 0  # slot entries already in this fork's cache (accepted tokens but the last)
    length: int = 0  # slot length to commit (s, or up to and including an EOS)
    complete: bool = False
    dropped: bool = False  # a slot at an earlier position accepted an EOS
    how: list[str] | None = None  # when tracing: how each accepted token was accepted (request.HOW)
    # for a speculative verification (`judge.Speculative`): per position, q(x) of its draft and
    # the logits (V,) it was drawn from (None where not recorded)
    q: list[float | None] = field(default_factory=list)
    q_logits: list[torch.Tensor | None] = field(default_factory=list)


class Infill:
    """Step 4, parallel autoregressive infilling, for every row that needs it: one forked
    cache row per selected slot, draft then verify until every slot is complete; then each
    slot's own KV entries are appended to its owner's row (KV reuse, no recomputation).

    It runs a round at a time (`round`: the engine's step is one round, so that a request
    that arrives waits for one round and not for every round of the infilling): the forks
    and their cache are kept from round to round, the rows' main cache rows untouched
    until the commit. The fork cache is scratch storage kept from step to step."""

    def __init__(self, fwd: Forward) -> None:
        self.fwd = fwd
        self.scratch: KVCache | None = None
        self.forks: list[Fork] = []  # the infilling in progress (none: every row's is committed)
        self.rows: list[Any] = []  # its rows, in the order `start` took them
        self._first: list[bool] | None = None  # its first round verifies these forks' plan drafts

    @property
    def running(self) -> bool:
        """Whether an infilling is in progress (its forks await more rounds or their commit)."""
        return bool(self.forks)

    def start(self, rows: Sequence[Any], index: list[int], cache: KVCache) -> None:
        """Fork each selected slot of `rows` (`index[i]`: rows[i]'s row in `cache`)."""
        forks: list[Fork] = []
        src_rows: list[int] = []
        for row, b in zip(rows, index):
            work: ToInfill = row.to_infill
            slots, drafts, per_slot = work.slots, work.drafts, work.accepted
            hows = work.how if work.how is not None else [None] * len(slots)
            for j, d, a, h, i in zip(slots, drafts, per_slot, hows, work.index):
                q, q_logits = row.plan.q_of(i, row.s)
                forks.append(Fork(row, j, list(d), a, cache.lengths[b], how=h, q=q, q_logits=q_logits))
            src_rows += [b] * len(slots)
        widest = max(r.s for r in rows)
        # rows grow by < s, feeds are <= s; the scratch storage of the last step is reused
        self.scratch = cache.select(src_rows, capacity=cache.used() + 2 * widest, out=self.scratch)
        self.forks, self.rows = forks, list(rows)
        first = [plan_drafts_first(f) for f in forks]
        self._first = first if any(first) else None

    def round(self) -> bool:
        """One round of the infilling in progress: its first, a verify pass over the plan's
        own drafts where the row allows it (`plan_drafts_first`), or a draft pass and a
        verify pass. Returns whether every slot is complete (then `commit`)."""
        forks, fcache = self.forks, self.scratch
        assert fcache is not None  # `start` forked the cache
        for f in forks:  # a row aborted since: its forks feed nothing more
            if f.row.done:
                f.dropped = f.complete = True
        if self._first is not None:
            self._verify(forks, fcache, only=self._first)
            self._first = None
        elif any(not f.complete for f in forks):
            self._draft(forks, fcache)
            self._verify(forks, fcache)
        return all(f.complete for f in forks)

    def commit(self, cache: KVCache, rows: Sequence[Any]) -> None:
        """Commit the infilling in progress to `cache`, whose rows are now `rows` (the
        batch may have changed since `start`: rows joined, finished, moved); a row aborted
        meanwhile (`done`) commits nothing."""
        at = {id(r): b for b, r in enumerate(rows)}
        live = [i for i, f in enumerate(self.forks) if not f.row.done]
        forks = [self.forks[i] for i in live]
        assert self.scratch is not None  # `start` forked the cache
        self._commit(forks, live, self.scratch, cache, [at[id(f.row)] for f in forks])
        for row in self.rows:  # done: the next step plans
            row.to_infill = None
        self.reset()

    def reset(self) -> None:
        """No infilling in progress (its forks dropped: committed, or a batch dropped)."""
        self.forks, self.rows, self._first = [], [], None

    @staticmethod
    def _feed(f: Fork, tail: list[int]) -> tuple[list[int], list[int]]:
        """Tokens and positions a fork feeds: its accepted tokens not yet cached, then tail."""
        P = len(f.row.req.prompt)
        toks = f.tokens[f.kept : f.accepted] + tail
        return toks, [P + f.slot * f.row.s + f.kept + i for i in range(len(toks))]

    def _draft(self, forks: list[Fork], fcache: KVCache) -> None:
        tokens, positions, want = [], [], []
        for f in forks:
            # a complete fork, one whose slot passed whole in step 3, or one that accepted an
            # EOS has nothing to draft: it feeds nothing (a packed forward spends no compute on its row)
            done = f.complete or f.length or f.row.ends(f.tokens[: f.accepted]) is not None
            n_masks = 0 if done else min(f.row.s - f.accepted, f.row.rule.window)
            toks, pos = self._feed(f, [f.row.mask_id] * n_masks) if n_masks else ([], [])
            tokens.append(toks)
            positions.append(pos)
            # the last accepted token's logits too: they score the first draft in the verify pass
            want.append((len(toks) - n_masks - 1, len(toks)) if n_masks else (0, 0))
        if not any(tokens):  # no fork drafts this round (a window of 0, or every slot final): no forward
            for f in forks:
                f.drafted, f.head = f.accepted, None
            return
        logits = self.fwd.run([f.row.req for f in forks], tokens, positions, fcache, want, _held(forks))
        advance = []
        for f, lg in zip(forks, logits):
            f.drafted, f.head = f.accepted, None
            advance.append(0)
            if lg.shape[0]:
                # the accepted tokens this pass fed (causal: the MASKs after them do not
                # touch their entries) stay cached, so the verify pass feeds only drafts
                advance[-1], f.kept, f.head, lg = f.accepted - f.kept, f.accepted, lg[0].clone(), lg[1:]
                drawn, q = f.row.req.sampler.draw(lg)
                drafts = drawn.tolist()
                f.tokens[f.accepted : f.accepted + len(drafts)] = drafts
                if f.row.judge.records_q and q is not None:  # what a speculative verification divides by
                    f.q[f.accepted : f.accepted + len(drafts)] = q.tolist()
                    f.q_logits[f.accepted : f.accepted + len(drafts)] = list(lg)
                eos = f.row.ends(drafts)  # drafts after an EOS are never verified: none can be committed
                f.drafted += len(drafts) if eos is None else eos + 1
        fcache.advance(advance)

    def _verify(self, forks: list[Fork], fcache: KVCache, only: list[bool] | None = None) -> None:
        """A verify pass over every fork (`only`: over the forks marked; the others feed
        nothing and stay as they are)."""
        taking = only or [True] * len(forks)  # the forks this pass is over
        tokens, positions, want = [], [], []
        for f, takes in zip(forks, taking):
            # a fork whose tokens are final feeds only the ones whose entries it lacks
            tail = [] if f.length else f.tokens[f.accepted : f.drafted]
            toks, pos = self._feed(f, tail) if takes and not f.complete else ([], [])
            tokens.append(toks)
            positions.append(pos)
            # the logits that score the fed tokens (each token's predict the next), and any the rule
            # reads past them
            want.append((0, len(toks) - 1 + f.row.rule.infill_next) if toks else (0, 0))
        logits = self.fwd.run([f.row.req for f in forks], tokens, positions, fcache, want, _held(forks))
        advance = []
        for f, takes, toks, lg in zip(forks, taking, tokens, logits):
            before = f.kept
            if not takes:
                advance.append(0)
                continue
            if f.length and not f.complete:
                f.kept, f.complete = f.length, True
            elif not f.complete:
                self._verify_fork(f, forks, toks, lg)
            if (
                f.complete and not f.dropped and toks and f.length == f.row.s
            ):  # this pass fed the slot's last token
                f.row.rule.whole_slots_verified([f.slot], lg, range(len(toks) - 1, len(toks)))
            advance.append(f.kept - before)
        fcache.advance(advance)

    def _verify_fork(self, f: Fork, forks: list[Fork], toks: list[int], lg: torch.Tensor) -> None:
        """Accept the fork's passing prefix, see whether its slot is complete, and keep the
        entries of this pass that hold final tokens."""
        s = f.row.s
        # pred[i] predicts slot token off + i: this pass's logits at the fed tokens (from
        # slot token kept), after the draft pass's at the token before them when it drafted
        if f.head is not None:
            pred, off, targets = torch.cat([f.head[None], lg]), f.kept, toks
        else:
            pred, off, targets = lg, f.kept + 1, toks[1:]
        passes = self._judge(f, pred, off, targets)
        n, corrected = f.row.rule.passing(f, pred, off, passes)
        f.how = f.row.trace.infilled(f.how, f.accepted, n, corrected, passes, off)
        if f.row.trace.steps:
            f.row.reject([(f.slot, f.tokens[: f.drafted], n)])
        f.accepted = n
        eos = f.row.ends(f.tokens[:n])
        if eos is not None:
            f.length = eos + 1
            if f.row.rule.commits(f.row, f.slot):  # the EOS ends the row's text
                self._drop_later_forks(f, forks)
        elif n == s:
            f.length = s
        valid = s if corrected is None else corrected  # entries this pass computed with final tokens
        if f.length:
            # complete once every entry is cached; a corrected last token is fed once more
            f.kept, f.complete = min(f.length, valid), f.length <= valid
        else:
            f.kept = n - 1  # the last accepted token is fed again

    @staticmethod
    def _judge(f: Fork, pred: torch.Tensor, off: int, targets: list[int]) -> list[bool]:
        """Whether verification passes each target (slot tokens off, off + 1, ...): judged
        from the first not-yet-accepted token on, by the row's judge; the accepted ones
        before it are final."""
        start = min(max(f.accepted - off, 0), len(targets))
        if start == len(targets):
            return [True] * start
        tokens = torch.tensor(targets[start:], dtype=torch.long, device=pred.device)
        q = None
        if f.row.judge.records_q:
            q = torch.tensor(f.q[off + start : off + len(targets)], dtype=torch.float64)
        return [True] * start + f.row.judge.passes(pred[start : len(targets)], tokens, q)

    @staticmethod
    def _drop_later_forks(f: Fork, forks: list[Fork]) -> None:
        f.row.drop_after(f.slot)
        for g in forks:
            if g.row is f.row and g.slot > f.slot:
                g.dropped = g.complete = True

    @staticmethod
    def _commit(forks: list[Fork], src: list[int], fcache: KVCache, cache: KVCache, owner: list[int]) -> None:
        """Each row's complete slots that its rule commits (`split`; it holds the others)
        get their fork's entries appended, in position order. forks[i] is row src[i] of
        `fcache`, its owner row owner[i] of `cache`."""
        by_row: dict[int, list[tuple[int, Fork]]] = {}
        for i, f in enumerate(forks):  # position order within each row
            if not f.dropped:
                by_row.setdefault(id(f.row), []).append((i, f))
        done = []  # per row: the (fork index, fork) pairs committed now
        for fs in by_row.values():
            row = fs[0][1].row
            n = row.rule.split(row, "infill", [f.slot for _, f in fs], [f.tokens[: f.length] for _, f in fs])
            done.append(fs[:n])
        live = [pair for fs in done for pair in fs]
        cache.append_from(
            fcache,
            src_rows=[src[i] for i, _ in live],
            src_starts=[f.base for _, f in live],
            counts=[f.length for _, f in live],
            dst_rows=[owner[i] for i, _ in live],
        )
        for fs in filter(None, done):
            row = fs[0][1].row
            # a traced row's forks all say how their tokens were accepted; an untraced row's none
            how = [f.how[: f.length] for _, f in fs if f.how is not None] or None
            row.commit("infill", [f.slot for _, f in fs], [f.tokens[: f.length] for _, f in fs], how)


def _held(forks: list[Fork]) -> list[dict[int, int] | None] | None:
    """Per fork, the slot tokens its cache holds that no feed shows (generation offset ->
    token), for the requests that shape their logits (`shaping.py`); None when none does."""
    if all(f.row.req.shaping is None for f in forks):
        return None
    return [{f.slot * f.row.s + i: t for i, t in enumerate(f.tokens[: f.kept])} for f in forks]
