"""OpenAI's error object, and the one place where an error of the library or of the
engine loop becomes one: the request's own fault is a 400 naming its field, a full
queue a 429 with Retry-After, a server that stops a 503, anything else a 500."""

from __future__ import annotations

from typing import Any

from ...decode.fit import NoRoomError
from ...errors import (
    ChatTemplateError,
    CompileError,
    ContextLengthError,
    MissingMaskTokenError,
    PromptError,
    ReFusionError,
)
from ...settings.fields import FieldError
from ..loop import QueueFull, ShuttingDown


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
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """A 400: the request's own fault, `param` the field it is about."""
    return APIError(400, message, param=param, code=code)


def _printable(text: str) -> str:
    """Text that encodes as UTF-8: an error may quote the request, and a lone surrogate
    from a JSON escape (\\ud800) would make the error response itself fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def library_error(e: BaseException, param: str | None = None) -> APIError:
    """`e` as an API error. `param` is the field that holds the prompt (`prompt`,
    `messages`) while it is prepared: a prompt's errors name it, a length error names
    the setting its advice changes (the prompt's field when only the prompt can)."""
    if isinstance(e, (QueueFull, ShuttingDown, CompileError)):
        return _server_state(e)
    if isinstance(e, NoRoomError):
        return bad(str(e), e.setting or param, "context_length_exceeded")
    if isinstance(e, PromptError):
        return bad(str(e), param, e.code)
    if isinstance(e, ChatTemplateError):
        return bad(f"the chat template rejected the messages: {e}", param)
    if isinstance(e, FieldError):  # a setting the model cannot take (a logit_bias id past its vocabulary)
        return bad(str(e), e.field, "invalid_value")
    if isinstance(e, ReFusionError):
        return bad(str(e), None, _code(e))
    return APIError(500, f"decoding failed: {type(e).__name__}", type="server_error", code="internal_error")


def _server_state(e: QueueFull | ShuttingDown | CompileError) -> APIError:
    """Errors that are not the request's fault: the client may retry (429, 503), or the
    server's setup is wrong (--compile on a machine that cannot: 500)."""
    if isinstance(e, QueueFull):
        return APIError(
            429,
            f"the server is busy ({e.max_queue} requests waiting); retry in {e.retry_after} s",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(e.retry_after)},
        )
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), type="server_error", code="shutting_down")
    return APIError(500, str(e), type="server_error", code="compile_failed")


def _code(e: ReFusionError) -> str:
    if isinstance(e, ContextLengthError):
        return "context_length_exceeded"
    if isinstance(e, MissingMaskTokenError):
        return "missing_mask_token"
    return "invalid_config"
