"""The OpenAI wire format: request validation, decode settings per request, response bodies.

Validation is written out by hand (not pydantic) so that every rejection names its field
the way OpenAI does: `{"error": {"message", "type", "param", "code"}}` with a 4xx status.
The decoding fields (temperature, top_p, seed, stop, ReFusion's knobs) are checked by
DecodeConfig's own check, whose FieldError becomes the 400 (`as_request_error`), and each
prompt is prepared (tokenised, checked, fitted to the context) by the decode layer's
`Admission`, whose errors become 400s here (`admit`).
Fields that OpenAI defines and that would change the answer in a way we cannot honour
(logprobs, tools, n > 1, penalties, ...) are refused; harmless ones (`user`, `metadata`,
...) are accepted and ignored; anything else is an unrecognised argument, as at OpenAI.
ReFusion's own knobs ride along as extra body fields (`extra_body` in the openai client).
Messages follow the same rule: OpenAI's message fields are accepted (`name`, an
assistant's `tool_calls` and `refusal`, a tool's `tool_call_id`), type-checked, and
passed to the chat template where it can use them; anything else is refused.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..decode.admit import Admission, PreparedRequest
from ..decode.fit import NoRoomError
from ..errors import ChatTemplateError, ConfigError, PromptError
from ..settings.decode import PRESETS, DecodeConfig
from ..settings.fields import FieldError, check_scalar, check_value, shown


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message, param = _printable(message), _printable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _printable(text: str | None) -> str | None:
    """Text that encodes as UTF-8: an error may quote the request, and a lone surrogate
    from a JSON escape (\\ud800) would make the error response itself fail."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


# ------------------------------------------------------------------ field checks
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


@contextmanager
def as_request_error(param: str | None = None) -> Iterator[None]:
    """DecodeConfig's errors as 400s: a FieldError points at its field as the request
    calls it (`param`, else the field's own name), "invalid_type" for a value of the
    wrong type and "invalid_value" for one out of range; any other ConfigError is an
    "invalid_config" of the request as a whole."""
    try:
        yield
    except FieldError as e:
        raise bad(str(e), param or e.field, "invalid_type" if e.wrong_type else "invalid_value") from None
    except ConfigError as e:
        raise bad(str(e), None, "invalid_config") from None


def _decode_value(f: dataclasses.Field, value: Any) -> Any:
    """A request's value for DecodeConfig field f (same name), by DecodeConfig's own check."""
    with as_request_error(f.name):
        return check_value(f, value)


def _own_value(name: str, kind: str, value: Any, **bounds: Any) -> Any:
    """A value of one of the server's own request fields (max_tokens, stream, preset, a
    message's strings), checked the way DecodeConfig's fields are."""
    with as_request_error(name):
        return check_scalar(name, kind, value, **bounds)


# request field -> the DecodeConfig field it sets under its own name (method, slot_size, .., stop_token_ids);
# max_tokens sets gen_length once fitted to the prompt (`admit`), and stop sets stop
DECODE_FIELDS = {f.name: f for f in dataclasses.fields(DecodeConfig) if f.metadata.get("http", True)}
_STOP = next(f for f in dataclasses.fields(DecodeConfig) if f.name == "stop")
# accepted and ignored
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
# accepted only at the value that means "off" (anything else would change the answer)
NEUTRAL = {
    "n": lambda v: v == 1 and _is_int(v),
    "best_of": lambda v: v == 1 and _is_int(v),
    "presence_penalty": lambda v: _is_number(v) and v == 0,
    "frequency_penalty": lambda v: _is_number(v) and v == 0,
    "repetition_penalty": lambda v: _is_number(v) and v == 1,
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: _is_int(v) and v == 0,
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "logit_bias": lambda v: v == {},
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "tool_choice": lambda v: v in ("none", "auto"),
    "function_call": lambda v: v in ("none", "auto"),
    "response_format": lambda v: v == {"type": "text"},
}
COMMON = {"model", "max_tokens", "stop", "stream", "preset", *DECODE_FIELDS, *IGNORED, *NEUTRAL}
FIELDS = {
    "completion": COMMON | {"prompt"},
    "chat": COMMON | {"messages", "max_completion_tokens"},
}
ROLES = {"system", "developer", "user", "assistant", "tool"}
# message fields by role, beyond role and content (`name` is allowed on every message)
MESSAGE_FIELDS = {"assistant": {"name", "tool_calls", "refusal"}, "tool": {"name", "tool_call_id"}}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", "include_slots"}
MAX_PROMPTS = 64
MAX_TOKENS = 2**31 - 1  # beyond any context; keeps the numbers in length errors printable


@dataclass
class CompletionRequest:
    """A validated request: what to decode and how (the settings still unresolved)."""

    kind: str  # "completion" or "chat"
    model: str | None
    prompts: list[str | list[int]] | None = None  # completion: text or token ids, one choice each
    messages: list[dict[str, Any]] | None = None  # chat: role and content (text), and the tool fields given
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    include_slots: bool = False  # stream the decoder's per-step slot events (docs/playground.md#events)
    preset: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # DecodeConfig fields


def parse_request(body: Any, kind: str) -> CompletionRequest:
    """Check a decoded JSON body for /v1/completions (kind "completion") or
    /v1/chat/completions ("chat"); raise APIError (400) on the first problem."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    body = {k: v for k, v in body.items() if v is not None}  # null = not given, as at OpenAI
    for name, ok in NEUTRAL.items():
        if name in body and not ok(body[name]):
            raise bad(
                f"{name}={shown(body[name])} is not supported by this server", name, "unsupported_value"
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model", "invalid_type")
    req = CompletionRequest(kind=kind, model=model)
    if kind == "completion":
        if "prompt" not in body:
            raise bad("you must provide a prompt", "prompt", "missing_required_parameter")
        req.prompts = _prompts(body["prompt"])
    else:
        if "messages" not in body:
            raise bad("you must provide messages", "messages", "missing_required_parameter")
        req.messages = _messages(body["messages"])
    for name in ("max_tokens", "max_completion_tokens"):
        if name in body:
            req.max_tokens = _own_value(name, "int", body[name], lo=1, hi=MAX_TOKENS)
    if "stop" in body:
        req.stop = list(_decode_value(_STOP, body["stop"]))
    req.stream = _own_value("stream", "bool", body.get("stream", False))
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - STREAM_OPTIONS:
            raise bad(
                "stream_options must be an object with include_usage or include_slots",
                "stream_options",
                "invalid_type",
            )
        req.include_usage = _own_value(
            "stream_options.include_usage", "bool", opts.get("include_usage", False)
        )
        req.include_slots = _stream_slots(opts, req.stream)
    if "preset" in body:
        req.preset = _own_value("preset", "str", body["preset"], choices=PRESETS)
    req.overrides = {name: _decode_value(f, body[name]) for name, f in DECODE_FIELDS.items() if name in body}
    return req


def _stream_slots(opts: dict[str, Any], stream: bool) -> bool:
    """stream_options.include_slots: the per-step slot events, which only a stream carries."""
    on = _own_value("stream_options.include_slots", "bool", opts.get("include_slots", False))
    if on and not stream:
        raise bad(
            'stream_options.include_slots needs "stream": true (the slot events come as stream chunks)',
            "stream_options.include_slots",
        )
    return on


def _prompts(p: Any) -> list[str | list[int]]:
    if isinstance(p, str):
        return [_text("prompt", p)]
    if not isinstance(p, list) or not p:
        raise bad(
            "prompt must be a string, a list of strings, or token ids (a list of integers or of lists)",
            "prompt",
            "invalid_type",
        )
    if all(_is_int(t) for t in p):
        return [list(p)]
    if all(isinstance(t, str) for t in p) or all(
        isinstance(t, list) and t and all(_is_int(x) for x in t) for t in p
    ):
        if len(p) > MAX_PROMPTS:
            raise bad(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt")
        return [
            _text(f"prompt[{i}]", t, "prompt") if isinstance(t, str) else list(t) for i, t in enumerate(p)
        ]
    raise bad(
        "prompt must be a string, a list of strings, or token ids (a list of integers or of lists)",
        "prompt",
        "invalid_type",
    )


def _messages(msgs: Any) -> list[dict[str, Any]]:
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
            out[name] = _string(f"{where}.{name}", m[name])
    if m.get("refusal") is not None:
        _string(
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
                "name": _string(f"{at}.function.name", fn.get("name")),
                "arguments": _string(f"{at}.function.arguments", fn.get("arguments", "")),
            },
        }
        if call.get("id") is not None:
            item["id"] = _string(f"{at}.id", call["id"])
        out.append(item)
    return out


def _string(where: str, v: Any) -> str:
    return _text(where, _own_value(where, "str", v))


def _text(where: str, v: str, param: str | None = None) -> str:
    """`v`, if it is Unicode text: a lone surrogate (a JSON escape such as \\ud800 with
    no pair) cannot be tokenised."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(
            f"{where} has a lone surrogate ({v[e.start]!r} at {e.start}), "
            "which is not text; send valid UTF-8",
            param or where,
            "invalid_value",
        ) from None
    return v


def _content(c: Any, where: str) -> str:
    if c is None:
        return ""
    if isinstance(c, str):
        return _text(f"{where}.content", c)
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
        return _text(f"{where}.content", "".join(texts))
    raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content", "invalid_type")


# ------------------------------------------------------------------ decode settings
def request_config(base: DecodeConfig, req: CompletionRequest) -> DecodeConfig:
    """The server's DecodeConfig with the request's preset (its slot settings only: the
    server's sampling settings stay) and knobs on top, and the request's stop strings
    (gen_length is set later, per prompt, by `admit`)."""
    with as_request_error():
        cfg = DecodeConfig.preset(req.preset, base) if req.preset else base
        return cfg.replace(**req.overrides, stop=tuple(req.stop) or cfg.stop)


def admit(
    admission: Admission, prompt: Any, cfg: DecodeConfig, max_tokens: int | None, param: str
) -> PreparedRequest:
    """One prompt prepared by the engine's admission (max_tokens must fit as it is;
    omitted, the server's gen_length is lowered to what fits), or a 400 whose `param` is
    the setting its advice changes (`param`, the prompt's field, when only the prompt can)."""
    try:
        return admission.prepare(
            prompt, cfg, chat=False, length=max_tokens, lower=True, length_name="max_tokens"
        )
    except NoRoomError as e:
        raise bad(str(e), e.setting or param, "context_length_exceeded") from None
    except PromptError as e:
        raise bad(str(e), param, e.code) from None
    except ChatTemplateError as e:
        raise bad(f"the chat template rejected the messages: {e}", param) from None


# ------------------------------------------------------------------ response bodies
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_body(
    kind: str, rid: str, model: str, choices: list[tuple[str, str]], use: dict[str, int]
) -> dict[str, Any]:
    """A whole (non-streamed) completion; choices = [(text, finish_reason), ...]."""
    if kind == "chat":
        items = [
            {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": r}
            for i, (t, r) in enumerate(choices)
        ]
        obj = "chat.completion"
    else:
        items = [
            {"index": i, "text": t, "logprobs": None, "finish_reason": r} for i, (t, r) in enumerate(choices)
        ]
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": items,
        "usage": use,
    }


def chunk_body(
    kind: str, rid: str, model: str, index: int, text: str | None, finish: str | None, *, first: bool = False
) -> dict[str, Any]:
    """One server-sent event of a streamed completion."""
    if kind == "chat":
        delta: dict[str, str] = (
            {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        )
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
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
