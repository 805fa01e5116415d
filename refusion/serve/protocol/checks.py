"""The checks a request's fields go through: DecodeConfig's own (the bounds and help the
CLI's flags are made from), their errors as 400s that name the field as the request
calls it, and text that must be Unicode to be tokenised."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ...errors import ConfigError
from ...settings.fields import FieldError, check_scalar, check_value
from .errors import bad, library_error


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


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
        raise library_error(e) from None


def decode_value(f: dataclasses.Field, value: Any) -> Any:
    """A request's value for DecodeConfig field f (same name), by DecodeConfig's own check."""
    with as_request_error(f.name):
        return check_value(f, value)


def own_value(name: str, kind: str, value: Any, **bounds: Any) -> Any:
    """A value of one of the server's own request fields (max_tokens, stream, preset, a
    message's strings), checked the way DecodeConfig's fields are."""
    with as_request_error(name):
        return check_scalar(name, kind, value, **bounds)


def string(where: str, v: Any) -> str:
    """A string field's value, checked as a string and as text."""
    return text(where, own_value(where, "str", v))


def text(where: str, v: str, param: str | None = None) -> str:
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
