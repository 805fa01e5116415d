"""A request's outputs in OpenAI's two shapes: one response body once every choice is
done, or server-sent events as the outputs come.

Both take the outputs as an async iterator of `ChoiceOutput`s (`client.Generation`) and
close it however they end (done, failed, or their consumer gone), which cancels the
choices still running. A choice that fails fails the request: a plain response raises
the API error, a stream ends with an `{"error": ...}` event; every stream ends with
`[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

from ...decode.shaping import TokenLogprob
from ..client import Outputs, RequestFailed
from ..jobs import ChoiceOutput
from .errors import library_error
from .logprobs import Speller, choice_logprobs
from .requests import CompletionRequest
from .responses import chunk_body, new_id, response_body, slots_chunk, usage, usage_chunk
from .tools import CallStream, split_calls

DONE = "data: [DONE]\n\n"


def event(obj: dict[str, Any]) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def completion_body(
    req: CompletionRequest,
    outputs: Outputs[ChoiceOutput],
    model: str,
    prompt_tokens: int,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """The whole completion: each choice's text, finish reason and (when asked for)
    log-probabilities, and the usage (of every row decoded: best_of's too)."""
    n = req.decoded
    texts: list[list[str]] = [[] for _ in range(n)]
    reasons, tokens = [""] * n, [0] * n
    logprobs: list[list[TokenLogprob] | None] = [None] * n
    async with aclosing(outputs):
        try:
            async for out in outputs:
                texts[out.index].append(out.text)
                if out.logprobs is not None:
                    logprobs[out.index] = (logprobs[out.index] or []) + list(out.logprobs)
                if out.finished:
                    reasons[out.index], tokens[out.index] = out.finish_reason or "", out.completion_tokens
        except RequestFailed as e:
            raise library_error(e.error) from None
    spell = Speller(tokenizer)
    done = []
    for i in returned_rows(req, logprobs):
        text, reason, calls = _calls_of(req, echoed(req, i, tokenizer) + "".join(texts[i]), reasons[i])
        lp = choice_logprobs(req.kind, spell, logprobs[i]) if req.logprobs_asked else None
        done.append((text, reason, lp, calls))
    use = usage(prompt_tokens, sum(tokens))
    return response_body(req.kind, new_id(req.kind), model, done, use, req.warning)


def returned_rows(req: CompletionRequest, logprobs: list[list[TokenLogprob] | None]) -> list[int]:
    """The rows returned as choices, in order: every row, or of each prompt's best_of rows
    the n with the highest log-probability (the sum over their tokens, as OpenAI ranks)."""
    if req.rows == req.n:
        return list(range(req.decoded))

    def score(i: int) -> float:
        return sum(t.logprob for t in logprobs[i] or [] if t.logprob is not None)

    rows = []
    for start in range(0, req.decoded, req.rows):
        group = range(start, start + req.rows)
        rows += sorted(group, key=lambda i: -score(i))[: req.n]
    return rows


def echoed(req: CompletionRequest, row: int, tokenizer: Any) -> str:
    """With echo, the text of the row's prompt (a token-id prompt decoded), which its
    choice's text begins with; else nothing."""
    if not req.echo or req.prompts is None:
        return ""
    prompt = req.prompts[row // req.rows]
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt) if tokenizer is not None else ""


def _calls_of(req: CompletionRequest, text: str, reason: str) -> tuple[str | None, str, list[dict[str, Any]]]:
    """A choice's text, finish reason and tool calls: with tools, the calls the text makes
    are read out of it, and a reply that ends in calls finishes with "tool_calls"."""
    if req.tools is None or not req.tools.reads_calls:
        return text, reason, []
    content, calls = split_calls(text)
    return content, ("tool_calls" if calls and reason == "stop" else reason), calls


async def completion_events(
    req: CompletionRequest,
    outputs: Outputs[ChoiceOutput],
    model: str,
    prompt_tokens: int,
    tokenizer: Any = None,
) -> AsyncIterator[str]:
    """The stream: chat's role chunks first (a queued client knows it was accepted), then
    each output's chunks as it comes, the usage last when asked for. The request's warning,
    if any, rides on the first text chunk (not a choiceless one: clients read choices[0])."""
    kind, rid, tokens, warning = req.kind, new_id(req.kind), 0, req.warning
    reads_calls = req.tools is not None and req.tools.reads_calls
    chunks = _Chunks(kind, rid, model, Speller(tokenizer), req.choices, reads_calls)
    async with aclosing(outputs):
        try:
            if kind == "chat":
                for i in range(req.choices):
                    yield event(chunk_body(kind, rid, model, i, "", None, first=True))
            for i in range(req.choices) if req.echo else ():  # best_of == n here: a row is a choice
                yield event(chunk_body(kind, rid, model, i, echoed(req, i, tokenizer), None))
            async for out in outputs:
                tokens += out.completion_tokens if out.finished else 0
                for chunk in chunks(out):
                    if warning and chunk["choices"]:
                        chunk, warning = chunk | {"warning": warning}, None
                    yield event(chunk)
            if req.include_usage:
                yield event(usage_chunk(kind, rid, model, usage(prompt_tokens, tokens)))
        except RequestFailed as e:  # the request failed, or the server shut down under it
            yield event(library_error(e.error).body())
        yield DONE


class _Chunks:
    """An output's chunks: its slot events, its text with the log-probabilities of the
    tokens it adds, its tool calls (`reads_calls`: each choice's text read by a
    `tools.CallStream`), its finish reason. Keeps each choice's characters streamed so
    far, for the completions' `text_offset`."""

    def __init__(
        self, kind: str, rid: str, model: str, spell: Speller, n: int, reads_calls: bool = False
    ) -> None:
        self.kind, self.rid, self.model, self.spell = kind, rid, model, spell
        self.offsets = [0] * n
        self.calls = [CallStream() for _ in range(n)] if reads_calls else None

    def __call__(self, out: ChoiceOutput) -> Iterator[dict[str, Any]]:
        kind, rid, model, i = self.kind, self.rid, self.model, out.index
        if out.slots is not None:
            yield slots_chunk(kind, rid, model, i, out.slots)
        text, calls = out.text, list[dict[str, Any]]()
        if self.calls is not None:
            text, calls = self.calls[i].feed(out.text, final=out.finished)
        if text or out.logprobs or calls:
            lp = choice_logprobs(kind, self.spell, out.logprobs, self.offsets[i])
            self.offsets[i] += len(out.text)
            yield chunk_body(kind, rid, model, i, text, None, logprobs=lp, tool_calls=calls)
        if out.finished:
            reason = out.finish_reason
            if self.calls is not None and self.calls[i].calls and reason == "stop":
                reason = "tool_calls"
            yield chunk_body(kind, rid, model, i, None, reason)
