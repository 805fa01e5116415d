"""The fields of every settings dataclass: each field's bounds and help are written once,
in its metadata (`knob`), and checked in one place (`check_value`, raising a FieldError
that names the field). The CLI builds its flags from the same metadata, the server checks
request bodies with it, and io checks a checkpoint's files with `check_scalar`, so every
such error reads the same. No torch here: this sits below every stage.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import field
from typing import Any

from ..errors import ConfigError


def knob(
    default: Any,
    help: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple[str, ...] | None = None,
    most: int | None = None,
    flag: bool = True,
    http: bool = True,
) -> Any:
    """A config field with its bounds (`most`: items of a list field) and help; `flag` /
    `http` say whether the CLI and the HTTP request expose it under its own name."""
    meta = {"help": help, "lo": lo, "hi": hi, "choices": choices, "most": most, "flag": flag, "http": http}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


class FieldError(ConfigError):
    """A value that one field cannot take. `field` names it and `wrong_type` says whether
    the value had the wrong type (else it was out of range), so that a driver can point
    at the field in its own terms (the server: its `param` and `code`)."""

    def __init__(self, field: str, message: str, *, wrong_type: bool = False) -> None:
        super().__init__(message)
        self.field, self.wrong_type = field, wrong_type


def check_fields(cfg: Any) -> None:
    """Check every field of a config dataclass against its `knob` metadata."""
    for f in dataclasses.fields(cfg):
        check_value(f, getattr(cfg, f.name))


def check_value(f: dataclasses.Field, value: Any) -> Any:
    """`value` checked against field f's type and bounds, as the field stores it (a list
    as a tuple, a lone string for a list of strings as a 1-tuple, a float field's integer
    as a float); FieldError naming the field otherwise."""
    if value is None and "None" in str(f.type):
        return value
    kind = field_kind(f)
    if kind == "tuple":
        return _check_items(f, value)
    if kind == "pairs":
        return _check_pairs(f, value)
    value = check_scalar(
        f.name,
        kind,
        value,
        lo=f.metadata.get("lo"),
        hi=f.metadata.get("hi"),
        choices=f.metadata.get("choices"),
    )
    return float(value) if kind == "float" else value


def check_scalar(
    name: str,
    kind: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """`value` checked to be a `kind` ('bool', 'int', 'float', 'str') within the bounds or
    choices; FieldError naming `name` otherwise. Fields and the server's own request
    fields (max_tokens, stream) share it, so every such error reads the same."""
    if not _is_kind(kind, value):
        raise FieldError(name, f"{name} must be {_WANT[kind]}, got {_what(value)}", wrong_type=True)
    if choices and value not in choices:
        raise FieldError(name, f"{name} must be one of {', '.join(choices)}, got {shown(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise FieldError(name, f"{name} must be {bounds_text(lo, hi)}, got {shown(value)}")
    return value


_WANT = {"bool": "a boolean", "int": "an integer", "float": "a finite number", "str": "a string"}


def _is_kind(kind: str, value: Any) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return (is_int or isinstance(value, float)) and math.isfinite(value)
    return {"bool": isinstance(value, bool), "int": is_int, "str": isinstance(value, str)}[kind]


def _check_items(f: dataclasses.Field, value: Any) -> tuple:
    """A list field: a list or tuple (a lone string, where it holds strings) of at most
    `most` items, each of its item type within its bounds. Strings must not be empty: an
    empty stop string would end every text before it starts."""
    name, meta, most = f.name, f.metadata, f.metadata.get("most")
    strings = "str" in str(f.type)
    items = (value,) if strings and isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(
        _is_kind("str" if strings else "int", v) for v in items
    ):
        want = "a string or a list of strings" if strings else "a list of integers"
        raise FieldError(name, f"{name} must be {want}, got {_what(value)}", wrong_type=True)
    if (most is not None and len(items) > most) or (strings and not all(items)):
        limit = f"at most {most} " if most is not None else ""
        raise FieldError(
            name, f"{name} takes {limit}{'non-empty strings' if strings else 'items'}, got {shown(value)}"
        )
    for v in items:
        check_scalar(name, "str" if strings else "int", v, lo=meta.get("lo"), hi=meta.get("hi"))
    return tuple(items)


def _check_pairs(f: dataclasses.Field, value: Any) -> tuple:
    """A map field (token id -> number): a dict or (id, number) pairs, at most `most`
    of them, ids >= 0, numbers within the field's bounds; stored as sorted pairs. JSON's
    keys are strings: a key of decimal digits is taken as its id."""
    name, meta, most = f.name, f.metadata, f.metadata.get("most")
    items = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in items
    ):
        raise FieldError(name, f"{name} must map token ids to numbers, got {_what(value)}", wrong_type=True)
    if most is not None and len(items) > most:
        raise FieldError(name, f"{name} takes at most {most} entries, got {len(items)}")
    pairs = {}
    for key, number in items:
        tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 else key
        if not _is_kind("int", tid) or not 0 <= tid < 2**31:
            raise FieldError(name, f"{name} keys must be token ids (integers >= 0), got {shown(key)}")
        where = f"{name}[{shown(key)}]"
        pairs[tid] = float(check_scalar(where, "float", number, lo=meta["lo"], hi=meta["hi"]))
    return tuple(sorted(pairs.items()))


def field_kind(f: dataclasses.Field) -> str:
    """'bool', 'int', 'float', 'str', 'tuple' or 'pairs' (a map of ids to numbers), from
    the field's annotation."""
    t = str(f.type)
    if t.startswith("tuple[tuple"):
        return "pairs"
    for kind in ("tuple", "bool", "float", "int", "str"):
        if t.startswith(kind):
            return kind
    raise TypeError(f"field {f.name} has an unsupported type {t}")


def bounds_text(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    return f">= {lo}" if lo is not None else f"<= {hi}"


_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlevel = 60, 60, 3


def shown(value: Any) -> str:
    """A value quoted in an error, cut short: a request's value may be megabytes long, or
    an integer of thousands of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return _short.repr(value)


def _what(value: Any) -> str:
    """A value of the wrong type, for "x must be ..., got ...": quoted with its type, or
    named where JSON's non-finite numbers would print as Python's (nan, inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return (
            "NaN"
            if math.isnan(value)
            else f"{'-' if value < 0 else ''}Infinity (or a number too large for a double)"
        )
    return f"{shown(value)} ({type(value).__name__})"
