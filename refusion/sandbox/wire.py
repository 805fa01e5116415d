"""Plain data across the sandbox's pipe: the only thing a candidate program can hand to
the trusted checker.

A value travels as a JSON structure with tags for the types JSON lacks. Decoding builds
only int, float, complex, bool, None, str, bytes, list, tuple, dict, set and frozenset,
of exactly those types: no object of the candidate's making (an `__eq__` that always
says yes, a float subclass) can reach the checker, whatever bytes it writes. Anything
else, too deep, too large or malformed, is `NotPlainData`.

Integers and floats go as hexadecimal (exact, no digit limit, NaN and infinities
included); builtin types (`int`, `str`, ...) by name. A value of the program's own
making that is not plain data (an instance of its class) travels as a reference (`ref`
and `resolve` hooks): the checker can hand it back to the program's functions and
do nothing else with it. This module imports nothing of the package: the sandbox copies
it next to the programs it runs.
"""

import json

MAX_DEPTH = 100
MAX_LINE = 64 << 20  # bytes of one message


class NotPlainData(BaseException):
    """A value that is not plain data, or a message that does not decode. A BaseException,
    so that a test's `except Exception` cannot swallow it."""


_COLLECTIONS = {tuple: "t", set: "s", frozenset: "fs"}
TYPES = {
    t.__name__: t
    for t in (int, float, complex, bool, str, bytes, bytearray, list, tuple, dict, set, frozenset)
}


def to_json(value, depth=0, ref=None):
    """The JSON structure of a plain value. Anything else goes to `ref(value)` (a JSON
    reference to it), or is NotPlainData when there is no `ref`. Subclasses of the plain
    types travel as their base type's value (read without calling any method the
    subclass may override)."""
    if depth > MAX_DEPTH:
        raise NotPlainData(f"nested more than {MAX_DEPTH} levels deep")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        return {"i": int.__format__(value, "x")}
    if isinstance(value, float):
        return {"f": float.hex(value)}
    if isinstance(value, complex):
        return {"c": [float.hex(complex.real.__get__(value)), float.hex(complex.imag.__get__(value))]}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if isinstance(value, list):
        return [to_json(v, depth + 1, ref) for v in list.__iter__(value)]
    if isinstance(value, dict):
        return {"d": [[to_json(k, depth + 1, ref), to_json(v, depth + 1, ref)] for k, v in dict.items(value)]}
    for kind, tag in _COLLECTIONS.items():
        if isinstance(value, kind):
            return {tag: [to_json(v, depth + 1, ref) for v in kind.__iter__(value)]}
    if isinstance(value, type) and TYPES.get(getattr(value, "__name__", None)) is value:
        return {"ty": value.__name__}
    if ref is not None:
        return {"r": ref(value)}
    raise NotPlainData(f"a {type(value).__name__} is not plain data")


def from_json(obj, depth=0, resolve=None):
    """The plain value of a JSON structure made by `to_json`; a reference becomes
    `resolve(reference)`. NotPlainData otherwise."""
    if depth > MAX_DEPTH:
        raise NotPlainData(f"nested more than {MAX_DEPTH} levels deep")
    if obj is None or type(obj) is bool or type(obj) is str:
        return obj
    if type(obj) is list:
        return [from_json(v, depth + 1, resolve) for v in obj]
    if type(obj) is not dict or len(obj) != 1:
        raise NotPlainData(f"malformed value ({type(obj).__name__})")
    ((tag, body),) = obj.items()
    try:
        if tag == "i":
            return int(_text(body), 16)
        if tag == "f":
            return float.fromhex(_text(body))
        if tag == "c" and type(body) is list and len(body) == 2:
            return complex(float.fromhex(_text(body[0])), float.fromhex(_text(body[1])))
        if tag == "b":
            return bytes.fromhex(_text(body))
        if tag == "d" and type(body) is list:
            return {
                from_json(_pair(p)[0], depth + 1, resolve): from_json(_pair(p)[1], depth + 1, resolve)
                for p in body
            }
        if tag in ("t", "s", "fs") and type(body) is list:
            items = [from_json(v, depth + 1, resolve) for v in body]
            return {"t": tuple, "s": set, "fs": frozenset}[tag](items)
        if tag == "ty" and type(body) is str and body in TYPES:
            return TYPES[body]
        if tag == "r" and resolve is not None:
            return resolve(body)
    except (ValueError, TypeError, OverflowError) as e:  # a bad number, an unhashable set member
        raise NotPlainData(f"malformed value: {e}") from None
    raise NotPlainData(f"malformed value (tag {tag!r})")


def _text(body):
    if type(body) is not str or len(body) > MAX_LINE:
        raise NotPlainData("malformed number")
    return body


def _pair(p):
    if type(p) is not list or len(p) != 2:
        raise NotPlainData("malformed dict item")
    return p


def dumps(message):
    """One message (a dict of JSON structures) as one line of bytes."""
    return json.dumps(message, separators=(",", ":")).encode("utf-8") + b"\n"


def loads(line):
    """A message line back into a dict; NotPlainData if it is not one (too long, not
    JSON, nested too deep for the parser)."""
    if len(line) > MAX_LINE:
        raise NotPlainData(f"a message over {MAX_LINE >> 20} MiB")
    try:
        message = json.loads(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise NotPlainData(f"not a message: {type(e).__name__}") from None
    if type(message) is not dict:
        raise NotPlainData("not a message")
    return message


def read_line(stream):
    """The next line of a binary stream, at most MAX_LINE bytes; b"" at its end."""
    line = stream.readline(MAX_LINE + 1)
    if len(line) > MAX_LINE:
        raise NotPlainData(f"a message over {MAX_LINE >> 20} MiB")
    return line
