"""Plain data across the sandbox's pipe: the only thing a candidate program can hand to
the trusted checker.

A value travels as a JSON structure with tags for the types JSON lacks. Decoding builds
only int, float, complex, bool, None, str, bytes, list, tuple, dict, set and frozenset,
and the numbers of the standard library and numpy (`Fraction`, `Decimal`, numpy's
numeric scalars and arrays), of exactly those types, built by the decoder from digits:
no object of the candidate's making (an `__eq__` that always says yes, a float
subclass) can reach the checker, whatever bytes it writes. Anything else, too deep, too
large or malformed, is `NotPlainData`.

Integers and floats go as hexadecimal (exact, no digit limit, NaN and infinities
included); a `Fraction` as its numerator and denominator, a `Decimal` as its sign,
digits and exponent, a numpy scalar or array as its dtype's name with its exact Python
values, so a checker compares them as the program's own process would (`np.int64(3) ==
3`, `Fraction(1, 2) == 0.5`, `Decimal("0.1") != 0.1`); builtin types (`int`, `str`, ...)
by name. A value of the program's own making that is not plain data (an instance of its
class, an iterator) travels as a reference (`ref` and `resolve` hooks): the checker can
hand it back to the program's functions, draw the next item of an iterator, and do
nothing else with it. This module imports nothing of the package: the sandbox copies it
next to the programs it runs. It imports the modules of those numbers only where they
are already loaded (encoding) or a message holds one of them (decoding).
"""

import json
import sys

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
    number = _number_to_json(value)
    if number is not None:
        return number
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
    if isinstance(value, type):
        name = getattr(value, "__name__", "")
        if TYPES.get(name) is value:
            return {"ty": name}
    if ref is not None:
        return {"r": ref(value)}
    raise NotPlainData(f"a {type(value).__name__} is not plain data")


# ------------------------------------------------------------------ numbers beyond JSON's
# numpy's dtypes that hold exact Python values (longdouble does not: a float64 cannot hold it)
NUMPY_KINDS = {
    "bool": bool,
    **{f"int{n}": int for n in (8, 16, 32, 64)},
    **{f"uint{n}": int for n in (8, 16, 32, 64)},
    **{f"float{n}": float for n in (16, 32, 64)},
    "complex64": complex,
    "complex128": complex,
}


def _loaded(module, name):
    """`module.name` if the module is already imported, else None: a value of its type
    cannot exist before it is."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def _number_to_json(value):
    """The tagged structure of a Fraction, a Decimal, or a numpy scalar or array of an
    exact dtype; None for anything else."""
    fraction = _loaded("fractions", "Fraction")
    if fraction is not None and isinstance(value, fraction):
        return {"q": [to_json(int(value.numerator)), to_json(int(value.denominator))]}
    decimal = _loaded("decimal", "Decimal")
    if decimal is not None and isinstance(value, decimal):
        sign, digits, exponent = decimal.as_tuple(value)
        exponent = exponent if isinstance(exponent, str) else to_json(int(exponent))
        return {"dec": [sign, "".join(map(str, digits)), exponent]}
    generic, ndarray = _loaded("numpy", "generic"), _loaded("numpy", "ndarray")
    if generic is not None and isinstance(value, generic) and value.dtype.name in NUMPY_KINDS:
        return {"np": [value.dtype.name, to_json(value.item())]}
    if ndarray is not None and type(value) is ndarray and value.dtype.name in NUMPY_KINDS:
        flat = [to_json(v) for v in value.ravel().tolist()]
        return {"nd": [value.dtype.name, list(value.shape), flat]}
    return None


def _number_from_json(tag, body, depth):
    """The number a `_number_to_json` structure stands for, built here from its digits."""
    if tag == "q" and type(body) is list and len(body) == 2:
        from fractions import Fraction

        return Fraction(_integer(body[0], depth), _integer(body[1], depth))
    if tag == "dec" and type(body) is list and len(body) == 3 and type(body[0]) is int and body[0] in (0, 1):
        from decimal import Decimal

        digits, exponent = _text(body[1]), body[2]
        if not (digits.isdigit() or digits == "") or not digits.isascii():
            raise NotPlainData("malformed Decimal digits")
        if exponent not in ("n", "N", "F"):
            exponent = _integer(exponent, depth)
        return Decimal((body[0], tuple(int(d) for d in digits), exponent))
    if tag in ("np", "nd") and type(body) is list and body and body[0] in NUMPY_KINDS:
        return _numpy_from_json(tag, body, depth)
    raise NotPlainData(f"malformed value (tag {tag!r})")


def _numpy_from_json(tag, body, depth):
    try:
        import numpy
    except ImportError:
        raise NotPlainData("a numpy value, and numpy does not load here") from None
    kind = NUMPY_KINDS[body[0]]
    if tag == "np" and len(body) == 2:
        return numpy.dtype(body[0]).type(_typed(from_json(body[1], depth + 1), kind))
    if tag == "nd" and len(body) == 3 and type(body[1]) is list and type(body[2]) is list:
        shape = [_typed(n, int) for n in body[1]]
        if any(n < 0 for n in shape):
            raise NotPlainData("a negative array dimension")
        flat = [_typed(from_json(v, depth + 1), kind) for v in body[2]]
        return numpy.array(flat, dtype=body[0]).reshape(shape)
    raise NotPlainData("malformed numpy value")


def _typed(value, kind):
    """`value` if it is exactly of `kind`, or a number it widens to (an int to a float or
    complex, a float to a complex), as numpy does on building the value."""
    if type(value) is kind or (type(value) is int and kind in (float, complex)):
        return value
    if type(value) is float and kind is complex:
        return value
    raise NotPlainData(f"a {type(value).__name__} where a {kind.__name__} is due")


def _integer(obj, depth):
    value = from_json(obj, depth + 1)
    if type(value) is not int:
        raise NotPlainData("malformed integer")
    return value


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
        if tag in ("q", "dec", "np", "nd"):
            return _number_from_json(tag, body, depth)
    except (ValueError, TypeError, OverflowError, ArithmeticError) as e:
        # a bad number, a zero denominator, an unhashable set member, a shape that does not fit
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
