"""One request in the engine: its settings, what it has committed so far, and what it
reports (`RequestOutput`).

Metrics are kept out of the algorithms (docs/architecture.md): a method commits spans of tokens to
its `Request`, which turns them into the final left-to-right prefix (what may be
streamed), its text and the finish decision; the counted forward adds to `stats`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from ..settings.decode import DecodeConfig
from .sampling import Sampler
from .shaping import TokenLogprob, shaping_of
from .text import StopText, TextDeltas


@dataclass
class DecodeStats:
    """Counts for one request. docs/algorithm.md#counting: NFE = forward passes it took part in (a batched
    forward counts once), TPF = tokens / NFE over the whole generation, TPS = tokens / s."""

    tokens: int = 0
    nfe: int = 0
    wall_time: float = 0.0
    # seconds inside the forward passes this request took part in (model + logits); the rest
    # of wall_time is the decoder's own per-step overhead (exact at batch size 1)
    forward_time: float = 0.0
    fed: int = 0  # real tokens this request fed to the model (padding excluded)
    logit_rows: int = 0  # positions whose logits it asked for
    # share of the forward seconds: each forward's time split evenly over the requests that took
    # part, so the shares of a batch add up to its forward time
    forward_share: float = 0.0
    # ReFusion draft widths (docs/algorithm.md#adaptive-widths): steps that drafted, the sums
    # of their plan widths (MASKs per slot) and infilling windows, and blocks decoded as AR
    draft_steps: int = 0
    plan_width_sum: int = 0
    window_sum: int = 0
    ar_blocks: int = 0
    grammar_time: float = 0.0  # seconds its grammar took: masking logits rows, following the prefix

    @property
    def tpf(self) -> float:
        return self.tokens / self.nfe if self.nfe else 0.0

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "nfe": self.nfe,
            "tpf": self.tpf,
            "wall_time": self.wall_time,
            "tps": self.tps,
            "forward_time": self.forward_time,
            "fed": self.fed,
            "logit_rows": self.logit_rows,
            "draft_steps": self.draft_steps,
            "ar_blocks": self.ar_blocks,
            "grammar_time": self.grammar_time,
        }


# what a traced step did besides committing (recorded with trace="steps"): the slots the
# plan selected with their drafts, a token replaced by its AR prediction, drafts thrown away
NOTES = ("plan", "correction", "rejected")

# How the decoder accepted a committed token (`TraceEvent.how`), by the code path that did it
# (docs/algorithm.md#provenance):
HOW = {
    "plan": "a slot's first token, passed by global verification on its plan confidence alone (unscored)",
    "verify": "passed global verification: its AR probability exceeded the token threshold",
    "infill-first": "infilling's first not-yet-accepted token, passed without exceeding the threshold",
    "infill": "passed an infilling verify pass: its AR probability exceeded the token threshold",
    "corrected": "an AR prediction put in place of a draft (ar_correction or first_token_check)",
    "ar": "AR decoding",
    "mdm": "masked diffusion decoding",
}


@dataclass
class TraceEvent:
    """One event of a decoding: a commit (which slots, start position and length, entered
    the cache, by which path, and how each token was accepted) or, with trace="steps", a
    note of what the step did besides."""

    step: int  # 0-based decoding step of this request in which it happened
    nfe: int  # this request's forward count when it happened
    # commits: "fast" (global verification), "infill" (parallel AR infilling), "ar", "mdm";
    # notes (NOTES): "plan", "correction" (the replacing token), "rejected" (the drafts dropped)
    path: str
    spans: list[tuple[int, int]]  # (first position relative to the generation start, length)
    tokens: list[list[int]]  # the tokens of each span
    # commits only (notes leave them empty): per span, per token, a key of HOW; and per span
    # whether everything to its left was final and in the context its tokens were decided in
    # (ReFusion slots decided in parallel beside an unfinished left neighbour are not)
    how: list[list[str]] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        return self.path not in NOTES


@dataclass
class RequestOutput:
    """What `Engine.step` reports for a request whose output grew or that finished."""

    request_id: str
    token_ids: list[int]  # the final left-to-right prefix so far (cut after EOS and at gen_length)
    text: str  # its text, cut at a stop string; a tail that may still grow into one is held back
    delta: str  # text added since this request's previous output (added with stream=False: all at the end)
    finished: bool
    finish_reason: str | None  # "stop" (EOS or a stop string), "length", "cancelled"; None while running
    stats: DecodeStats
    prompt_tokens: int
    trace: list[TraceEvent] | None = None
    # with DecodeConfig.logprobs: one per token of token_ids (shaping.py says what they are)
    logprobs: list[TokenLogprob] | None = None


class Request:
    """A request's state while the engine decodes it. Decoders commit spans of generation
    offsets; the engine asks `advance` after each step what is new."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        cfg: DecodeConfig,
        eos_ids: AbstractSet[int],
        sampler: Sampler,
        tokenizer: Any,
        trace: bool | str,
        stream: bool = True,
    ) -> None:
        self.id, self.prompt, self.cfg, self.eos_ids, self.sampler = request_id, prompt, cfg, eos_ids, sampler
        self.tokenizer = tokenizer
        # with stream=False only the final output is reported; text is decoded as the prefix
        # grows only when someone reads it (a stream) or a stop string may end it, otherwise
        # once at the end (decoding every prefix is quadratic)
        self.stream = stream
        self.live_text = stream or bool(cfg.stop)
        self.filled: list[int | None] = []
        self.prefix_len = 0  # final left-to-right prefix (cut after EOS and at gen_length)
        self.reported = 0  # prefix length at the last output
        self.stats = DecodeStats()
        # trace: the commits (True), or the commits and the notes of each step ("steps")
        self.trace: list[TraceEvent] | None = [] if trace else None
        self.traces_steps = trace == "steps"
        self.steps = 0  # decoding steps taken
        self.started = 0.0
        self.finish_reason: str | None = None
        self.deltas = TextDeltas(tokenizer) if tokenizer is not None else None
        self.stop_text = StopText(cfg.stop)
        self.text = ""
        # penalties, bias, a grammar, log-probabilities (None: none asked)
        self.shaping = shaping_of(cfg, tokenizer, eos_ids, prompt)

    # ------------------------------------------------------------------ decoder side
    def start(self) -> None:
        """The request starts decoding now (its wall time counts from here)."""
        self.filled = [None] * self.cfg.region_length
        self.started = time.perf_counter()

    @property
    def tracing(self) -> bool:
        """Whether commits are recorded; a decoder works out provenance only then."""
        return self.trace is not None

    def commit(
        self,
        path: str,
        spans: Sequence[tuple[int, list[int]]],
        how: Sequence[list[str]] | None = None,
        exact: Sequence[bool] | None = None,
        record: bool = True,
    ) -> None:
        """Tokens enter the committed sequence at generation offsets (start, tokens).
        `how` and `exact` (read only when tracing) say how each token was accepted and
        whether each span's left context was final; by default every token was accepted
        by `path` itself in its exact context (AR, MDM). record=False: a token final
        before its slot commits it again, which the trace records then, once."""
        for start, toks in spans:
            self.filled[start : start + len(toks)] = toks
        if self.trace is not None and record:
            self._record(
                path,
                spans,
                [list(h) for h in how] if how is not None else [[path] * len(t) for _, t in spans],
                list(exact) if exact is not None else [True] * len(spans),
            )
        row, n, limit = self.filled, self.prefix_len, self.cfg.gen_length
        while n < limit and row[n] is not None and (n == 0 or row[n - 1] not in self.eos_ids):
            n += 1
        if self.shaping is not None:
            self.shaping.settle(self, row, self.prefix_len, n)
        self.prefix_len = n

    def note(self, path: str, spans: Sequence[tuple[int, list[int]]]) -> None:
        """Record what the step did besides committing (a path of NOTES) when the trace
        wants the steps; decoders check `traces_steps` before building the spans."""
        if self.traces_steps and spans:
            self._record(path, spans)

    def _record(
        self,
        path: str,
        spans: Sequence[tuple[int, list[int]]],
        how: list[list[str]] | None = None,
        exact: list[bool] | None = None,
    ) -> None:
        assert self.trace is not None  # called only for a traced request
        self.trace.append(
            TraceEvent(
                self.steps,
                self.stats.nfe,
                path,
                [(s, len(t)) for s, t in spans],
                [list(t) for _, t in spans],
                how or [],
                exact or [],
            )
        )

    @property
    def token_ids(self) -> list[int]:
        return self.filled[: self.prefix_len]  # type: ignore[return-value]

    @property
    def complete(self) -> bool:
        """The prefix holds everything this request wants: an EOS or gen_length tokens."""
        n = self.prefix_len
        return n == self.cfg.gen_length or (n > 0 and self.filled[n - 1] in self.eos_ids)

    # ------------------------------------------------------------------ engine side
    def advance(self, decoder_done: bool, stops_early: bool = True) -> RequestOutput | None:
        """After a step: the output if the prefix grew or the request finished, deciding
        the finish (EOS, gen_length, a stop string, or the decoder ran out of region).
        `stops_early`: the row may stop as soon as its output is final."""
        self.steps += 1
        grew = self.prefix_len > self.reported
        finishing = self.finish_reason is None and (decoder_done or (stops_early and self.complete))
        if not grew and not finishing:
            return None
        delta = ""
        if finishing or self.live_text:
            delta, hit = self._text(final=finishing)
            if hit:
                self.finish_reason = "stop"
        if self.finish_reason is None and finishing:
            ids = self.token_ids
            self.finish_reason = "stop" if ids and ids[-1] in self.eos_ids else "length"
        if not self.stream:
            if self.finish_reason is None:
                return None  # nobody reads the prefix before the end
            delta = self.text
        self.reported = self.prefix_len
        return self.output(delta)

    def cancel(self) -> RequestOutput:
        self.finish_reason = self.finish_reason or "cancelled"
        delta = self._text(final=True)[0]
        return self.output(delta if self.stream else self.text)

    def output(self, delta: str = "") -> RequestOutput:
        finished = self.finish_reason is not None
        if finished and not self.stats.wall_time and self.started:
            self.stats.wall_time = time.perf_counter() - self.started
        self.stats.tokens = self.prefix_len
        return RequestOutput(
            self.id,
            self.token_ids,
            self.text,
            delta,
            finished,
            self.finish_reason,
            self.stats,
            len(self.prompt),
            self.trace,
            self.logprobs_so_far(),
        )

    def logprobs_so_far(self) -> list[TokenLogprob] | None:
        """The final prefix's log-probabilities (None: not asked for)."""
        if self.shaping is None or self.shaping.logprobs is None:
            return None
        return self.shaping.logprobs.tokens[: self.prefix_len]

    def _text(self, final: bool) -> tuple[str, bool]:
        if self.deltas is None:
            return "", False
        piece, hit = self.stop_text.feed(self.deltas.update(self.token_ids, final=final), final)
        self.text += piece
        return piece, hit
