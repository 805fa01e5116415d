"""A completion in flight (`Job`) and what it reports (`ChoiceOutput`).

A job is one choice of one request: one prompt, prepared once, with its own `DecodeConfig`.
The engine loop's thread turns the engine's `RequestOutput`s for it (and, when asked, the
slot events its request recorded) into `ChoiceOutput`s and hands them to `notify`; an
error that ends it is handed over as the exception itself. The text of a non-streamed
response is the concatenation of the same outputs, so streamed and non-streamed answers
are the same by construction.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..decode.admit import PreparedRequest
from ..decode.shaping import TokenLogprob
from ..decode.trace import event_dicts
from .metrics import Metrics


@dataclass(frozen=True)
class ChoiceOutput:
    """What one engine step did for one choice: text that became final (left to right),
    the step's slot events (for a request that asked for them), and, once it is done, why
    it finished and how many tokens it returned."""

    index: int  # the choice: its prompt's place in the request
    text: str = ""
    slots: dict[str, Any] | None = None  # events, forward count and seconds so far; at the end, the stats
    finish_reason: str | None = None  # "stop", "length", "cancelled"; None while it runs
    completion_tokens: int = 0
    # with logprobs asked for: the log-probabilities of the tokens final since the last output
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def widths_used(stats: Any, adaptive: bool) -> dict[str, Any]:
    """The draft widths a finished request drafted at: whether they followed the batch,
    and its mean plan width (MASKs per slot) and infilling window over its drafting steps
    (None when it drafted none: AR, MDM, or only AR blocks)."""
    steps = stats.draft_steps
    return {
        "adaptive_widths": adaptive,
        "plan_width": stats.plan_width_sum / steps if steps else None,
        "infill_window": stats.window_sum / steps if steps else None,
    }


# what a job hands over: an output, or the error that ended it
Notify = Callable[["ChoiceOutput | BaseException"], None]


class Job:
    """One completion (one choice) in flight, between the event loop that submits and
    cancels it and the engine loop's thread that adds it to the engine and reports on it."""

    _ids = itertools.count()

    def __init__(
        self, prepared: PreparedRequest, notify: Notify, *, index: int = 0, slots: bool = False
    ) -> None:
        self.id = f"job-{next(Job._ids)}"
        self.prepared, self.notify, self.index = prepared, notify, index
        self.slots = slots  # send the decoder's slot events of each step (its trace of the steps)
        self.events_sent = 0
        self.cancelled = threading.Event()  # the client went away (or the server is stopping)
        self.finished = False
        self.emitted = False  # anything handed over
        self.completion_tokens = 0
        self.logprobs_sent = 0  # tokens whose log-probabilities were handed over
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.metrics: Metrics | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def update(self, out: Any) -> None:
        """A `RequestOutput` of this job's request (worker thread)."""
        if self.finished:
            return
        self.completion_tokens = len(out.token_ids)
        if out.delta and not self.emitted and self.metrics:
            self.metrics.ttft.observe(time.monotonic() - self.submitted)
        if out.finished:
            self.finished = True
            self._count_finished(out)
        if out.delta or out.finished:
            reason = out.finish_reason if out.finished else None
            lp = self._logprobs(out)
            self._send(ChoiceOutput(self.index, out.delta, None, reason, self.completion_tokens, lp))

    def _logprobs(self, out: Any) -> tuple[TokenLogprob, ...] | None:
        """The log-probabilities of the tokens final since the last ones handed over."""
        if out.logprobs is None:
            return None
        new, self.logprobs_sent = tuple(out.logprobs[self.logprobs_sent :]), len(out.logprobs)
        return new

    def _count_finished(self, out: Any) -> None:
        if self.metrics:
            self.metrics.finished.inc(1, out.finish_reason)
            self.metrics.completion_tokens.inc(self.completion_tokens)
            self.metrics.generated_tokens.inc(out.stats.tokens)
            self.metrics.forwards.inc(out.stats.nfe)
            self.metrics.drafting_steps.inc(out.stats.draft_steps)
            self.metrics.ar_blocks.inc(out.stats.ar_blocks)
            if out.stats.nfe:
                self.metrics.tpf.observe(out.stats.tpf)

    def send_slots(self, req: Any, out: Any, tokenizer: Any, adaptive: bool = False) -> None:
        """The slot events this job's request recorded since the last ones sent (worker
        thread), with its forward count and seconds so far; at the end, its final counts.
        `req` is the engine's request (None once it finished), `out` this step's output,
        `adaptive` whether its draft widths followed the batch (the engine's WidthPolicy)."""
        trace = out.trace if out is not None else getattr(req, "trace", None)
        new = (trace or [])[self.events_sent :]
        if self.finished or not (new or (out is not None and out.finished)):
            return
        self.events_sent += len(new)
        stats = out.stats if out is not None else req.stats
        started = getattr(req, "started", 0.0)
        payload = {
            "events": event_dicts(tokenizer, new),
            "nfe": stats.nfe,
            "elapsed": time.perf_counter() - started if started else stats.wall_time,
        }
        if out is not None and out.finished:
            cfg = self.prepared.cfg  # is its text AR's own (DecodeConfig.lossless), at what temperature
            payload["stats"] = {
                **stats.as_dict(),
                "tokens": len(out.token_ids),
                "lossless": cfg.lossless,
                "temperature": cfg.temperature,
                **widths_used(stats, adaptive),
            }
        self._send(ChoiceOutput(self.index, slots=payload))

    def finish_cancelled(self) -> None:
        """Cancelled before it reached the engine: done, with nothing generated."""
        if not self.finished:
            self.finished = True
            if self.metrics:
                self.metrics.finished.inc(1, "cancelled")
            self._send(ChoiceOutput(self.index, finish_reason="cancelled"))

    def fail(self, error: BaseException, reason: str = "error") -> None:
        """Finish with `error`; `reason` labels it in the completions metric."""
        if not self.finished:
            self.finished = True
            if self.metrics:
                self.metrics.finished.inc(1, reason)
            self._send(error)

    def _send(self, item: ChoiceOutput | BaseException) -> None:
        self.emitted = True
        try:
            self.notify(item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self.cancel()
