"""A checkpoint's chat template applied to a conversation as `transformers`'
`apply_chat_template` applies it (messages as plain data without their None fields, the
reasoning fields aliased, the special tokens and the caller's options beside them, a
continued last message cut where it ends), but rendered in our bounded sandbox
(`template_sandbox.py`), so that a template that loops or allocates without end fails
in one line instead of hanging a load or filling the memory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from ..files import LIMITS
from .template_sandbox import Budget, compiled, spending

# the message fields a reasoning text may come under; templates read the first
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks where a continued final message ends


# ---------------------------------------------------------------------------- rendering a conversation
def render(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final: bool,
    variables: Mapping[str, Any],
) -> str:
    """The conversation as the template writes it, as `transformers`' `apply_chat_template`
    (tokenize=False) writes it: messages as plain data without their None fields, the
    reasoning fields aliased, `variables` (the special tokens and the caller's options)
    beside them, and with `continue_final` the text cut where the last message ends."""
    chat = [{k: _plain(v) for k, v in dict(m).items() if v is not None} for m in messages]
    chat = [_aliased(m) for m in chat]
    final = None
    if continue_final:
        final = _mark_final(source, chat)
    values = {k: _plain(v) for k, v in variables.items()}
    size = sum(len(json.dumps(m, default=str)) for m in chat) + sum(len(str(v)) for v in values.values())
    steps = LIMITS.template_iterations + 64 * len(chat)
    deadline = time.monotonic() + LIMITS.template_seconds
    with spending(Budget(steps, LIMITS.template_chars + 4 * size, deadline, steps)) as budget:
        text = _stream(
            compiled(source),
            budget,
            messages=chat,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **({"tools": None} | values),
        )
    return text if final is None else _cut_at_final(text, final)


def _stream(template: jinja2.Template, budget: Budget, **context: Any) -> str:
    """The template's output, measured as it streams out."""
    parts, total = [], 0
    for part in template.generate(**context):
        total += len(part)
        budget.fits(total, "an output")
        parts.append(part)
    return "".join(parts)


def _plain(value: Any) -> Any:
    """What a template may see of a value: plain JSON-like data (a subclass of str, int or
    float as its base type), anything else as a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _mark_final(source: str, chat: list[dict[str, Any]]) -> str:
    """Tag the end of the last message's text, to cut the output there; its text."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    final = chat[-1].get("content")
    if final is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in source:
        raise ValueError('continue_final_message is set to "content", which the chat_template does not use')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return text
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue in the final message!"
        )
    chat[-1]["content"] = final + _CONTINUE_TAG
    return final


def _cut_at_final(text: str, final: str) -> str:
    """The output up to where the continued message ends (its trailing space kept where
    the template kept it)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after "
            "applying the chat template"
        )
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
