"""`Engine`: the one object that owns the model, the KV cache, the batch and the step loop.

Drivers (`generate`, `stream`, the server, the evaluator, the benchmarks) add requests,
each with its own `DecodeConfig`, and call `step()` until nothing is left:

    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=16))
    rid = engine.add_request("prompt", DecodeConfig(method="refusion", slot_threshold=0.8))
    while engine.has_unfinished():
        for out in engine.step():   # RequestOutput: final left-to-right prefix, text, finished, ...
            ...

Requests of any mix of settings share a batch. AR and ReFusion rows live in one KV cache
and share its forwards: one step runs the plan forward (ReFusion rows feed MASKs, AR rows
take a token), the verification forward (AR rows take another token), then infilling
for the ReFusion rows that need it. MDM rows, which reuse no KV, run as their own group:
one forward per step over their whole contexts. A request added between steps joins at
the next step (its prompt is prefilled in that step's first forward); a finished or
aborted row frees its place at once.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..model.prompts import Prompt
from ..model.sizing import cache_bytes, entry_bytes, request_need, row_capacity
from ..model.transformer import Transformer
from ..settings.decode import DecodeConfig, EngineConfig
from ..settings.recommended import recommended_of
from .admit import Admission, Messages, PreparedRequest
from .ar import ARRow, Feed
from .forward import Forward, compiled_step, make_room
from .mdm import MDMRow
from .refusion import Infill, ReFusionRow
from .request import Request, RequestOutput
from .sampling import Sampler
from .widths import choose, drafting_of, widths_keep_output

if TYPE_CHECKING:
    from .follow import Followers

CachedRow = ARRow | ReFusionRow


class Engine:
    """Decodes requests with per-request settings in one continuous batch (see the module
    docstring). Not thread-safe: one thread adds, steps and aborts (a server runs one
    engine loop)."""

    def __init__(self, model: Transformer, tokenizer=None, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig(tensor_parallel_size=_split(model))
        if config.device is not None and torch.device(config.device) != model.device:
            model = model.to(config.device)
        self.model, self.tokenizer = model, tokenizer
        _check_parallel(model, config)
        # a request without a config gets what the checkpoint recommends (its decode_config.json)
        self.admission = Admission(model.config, tokenizer, recommended_of(model).decode_config())
        self.eos_ids, self.mask_id = self.admission.eos_ids, self.admission.mask_id
        # on rank 0 of a split model, what is added and aborted reaches the other ranks (follow.py)
        self.followers: Followers | None = None
        pad_id = self.mask_id if self.mask_id is not None else next(iter(self.eos_ids), 0)
        self.fwd = Forward(model, pad_id, compiled_step() if config.compile else None)
        self._entry_bytes = entry_bytes(model.config, model.dtype)  # a rank's config: its share of the heads
        self.infill = Infill(self.fwd, self.mask_id)
        # draft widths that follow the batch (docs/algorithm.md#adaptive-widths); on a split model
        # each rank would time its own forwards and choose apart, so widths stay fixed there
        self.adaptive = config.adaptive_drafts and config.tensor_parallel_size == 1
        self.drafting = drafting_of(model)
        self._last_step_end = 0.0  # when the last step ended, while requests remained
        self._drafted = False  # whether a row drafted in the last step (else: AR blocks and AR rows)
        self._not_step = 0.0  # seconds of this step that are no step's own work (a calibration)
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.rows: list[CachedRow] = []  # AR and ReFusion rows, one per row of `cache`
        self.mdm: list[MDMRow] = []
        self.cache = None
        self.finished_outputs: list[RequestOutput] = []  # aborted requests, reported by the next step
        self.rows_last_step = 0  # rows that took part in the last step (all groups)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ the drivers' side
    @property
    def forwards(self) -> int:
        """Model forward passes run so far."""
        return self.fwd.forwards

    @property
    def num_running(self) -> int:
        return len(self.rows) + len(self.mdm)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.finished_outputs)

    @property
    def default_config(self) -> DecodeConfig:
        """What a request without a config decodes with: the checkpoint's recommendation."""
        return self.admission.default

    def prepare(
        self, prompt: Prompt | Messages, cfg: DecodeConfig | None = None, **fit: Any
    ) -> PreparedRequest:
        """A request checked and fitted once (`Admission.prepare`: its keywords), to add
        as it is."""
        return self.admission.prepare(prompt, cfg, **fit)

    def add_request(
        self,
        prompt: Prompt | Messages | PreparedRequest,
        cfg: DecodeConfig | None = None,
        *,
        request_id: str | None = None,
        chat: bool = True,
        trace: bool | str = False,
        stream: bool = True,
    ) -> str:
        """Queue a request; it joins the batch at the next step. A prepared request is
        taken as it is; anything else is prepared first (`prepare`: a text prompt goes
        through the chat template unless chat=False, token ids are taken as they are, and
        gen_length must fit as given). `trace` records its commits in its outputs (True),
        or its commits and what each step did besides ("steps": the plan's drafts,
        corrections, rejected drafts). With stream=False it is reported once, when
        finished (its text decoded then, not at every step). Raises (ConfigError,
        ContextLengthError, MissingMaskTokenError) before any compute."""
        if isinstance(prompt, PreparedRequest):
            if cfg is not None:
                raise ConfigError("a prepared request carries its own config: add it without one")
            prepared = prompt
        else:
            prepared = self.prepare(prompt, cfg, chat=chat)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ConfigError(f"request id {rid!r} is already in use")
        if self.followers is not None:
            self.followers.add(prepared, rid, trace, stream)
        c = prepared.cfg
        req = Request(
            rid,
            list(prepared.ids),
            c,
            prepared.eos_ids,
            Sampler(c, self.model.device),
            self.tokenizer,
            trace,
            stream,
        )
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    @torch.inference_mode()
    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its row; the next `step` reports it as finished
        ("cancelled", with the tokens it had). False if it is unknown or already done."""
        if self.followers is not None:
            self.followers.abort(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        for row in self.rows + self.mdm:
            if row.req is req:
                row.done = True
        self._retire()
        self.finished_outputs.append(req.cancel())
        return True

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests, run one step of every group, and report each request
        whose final prefix grew or that finished. Runs under inference mode whatever the
        caller's thread (a server's engine loop): no autograd state is kept."""
        if self.followers is not None:
            self.followers.step()
        outputs, self.finished_outputs = self.finished_outputs, []
        start, forward_seconds = time.perf_counter(), self.fwd.seconds
        try:
            self._admit()
            self.rows_last_step = self.num_running
            if self.rows:
                self._step_cached()
            if self.mdm:
                self._step_mdm()
        except BaseException:  # the aborted requests' outputs are still owed to the caller
            self.finished_outputs = outputs + self.finished_outputs
            raise
        for row in self.rows + self.mdm:
            out = row.req.advance(row.done, row.stops_early)
            if out is not None:
                outputs.append(out)
                if out.finished:
                    row.done = True
                    self.requests.pop(row.req.id, None)
        self._retire()
        self._time_step(start, forward_seconds)
        return outputs

    def _time_step(self, start: float, forward_seconds: float) -> None:
        """The step's time outside its forwards, and the driver's since the last step (at
        most the step's own length: a longer gap is a driver waiting for work), per row, for
        the draft widths (`widths.StepOverhead`), counted apart for steps where a row drafted
        (infilling's bookkeeping) and steps of AR blocks and AR rows only."""
        end = time.perf_counter()
        if self.adaptive and self.rows_last_step:
            gap = min(start - self._last_step_end, end - start) if self._last_step_end else 0.0
            outside = end - start - (self.fwd.seconds - forward_seconds) - self._not_step + gap
            kind = self.drafting.overhead if self._drafted else self.drafting.ar_overhead
            kind.add(self.rows_last_step, outside)
        self._last_step_end, self._not_step = (end if self.has_unfinished() else 0.0), 0.0

    def abort_running(self) -> list[str]:
        """Drop every running request and the cache (after a step failed half-way, its
        state is not to be trusted); waiting requests stay. Returns the dropped ids."""
        if self.followers is not None:
            self.followers.abort_running()
        ids = [rid for rid, r in self.requests.items() if r.started]
        for rid in ids:
            self.requests.pop(rid)
        self.rows, self.mdm, self.cache, self.infill.scratch = [], [], None, None
        return ids

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> None:
        """Waiting requests in order, while the batch has room and the KV memory budget
        holds them; one that does not fit waits at the head (none overtakes it). A
        request alone in the engine always starts."""
        new: list[CachedRow] = []
        while self.waiting and self.num_running + len(new) < self.config.max_batch_size:
            req = self.waiting[0]
            if (self.num_running or new) and not self._fits(req, new):
                break
            self.waiting.popleft()
            req.start()
            if req.cfg.method == "mdm":
                self.mdm.append(MDMRow(req, self.mask_id))
            else:
                new.append(self._row(req))
        if new:
            try:
                self._make_room(new)
            except BaseException:  # (out of memory, say): the requests wait again, nothing is lost
                for row in reversed(new):
                    row.req.started = 0.0
                    self.waiting.appendleft(row.req)
                raise
            self.rows += new

    def _row(self, req: Request) -> CachedRow:
        if req.cfg.method != "refusion":
            return ARRow(req)
        row = ReFusionRow(req)
        if self.adaptive and widths_keep_output(req.cfg):
            row.acceptance = self.drafting.acceptance
        return row

    def _make_room(self, new: list[CachedRow]) -> None:
        """Cache rows for `new`, each as long as the sizing rule says every step of the
        running and new rows needs (`row_capacity`), with storage reserved for the rows
        that can be in flight (running and waiting, up to max_batch_size) within the budget."""
        needs = [request_need(r.req.cfg, len(r.req.prompt)) for r in self.rows + new]
        capacity = row_capacity(needs, joining=bool(self.rows))
        waiting = sum(q.cfg.method != "mdm" for q in self.waiting)
        budget_rows = int(self.config.memory_budget_gb * 2**30 // max(capacity * self._entry_bytes, 1))
        rows = len(self.rows) + len(new)
        reserve = max(rows, min(self.config.max_batch_size, rows + waiting, budget_rows))
        self.cache = make_room(self.model, self.cache, len(new), capacity, reserve)

    def _fits(self, req: Request, new: list[CachedRow]) -> bool:
        """Would the cache rows of every running request, of the ones admitted this step and
        of `req` fit the memory budget, sized by the one rule (`cache_bytes`)?"""
        reqs = [r.req for r in self.rows + self.mdm + new] + [req]
        needs = [request_need(q.cfg, len(q.prompt)) for q in reqs]
        return (
            cache_bytes(needs, self._entry_bytes, joining=bool(self.rows))
            <= self.config.memory_budget_gb * 2**30
        )

    def _retire(self) -> None:
        """Finished rows leave; their cache storage stays for rows that join."""
        keep = [b for b, r in enumerate(self.rows) if not r.done]
        if len(keep) < len(self.rows):
            self.rows = [self.rows[b] for b in self.cache.retain(keep)]
        self.mdm = [r for r in self.mdm if not r.done]

    # ------------------------------------------------------------------ one step
    def _step_cached(self) -> None:
        """ReFusion's round (docs/algorithm.md#one-step) for every ReFusion row, with the AR rows taking a
        token in each forward of the main cache."""
        self._choose_widths()
        self._drafted = any(isinstance(r, ReFusionRow) and not r.ar_block for r in self.rows)
        self._plan()
        refusion = [r for r in self.rows if isinstance(r, ReFusionRow)]
        if not refusion:
            return
        self._verify()
        self._infill()
        for r in refusion:
            r.next_block_if_complete()

    def _choose_widths(self) -> None:
        """Each group of rows with adaptive widths at the start of a block (same slot size
        and widest window) gets the plan width and infilling window that commit the most
        tokens per second with the batch as it is (`widths.choose`); the forward cost is
        timed at first use and every five minutes after. A row inside an AR block does not
        choose: it runs to the block's end, a token in each plan and verification forward,
        and waits through the drafting rows' infilling, so it is priced as such a rider."""
        groups: dict[tuple[int, int], list[ReFusionRow]] = {}
        cached: dict[int, int] = {}  # id(row) -> entries in its cache row
        for b, r in enumerate(self.rows):
            if isinstance(r, ReFusionRow) and r.acceptance is not None and not r.ar_block:
                groups.setdefault((r.s, r.req.cfg.infill_window or r.s), []).append(r)
                cached[id(r)] = self.cache.lengths[b]
        if not groups:
            return
        cost = self.drafting.cost
        if cost.stale():
            t0 = time.perf_counter()
            cost.calibrate(self.fwd.time_shapes, self.config.max_batch_size)
            self._not_step += time.perf_counter() - t0  # a one-off: not the step's own work
        for (s, window), rows in groups.items():
            member = {id(r) for r in rows}
            rest = [r for r in self.rows if id(r) not in member]
            fed = sum(r.s if isinstance(r, ReFusionRow) and not r.ar_block else 1 for r in rest)
            # the rows' mean cache length: attention's share of a forward's cost
            context = sum(cached[id(r)] for r in rows) // len(rows)
            at = functools.partial(cost, context=context)
            d = self.drafting
            overheads = (d.overhead.seconds(len(self.rows)), d.ar_overhead.seconds(len(self.rows)))
            p, w = choose(len(rows), len(rest), fed, s, window, d.acceptance, at, overheads=overheads)
            for r in rows:
                if p == 0 and r.can_start_ar_block():
                    r.start_ar_block()  # counted in its request's stats (ar_blocks), as drafting steps are
                else:
                    r.set_widths(max(p, 1), w)

    def _plan(self) -> None:
        """Steps 1-2: MASKs for every undecoded slot of each ReFusion row's block (its
        prompt first, on its first step), then the slots to verify; AR rows take a token."""
        rows, mask = self.rows, self.mask_id
        feeds = [r.plan_feed(mask) if isinstance(r, ReFusionRow) else r.feed() for r in rows]
        logits = self._run(feeds)
        self.cache.advance(
            [
                0 if f is None else r.take_plan(lg, len(f[0])) if isinstance(r, ReFusionRow) else r.take(lg)
                for r, f, lg in zip(rows, feeds, logits)
            ]
        )

    def _verify(self) -> None:
        """Step 3: global verification of the selected drafts, fast-path commits; AR rows
        that are not done take another token."""
        rows = self.rows
        feeds = [
            r.verify_feed() if isinstance(r, ReFusionRow) else None if r.done else r.feed() for r in rows
        ]
        logits = self._run(feeds)
        self.cache.advance(
            [
                0 if f is None else r.take_verify(lg, f[0]) if isinstance(r, ReFusionRow) else r.take(lg)
                for r, f, lg in zip(rows, feeds, logits)
            ]
        )

    def _infill(self) -> None:
        """Step 4 for the ReFusion rows whose selection did not pass whole."""
        need = [
            (r, b) for b, r in enumerate(self.rows) if isinstance(r, ReFusionRow) and r.to_infill is not None
        ]
        if need:
            self.infill([r for r, _ in need], [b for _, b in need], self.cache)

    def _run(self, feeds: list[Feed | None]) -> list[torch.Tensor]:
        """One forward of the main cache; a row with no feed takes no part."""
        tokens = [f[0] if f else [] for f in feeds]
        positions = [f[1] if f else [] for f in feeds]
        want = [f[2] if f else (0, 0) for f in feeds]
        return self.fwd.run([r.req for r in self.rows], tokens, positions, self.cache, want)

    def _step_mdm(self) -> None:
        feeds = [r.feed() for r in self.mdm]
        logits = self.fwd.run(
            [r.req for r in self.mdm],
            [f[0] for f in feeds],
            [f[1] for f in feeds],
            None,
            [f[2] for f in feeds],
        )
        for r, lg in zip(self.mdm, logits):
            r.take(lg)


def _split(model: Transformer) -> int:
    """Over how many processes the model is split (1: whole here)."""
    shard = getattr(model, "tensor_parallel", None)
    return shard.world if shard is not None else 1


def _check_parallel(model: Transformer, config: EngineConfig) -> None:
    """The model's split must be the one the config asks for; compiled forwards are one
    process's graph, without the collectives a split model runs."""
    split = _split(model)
    if split != config.tensor_parallel_size:
        raise ConfigError(
            f"the model is split over {split} process(es) but tensor_parallel_size is "
            f"{config.tensor_parallel_size}: load it with refusion.load(..., tensor_parallel_size="
            f"{config.tensor_parallel_size}) in each of the processes (refusion.parallel.spawn)"
        )
    if split > 1 and config.compile:
        raise ConfigError(
            "compiled forwards (--compile) run in one process: drop --compile with --tensor-parallel-size"
        )
