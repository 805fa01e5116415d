"""A chat request's messages: OpenAI's message fields are accepted (`name`, an
assistant's `tool_calls` and `refusal`, a tool's `tool_call_id`), type-checked, and
passed to the chat template where it can use them; anything else is refused."""

from __future__ import annotations

from typing import Any

from ...settings.fields import shown
from .checks import string, text
from .errors import bad

ROLES = {"system", "developer", "user", "assistant", "tool"}
# message fields by role, beyond role and content (`name` is allowed on every message)
MESSAGE_FIELDS = {"assistant": {"name", "tool_calls", "refusal"}, "tool": {"name", "tool_call_id"}}


def parse_messages(msgs: Any) -> list[dict[str, Any]]:
    """A chat request's `messages`, each checked and in the shape the chat template gets."""
    if not isinstance(msgs, list):
        raise bad("messages must be a list of {role, content} objects", "messages", "invalid_type")
    if not msgs:
        raise bad("messages must not be empty", "messages", "empty_array")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(msgs)]


def _message(m: Any, where: str) -> dict[str, Any]:
    """One message as the chat template gets it: role and text content, plus the OpenAI
    fields it carries (a template that does not use them ignores them; one that rejects
    the conversation gets a 400 when the prompt is made)."""
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object with role and content", where, "invalid_type")
    role = m.get("role")
    if role not in ROLES:
        raise bad(
            f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {shown(role)}", f"{where}.role"
        )
    allowed = MESSAGE_FIELDS.get(role, {"name"})
    extra = sorted(set(m) - {"role", "content"} - allowed)
    if extra:
        name = extra[0]
        owner = next((r for r, fields in MESSAGE_FIELDS.items() if name in fields), None)
        why = f": only {owner} messages carry it" if owner else ""
        raise bad(
            f"{where}.{name} is not a field of a {role} message{why}", f"{where}.{name}", "unknown_parameter"
        )
    if m.get("content") is None and not (role == "assistant" and _speaks_otherwise(m)):
        raise bad(
            f"{where}.content is required: give the message's text (only an assistant message "
            "with tool_calls or a refusal may leave it out)",
            f"{where}.content",
            "missing_required_parameter",
        )
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _content(m.get("content"), where),
    }
    for name in ("name", "tool_call_id"):
        if m.get(name) is not None:
            out[name] = string(f"{where}.{name}", m[name])
    if m.get("refusal") is not None:
        string(
            f"{where}.refusal", m["refusal"]
        )  # the model's own earlier refusal: checked, not shown to the template
    if m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    return out


def _speaks_otherwise(m: dict[str, Any]) -> bool:
    """Whether an assistant message says something without content, as OpenAI allows:
    its tool calls or its refusal."""
    return m.get("tool_calls") is not None or m.get("refusal") is not None


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier tool calls, in OpenAI's shape: [{id, type: "function",
    function: {name, arguments}}], arguments being JSON text."""
    if not isinstance(calls, list):
        raise bad(f"{where} must be a list of tool calls", where, "invalid_type")
    out = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad(
                f"{at} must be an object with id, type and function: {{name, arguments}}", at, "invalid_type"
            )
        if call.get("type", "function") != "function":
            raise bad(f'{at}.type must be "function", got {shown(call["type"])}', f"{at}.type")
        fn = call["function"]
        item = {
            "type": "function",
            "function": {
                "name": string(f"{at}.function.name", fn.get("name")),
                "arguments": string(f"{at}.function.arguments", fn.get("arguments", "")),
            },
        }
        if call.get("id") is not None:
            item["id"] = string(f"{at}.id", call["id"])
        out.append(item)
    return out


def _content(c: Any, where: str) -> str:
    if c is None:
        return ""
    if isinstance(c, str):
        return text(f"{where}.content", c)
    if isinstance(c, list):
        texts = []
        for part in c:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise bad(
                    f"{where}.content: only text parts are supported", f"{where}.content", "invalid_type"
                )
            texts.append(part["text"])
        return text(f"{where}.content", "".join(texts))
    raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content", "invalid_type")


def for_template(messages: list[dict[str, Any]], template: Any) -> list[dict[str, Any]]:
    """The messages with only the fields the chat template reads: role and content always,
    `name`, `tool_calls` and `tool_call_id` where the template mentions them (one that
    does not would drop them silently anyway; one that iterates a message's keys would
    print them)."""
    source = template if isinstance(template, str) else str(template or "")
    return [{k: v for k, v in m.items() if k in ("role", "content") or k in source} for m in messages]
