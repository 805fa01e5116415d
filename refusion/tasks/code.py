"""Short Python functions from a templated description, checked by running.

    Write a Python function solve(xs) that returns the sum of x * 3 for each x
    in xs that is greater than 10.
    ->
    def solve(xs):
        total = 0
        for x in xs:
            if x > 10:
                total += x * 3
        return total

The answer holds the function name and test cases; the checker runs the
model's code on them in the sandbox (``code_check.run_tests``).
"""

from __future__ import annotations

import random
import re

from .base import Item, strip_eos
from .code_check import run_tests
from .vocab import FUNC_NAMES

IND = "    "


def _condition(rng: random.Random, var: str):
    """(python expression, phrase after 'is'/'are', predicate)."""
    kind = rng.choice(("even", "odd", "greater", "less"))
    if kind == "even":
        return f"{var} % 2 == 0", "even", lambda v: v % 2 == 0
    if kind == "odd":
        return f"{var} % 2 == 1", "odd", lambda v: v % 2 == 1
    c = rng.randint(2, 20)
    if kind == "greater":
        return f"{var} > {c}", f"greater than {c}", lambda v: v > c
    return f"{var} < {c}", f"less than {c}", lambda v: v < c


def _expression(rng: random.Random, var: str, identity: bool = True):
    """(python expression, function) such as ("x * 3", lambda x: x * 3)."""
    kind = rng.choice(("id", "add", "sub", "mul") if identity else ("add", "sub", "mul"))
    if kind == "id":
        return var, lambda v: v
    c = rng.randint(2, 9)
    if kind == "add":
        return f"{var} + {c}", lambda v: v + c
    if kind == "sub":
        return f"{var} - {c}", lambda v: v - c
    return f"{var} * {c}", lambda v: v * c


def _list_tests(rng: random.Random, fn) -> list:
    inputs: list[list[int]] = [[]] + [
        [rng.randint(0, 25) for _ in range(rng.randint(1, 6))] for _ in range(5)
    ]
    return [[[xs], fn(xs)] for xs in inputs]


def _aggregate(rng: random.Random, name: str):
    """Sum / list / count over xs, optionally filtered."""
    agg = rng.choice(("sum", "list", "count"))
    filtered = agg == "count" or rng.random() < 0.7
    cond, phrase, pred = _condition(rng, "x") if filtered else (None, None, lambda v: True)
    expr, f = _expression(rng, "x")
    head = f"Write a Python function {name}(xs) that returns"
    if agg == "sum":
        desc = f"{head} the sum of {expr} for each x in xs" + (f" that is {phrase}." if filtered else ".")
        var, init, update = "total", "0", f"total += {expr}"

        def fn(xs):
            return sum(f(x) for x in xs if pred(x))
    elif agg == "list":
        desc = f"{head} a list of {expr} for each x in xs" + (f" that is {phrase}." if filtered else ".")
        var, init, update = "result", "[]", f"result.append({expr})"

        def fn(xs):
            return [f(x) for x in xs if pred(x)]
    else:
        desc = f"{head} how many numbers in xs are {phrase}."
        var, init, update = "count", "0", "count += 1"

        def fn(xs):
            return sum(1 for x in xs if pred(x))

    body = [f"def {name}(xs):", f"{IND}{var} = {init}", f"{IND}for x in xs:"]
    if filtered:
        body += [f"{IND * 2}if {cond}:", f"{IND * 3}{update}"]
    else:
        body += [f"{IND * 2}{update}"]
    body.append(f"{IND}return {var}")
    return desc, body, _list_tests(rng, fn), f"{agg}_filtered" if filtered else agg


def _piecewise(rng: random.Random, name: str):
    """One value for x when a condition holds, another otherwise."""
    cond, phrase, pred = _condition(rng, "x")
    e1, f1 = _expression(rng, "x", identity=False)
    e2, f2 = _expression(rng, "x")
    desc = f"Write a Python function {name}(x) that returns {e1} if x is {phrase}, otherwise {e2}."
    body = [f"def {name}(x):", f"{IND}if {cond}:", f"{IND * 2}return {e1}", f"{IND}return {e2}"]
    xs = sorted(rng.sample(range(0, 26), 8))
    tests = [[[x], f1(x) if pred(x) else f2(x)] for x in xs]
    return desc, body, tests, "piecewise"


def _range_sum(rng: random.Random, name: str):
    """Sum of an expression of i for i = 1..n."""
    if rng.random() < 0.4:
        expr, f = rng.choice((("i", lambda i: i), ("i * i", lambda i: i * i)))
    else:
        expr, f = _expression(rng, "i", identity=False)
    desc = f"Write a Python function {name}(n) that returns the sum of {expr} for i from 1 to n."
    body = [
        f"def {name}(n):",
        f"{IND}total = 0",
        f"{IND}for i in range(1, n + 1):",
        f"{IND * 2}total += {expr}",
        f"{IND}return total",
    ]
    tests = [[[n], sum(f(i) for i in range(1, n + 1))] for n in (0, 1, 2, 5, rng.randint(6, 12))]
    return desc, body, tests, "range_sum"


KINDS = (_aggregate, _aggregate, _piecewise, _range_sum)

_FENCE = re.compile(r"^```[a-zA-Z]*\n(.*?)\n?```$", re.S)


def extract_code(text: str) -> str:
    """The code in a model's output: EOS and surrounding blank lines dropped,
    one enclosing markdown fence removed if present."""
    code = strip_eos(text).strip("\n")
    m = _FENCE.match(code.strip())
    return m.group(1) if m else code


class Code:
    name = "code"

    def generate(self, rng: random.Random) -> Item:
        kind = rng.choice(KINDS)
        func = rng.choice(FUNC_NAMES)
        desc, body, tests, op = kind(rng, func)
        return Item(self.name, desc, "\n".join(body), {"name": func, "tests": tests}, {"op": op})

    def check(self, item: Item, text: str) -> bool:
        return run_tests(extract_code(text), item.answer["name"], item.answer["tests"])
