"""`Engine`: the one object that owns the model, the KV cache, the batch and the step loop.

Drivers (`generate`, `stream`, the server, the evaluator, the benchmarks) add requests,
each with its own `DecodeConfig`, and call `step()` until nothing is left:

    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=16))
    rid = engine.add_request("prompt", DecodeConfig(method="refusion", slot_threshold=0.8))
    while engine.has_unfinished():
        for out in engine.step():   # RequestOutput: final left-to-right prefix, text, finished, ...
            ...

Requests of any mix of settings share a batch. A step is schedule -> execute -> update:
the scheduler admits waiting requests (`scheduler.py`); the rows of the KV cache run the
plan forward (ReFusion rows feed MASKs, AR rows take a token) in one step, the
verification forward (AR rows take another token) in the next, then a step per round of
infilling for the ReFusion rows that need it, every row answering the same phase
interface (`rows.Row`); rows of methods that reuse no KV
(MDM) run as their own group, one forward per step over their whole contexts; then each
request reports what grew. A request added between steps joins at the next step, which
is the joining rows' first forward alone (their prompts prefilled, a ReFusion row's with its
plan unless it joins running rows greedily and losslessly; AR rows take a token in it), so
that a lossless row's first token streams after it; a finished or aborted row frees its
place at once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..model.kv_cache import KVCache
from ..model.prompts import Prompt
from ..model.sizing import entry_bytes
from ..model.transformer import Transformer
from ..settings.decode import DecodeConfig, EngineConfig
from ..settings.recommended import recommended_of
from .admit import Admission, Messages, PreparedRequest
from .forward import Forward, compiled_step
from .methods import method_of
from .refusion import Infill
from .request import Request, RequestOutput
from .rows import Feed, Row
from .sampling import Sampler
from .scheduler import Scheduler
from .width_policy import WidthPolicy
from .widths import RowAcceptance, drafting_of

if TYPE_CHECKING:
    from .follow import Followers


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
        self.fwd = Forward(model, pad_id, compiled_step() if config.compile else None, self.mask_id)
        self.infill = Infill(self.fwd)
        # draft widths that follow the batch (docs/algorithm.md#adaptive-widths); on a split model
        # each rank would time its own forwards and choose apart, so widths stay fixed there
        self.widths = WidthPolicy(
            drafting_of(model), config.adaptive_drafts and config.tensor_parallel_size == 1
        )
        # a rank's config: its share of the heads
        self.scheduler = Scheduler(model, config, entry_bytes(model.config, model.dtype), self._new_row)
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.finished_outputs: list[RequestOutput] = []  # aborted requests, reported by the next step
        self.rows_last_step = 0  # rows that took part in the last step (all groups)
        self._verifying = False  # the last step planned: the next verifies that plan
        self._ids = itertools.count()

    # ------------------------------------------------------------------ the drivers' side
    @property
    def forwards(self) -> int:
        """Model forward passes run so far."""
        return self.fwd.forwards

    @property
    def num_running(self) -> int:
        return self.scheduler.running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def rows(self) -> list[Row]:
        """The rows of the KV cache, one per row of `cache`."""
        return self.scheduler.rows

    @property
    def cache(self) -> KVCache | None:
        return self.scheduler.cache

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
        sampler = Sampler(c, self.model.device)
        req = Request(rid, list(prepared.ids), c, prepared.eos_ids, sampler, self.tokenizer, trace, stream)
        self.requests[rid] = req
        self.scheduler.waiting.append(req)
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
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        for row in self.scheduler.every_row():
            if row.req is req:
                row.done = True
        self.scheduler.retire()
        self.finished_outputs.append(req.cancel())
        return True

    def abort_running(self) -> list[str]:
        """Drop every running request and the cache (after a step failed half-way, its
        state is not to be trusted); waiting requests stay. Returns the dropped ids."""
        if self.followers is not None:
            self.followers.abort_running()
        ids = [rid for rid, r in self.requests.items() if r.started]
        for rid in ids:
            self.requests.pop(rid)
        self.scheduler.drop_running()
        self.infill.reset()
        self.infill.scratch = None
        self._verifying = False
        return ids

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule (admit waiting requests), execute (one step of every row), update
        (report each request whose final prefix grew or that finished, and retire the
        finished rows). Runs under inference mode whatever the caller's thread (a
        server's engine loop): no autograd state is kept."""
        if self.followers is not None:
            self.followers.step()
        outputs, self.finished_outputs = self.finished_outputs, []
        start, forward_seconds = time.perf_counter(), self.fwd.seconds
        try:
            self.scheduler.admit()
            self.rows_last_step = self.num_running
            drafted = self._execute()
        except BaseException:  # the aborted requests' outputs are still owed to the caller
            self.finished_outputs = outputs + self.finished_outputs
            raise
        outputs += self._update()
        rows = self.rows_last_step if drafted is not None else 0  # a joining step is not a typical one
        seconds = self.fwd.seconds - forward_seconds
        self.widths.timed(start, seconds, rows, bool(drafted), self.has_unfinished())
        return outputs

    def _new_row(self, req: Request) -> Row:
        row = method_of(req.cfg).row(req, self.mask_id)
        if self.widths.follows(req.cfg):
            row.acceptance = RowAcceptance(self.widths.drafting.acceptance)
        return row

    def _execute(self) -> bool | None:
        """One step of every row: the KV cache's rows, and the group of rows without a
        cache in one forward of their own. Returns whether a row drafted (the step's
        timing is counted by kind; None: a step that rows joined in, not counted)."""
        drafted: bool | None = False
        if self.scheduler.rows:
            drafted = self._step_cached()
        if self.scheduler.group:
            self._step_group()
        return drafted

    def _step_cached(self) -> bool | None:
        """ReFusion's round (docs/algorithm.md#one-step) over the KV cache's rows, a forward
        or two per step: the draft widths chosen, the plan forward; the verification
        forward (AR rows take a token in each); then, when verification left slots to
        infill, a step per infilling round. A request that arrives waits for a step to end
        before it joins, so each of them ends a step. Returns whether a row drafted (None:
        a step that rows joined in, `_join`)."""
        rows, cache = self.scheduler.rows, self.scheduler.cache
        assert cache is not None  # the scheduler gave the rows their cache
        self.widths.choose(rows, cache.lengths, self.fwd.time_shapes, self.config.max_batch_size)
        drafted = any(r.drafting for r in rows)
        joining = [r.joining for r in rows]
        if any(joining):
            self._join(joining)
            return None
        if self.infill.running or any(r.infills() for r in rows):  # verification left slots to infill
            if not self._infill():
                return drafted  # more rounds to come
        elif not self._verifying:
            self._plan()
            # AR rows alone: one forward, one token a row; else the plan's verification is next
            self._verifying = any(r.verifies for r in rows)
            return drafted
        else:
            self._verify()
            self._verifying = False
        for r in rows:
            r.end_step()
        return drafted

    def _plan(self) -> None:
        """Steps 1-2: MASKs for every undecoded slot of each ReFusion row's block (its
        prompt first, on its first step), then the slots to verify; AR rows take a token."""
        self._phase([r.plan_feed() for r in self.rows], lambda r, lg, f: r.take_plan(lg, f))

    def _join(self, joining: list[bool]) -> None:
        """Rows joined: this step is their first forward alone (their prompts prefilled; a
        ReFusion row's plan MASKs with it, unless it joins running rows with its first token
        final at its prompt's end), with the AR rows taking a token in it, so that their
        first tokens stream after one short forward and not after a whole drafting step of
        the rows running (docs/algorithm.md#joining). A ReFusion row that planned verifies
        in the next step, beside the others'."""
        running = not all(joining)
        feeds = [
            r.join_feed(running) if j else (None if r.verifies else r.plan_feed())
            for r, j in zip(self.rows, joining)
        ]
        # the rows that feed are the joining ones and AR rows, whose take_join is their take_plan
        self._phase(feeds, lambda r, lg, f: r.take_join(lg, f))

    def _verify(self) -> None:
        """Step 3: global verification of the selected drafts, fast-path commits; AR rows
        that are not done take another token."""
        self._phase([r.verify_feed() for r in self.rows], lambda r, lg, f: r.take_verify(lg, f))

    def _infill(self) -> bool:
        """Step 4 for the ReFusion rows whose selection did not pass whole: a round of it
        (forked at the first), committed after the last. Returns whether it is committed."""
        cache = self.cache
        assert cache is not None  # the scheduler gave the rows their cache
        if not self.infill.running:
            need = [(r, b) for b, r in enumerate(self.rows) if r.infills()]
            self.infill.start([r for r, _ in need], [b for _, b in need], cache)
        if not self.infill.round():
            return False
        self.infill.commit(cache, self.rows)
        return True

    def _phase(self, feeds: list[Feed | None], take: Callable[[Row, torch.Tensor, Feed], int]) -> None:
        """One forward of the KV cache over every row's feed (a row with none takes no
        part); each row takes its logits and says which of its entries stay."""
        rows, cache = self.scheduler.rows, self.scheduler.cache
        assert cache is not None  # the scheduler gave the rows their cache
        none = Feed([], [], (0, 0))
        logits = self.fwd.run(
            [r.req for r in rows],
            [(f or none).tokens for f in feeds],
            [(f or none).positions for f in feeds],
            cache,
            [(f or none).logits for f in feeds],
        )
        cache.advance([0 if f is None else take(r, lg, f) for r, f, lg in zip(rows, feeds, logits)])

    def _step_group(self) -> None:
        group = self.scheduler.group
        feeds = [r.feed() for r in group]
        logits = self.fwd.run(
            [r.req for r in group],
            [f.tokens for f in feeds],
            [f.positions for f in feeds],
            None,
            [f.logits for f in feeds],
        )
        for r, lg in zip(group, logits):
            r.take(lg)

    def _update(self) -> list[RequestOutput]:
        """Each row's request reports what grew or that it finished; finished rows leave."""
        outputs = []
        for row in self.scheduler.every_row():
            out = row.req.advance(row.done, row.stops_early)
            if out is not None:
                outputs.append(out)
                if out.finished:
                    row.done = True
                    self.requests.pop(row.req.id, None)
        self.scheduler.retire()
        return outputs


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
