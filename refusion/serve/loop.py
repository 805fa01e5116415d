"""The engine loop: one worker thread owns the `Engine` and steps it; the event loop hands
it completions (`Job`s) and cancellations.

Between two steps the worker adds every newly submitted job to the engine (each with its
own `DecodeConfig`: requests of any settings share the batch, and a request that arrives
mid-generation joins at the next step), aborts the jobs whose client went away, then runs
one step and hands each `RequestOutput` to its job, which reports it (`jobs.py`). The
engine decides the rest: the batch size, the KV memory budget, finish reasons (EOS,
max_tokens, stop strings).

Sampling: each completion has its own generator, seeded from its `seed` (reproducible
whatever it is batched with) or, without one, drawn at random.

The queue is bounded (`max_queue` completions not yet running); `submit` raises
`QueueFull` with a retry estimate when it is full, and `ShuttingDown` once `close`
has begun.

Shutdown (`close`, then `shutdown` to wait): new submissions are refused and queued
completions fail with `ShuttingDown` at once (their clients can retry elsewhere rather
than wait out a drain they would not survive); running ones decode on until the
deadline, when they fail with `ShuttingDown` too (an error, so a stream ends with an
error event and not a silent cut) and their rows are aborted.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .jobs import Job
from .metrics import Metrics

log = logging.getLogger("refusion.serve")

QUEUED = (
    "the server is shutting down and this request had not started; "
    "retry it (on another replica, or once the server is back)"
)
CUT = "the server shut down before this request finished (its shutdown timeout ran out); retry it"
REFUSED = "the server is shutting down and takes no new requests; retry on another replica or once it is back"


class QueueFull(Exception):
    """The queue holds `max_queue` completions; `retry_after` estimates the seconds until
    there is room."""

    def __init__(self, retry_after: int, max_queue: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after, self.max_queue = retry_after, max_queue


class ShuttingDown(Exception):
    """The server is stopping: the request was refused, dropped from the queue, or cut at
    the shutdown deadline. Not the request's fault: the client should retry."""


class EngineLoop:
    """The worker thread that owns the engine: jobs go in through `submit` (any thread),
    and each job reports its outputs from the worker (see the module docstring)."""

    def __init__(self, engine: Any, *, max_queue: int = 256, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._inbox: list[Job] = []  # submitted, not yet added to the engine
        self._jobs: dict[str, Job] = {}  # added to the engine, not finished
        self._cv = threading.Condition()
        self._closing = False
        self._deadline = math.inf  # monotonic time at which running completions are cut (set by close)
        self._last_step = (
            0.0  # seconds the last step took: a step that would end past the deadline is not begun
        )
        self._request_seconds = 1.0  # running mean of a completion's time in the engine, for Retry-After
        self._thread = threading.Thread(target=self._run, name="refusion-engine", daemon=True)

    # ---------------------------------------------------------------- the event loop's side
    def start(self) -> None:
        self._thread.start()

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue every job or none."""
        with self._cv:
            if self._closing:
                raise ShuttingDown(REFUSED)
            if self.queue_length + len(jobs) > self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(self._retry_after(), self.max_queue)
            for job in jobs:
                job.metrics = self.metrics
                self.metrics.prompt_tokens.inc(len(job.prepared.ids))
                self._inbox.append(job)
            self.metrics.queue_length.set(self.queue_length)
            self._cv.notify_all()

    @property
    def queue_length(self) -> int:
        """Completions not yet running: submitted, or waiting in the engine for room."""
        return len(self._inbox) + self.engine.num_waiting

    @property
    def running(self) -> int:
        return self.engine.num_running

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _retry_after(self) -> int:
        per_batch = max(1, self.engine.config.max_batch_size)
        return max(1, math.ceil(self._request_seconds * (1 + self.queue_length / per_batch)))

    def close(self, timeout: float = 30.0) -> None:
        """Begin shutting down without waiting: refuse new work, fail the queued jobs now,
        and give running ones `timeout` seconds before they are cut. Called again, it
        keeps the first deadline."""
        with self._cv:
            if not self._closing:
                self._closing = True
                self._deadline = time.monotonic() + max(timeout, 0.0)
            queued, self._inbox = self._inbox, []
            self._cv.notify_all()
        for job in queued:
            job.fail(ShuttingDown(QUEUED), "cancelled")
        if queued:
            log.info("shutting down: %d queued completion(s) refused", len(queued))

    def shutdown(self, timeout: float = 30.0) -> None:
        """`close(timeout)`, then wait for the worker to finish what runs (cut at the
        deadline) and stop."""
        self.close(timeout)
        if self._thread.is_alive():
            self._thread.join(max(self._deadline - time.monotonic(), 0.0) + 10.0)
        if not self._thread.is_alive():  # no worker (never started, or gone): nobody else will answer
            with self._cv:
                left, self._inbox = [*self._inbox, *self._jobs.values()], []
                self._jobs = {}
            for job in left:
                job.fail(ShuttingDown(QUEUED if job.started is None else CUT), "cancelled")

    # ---------------------------------------------------------------- the worker's side
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._jobs and not self._closing:
                    self._cv.wait()
                if not self._inbox and not self._jobs:
                    return  # closing, nothing left
                new, self._inbox = self._inbox, []
                closing, past_deadline = self._closing, time.monotonic() + self._last_step >= self._deadline
            self._add(new)
            if closing:
                self._drop_queued()
            if past_deadline:
                self._cut_running()
            self._abort_cancelled()
            if self.engine.has_unfinished():
                self._step()
            elif self._jobs:  # every job's request is gone (aborted): nothing to step
                with self._cv:
                    self._cv.wait(0.05)

    def _add(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.cancelled.is_set():
                job.finish_cancelled()
                continue
            try:
                # a job that streams slot events has its request trace its steps
                traced = {"trace": "steps"} if job.slots else {}
                self.engine.add_request(job.prepared, request_id=job.id, **traced)
            except Exception as e:  # the request's own fault (a ReFusionError) or not: it fails alone
                job.fail(e)
                continue
            if self.engine.num_running:
                self.metrics.joined.inc()
            self._jobs[job.id] = job

    def _drop_queued(self) -> None:
        """Closing: jobs that wait in the engine for room fail now (they would not start
        before the deadline anyway, or would start only to be cut)."""
        queued = [j for j in self._jobs.values() if j.started is None and not self._is_running(j)]
        self._fail(queued, QUEUED, log.info, "shutting down: %d queued completion(s) refused")

    def _cut_running(self) -> None:
        """The shutdown deadline is here (or the next step would end past it): every job
        left fails with ShuttingDown (its client gets an error, not a silent cut) and its
        row is aborted. One log line."""
        left = [j for j in self._jobs.values() if not j.finished]
        self._fail(left, CUT, log.warning, "shutdown timeout over: %d running completion(s) cut")

    @staticmethod
    def _fail(jobs: list, why: str, say: Callable[..., None], line: str) -> None:
        """Fail and cancel `jobs` with ShuttingDown(why); one log line when there were any."""
        for job in jobs:
            job.fail(ShuttingDown(why), "cancelled")
            job.cancel()
        if jobs:
            say(line, len(jobs))

    def _abort_cancelled(self) -> None:
        for job in [j for j in self._jobs.values() if j.cancelled.is_set()]:
            self.engine.abort(job.id)  # reported finished ("cancelled") by the next step

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:  # the server must outlive any one step: its rows fail, others go on
            log.exception("an engine step failed")
            for rid in self.engine.abort_running():
                job = self._jobs.pop(rid, None)
                if job is not None:
                    job.fail(e)
            return
        dt = self._last_step = time.monotonic() - t0
        self.metrics.step_seconds.observe(dt)
        self.metrics.rows_per_step.observe(self.engine.rows_last_step)
        self.metrics.rows.set(self.engine.rows_last_step)
        self.metrics.engine_forwards.set(self.engine.forwards)
        now = time.monotonic()
        for job in self._jobs.values():
            if job.started is None and self._is_running(job):
                job.started = now
                self.metrics.queue_wait.observe(now - job.submitted)
        self._send_slots(outputs)
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            job.update(out)
            if out.finished:
                del self._jobs[out.request_id]
                if job.started is not None:
                    self._request_seconds = 0.8 * self._request_seconds + 0.2 * (now - job.started)
        self.metrics.queue_length.set(self.queue_length)
        self.metrics.running.set(self.running)

    def _send_slots(self, outputs: list[Any]) -> None:
        """Each job that asked for them gets its step's slot events, before its text."""
        by_id = {out.request_id: out for out in outputs}
        for job in self._jobs.values():
            if job.slots:
                req = self.engine.requests.get(job.id)
                follows = self.engine.widths.follows(job.prepared.cfg)
                job.send_slots(req, by_id.get(job.id), self.engine.tokenizer, follows)

    def _is_running(self, job: Job) -> bool:
        req = self.engine.requests.get(job.id)
        return req is None or req.started > 0  # gone from the engine: it ran (and finished)
