"""The bodies the server answers with, in OpenAI's schema: a whole completion, a stream's
chunks (text, slot events, usage), and a model card."""

from __future__ import annotations

import time
import uuid
from typing import Any


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_body(
    kind: str,
    rid: str,
    model: str,
    choices: list[tuple[str | None, str, Any, list[dict[str, Any]]]],
    use: dict[str, int],
    warning: str | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) completion; choices = [(text, finish_reason, logprobs,
    tool_calls), ...]; a `warning` (why the text may be noise) beside them when there is one."""
    if kind == "chat":
        items = [
            {"index": i, "message": message(t, calls), "logprobs": lp, "finish_reason": r}
            for i, (t, r, lp, calls) in enumerate(choices)
        ]
        obj = "chat.completion"
    else:
        items = [
            {"index": i, "text": t, "logprobs": lp, "finish_reason": r}
            for i, (t, r, lp, _) in enumerate(choices)
        ]
        obj = "text_completion"
    body = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": items,
        "usage": use,
    }
    return body | ({"warning": warning} if warning else {})


def message(text: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat choice's message: its text, and its tool calls when it made some."""
    return {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})


def chunk_body(
    kind: str,
    rid: str,
    model: str,
    index: int,
    text: str | None,
    finish: str | None,
    *,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One server-sent event of a streamed completion (`logprobs`: of the tokens it adds;
    chat's `tool_calls`: calls completed, each whole, with its index)."""
    if kind == "chat":
        delta: dict[str, Any] = (
            {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        )
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def slots_chunk(kind: str, rid: str, model: str, index: int, slots: dict[str, Any]) -> dict[str, Any]:
    """A stream chunk of slot events (stream_options.include_slots): no choice changes,
    `slots` holds choice `index`'s events of the last step and its counts so far."""
    return _choiceless_chunk(kind, rid, model, slots={"index": index, **slots})


def usage_chunk(kind: str, rid: str, model: str, use: dict[str, int]) -> dict[str, Any]:
    return _choiceless_chunk(kind, rid, model, usage=use)


def _choiceless_chunk(kind: str, rid: str, model: str, **extra: Any) -> dict[str, Any]:
    """A stream chunk that changes no choice, carrying `extra` (usage, slot events)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], **extra}


def model_card(name: str, created: int, context: int) -> dict[str, Any]:
    """One entry of /v1/models."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "refusion",
        "max_model_len": context,
    }
