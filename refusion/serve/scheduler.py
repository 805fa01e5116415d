"""The batching scheduler: one worker thread owns the model and runs `generate` on batches.

Requests that arrive together and whose `DecodeConfig`s are equal are decoded in one
`generate` call (for `mdm`, whose batches nothing can join, "together" means within
`batch_window` seconds of the oldest waiting one; `ar` and `refusion` start at once); a request with a
different config waits for a later batch (configs decide the plan, the slot layout and
the sampler, so only equal ones can share a call and still decode exactly what each
would decode alone). Batching is continuous for the `ar` and `refusion` methods: a
request with the running batch's config that arrives mid-batch joins it at the next
step, as soon as the batch has a free place (`generate`'s `admit`); `mdm` batches run to
the end. Rows leave early: a row that has its max_tokens, has hit a stop string or EOS,
or whose client went away reports `is_cancelled`, and the decoder stops it at its next
step, which frees its place.

Sampling: each completion has its own generator, seeded from its `seed` (reproducible
whatever it is batched with) or, without one, drawn at random.

The queue is bounded (`max_queue` waiting completions); `submit` raises `QueueFull` with
a retry estimate when it is full, and `ShuttingDown` once `shutdown` has begun.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..decode import DecodeConfig, GenerationOutput, TextDeltas, check_prompts, generate
from ..errors import ReFusionError
from .metrics import Metrics

log = logging.getLogger("refusion.serve")

JOINABLE = ("ar", "refusion")  # methods whose running batch takes new rows between steps

# ("text", str) | ("done", finish_reason, completion_tokens) | ("error", exception)
Event = tuple


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


class StopText:
    """Cuts text at the first stop string. Releases text as it comes, except a tail that
    could still grow into a stop string, so a stop string is never half-sent."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.pending = ""  # received, not yet released

    def feed(self, delta: str, final: bool) -> tuple[str, bool]:
        """(text to release now, whether a stop string was hit). A complete stop string
        only counts once no earlier start could still grow into another one."""
        self.pending += delta
        p = self.pending
        hit = min((i for s in self.stops if (i := p.find(s)) >= 0), default=None)
        partial = None if final else self._earliest_partial(p)
        if hit is not None and (partial is None or hit <= partial):
            self.pending = ""
            return p[:hit], True
        cut = len(p) if partial is None else partial
        self.pending = p[cut:]
        return p[:cut], False

    def _earliest_partial(self, p: str) -> int | None:
        """The first index from which the rest of `p` is a proper prefix of a stop string."""
        longest = max((len(s) - 1 for s in self.stops), default=0)
        for j in range(max(0, len(p) - longest), len(p)):
            if any(len(s) > len(p) - j and s.startswith(p[j:]) for s in self.stops):
                return j
        return None


class Job:
    """One completion (one choice) in flight. Its text is made in the worker thread, from
    the decoder's final left-to-right prefixes, and handed to `notify` as events; the
    text of a non-streamed response is the concatenation of the same events, so streamed
    and non-streamed answers are the same by construction."""

    def __init__(
        self,
        ids: list[int],
        cfg: DecodeConfig,
        max_tokens: int,
        stops: Sequence[str],
        tokenizer: Any,
        eos_ids: set[int],
        notify: Callable[[Event], None],
    ) -> None:
        self.ids, self.cfg, self.max_tokens = ids, cfg, max_tokens
        self.eos_ids, self.notify = eos_ids, notify
        self.deltas = TextDeltas(tokenizer)
        self.stop_text = StopText(stops)
        self.cancelled = threading.Event()  # the client went away (or the server is stopping)
        self.finished = False
        self.emitted = False  # any event sent
        self.completion_tokens = 0
        self.submitted = time.monotonic()
        self.metrics: Metrics | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def stopped(self) -> bool:
        """What the decoder's `is_cancelled` sees: nothing more is wanted from this row."""
        return self.finished or self.cancelled.is_set()

    def on_prefix(self, ids: list[int], done: bool) -> None:
        """The decoder's final prefix grew (worker thread)."""
        if self.finished:
            return
        if self.cancelled.is_set():
            return self._finish("cancelled")
        ids = ids[: self.max_tokens]
        ends = bool(ids) and ids[-1] in self.eos_ids
        final = done or ends or len(ids) >= self.max_tokens
        text, hit = self.stop_text.feed(self.deltas.update(ids, final=final), final)
        self.completion_tokens = len(ids)
        if text:
            if not self.emitted and self.metrics:
                self.metrics.ttft.observe(time.monotonic() - self.submitted)
            self._send(("text", text))
        if hit or final:
            self._finish("stop" if hit or ends else "length")

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.finished = True
            if self.metrics:
                self.metrics.finished.inc(1, "error")
            self._send(("error", error))

    def _finish(self, reason: str) -> None:
        self.finished = True
        if self.metrics:
            self.metrics.finished.inc(1, reason)
            self.metrics.completion_tokens.inc(self.completion_tokens)
        self._send(("done", reason, self.completion_tokens))

    def _send(self, event: Event) -> None:
        self.emitted = True
        try:
            self.notify(event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self.cancel()


class Scheduler:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_queue: int = 256,
        batch_window: float = 0.01,
        metrics: Metrics | None = None,
        generate_fn: Callable[..., list[GenerationOutput]] = generate,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_queue, self.batch_window = max_queue, batch_window
        self.metrics = metrics or Metrics()
        self.generate_fn = generate_fn
        self._queue: deque[Job] = deque()
        self._running: list[Job] = []
        self._cv = threading.Condition()
        self._closing = False
        self._batch_seconds = 1.0  # running mean of a batch's wall time, for Retry-After
        self._thread = threading.Thread(target=self._run, name="refusion-decode", daemon=True)

    # ---------------------------------------------------------------- the event loop's side
    def start(self) -> None:
        self._thread.start()

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue every job or none."""
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if len(self._queue) + len(jobs) > self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(self._retry_after())
            for job in jobs:
                job.metrics = self.metrics
                self.metrics.prompt_tokens.inc(len(job.ids))
                self._queue.append(job)
            self.metrics.queue_length.set(len(self._queue))
            self._cv.notify_all()

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _retry_after(self) -> int:
        per_batch = max(1, self._running[0].cfg.max_batch_size if self._running else 1)
        return max(1, math.ceil(self._batch_seconds * (1 + len(self._queue) / per_batch)))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new work, let queued and running completions finish for up to `timeout`
        seconds, then cancel what is left and stop the worker."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._cv:
            for job in self._queue:
                job.fail(ShuttingDown("the server shut down before this request was decoded"))
            self._queue.clear()
            for job in self._running:
                job.cancel()
        if self._thread.is_alive():
            self._thread.join(10.0)

    # ---------------------------------------------------------------- the worker's side
    def _run(self) -> None:
        while (batch := self._take()) is not None:
            if batch:
                self._decode(batch)

    def _take(self) -> list[Job] | None:
        """The next batch: the oldest live job and every queued job with an equal config,
        up to its max_batch_size; None when shutting down with nothing left."""
        with self._cv:
            while not self._queue and not self._closing:
                self._cv.wait()
            if not self._queue:
                return None
            # only a batch that nothing can join later waits for company: ar and refusion
            # requests that arrive after it starts join at its next step, so they start at once
            window = 0.0 if self._queue[0].cfg.method in JOINABLE else self.batch_window
            deadline = self._queue[0].submitted + window
            while not self._closing and len(self._queue) < self._queue[0].cfg.max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            live = [j for j in self._queue if not j.cancelled.is_set()]
            for j in self._queue:
                if j.cancelled.is_set():
                    j.on_prefix([], True)  # finishes it as cancelled
            batch: list[Job] = []
            rest: deque[Job] = deque()
            for j in live:
                fits = len(batch) < live[0].cfg.max_batch_size and j.cfg == live[0].cfg
                (batch if fits else rest).append(j)
            self._queue, self._running = rest, batch
            self.metrics.queue_length.set(len(rest))
            self.metrics.running.set(len(batch))
            return batch

    def _admit(self, batch: list[Job], room: int, max_len: int) -> list[list[int]]:
        """Queued jobs with the running batch's config join it (up to `room`, prompts of at
        most `max_len` tokens), checked one by one first so a bad request fails alone;
        called by `generate` between steps. A job too long to join stops the joining: later
        jobs do not overtake it, and it heads the next batch."""
        with self._cv:
            if self._closing:
                return []
            taken: list[Job] = []
            rest: deque[Job] = deque()
            blocked = False
            for j in self._queue:
                same = j.cfg == batch[0].cfg and not j.cancelled.is_set()
                blocked = blocked or (same and len(j.ids) > max_len)
                fits = same and not blocked and len(taken) < room
                (taken if fits else rest).append(j)
            self._queue = rest
            self.metrics.queue_length.set(len(rest))
        ok = []
        for j in taken:
            try:
                check_prompts(self.model, self.tokenizer, j.cfg, [j.ids])
            except ReFusionError as e:
                j.fail(e)
            else:
                ok.append(j)
        now = time.monotonic()
        for j in ok:
            self.metrics.queue_wait.observe(now - j.submitted)
        with self._cv:
            batch.extend(ok)  # the callbacks index into it; it is also self._running
            self.metrics.running.set(len(batch))
        self.metrics.joined.inc(len(ok))
        return [j.ids for j in ok]

    def _decode(self, batch: list[Job]) -> None:
        t0 = time.monotonic()
        for j in batch:
            self.metrics.queue_wait.observe(t0 - j.submitted)
        self.metrics.batch_size.observe(len(batch))
        joinable = batch[0].cfg.method in JOINABLE
        try:
            outs = self.generate_fn(
                self.model,
                self.tokenizer,
                [j.ids for j in batch],
                batch[0].cfg,
                on_prefix=lambda i, ids, done: batch[i].on_prefix(ids, done),
                is_cancelled=lambda i: batch[i].stopped(),
                admit=(lambda room, max_len: self._admit(batch, room, max_len)) if joinable else None,
            )
        except ReFusionError as e:
            # raised before any compute: retry one by one so only the bad request fails
            if len(batch) > 1 and not any(j.emitted for j in batch):
                for j in batch:
                    self._decode([j])
                return
            for j in batch:
                j.fail(e)
        except Exception as e:  # the server must outlive any one batch
            log.exception("decoding a batch of %d failed", len(batch))
            for j in batch:
                j.fail(e)
        else:
            for j, out in zip(batch, outs):
                self.metrics.generated_tokens.inc(out.stats.tokens)
                self.metrics.forwards.inc(out.stats.nfe)
                if out.stats.nfe:
                    self.metrics.tpf.observe(out.stats.tpf)
                j.on_prefix(out.token_ids, True)  # normally finished already
        finally:
            dt = time.monotonic() - t0
            self.metrics.batch_seconds.observe(dt)
            self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * dt
            with self._cv:
                self._running = []
                self.metrics.running.set(0)
