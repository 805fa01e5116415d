"""The sandbox a chat template runs in: Jinja's immutable sandbox, with every step counted
and every value measured against `files.LIMITS`.

A chat template is a Jinja program shipped with a checkpoint, so it is untrusted code.
Jinja's sandbox stops it reaching Python's internals, but not from looping or
allocating without end: three nested `range(99999)` loops run for days, `('a' * 99999) *
99999` asks for 10 GB. Here:

- steps: every loop iteration (the compiler is made to wrap each `for` in a counter),
  every element of a `range` and every operation the sandbox sees (a call, an attribute,
  an item, an operator) counts, up to `template_iterations` (more for long
  conversations), and the clock is read at each step against `template_seconds`;
- size: every value an operation builds, each `~` concatenation and the output as it
  streams hold at most `template_chars` characters (or items) beyond four times the
  conversation's own; the operations whose result can outgrow their inputs (`*`, `**`,
  `%` and `format` widths, `replace`, `join`, `indent`, width arguments, a container
  turned into text) are measured before they run.

Going over one is a `TemplateLimitError`. The names a template may use are those
`transformers` gives one (`raise_exception`, `strftime_now`, `tojson`, `namespace`,
`dict`, `{% generation %}`, loop controls).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import re
import string
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.visitor import NodeTransformer

from ..files import LIMITS

_LOOP, _SIZED, _TEXT = "__refusion_loop", "__refusion_sized", "__refusion_text"  # checks the compiler calls
_MOST_BITS = 2**16  # a number a template builds (some 20,000 digits)
# the filters that turn their subject into text first: a container's text is measured before
_TEXT_FILTERS = frozenset(
    "string tojson pprint format join e escape forceescape safe upper lower title capitalize trim "
    "center indent wordwrap truncate striptags replace urlencode xmlattr wordcount".split()
)


class TemplateLimitError(jinja2.TemplateError):
    """A chat template went over one of its bounds (steps, time, size)."""


@dataclasses.dataclass
class Budget:
    """What one render may still spend: steps, and the characters (or items) of a value."""

    steps: int
    chars: int
    deadline: float
    allowed: int = 0  # the steps it started with, for the message

    def step(self, n: int = 1) -> None:
        self.steps -= n
        if self.steps < 0:
            raise TemplateLimitError(
                "it takes more steps (loop iterations, range elements, operations) than a chat template "
                f"needs, over {self.allowed:,} (a limit of this reader)"
            )
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"it runs longer than {LIMITS.template_seconds:g} s (a limit of this reader)"
            )

    def fits(self, size: int, what: str = "a value") -> None:
        if size > self.chars:
            raise TemplateLimitError(
                f"it builds {what} of {size:,} characters or items, more than a prompt needs "
                f"(over {self.chars:,}, a limit of this reader)"
            )

    def sized(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict, set, range)):
            self.fits(len(value))
        elif isinstance(value, int) and value.bit_length() > _MOST_BITS:
            raise TemplateLimitError(
                f"it builds a number of over {_MOST_BITS:,} bits (a limit of this reader)"
            )
        return value


_budget: contextvars.ContextVar[Budget] = contextvars.ContextVar("chat_template_budget")


@contextlib.contextmanager
def spending(budget: Budget) -> Iterator[Budget]:
    """Renders in this context (this thread's, or this task's) spend `budget`."""
    token = _budget.set(budget)
    try:
        yield budget
    finally:
        _budget.reset(token)


def _spend(n: int = 1) -> Budget:
    budget = _budget.get()
    budget.step(n)
    return budget


# ---------------------------------------------------------------------------- the environment
class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every operation it intercepts counted and measured."""

    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _spend()
        if operator == "*":
            budget.fits(_repeated_size(left, right) or _repeated_size(right, left))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if abs(left).bit_length() * right > _MOST_BITS:
                raise TemplateLimitError(
                    f"it raises a number to the power {right}, over {_MOST_BITS:,} bits "
                    "(a limit of this reader)"
                )
        elif operator == "%" and isinstance(left, str):
            _check_printf(budget, left, right)
        return budget.sized(super().call_binop(context, operator, left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _spend()
        value = super().getattr(obj, attribute)
        if isinstance(obj, str) and attribute in ("format", "format_map") and callable(value):
            return _checked_format(obj, value)
        return value

    def getitem(self, obj: Any, argument: Any) -> Any:
        _spend()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _spend()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_method(budget, owner, getattr(__obj, "__name__", ""), args, kwargs)
        return budget.sized(super().call(__context, __obj, *args, **kwargs))


def _text_size(budget: Budget, value: Any) -> int:
    """About how many characters `value` is as text, each container element a step: a
    list of many references to one long string is small in memory but huge as text."""
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 4
        elif isinstance(item, (list, tuple, set, frozenset, dict)):
            for part in item.items() if isinstance(item, dict) else item:
                budget.step()
                stack.append(part)
        else:
            total += 24  # a number, None, an object's name
        if total > budget.chars:
            break
    return total


def _as_text(value: Any) -> Any:
    """`value`, once it is known to fit as text (what the compiler wraps each operand of
    `~` in, and the environment's `finalize` applies to each `{{ }}`)."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        budget = _budget.get()
        budget.fits(_text_size(budget, value), "a value as text")
    return value


def _repeated_size(seq: Any, times: Any) -> int:
    """The length of `seq * times` for a string or list repeated, else 0."""
    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and not isinstance(times, bool):
        return len(seq) * max(times, 0)
    return 0


_WIDTHS = re.compile(r"%[-+ #0]*(\d+)|\.(\d+)")


def _check_printf(budget: Budget, fmt: str, args: Any) -> None:
    """`fmt % args` within bounds: the widths and precisions written in `fmt`, and those
    passed as numbers (`%*d`)."""
    widths = [int(a or b) for a, b in _WIDTHS.findall(fmt) if len(a or b) < 12]
    if any(len(a or b) >= 12 for a, b in _WIDTHS.findall(fmt)):
        budget.fits(10**12, "a formatted value")
    values = args if isinstance(args, tuple) else (args,)
    numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    texts = sum(_text_size(budget, v) for v in values)
    budget.fits(
        len(fmt) + sum(widths) + texts + sum(max(n, 0) for n in numbers if "*" in fmt), "a formatted value"
    )


def _checked_format(text: str, method: Callable[..., str]) -> Callable[..., str]:
    """`text.format` (the sandbox's), refusing widths beyond the bounds before it runs."""

    def format_checked(*args: Any, **kwargs: Any) -> str:
        budget = _spend()
        widths = 0
        for _literal, _field, spec, _conversion in string.Formatter().parse(text):
            digits = re.findall(r"\d+", spec or "")
            if any(len(d) >= 12 for d in digits):
                budget.fits(10**12, "a formatted value")
            widths += sum(int(d) for d in digits)
        values = (*args, *kwargs.values())
        numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        texts = sum(_text_size(budget, v) for v in values)
        budget.fits(len(text) + widths + texts + sum(max(n, 0) for n in numbers), "a formatted value")
        return budget.sized(method(*args, **kwargs))

    return format_checked


def _check_method(budget: Budget, owner: str, name: str, args: tuple, kwargs: dict) -> None:
    """A string's method, measured before it runs where its result can outgrow its
    inputs: number arguments (widths: `ljust`, `center`, `zfill`) and `replace`, `join`,
    `expandtabs`."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            budget.fits(abs(value), "a width or count")
    if name == "replace" and len(args) >= 2:
        budget.fits(_replaced_size(owner, args[0], args[1], args[2] if len(args) > 2 else -1))
    elif name == "join" and args:
        budget.fits(_joined_size(owner, args[0]))
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        budget.fits(len(owner) + owner.count("\t") * (size if isinstance(size, int) else 8))


def _replaced_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    """The length of `text.replace(old, new, count)`, computed without making it."""
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    found = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * (len(new) - len(old))


def _joined_size(separator: Any, items: Any) -> int:
    """The length of `separator.join(items)` (or the `join` filter's), roughly, without making it."""
    if not isinstance(items, (list, tuple, str)):
        return 0
    parts = sum(len(x) if isinstance(x, str) else 8 for x in items)
    return parts + len(str(separator)) * max(len(items) - 1, 0)


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A filter counted, its arguments measured as a method's are, its result sized."""

    passed = getattr(fn, "jinja_pass_arg", None)  # the context or environment Jinja passes first

    def run(*args: Any, **kwargs: Any) -> Any:
        budget = _spend()
        values = args[1:] if passed is not None else args
        subject, rest = (values[0], values[1:]) if values else (None, ())
        if name in _TEXT_FILTERS:
            _as_text(subject)
        for value in (*rest, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                budget.fits(abs(value), "a width or count")
        if name == "replace" and len(rest) >= 2:
            budget.fits(_replaced_size(str(subject), rest[0], rest[1], rest[2] if len(rest) > 2 else -1))
        elif name == "join":
            budget.fits(_joined_size(rest[0] if rest else kwargs.get("d", ""), subject))
        elif name == "indent" and isinstance(subject, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            lines = subject.count("\n") + 1
            budget.fits(len(subject) + lines * (len(width) if isinstance(width, str) else width))
        elif name == "format" and isinstance(subject, str):
            _check_printf(budget, subject, tuple(rest))
        elif name == "tojson":
            indent = kwargs.get("indent", rest[1] if len(rest) > 1 else None)
            if isinstance(indent, int) and indent > 64:
                raise TemplateLimitError("it indents JSON by more than 64 spaces (a limit of this reader)")
        return budget.sized(fn(*args, **kwargs))

    if passed is not None:
        run.jinja_pass_arg = passed  # type: ignore[attr-defined]
    return run


def _loop(items: Any) -> Iterator[Any]:
    """A loop's items, one step each (the compiler is made to wrap every `for` in this)."""
    budget = _budget.get()
    for item in items:
        budget.step()
        yield item


def _sized(value: Any) -> Any:
    """A `~` concatenation's result, measured (the compiler is made to wrap each in this)."""
    return _budget.get().sized(value)


def _range(*args: int) -> range:
    """Jinja's sandboxed `range`, each element a step."""
    items = safe_range(*args)
    _spend(len(items))
    return items


class _Bounded(NodeTransformer):
    """Rewrites a parsed template so every loop steps the budget and every `~` is measured
    (its operands as text before they are joined, and the result)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:  # noqa: N802 (Jinja's visitor names)
        self.generic_visit(node)  # in place
        node.iter = nodes.Call(nodes.Name(_LOOP, "load"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:  # noqa: N802
        self.generic_visit(node)  # in place
        node.nodes = [nodes.Call(nodes.Name(_TEXT, "load"), [n], [], None, None) for n in node.nodes]
        return nodes.Call(nodes.Name(_SIZED, "load"), [node], [], None, None)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`, which marks the assistant's text for
    training masks in transformers; here it renders its body as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing attributes that start with an underscore (as transformers does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in dict(*args, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


class _Dict:
    """`dict` as a template may call it (and `dict.fromkeys`), not the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """JSON without Jinja's HTML escaping, as transformers gives templates."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compiled(source: str) -> jinja2.Template:
    """The template compiled in the bounded environment (cached: a server renders the
    same template for every request)."""
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols], finalize=_as_text
    )
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.filters["tojson"] = _bounded_filter("tojson", _tojson)
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
        range=_range,
        **{_LOOP: _loop, _SIZED: _sized, _TEXT: _as_text},
    )
    return env.from_string(_Bounded().visit(env.parse(source)))
