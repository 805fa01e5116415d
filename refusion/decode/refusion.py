"""The ReFusion decoder (docs/algorithm.md): plan, select slots, verify, infill, commit.

Each step of a row decodes slots of its current block (the generation region is split
into `serial_blocks` blocks of slots, decoded left to right):
1. plan: one forward over a MASK for every undecoded slot of the block drafts each of
   its tokens, with the draft's probability as its confidence;
2. select_slots: the slots whose first-token confidence exceeds slot_threshold (the most
   confident one if none does);
3. verify: one causal forward over the selected drafts in position order scores each
   drafted token by its AR probability (a slot's first token keeps its plan confidence);
   the longest passing prefix (probability > token_threshold) is committed if it covers
   whole slots or ends in EOS;
4. infill: otherwise each selected slot gets its own fork of the committed cache and is
   completed by parallel AR infilling: draft the rest of the slot from MASKs, verify the
   drafts (the first not-yet-accepted token passes, then every one that scores above the
   threshold), until the slot is whole or ends in EOS;
5. commit: each slot's KV entries, computed by its fork, are appended to its row (KV
   reuse, no recomputation); an EOS ends the row after its block.

Rows of any settings step together: one batched forward plans every ReFusion row (AR
rows of the same cache take a token in it), one verifies them, then the rows that need
it infill together (one row of the forward per selected slot). Each row's decisions
depend only on its own logits and its own settings (slot size, thresholds, sampler), so
a batch decodes exactly what each request would decode alone.

The decoding options beyond the paper (`options.py`) change this rule at a few points;
there the decoder asks the row's `rule`, and `PaperRule` answers as the paper does, which
is exact against the authors' decoder.

Generation offsets: position `P + i` of a prompt of length P is offset `i`; slot j of the
region covers offsets j*s .. j*s+s-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.kv_cache import KVCache
from .forward import Forward
from .options import PaperRule, rule_for
from .request import Request
from .rows import Feed
from .sampling import token_probs
from .widths import Acceptance, equals_greedy_ar


@dataclass
class Plan:
    """The plan step's drafts for one row: per undecoded slot, tokens and their confidences."""

    drafts: torch.Tensor  # (n_undecoded, s) int64
    conf: torch.Tensor  # (n_undecoded, s) float32


@dataclass
class Fork:
    """One selected slot in parallel AR infilling: its own copy of the committed cache."""

    row: ReFusionRow
    slot: int
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


@dataclass
class ReFusionRow:
    """One request's state: which slots of the current block are still undecoded, and
    what this step's plan and verification left to infill."""

    req: Request
    undecoded: list[int] = field(default_factory=list)  # slot indices of the current block, ascending
    block: int = 0
    # committed tokens whose KV entries are not cached yet, from position `pending_at`: the
    # prompt before the first step; after an AR block (`ar_block`), its last token
    pending: list[int] = field(default_factory=list)
    pending_at: int = 0
    ends_after_block: bool = False  # an EOS was committed: finish this block, then stop
    done: bool = False
    plan: Plan | None = None
    selected: list[int] = field(default_factory=list)  # indices into `undecoded` chosen by the plan
    chunks: list[list[int]] = field(default_factory=list)  # the selected slots' drafts (verify_feed)
    # slots, drafts, passing prefixes, and (when tracing) how each token of those prefixes passed
    to_infill: tuple[list[int], list[list[int]], list[int], list[list[str]] | None] | None = None
    # when tracing: slot -> how the plan step set its first token
    first_how: dict[int, str] = field(default_factory=dict)
    # when tracing: committed slot -> it was decided in AR's own context
    exact: dict[int, bool] = field(default_factory=dict)
    # draft widths the engine sets each step when they cannot change the output
    # (docs/algorithm.md#adaptive-widths): MASKs the plan drafts per slot (0: the whole slot),
    # and where the row's verify passes are counted
    width: int = 0
    mask_id: int = (
        0  # the model's MASK: what the plan feeds, and the undrafted rest of a slot under a narrower plan
    )
    acceptance: Acceptance | None = None
    # the current block decoded as AR decoding would, a token per forward (`ar_feed`), when
    # that commits more tokens per second than drafting; `ar_next`: its next offset
    ar_block: bool = False
    ar_next: int = 0

    def __post_init__(self) -> None:
        cfg = self.req.cfg
        self.s, self.tau = cfg.slot_size, cfg.token_threshold
        self.rule: PaperRule = rule_for(cfg)
        self.n_blocks = cfg.serial_blocks
        self.slots_per_block = cfg.slots_per_block
        self.undecoded = self._block_slots(0)
        self.pending = list(self.req.prompt)

    stops_early = True  # finished once its output is final (EOS or gen_length), whatever slots are left
    verifies = True  # every step runs its global verification forward

    def set_widths(self, plan: int, window: int) -> None:
        """This step's plan width (MASKs per slot) and infilling window (0: one AR token per
        round). Only for rows whose output cannot depend on them (`widths.widths_keep_output`):
        one slot per block, so a narrower plan drafts a prefix of its only slot."""
        self.width = plan if plan < self.s else 0
        self.rule.window = window

    # ------------------------------------------------------------------ AR blocks
    def can_start_ar_block(self) -> bool:
        """At the start of a block, whether the AR prediction of its first token is at hand:
        the prompt or a pending token to feed, or the logits the first-token check kept."""
        fresh = self.undecoded == self._block_slots(self.block) and not self.ar_block
        return fresh and bool(self.pending or self.undecoded[0] in self.rule.lookahead)

    def start_ar_block(self) -> None:
        """Decode this block a token per forward. Its first token is the AR prediction
        the first-token check kept when nothing is pending to feed."""
        self.ar_block, self.ar_next, self.to_infill = True, self.block * self.s, None
        self.req.stats.ar_blocks += 1
        if not self.pending:
            logits = self.rule.lookahead.pop(self.undecoded[0])
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
            self.rule.committed(self, [slot])
            if self.req.tracing:  # decoded left to right: in AR's context if everything to its left was
                self.exact[slot] = all(self.exact.get(k, False) for k in range(slot))

    def _block_slots(self, block: int) -> list[int]:
        return list(range(block * self.slots_per_block, (block + 1) * self.slots_per_block))

    def drop_after(self, slot: int) -> None:
        """An EOS was accepted in `slot`: slots at later positions will never be decoded."""
        self.undecoded = [j for j in self.undecoded if j < slot]
        self.ends_after_block = True

    def infills(self) -> bool:
        return self.to_infill is not None

    @property
    def drafting(self) -> bool:
        return not self.ar_block

    @property
    def adaptive(self) -> bool:
        return self.acceptance is not None and not self.ar_block

    def fed_per_forward(self) -> int:
        return 1 if self.ar_block else self.s

    def end_step(self) -> None:
        self.next_block_if_complete()

    def next_block_if_complete(self) -> None:
        if self.undecoded:
            return
        self.block, self.ar_block = self.block + 1, False
        if self.ends_after_block or self.block == self.n_blocks:
            self.done = True
        else:
            self.undecoded = self._block_slots(self.block)

    def commit(
        self, path: str, slots: list[int], toks: list[list[int]], how: list[list[str]] | None = None
    ) -> None:
        """Slots (indices into the region, in position order) leave the undecoded list;
        their tokens are final. `how` (when tracing): how each token was accepted."""
        exact = self._exact(path, slots) if self.req.tracing else None
        gone = set(slots)
        self.undecoded = [j for j in self.undecoded if j not in gone]
        self.rule.committed(self, slots)
        keep = [i for i, t in enumerate(toks) if t]
        spans = [(slots[i] * self.s, toks[i]) for i in keep]
        if exact is None:
            self.req.commit(path, spans)
        else:
            self.req.commit(path, spans, [how[i] for i in keep], [exact[i] for i in keep])

    def _exact(self, path: str, slots: list[int]) -> list[bool]:
        """Per slot: was its context exactly AR's, every slot to its left final (committed
        in an exact context itself) and in it, and none to its right? Global verification
        decided each slot after the ones fed before it; an infilling fork saw the committed
        ones only. `self.exact` holds every committed slot."""
        out = []
        for i, j in enumerate(slots):  # position order: slots[:i] are to the left of j
            left = all(self.exact.get(k, False) for k in range(j))
            right = any(k > j for k in self.exact)  # committed before, at a later position
            ok = (path == "fast" or i == 0) and left and not right
            self.exact[j] = ok
            out.append(ok)
        return out

    # ------------------------------------------------------------------ step 1: plan
    def plan_feed(self) -> Feed:
        """MASK for every undecoded slot of the block, after the pending tokens (the prompt
        on the first step, the last token of an AR block); in an AR block, its next token."""
        if self.ar_block:
            return self.ar_feed()
        P, s, w = len(self.req.prompt), self.s, self.width or self.s
        head, at = self.pending, self.pending_at
        mask_pos = [P + j * s + i for j in self.undecoded for i in range(w)]
        self.pending = []
        stats = self.req.stats
        stats.draft_steps += 1
        stats.plan_width_sum += w
        stats.window_sum += self.rule.window
        start = len(head) - self.rule.plan_head(bool(head), self.undecoded[0])
        return Feed(
            head + [self.mask_id] * len(mask_pos),
            list(range(at, at + len(head))) + mask_pos,
            (start, len(head) + len(mask_pos)),
        )

    def take_plan(self, logits: torch.Tensor, feed: Feed) -> int:
        """Draft every masked position and select the slots to verify (step 2); returns
        the entries kept: the prompt stays, the MASK entries go. In an AR block: its token."""
        if self.ar_block:
            return self.take_ar(logits)
        logits = self.rule.take_plan_head(logits)  # (n*w, V): the MASKs'
        w = self.width or self.s
        drafts = self.req.sampler.pick(logits).view(-1, w)  # (n, w)
        conf = token_probs(logits, drafts.flatten()).view(-1, w)
        if w < self.s:  # a narrower plan: the undrafted rest of the slot stays MASK, confidence 0
            drafts = torch.nn.functional.pad(drafts, (0, self.s - w), value=self.mask_id)
            conf = torch.nn.functional.pad(conf, (0, self.s - w))
        self.plan = Plan(drafts, conf)
        self.selected = select_slots(self.plan, self.req.cfg.slot_threshold)
        self.rule.select(self)
        if self.req.traces_steps:
            self.req.note(
                "plan",
                [(self.undecoded[i] * self.s, self.plan.drafts[i, :w].tolist()) for i in self.selected],
            )
        before = self.plan.drafts[self.selected, 0].tolist() if self.req.tracing else None
        checked = self.rule.check_selected(self)
        if before is not None:
            self._trace_first_tokens(before, checked)
        return len(feed.tokens) - logits.shape[0]

    def _trace_first_tokens(self, before: list[int], checked: list[int]) -> None:
        """When tracing: how the plan step left each selected slot's first token (checked
        against its left neighbour's AR prediction, or replaced by it)."""
        self.first_how = {}
        for i, old in zip(self.selected, before):
            if int(self.plan.drafts[i, 0]) != old:
                self.first_how[self.undecoded[i]] = "corrected"
            elif i in checked:
                self.first_how[self.undecoded[i]] = "verify"

    def _trace_verified(self, slots: list[int], per_slot: list[int]) -> list[list[str]]:
        """When tracing: how global verification passed each selected slot's tokens, up to
        its passing prefix (`per_slot`, before a slot keeps its first token regardless)."""
        scored = self.rule.first_scored(slots)
        how = []
        for j, sc, n in zip(slots, scored, per_slot):
            first = self.first_how.get(j) or ("verify" if sc and n > 0 else "plan")
            how.append([first] + ["verify"] * (max(n, 1) - 1))
        return how

    def ends(self, toks: list[int]) -> int | None:
        """The index of the first EOS in `toks` (None: there is none)."""
        return next((i for i, t in enumerate(toks) if t in self.req.eos_ids), None)

    # ------------------------------------------------------------------ step 3: verify
    def verify_feed(self) -> Feed:
        """The selected drafts in position order, the last slot's up to its first EOS: no
        token after it can be committed from this pass. In an AR block, its next token
        (None: the block is complete)."""
        if self.ar_block:
            return self.ar_feed()
        P, s, sel = len(self.req.prompt), self.s, self.selected
        self.chunks = self.plan.drafts[sel].tolist()  # read from the plan once a step
        w = self.width or s  # a narrower plan: one slot, of which the first w tokens are drafted
        toks = [t for chunk in self.chunks for t in chunk[:w]]
        eos = self.ends(toks[(len(sel) - 1) * s :])
        if eos is not None:
            toks = toks[: (len(sel) - 1) * s + eos + 1]
        positions = [P + self.undecoded[j] * s + i for j in sel for i in range(s)][: len(toks)]
        # the logits that score the fed tokens (each token's predict the next), and any the rule reads
        # past them
        return Feed(toks, positions, (0, len(toks) - 1 + self.rule.global_next))

    def take_verify(self, logits: torch.Tensor, feed: Feed) -> int:
        """Global verification: commit the longest passing prefix if it ends in EOS or
        covers whole slots (fast path), else leave the slots to infill; returns the
        entries kept. In an AR block: its token."""
        if self.ar_block:
            return self.take_ar(logits)
        toks = feed.tokens
        s, sel = self.s, self.selected
        slots = [self.undecoded[j] for j in sel]
        passing = self._passing(logits, toks, slots)  # (n_sel * s,)
        passed = [leading(passing[i : i + s]) for i in range(0, len(passing), s)]  # passing prefix per slot
        how = self._trace_verified(slots, passed) if self.req.tracing else None
        per_slot = [max(n, 1) for n in passed]  # a slot keeps at least its first token, the plan's draft
        prefix = leading(passing)
        if self.acceptance is not None:  # the drafts scored past the first token, and how many passed
            self.acceptance.plan.add(max(prefix - 1, 0), len(toks) - 1)
        chunks = self.chunks  # whole slots, also past an EOS the feed stopped at
        self.to_infill = None
        eos = self.ends(toks[:prefix])
        if eos is not None:
            k = eos // s + 1
            cut = eos + 1 - (k - 1) * s
            if how is not None:
                how[k - 1] = how[k - 1][:cut]
            done = chunks[: k - 1] + [chunks[k - 1][:cut]]
            n = self.rule.split(self, "fast", slots[:k], done)  # the rule holds the others
            if n < k:  # the EOS's slot is held: the slots committed are whole, and the row goes on
                self.rule.whole_slots_verified(slots[:n], logits, range(s - 1, n * s, s))
                self.commit("fast", slots[:n], done[:n], how)
                return n * s
            self.commit("fast", slots[:n], done[:n], how)
            self.drop_after(slots[k - 1])
            return eos + 1
        if prefix >= s:
            k = self.rule.split(self, "fast", slots[: prefix // s], chunks[: prefix // s])
            self.rule.whole_slots_verified(slots[:k], logits, range(s - 1, k * s, s))
            self.commit("fast", slots[:k], chunks[:k], how)
            refill = self.rule.refill(self, logits, slots, chunks, passed, k)
            kept = 0  # drafts of slots[k] that stay
            if refill is not None:  # the slot fed after the committed ones is filled again in this step
                kept, corrected = refill
                h = (
                    None
                    if how is None
                    else [how[k][: kept - 1] + ["corrected"] if corrected else how[k][:kept]]
                )
                self.to_infill = ([slots[k]], [chunks[k]], [kept], h)
            self.reject(
                [
                    (j, chunk[: self.width or s], kept * (i == 0))
                    for i, (j, chunk) in enumerate(zip(slots[k:], chunks[k:]))
                ]
            )
            return k * s
        first = per_slot[0]
        self.rule.before_infill(self, logits, chunks, per_slot)
        if how is not None and per_slot[0] > first:  # the rule corrected the first slot's failing token
            how[0] = how[0][:first] + ["corrected"]
        # a narrower plan drafted only the first `width` tokens of a slot: the rest are MASKs
        self.reject([(j, chunk[: self.width or s], n) for j, chunk, n in zip(slots, chunks, per_slot)])
        fill = [i for i, w in enumerate(self.rule.waits(self, slots)) if not w]
        self.to_infill = (
            [slots[i] for i in fill],
            [chunks[i] for i in fill],
            [per_slot[i] for i in fill],
            None if how is None else [how[i] for i in fill],
        )
        return 0

    def _passing(self, logits: torch.Tensor, toks: list[int], slots: list[int]) -> list[bool]:
        """Per token of the selected slots, in feed order: whether global verification
        passes it. A fed token passes when its AR probability exceeds token_threshold; a
        slot's first token that the pass does not score (`rule.first_scored`) passes on the
        plan confidence that selected it; the unfed tail fails. One read of the scores."""
        target = torch.tensor(toks[1:], dtype=torch.long, device=logits.device)
        scored = (token_probs(logits[: len(toks) - 1], target) > self.tau).tolist()
        passing = [False, *scored] + [False] * (len(slots) * self.s - len(toks))
        for i, by_score in enumerate(self.rule.first_scored(slots)):
            if not by_score:
                passing[i * self.s] = True
        return passing

    def reject(self, drafts: list[tuple[int, list[int], int]]) -> None:
        """Note, when the trace wants the steps, the drafts of slots that are dropped:
        (slot, its drafts, how many of them stay)."""
        if self.req.traces_steps:
            spans = [(j * self.s + n, toks[n:]) for j, toks, n in drafts]
            self.req.note("rejected", [(at, toks) for at, toks in spans if toks])


def select_slots(plan: Plan, slot_threshold: float) -> list[int]:
    """Indices (into the undecoded list) of the slots whose first-token confidence exceeds
    the threshold, in position order; the single most confident one if none does."""
    first = plan.conf[:, 0]  # (n_undecoded,)
    chosen = [i for i, over in enumerate((first > slot_threshold).tolist()) if over]
    return chosen if chosen else [int(first.argmax())]


def leading(flags: list[bool]) -> int:
    """How many of `flags`, from the first, are True."""
    return next((i for i, f in enumerate(flags) if not f), len(flags))


class Infill:
    """Step 4, parallel autoregressive infilling, for every row that needs it: one forked
    cache row per selected slot, draft then verify until every slot is complete; then each
    slot's own KV entries are appended to its owner's row (KV reuse, no recomputation).
    The fork cache is scratch storage kept from step to step."""

    def __init__(self, fwd: Forward, mask_id: int) -> None:
        self.fwd, self.mask_id = fwd, mask_id
        self.scratch: KVCache | None = None

    def __call__(self, rows: list[ReFusionRow], index: list[int], cache: KVCache) -> None:
        """`rows` need infilling; `index[i]` is rows[i]'s row in `cache`."""
        forks: list[Fork] = []
        src_rows: list[int] = []
        for row, b in zip(rows, index):
            slots, drafts, per_slot, how = row.to_infill
            hows = how if how is not None else [None] * len(slots)
            forks += [
                Fork(row, j, list(d), a, cache.lengths[b], how=h)
                for j, d, a, h in zip(slots, drafts, per_slot, hows)
            ]
            src_rows += [b] * len(slots)
        widest = max(r.s for r in rows)
        # rows grow by < s, feeds are <= s; the scratch storage of the last step is reused
        fcache = self.scratch = cache.select(src_rows, capacity=cache.used() + 2 * widest, out=self.scratch)
        first = [self._plan_drafts_first(f) for f in forks]
        if any(first):
            self._verify(forks, fcache, only=first)
        while any(not f.complete for f in forks):
            self._draft(forks, fcache)
            self._verify(forks, fcache)
        self._commit(forks, fcache, cache, src_rows)

    @staticmethod
    def _plan_drafts_first(f: Fork) -> bool:
        """Whether the fork's first round verifies the plan's own drafts past its accepted
        prefix (up to a window of them) instead of drafting afresh: one forward instead of
        two. The plan drafted them from MASKs, so the token that failed global verification
        never conditioned them, and they often still pass after its correction. Only for
        rows whose output cannot depend on which drafts are verified (`equals_greedy_ar`:
        every accepted token is the AR argmax, and each round accepts one at least)."""
        if not equals_greedy_ar(f.row.req.cfg) or f.row.ends(f.tokens[: f.accepted]) is not None:
            return False
        tail = f.tokens[f.accepted : f.accepted + f.row.rule.window]
        if f.row.mask_id in tail:  # a narrower plan left the rest of the slot undrafted
            tail = tail[: tail.index(f.row.mask_id)]
        eos = f.row.ends(tail)  # drafts after an EOS are never verified
        f.drafted, f.head = f.accepted + (len(tail) if eos is None else eos + 1), None
        return f.drafted > f.accepted

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
            toks, pos = self._feed(f, [self.mask_id] * n_masks) if n_masks else ([], [])
            tokens.append(toks)
            positions.append(pos)
            # the last accepted token's logits too: they score the first draft in the verify pass
            want.append((len(toks) - n_masks - 1, len(toks)) if n_masks else (0, 0))
        if not any(tokens):  # no fork drafts this round (a window of 0, or every slot final): no forward
            for f in forks:
                f.drafted, f.head = f.accepted, None
            return
        logits = self.fwd.run([f.row.req for f in forks], tokens, positions, fcache, want)
        advance = []
        for f, lg in zip(forks, logits):
            f.drafted, f.head = f.accepted, None
            advance.append(0)
            if lg.shape[0]:
                # the accepted tokens this pass fed (causal: the MASKs after them do not
                # touch their entries) stay cached, so the verify pass feeds only drafts
                advance[-1], f.kept, f.head, lg = f.accepted - f.kept, f.accepted, lg[0].clone(), lg[1:]
                drafts = f.row.req.sampler.pick(lg).tolist()
                f.tokens[f.accepted : f.accepted + len(drafts)] = drafts
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
        logits = self.fwd.run([f.row.req for f in forks], tokens, positions, fcache, want)
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
        scores = token_probs(
            pred[: len(targets)], torch.tensor(targets, dtype=torch.long, device=lg.device)
        ).tolist()
        n, corrected = f.row.rule.passing(f, pred, off, scores)
        if f.how is not None:
            f.how = f.how[: f.accepted] + [
                _infill_how(i, corrected, scores[i - off] if 0 <= i - off < len(scores) else None, f.row.tau)
                for i in range(f.accepted, n)
            ]
        if f.row.req.traces_steps:
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
    def _drop_later_forks(f: Fork, forks: list[Fork]) -> None:
        f.row.drop_after(f.slot)
        for g in forks:
            if g.row is f.row and g.slot > f.slot:
                g.dropped = g.complete = True

    @staticmethod
    def _commit(forks: list[Fork], fcache: KVCache, cache: KVCache, owner: list[int]) -> None:
        """Each row's complete slots that its rule commits (`split`; it holds the others)
        get their fork's entries appended, in position order."""
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
            src_rows=[i for i, _ in live],
            src_starts=[f.base for _, f in live],
            counts=[f.length for _, f in live],
            dst_rows=[owner[i] for i, _ in live],
        )
        for fs in filter(None, done):
            row = fs[0][1].row
            how = [f.how[: f.length] for _, f in fs] if row.req.tracing else None
            row.commit("infill", [f.slot for _, f in fs], [f.tokens[: f.length] for _, f in fs], how)


def _infill_how(i: int, corrected: int | None, score: float | None, tau: float) -> str:
    """How an infilling verify pass accepted slot token i (request.HOW)."""
    if i == corrected:
        return "corrected"
    return "infill" if score is not None and score > tau else "infill-first"
