"""The ReFusion decoder (SPEC §3): plan, select slots, verify, infill, commit.

All rows of a batch step together: one batched forward for the plan of every active row,
one for their verification, then the rows that need it infill together (one row of the
forward per selected slot). Each row's decisions depend only on its own logits, so a
batch decodes exactly what each prompt would decode alone.

Generation offsets: position `P + i` of a prompt of length P is offset `i`; slot j of the
region covers offsets j*s .. j*s+s-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import KVCache
from .config import DecodeConfig
from .engine import Forward, Progress, make_room
from .sampling import Sampler, token_probs


@dataclass
class Row:
    """One prompt's state: which slots of the current block are still undecoded."""

    rid: int  # index of the prompt
    prompt: list[int]
    slots_per_block: int
    n_blocks: int
    block: int = 0
    undecoded: list[int] = field(default_factory=list)  # slot indices, ascending
    prefilled: bool = False
    ends_after_block: bool = False  # an EOS was committed: finish this block, then stop
    done: bool = False

    def __post_init__(self) -> None:
        self.undecoded = self._block_slots(0)

    def _block_slots(self, block: int) -> list[int]:
        return list(range(block * self.slots_per_block, (block + 1) * self.slots_per_block))

    def drop_after(self, slot: int) -> None:
        """An EOS was accepted in `slot`: slots at later positions will never be decoded."""
        self.undecoded = [j for j in self.undecoded if j < slot]
        self.ends_after_block = True

    def next_block_if_complete(self) -> None:
        if self.undecoded:
            return
        self.block += 1
        if self.ends_after_block or self.block == self.n_blocks:
            self.done = True
        else:
            self.undecoded = self._block_slots(self.block)


@dataclass
class Plan:
    """The plan step's drafts for one row: per undecoded slot, tokens and their confidences."""

    drafts: torch.Tensor  # (n_undecoded, s) int64
    conf: torch.Tensor  # (n_undecoded, s) float32


@dataclass
class Fork:
    """One selected slot in parallel AR infilling: its own copy of the committed cache."""

    row: Row
    slot: int
    tokens: list[int]  # (s,) current drafts; tokens[:accepted] are final
    accepted: int  # >= 1
    base: int  # committed length of the owner's cache when forked
    kept: int = 0  # slot entries already in this fork's cache (accepted tokens but the last)
    length: int = 0  # slot length to commit (s, or up to and including an EOS)
    complete: bool = False
    dropped: bool = False  # a slot at an earlier position accepted an EOS


class ReFusionDecoder:
    def __init__(self, fwd: Forward, progress: Progress, sampler: Sampler, cfg: DecodeConfig, mask_id: int, eos_ids: set[int],
                 max_rows: int = 0) -> None:
        self.fwd, self.progress, self.sampler, self.cfg = fwd, progress, sampler, cfg
        self.max_rows = max_rows  # rows in flight at most: the cache reserves storage for them
        self.mask_id, self.eos_ids = mask_id, eos_ids
        self.s = cfg.slot_size
        self.rows: list[Row] = []  # one per cache row
        self.cache: KVCache | None = None
        self.forks: KVCache | None = None  # scratch for infilling, reused step after step

    # ------------------------------------------------------------------ driver
    @property
    def active(self) -> int:
        return len(self.rows)

    def decode(self, prompts: list[list[int]], rids: list[int]) -> None:
        """Decode a batch to the end (no rows joining)."""
        self.admit(prompts, rids)
        while self.rows:
            self.step()

    def admit(self, prompts: list[list[int]], rids: list[int]) -> None:
        """New rows join at the next step; their first plan step also prefills the prompt
        (continuous batching: each row's decisions depend only on its own logits)."""
        cfg = self.cfg
        n_slots = cfg.padded_length // self.s
        new = [Row(rid, p, n_slots // cfg.serial_blocks, cfg.serial_blocks) for rid, p in zip(rids, prompts)]
        for row in new:
            self.progress.start(row.rid, cfg.padded_length)
        widest = cfg.padded_length + cfg.padded_length // cfg.serial_blocks  # the region, and a block of MASKs
        running = max((len(r.prompt) for r in self.rows), default=0)
        self.cache = make_room(self.fwd.model, self.cache, prompts, running, widest, self.max_rows)
        self.rows += new

    def step(self) -> None:
        """One round for every row: plan, select, verify, infill where needed, commit;
        finished rows leave the batch."""
        rows, cache = self.rows, self.cache
        plans = self.plan(rows, cache)
        selections = [select_slots(p, self.cfg.slot_threshold) for p in plans]
        to_infill = self.verify(rows, plans, selections, cache)
        if to_infill:
            self.infill(rows, to_infill, cache)
        for row in rows:
            row.next_block_if_complete()
            if self.progress.check_cancelled(row.rid):
                row.done = True
            if row.done:
                self.fwd.finish(row.rid)
        keep = [i for i, row in enumerate(rows) if not row.done]
        if len(keep) < len(rows):  # finished rows leave; their storage stays for rows that join
            self.rows = [rows[i] for i in cache.retain(keep)]

    # ------------------------------------------------------------------ step 1
    def plan(self, rows: list[Row], cache: KVCache) -> list[Plan]:
        """Feed MASK for every undecoded slot of each row's block (after the prompt on the
        first step); draft each masked position; discard the MASK entries."""
        s = self.s
        tokens, positions, want, keep = [], [], [], []
        for row, n in zip(rows, cache.lengths):
            P = len(row.prompt)
            head = [] if row.prefilled else row.prompt
            mask_pos = [P + j * s + i for j in row.undecoded for i in range(s)]
            tokens.append(head + [self.mask_id] * len(mask_pos))
            positions.append(list(range(len(head))) + mask_pos)
            want.append((len(head), len(head) + len(mask_pos)))
            keep.append(len(head))
            row.prefilled = True
        logits = self.fwd.run([r.rid for r in rows], tokens, positions, cache, want)
        cache.advance(keep)  # the prompt stays, the MASK entries go
        plans = []
        for row, lg in zip(rows, logits):
            drafts = self.sampler.pick(lg[None], [row.rid])[0]  # (n*s,)
            conf = token_probs(lg, drafts)
            plans.append(Plan(drafts.view(-1, s), conf.view(-1, s)))
        return plans

    # ------------------------------------------------------------------ step 3
    def verify(self, rows: list[Row], plans: list[Plan], selections: list[list[int]], cache: KVCache) -> list[tuple[Row, list[int], list[list[int]], list[int]]]:
        """Global verification: feed the selected drafts in position order; commit the
        longest passing prefix if it ends in EOS or covers whole slots (fast path). Return
        the rows that must infill: (row, selected slot indices, drafts, passing prefixes)."""
        s = self.s
        tokens, positions, want = [], [], []
        for row, plan, sel in zip(rows, plans, selections):
            P = len(row.prompt)
            tokens.append(plan.drafts[sel].flatten().tolist())
            positions.append([P + row.undecoded[j] * s + i for j in sel for i in range(s)])
            want.append((0, len(sel) * s - 1))
        logits = self.fwd.run([r.rid for r in rows], tokens, positions, cache, want)
        advance, to_infill = [], []
        for row, plan, sel, toks, lg in zip(rows, plans, selections, tokens, logits):
            flat = torch.tensor(toks, device=lg.device)
            passing = torch.ones(len(toks), dtype=torch.bool, device=lg.device)
            passing[1:] = token_probs(lg, flat[1:]) > self.cfg.token_threshold
            passing.view(-1, s)[:, 0] = True  # a slot's first token keeps its plan confidence: it passes
            per_slot = passing.view(-1, s).int().cumprod(-1).sum(-1).tolist()  # passing prefix per slot
            prefix = int(passing.int().cumprod(0).sum())
            slots = [row.undecoded[j] for j in sel]
            eos = next((i for i in range(prefix) if toks[i] in self.eos_ids), None)
            if eos is not None:
                n_acc = eos + 1
                self._commit_fast(row, slots[: eos // s + 1], toks[:n_acc])
                row.drop_after(slots[eos // s])
                advance.append(n_acc)
            elif prefix >= s:
                k = prefix // s
                self._commit_fast(row, slots[:k], toks[: k * s])
                advance.append(k * s)
            else:
                advance.append(0)
                drafts = [toks[i * s : (i + 1) * s] for i in range(len(sel))]
                to_infill.append((row, slots, drafts, per_slot))
        cache.advance(advance)
        return to_infill

    def _commit_fast(self, row: Row, slots: list[int], toks: list[int]) -> None:
        s = self.s
        row.undecoded = [j for j in row.undecoded if j not in slots]
        spans = [(j * s, toks[i * s : (i + 1) * s]) for i, j in enumerate(slots)]
        self.progress.commit(row.rid, "fast", [sp for sp in spans if sp[1]])

    # ------------------------------------------------------------------ step 4
    def infill(self, rows: list[Row], to_infill, cache: KVCache) -> None:
        """Parallel autoregressive infilling: one forked row per selected slot, draft then
        verify until every slot is complete; then append each slot's own KV entries to
        its owner's row (KV reuse, no recomputation)."""
        index = {id(r): i for i, r in enumerate(rows)}
        forks: list[Fork] = []
        for row, slots, drafts, per_slot in to_infill:
            base = cache.lengths[index[id(row)]]
            forks += [Fork(row, j, list(d), a, base) for j, d, a in zip(slots, drafts, per_slot)]
        src_rows = [index[id(f.row)] for f in forks]
        # rows grow by < s, feeds are <= s; the scratch storage of the last step is reused
        fcache = self.forks = cache.select(src_rows, capacity=cache.used() + 2 * self.s, out=self.forks)
        while any(not f.complete for f in forks):
            self._infill_draft(forks, fcache)
            self._infill_verify(forks, fcache)
        self._commit_infill(forks, fcache, cache, index)

    def _feed(self, f: Fork, tail: list[int]) -> tuple[list[int], list[int]]:
        """Tokens and positions a fork feeds: its accepted tokens not yet cached, then tail."""
        P = len(f.row.prompt)
        toks = f.tokens[f.kept : f.accepted] + tail
        return toks, [P + f.slot * self.s + f.kept + i for i in range(len(toks))]

    def _infill_draft(self, forks: list[Fork], fcache: KVCache) -> None:
        tokens, positions, want = [], [], []
        for f in forks:
            # a complete fork, or one whose slot passed whole in step 3, has nothing to draft:
            # it feeds nothing (a packed forward spends no compute on its row)
            n_masks = 0 if f.complete else self.s - f.accepted
            toks, pos = self._feed(f, [self.mask_id] * n_masks) if n_masks else ([], [])
            tokens.append(toks)
            positions.append(pos)
            want.append((len(toks) - n_masks, len(toks)))
        logits = self.fwd.run([f.row.rid for f in forks], tokens, positions, fcache, want)
        for f, lg in zip(forks, logits):
            if not f.complete:
                f.tokens[f.accepted :] = self.sampler.pick(lg[None], [f.row.rid])[0].tolist()

    def _infill_verify(self, forks: list[Fork], fcache: KVCache) -> None:
        s, tau = self.s, self.cfg.token_threshold
        tokens, positions, want = [], [], []
        for f in forks:
            toks, pos = self._feed(f, f.tokens[f.accepted :]) if not f.complete else ([], [])
            tokens.append(toks)
            positions.append(pos)
            want.append((0, max(len(toks) - 1, 0)))
        logits = self.fwd.run([f.row.rid for f in forks], tokens, positions, fcache, want)
        advance = []
        for f, toks, lg in zip(forks, tokens, logits):
            if f.complete:
                advance.append(0)
                continue
            # entry i scores slot token kept+i+1; the first not-yet-accepted token always passes
            scores = token_probs(lg, torch.tensor(toks[1:], device=lg.device)).tolist()
            n = min(f.accepted + 1, s)
            while n < s and scores[n - f.kept - 1] > tau:
                n += 1
            f.accepted = n
            eos = next((i for i in range(n) if f.tokens[i] in self.eos_ids), None)
            if eos is not None:
                f.length, f.complete = eos + 1, True
                self._drop_later_forks(f, forks)
            elif n == s:
                f.length, f.complete = s, True
            keep = f.length if f.complete else n - 1  # the last accepted token is fed again
            advance.append(keep - f.kept)
            f.kept = keep
        fcache.advance(advance)

    @staticmethod
    def _drop_later_forks(f: Fork, forks: list[Fork]) -> None:
        f.row.drop_after(f.slot)
        for g in forks:
            if g.row is f.row and g.slot > f.slot:
                g.dropped = g.complete = True

    def _commit_infill(self, forks: list[Fork], fcache: KVCache, cache: KVCache, index: dict[int, int]) -> None:
        live = [(i, f) for i, f in enumerate(forks) if not f.dropped]  # position order within each row
        cache.append_from(
            fcache,
            src_rows=[i for i, _ in live],
            src_starts=[f.base for _, f in live],
            counts=[f.length for _, f in live],
            dst_rows=[index[id(f.row)] for _, f in live],
        )
        by_row: dict[int, list[Fork]] = {}
        for _, f in live:
            by_row.setdefault(id(f.row), []).append(f)
        for fs in by_row.values():
            row = fs[0].row
            done = {f.slot for f in fs}
            row.undecoded = [j for j in row.undecoded if j not in done]
            self.progress.commit(row.rid, "infill", [(f.slot * self.s, f.tokens[: f.length]) for f in fs])


def select_slots(plan: Plan, slot_threshold: float) -> list[int]:
    """Indices (into the undecoded list) of the slots whose first-token confidence exceeds
    the threshold, in position order; the single most confident one if none does."""
    first = plan.conf[:, 0]  # (n_undecoded,)
    chosen = (first > slot_threshold).nonzero().flatten().tolist()
    return chosen if chosen else [int(first.argmax())]
