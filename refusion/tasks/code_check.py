"""Check the code family's answers: a static check of the syntax tree, then the sandbox.

The code family checks a model's output by running it, and a model's output is
arbitrary text. Two layers keep that harmless and its verdict honest:

1. a static check of the syntax tree: no imports, no names or attributes starting with
   an underscore, no class/with/try/global statements, only a short list of attribute
   names (``xs.append``): the family's functions need nothing more;
2. the one code sandbox, which the evaluator uses for every benchmark's code too
   (``refusion.sandbox``): the candidate runs there and only answers calls,
   while the tests run in a trusted checker on the plain data it returns (its own
   interpreter, namespaces and uid where the machine allows, resource limits, a
   wall-clock timeout: infinite loops count as failures, never as hangs).
"""

from __future__ import annotations

import ast
import json

from ..sandbox import Check, Limits, run_check

SAFE_ATTRIBUTES = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "remove",
        "index",
        "count",
        "sort",
        "reverse",
        "copy",
        "get",
        "keys",
        "values",
        "items",
        "add",
        "upper",
        "lower",
        "split",
        "join",
        "strip",
    }
)
FORBIDDEN_NODES = (
    ast.Import,
    ast.ImportFrom,
    ast.Global,
    ast.Nonlocal,
    ast.ClassDef,
    ast.With,
    ast.AsyncWith,
    ast.AsyncFunctionDef,
    ast.AsyncFor,
    ast.Await,
    ast.Try,
    ast.Raise,
    ast.Delete,
    ast.Yield,
    ast.YieldFrom,
    ast.JoinedStr,
    ast.NamedExpr,
)
TIMEOUT_S = 2.0
MEMORY_BYTES = 512 * 2**20

# The checker's test: every case's result must have the expected type and value.
_TEST = """
import json
for args, expected in json.loads({tests!r}):
    got = {name}(*args)
    assert type(got) is type(expected) and got == expected, (args, got, expected)
"""


class UnsafeCode(ValueError):
    """The source uses a construct the static check does not allow."""


def validate(source: str) -> ast.Module:
    """Parse ``source`` and reject anything outside the allowed subset."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:
        raise UnsafeCode(f"does not parse: {e}") from e
    for node in ast.walk(tree):
        if isinstance(node, FORBIDDEN_NODES):
            raise UnsafeCode(f"{type(node).__name__} is not allowed")
        if isinstance(node, ast.Name) and node.id.startswith("_"):
            raise UnsafeCode(f"name {node.id!r} is not allowed")
        if isinstance(node, ast.Attribute) and node.attr not in SAFE_ATTRIBUTES:
            raise UnsafeCode(f"attribute {node.attr!r} is not allowed")
        if isinstance(node, (ast.FunctionDef, ast.arg)):
            ident = node.name if isinstance(node, ast.FunctionDef) else node.arg
            if ident.startswith("_"):
                raise UnsafeCode(f"name {ident!r} is not allowed")
    return tree


def run_tests(source: str, func_name: str, tests: list, timeout: float = TIMEOUT_S) -> bool:
    """True when ``source`` defines ``func_name`` and it returns the expected
    value (same type, equal) for every ``(args, expected)`` in ``tests``."""
    try:
        validate(source)
    except UnsafeCode:
        return False
    check = Check(
        program=source, test=_TEST.format(tests=json.dumps(tests), name=func_name), calls=(func_name,)
    )
    # the limit includes the interpreters' start (a few tens of ms in the sandbox)
    return run_check(check, Limits(timeout=timeout, memory_mb=MEMORY_BYTES >> 20)).passed
