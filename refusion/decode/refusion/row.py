"""One request decoded by ReFusion (docs/algorithm.md#decoding): the paper's steps.

Each step of a row decodes slots of its current block (the generation region is split
into `serial_blocks` blocks of slots, decoded left to right):

1. plan: one forward over a MASK for every undecoded slot of the block drafts each of its
   tokens, with the draft's probability as its confidence;
2. select_slots: the slots whose first-token confidence exceeds slot_threshold (the most
   confident one if none does);
3. verify: one causal forward over the selected drafts in position order scores each
   drafted token by its AR probability (a slot's first token keeps its plan confidence);
   the longest passing prefix (probability > token_threshold) is committed if it covers
   whole slots or ends in EOS;
4. infill (`infill.py`): otherwise each selected slot gets its own fork of the committed
   cache and is completed by parallel AR infilling;
5. commit: each slot's KV entries, computed by its fork, are appended to its row (KV
   reuse, no recomputation); an EOS ends the row after its block.

Where an option beyond the paper departs from this, the step asks the row's `rule`
(`rule.py`); what the row drafts (widths, AR blocks) is `drafting.py`'s; what it records
for a trace is its observer's (`provenance.py`). Each row's decisions depend only on its
own logits and settings, so a batch decodes exactly what each request decodes alone.

Generation offsets: position `P + i` of a prompt of length P is offset `i`; slot j of the
region covers offsets j*s .. j*s+s-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..request import Request
from ..rows import Feed
from ..sampling import token_probs
from ..widths import RowAcceptance, drafts_keep_output
from .drafting import DraftingRow
from .judge import judge_for
from .provenance import trace_of
from .rule import Rule


@dataclass
class Plan:
    """The plan step's drafts for one row: per undecoded slot, tokens and their confidences;
    for a speculative verification (`judge.Speculative`) also the probability each was
    drawn with and the logits it was drawn from."""

    drafts: torch.Tensor  # (n_undecoded, s) int64
    conf: torch.Tensor  # (n_undecoded, s) float32
    q: torch.Tensor | None = None  # (n_undecoded, w) float64: q(draft)
    logits: torch.Tensor | None = None  # (n_undecoded * w, V): the MASKs' logits

    def q_logits(self, i: int, t: int) -> torch.Tensor | None:
        """The logits (V,) slot i's draft at position t was drawn from (None: not recorded,
        or nothing was drafted there)."""
        if self.q is None or self.logits is None or t >= self.q.shape[1]:
            return None
        return self.logits[i * self.q.shape[1] + t]

    def q_of(self, i: int, s: int) -> tuple[list[float | None], list[torch.Tensor | None]]:
        """Slot i's drafts' q(x) and logits rows, per position of its s (None past the
        drafted width, and without a speculative verification)."""
        if self.q is None:
            return [None] * s, [None] * s
        w = self.q.shape[1]
        return [*self.q[i].tolist(), *[None] * (s - w)], [self.q_logits(i, t) for t in range(s)]


@dataclass
class ToInfill:
    """What global verification leaves to this step's infilling: slots, their drafts, how
    many tokens of each are accepted, and (when tracing) how each of those was."""

    slots: list[int]
    drafts: list[list[int]]
    accepted: list[int]
    how: list[list[str]] | None
    index: list[int]  # each slot's index into the row's undecoded list (its plan drafts)


@dataclass
class Verified:
    """One global verification of the selected slots (feed order = position order)."""

    slots: list[int]
    toks: list[int]  # what was fed
    passed: list[int]  # per slot, its passing prefix
    prefix: int  # the passing prefix of the whole feed
    how: list[list[str]] | None  # when tracing: how each passing token passed


def select_slots(plan: Plan, slot_threshold: float) -> list[int]:
    """Indices (into the undecoded list) of the slots whose first-token confidence exceeds
    the threshold, in position order; the single most confident one if none does."""
    first = plan.conf[:, 0]  # (n_undecoded,)
    chosen = [i for i, over in enumerate((first > slot_threshold).tolist()) if over]
    return chosen if chosen else [int(first.argmax())]


def leading(flags: list[bool]) -> int:
    """How many of `flags`, from the first, are True."""
    return next((i for i, f in enumerate(flags) if not f), len(flags))


@dataclass
class ReFusionRow(DraftingRow):
    """One request's state: which slots of the current block are still undecoded, and
    what this step's plan and verification left to infill."""

    req: Request
    mask_id: int = 0  # the model's MASK: what the plan feeds (and a narrower plan leaves)
    undecoded: list[int] = field(default_factory=list)  # slot indices of the current block, ascending
    block: int = 0
    # committed tokens whose KV entries are not cached yet, from position `pending_at`: the
    # prompt before the first step; after an AR block, its last token
    pending: list[int] = field(default_factory=list)
    pending_at: int = 0
    ends_after_block: bool = False  # an EOS was committed: finish this block, then stop
    done: bool = False
    plan: Plan = field(default_factory=lambda: Plan(torch.empty(0, 0, dtype=torch.long), torch.empty(0, 0)))
    selected: list[int] = field(default_factory=list)  # indices into `undecoded` chosen by the plan
    chunks: list[list[int]] = field(default_factory=list)  # the selected slots' drafts (verify_feed)
    to_infill: ToInfill | None = None
    # draft widths the engine sets each step when they cannot change the output (drafting.py):
    # MASKs the plan drafts per slot (0: the whole slot), and where verify passes are counted
    width: int = 0
    acceptance: RowAcceptance | None = None
    ar_block: bool = False  # the current block is decoded as AR decoding would (drafting.py)
    ar_next: int = 0  # its next offset
    planned: bool = False  # its plan awaits its verification (a joining row plans in a step of its own)
    prefilling: bool = False  # it joins by feeding its prompt alone (`join_feed`)

    stops_early = True  # finished once its output is final (EOS or gen_length), whatever slots are left
    verifies = True  # every step runs its global verification forward

    def __post_init__(self) -> None:
        cfg = self.req.cfg
        self.s, self.tau = cfg.slot_size, cfg.token_threshold
        self.rule = Rule(cfg)
        self.judge = judge_for(cfg, self.req.sampler)
        self.trace = trace_of(self.req, self.mask_id, self.tau)
        self.n_blocks, self.slots_per_block = cfg.serial_blocks, cfg.slots_per_block
        self.undecoded = self.block_slots(0)
        self.pending = list(self.req.prompt)

    # ------------------------------------------------------------------ step 1: plan
    def plan_feed(self) -> Feed | None:
        """MASK for every undecoded slot of the block, after the pending tokens (the prompt
        on the first step, the last token of an AR block); in an AR block, its next token."""
        if self.ar_block:
            return self.ar_feed()
        if self.planned:  # it planned in the step it joined in: it verifies now
            return None
        P, s, w = len(self.req.prompt), self.s, self.plan_width
        head, at = self.pending, self.pending_at
        mask_pos = [P + j * s + i for j in self.undecoded for i in range(w)]
        self.pending = []
        self._count_draft_step(w)
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
        self.plan = self._draft(logits)
        self.selected = select_slots(self.plan, self.req.cfg.slot_threshold)
        self.rule.select(self)
        if self.trace.steps:
            w = self.plan_width
            self.trace.planned(
                [(self.undecoded[i] * self.s, self.plan.drafts[i, :w].tolist()) for i in self.selected]
            )
        before = self.plan.drafts[self.selected, 0].tolist() if self.trace.wants_first_tokens else None
        checked = set(self.rule.check_selected(self))
        if before is not None:
            after = self.plan.drafts[self.selected, 0].tolist()
            slots = [self.undecoded[i] for i in self.selected]
            self.trace.first_tokens(slots, before, after, [i in checked for i in self.selected])
        self.planned = True
        self._commit_first_token(checked)
        return len(feed.tokens) - logits.shape[0]

    @property
    def joining(self) -> bool:
        return not self.pending_at and bool(self.pending)  # its prompt, not yet fed

    # ------------------------------------------------------------------ joining a running batch
    def join_feed(self, running: bool) -> Feed | None:
        """What it feeds the step it joins in: its plan, or, when it joins rows already
        running and its first token is final at the prompt's end (`prefills_alone`), its
        prompt alone, a forward as short as an AR row's join, so that its first token
        streams as soon as AR's would; its first plan is then the batch's next
        (docs/algorithm.md#joining)."""
        if not (running and self.prefills_alone):
            return self.plan_feed()
        self.prefilling = True
        n = len(self.pending)
        return Feed(self.pending, list(range(n)), (n - 1, n))

    @property
    def prefills_alone(self) -> bool:
        """Greedy and lossless, outside an AR block: the AR argmax at the prompt's last token
        is its first token, whatever the plan drafts (the first-token check makes it so)."""
        cfg = self.req.cfg
        return not self.ar_block and cfg.greedy and drafts_keep_output(cfg)  # lossless: the check is on

    def take_join(self, logits: torch.Tensor, feed: Feed) -> int:
        """Its logits of the step it joined in: the plan's (`take_plan`), or, having fed its
        prompt alone, the AR prediction at its last token (1, V), kept for its first plan's
        first-token check and committed as its first token; returns the entries kept."""
        if not self.prefilling:
            return self.take_plan(logits, feed)
        self.prefilling = False
        self.pending, self.pending_at = [], len(feed.tokens)
        self.rule.keep_lookahead(self.undecoded[0], logits[0])
        self._commit_first(int(self.req.sampler.pick(logits)[0]))
        return len(feed.tokens)

    def _commit_first_token(self, checked: set[int]) -> None:
        """On a lossless row's first plan, the generation's first token is final once the
        first-token check has it (the AR prediction read at the prompt's last token, or the
        draft that passed against it: speculative sampling when sampled): it is committed
        now, so that it streams after the forward that prefilled the prompt (`Engine`:
        the step a request joins in is that forward), and its slot commits it again with
        the rest; a trace records it then, once, with its slot (so a traced request whose
        first token ends it, which no slot would commit again, waits for its slot)."""
        first = self.block == 0 and self.selected[:1] == [0] and self.undecoded[:1] == [0]
        if first and 0 in checked and drafts_keep_output(self.req.cfg):
            self._commit_first(int(self.plan.drafts[0, 0]))

    def _commit_first(self, tok: int) -> None:
        """The generation's first token is final: committed now, unless a traced request's
        first token ends it (its slot records it then)."""
        if self.req.tracing and (tok in self.req.eos_ids or self.req.cfg.gen_length == 1):
            return
        self.req.commit("fast", [(0, [tok])], record=False)

    def _draft(self, logits: torch.Tensor) -> Plan:
        """Each masked position's draft and its probability; a narrower plan's undrafted
        rest of the slot stays MASK, confidence 0."""
        w = self.plan_width
        flat, q = self.req.sampler.draw(logits)
        drafts = flat.view(-1, w)  # (n, w)
        conf = token_probs(logits, flat).view(-1, w)
        if w < self.s:
            drafts = torch.nn.functional.pad(drafts, (0, self.s - w), value=self.mask_id)
            conf = torch.nn.functional.pad(conf, (0, self.s - w))
        if not self.judge.records_q or q is None:
            return Plan(drafts, conf)
        return Plan(drafts, conf, q.view(-1, w), logits)

    def _count_draft_step(self, w: int) -> None:
        stats = self.req.stats
        stats.draft_steps += 1
        stats.plan_width_sum += w
        stats.window_sum += self.rule.window

    # ------------------------------------------------------------------ step 3: verify
    def verify_feed(self) -> Feed | None:
        """The selected drafts in position order, the last slot's up to its first EOS: no
        token after it can be committed from this pass. In an AR block, its next token
        (None: the block is complete)."""
        if self.ar_block:
            return self.ar_feed()
        if not self.planned:  # it joined by its prompt alone: its first plan is the next
            return None
        P, s, sel = len(self.req.prompt), self.s, self.selected
        self.chunks = self.plan.drafts[sel].tolist()  # read from the plan once a step
        w = self.plan_width  # a narrower plan: one slot, of which the first w tokens are drafted
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
        self.planned = False
        v = self._verify(logits, feed.tokens)
        self.to_infill = None
        eos = self.ends(v.toks[: v.prefix])
        if eos is not None:
            return self._commit_to_eos(v, eos, logits)
        if v.prefix >= self.s:
            return self._commit_whole_slots(v, logits)
        self._leave_to_infill(v, logits)
        return 0

    def _verify(self, logits: torch.Tensor, toks: list[int]) -> Verified:
        """Score the fed drafts: per slot its passing prefix, and the whole feed's."""
        s = self.s
        slots = [self.undecoded[j] for j in self.selected]
        passing = self._passing(logits, toks, slots)  # (n_sel * s,)
        passed = [leading(passing[i : i + s]) for i in range(0, len(passing), s)]
        how = self.trace.verified(slots, passed, self.rule.first_scored(slots))
        prefix = leading(passing)
        if self.acceptance is not None:  # the drafts scored past the first token, and how many passed
            self.acceptance.plan.add(max(prefix - 1, 0), len(toks) - 1)
        return Verified(slots, toks, passed, prefix, how)

    def _passing(self, logits: torch.Tensor, toks: list[int], slots: list[int]) -> list[bool]:
        """Per token of the selected slots, in feed order: whether global verification
        passes it. A fed token passes as the row's judge says (`judge.py`: the paper's, when
        its AR probability exceeds token_threshold); a
        slot's first token that the pass does not score (`rule.first_scored`) passes on the
        plan confidence that selected it; the unfed tail fails. One read of the scores."""
        target = torch.tensor(toks[1:], dtype=torch.long, device=logits.device)
        q = self._q_fed(len(toks))
        scored = self.judge.passes(logits[: len(toks) - 1], target, None if q is None else q[1:])
        passing = [False, *scored] + [False] * (len(slots) * self.s - len(toks))
        for i, by_score in enumerate(self.rule.first_scored(slots)):
            if not by_score:
                passing[i * self.s] = True
        return passing

    def _q_fed(self, n: int) -> torch.Tensor | None:
        """q(x) (n,) of the first n tokens global verification feeds (None: not recorded)."""
        q = self.plan.q
        return None if q is None else q[self.selected].flatten()[:n]

    def _commit_to_eos(self, v: Verified, eos: int, logits: torch.Tensor) -> int:
        """The passing prefix holds an EOS: the slots up to it are committed, the EOS's
        slot cut after it, and the later ones dropped (unless the rule holds its slot)."""
        s, slots, how = self.s, v.slots, v.how
        k = eos // s + 1
        cut = eos + 1 - (k - 1) * s
        if how is not None:
            how[k - 1] = how[k - 1][:cut]
        done = self.chunks[: k - 1] + [self.chunks[k - 1][:cut]]
        n = self.rule.split(self, "fast", slots[:k], done)  # the rule holds the others
        if n < k:  # the EOS's slot is held: the slots committed are whole, and the row goes on
            self.rule.whole_slots_verified(slots[:n], logits, range(s - 1, n * s, s))
            self.commit("fast", slots[:n], done[:n], how)
            return n * s
        self.commit("fast", slots[:n], done[:n], how)
        self.drop_after(slots[k - 1])
        return eos + 1

    def _commit_whole_slots(self, v: Verified, logits: torch.Tensor) -> int:
        """The passing prefix covers whole slots: they are committed, with this pass's KV
        entries; the rest of the selection goes back to planning (or, as the rule has it,
        the next slot is filled again in this step's infilling)."""
        s, slots, chunks, how = self.s, v.slots, self.chunks, v.how
        k = self.rule.split(self, "fast", slots[: v.prefix // s], chunks[: v.prefix // s])
        self.rule.whole_slots_verified(slots[:k], logits, range(s - 1, k * s, s))
        self.commit("fast", slots[:k], chunks[:k], how)
        refill = self.rule.refill(self, logits, slots, chunks, v.passed, k)
        kept = 0  # drafts of slots[k] that stay
        if refill is not None:  # the slot fed after the committed ones is filled again in this step
            kept, corrected = refill
            h = None if how is None else [how[k][: kept - 1] + ["corrected"] if corrected else how[k][:kept]]
            self.to_infill = ToInfill([slots[k]], [chunks[k]], [kept], h, [self.selected[k]])
        self.reject(
            [
                (j, chunk[: self.plan_width], kept * (i == 0))
                for i, (j, chunk) in enumerate(zip(slots[k:], chunks[k:]))
            ]
        )
        return k * s

    def _leave_to_infill(self, v: Verified, logits: torch.Tensor) -> None:
        """No whole slot passed: each selected slot goes to infilling with its passing
        prefix (at least its first token, the plan's draft)."""
        slots, chunks, how = v.slots, self.chunks, v.how
        per_slot = [max(n, 1) for n in v.passed]
        first = per_slot[0]
        self.rule.before_infill(self, logits, chunks, per_slot)
        if how is not None and per_slot[0] > first:  # the rule corrected the first slot's failing token
            how[0] = how[0][:first] + ["corrected"]
        # a narrower plan drafted only the first `width` tokens of a slot: the rest are MASKs
        self.reject([(j, chunk[: self.plan_width], n) for j, chunk, n in zip(slots, chunks, per_slot)])
        fill = [i for i, w in enumerate(self.rule.waits(slots)) if not w]
        self.to_infill = ToInfill(
            [slots[i] for i in fill],
            [chunks[i] for i in fill],
            [per_slot[i] for i in fill],
            None if how is None else [how[i] for i in fill],
            [self.selected[i] for i in fill],
        )

    def reject(self, drafts: list[tuple[int, list[int], int]]) -> None:
        """Note, when the trace wants the steps, the drafts of slots that are dropped:
        (slot, its drafts, how many of them stay)."""
        if self.trace.steps:
            self.trace.rejected([(j * self.s + n, toks[n:]) for j, toks, n in drafts])

    # ------------------------------------------------------------------ step 5: commit
    def commit(
        self, path: str, slots: list[int], toks: list[list[int]], how: list[list[str]] | None = None
    ) -> None:
        """Slots (indices into the region, in position order) leave the undecoded list;
        their tokens are final. `how` (when tracing): how each token was accepted."""
        exact = self.trace.decided(path, slots)
        gone = set(slots)
        self.undecoded = [j for j in self.undecoded if j not in gone]
        self.rule.committed(self, slots)
        keep = [i for i, t in enumerate(toks) if t]
        spans = [(slots[i] * self.s, toks[i]) for i in keep]
        if exact is None or how is None:
            self.req.commit(path, spans)
        else:
            self.req.commit(path, spans, [how[i] for i in keep], [exact[i] for i in keep])

    # ------------------------------------------------------------------ blocks
    def ends(self, toks: list[int]) -> int | None:
        """The index of the first EOS in `toks` (None: there is none)."""
        return next((i for i, t in enumerate(toks) if t in self.req.eos_ids), None)

    def drop_after(self, slot: int) -> None:
        """An EOS was accepted in `slot`: slots at later positions will never be decoded."""
        self.undecoded = [j for j in self.undecoded if j < slot]
        self.ends_after_block = True

    def infills(self) -> bool:
        return self.to_infill is not None

    def end_step(self) -> None:
        """A complete block gives way to the next one, or ends the row."""
        if self.undecoded:
            return
        self.block, self.ar_block = self.block + 1, False
        if self.ends_after_block or self.block == self.n_blocks:
            self.done = True
        else:
            self.undecoded = self.block_slots(self.block)
