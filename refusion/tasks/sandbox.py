"""Run untrusted Python functions against test cases, in the evaluator's sandbox.

The code family checks a model's output by running it, and a model's output is
arbitrary text. Three layers keep that harmless and its verdict honest:

1. a static check of the syntax tree: no imports, no names or attributes starting with
   an underscore, no class/with/try/global statements, only a short list of attribute
   names (``xs.append``);
2. the candidate is ``exec``-ed with only a few harmless builtins (no ``print``, no
   ``exit``, no ``open``): it cannot end the test program early or write a verdict;
3. the test program runs in the one sandbox the evaluator uses for every benchmark's
   code (``refusion.evaluate.sandbox``: its own interpreter, namespaces and uid where
   the machine allows, resource limits, a wall-clock timeout after which it is killed:
   infinite loops count as failures, never as hangs).
"""

from __future__ import annotations

import ast
import json

SAFE_BUILTINS = (
    "abs", "all", "any", "bool", "dict", "enumerate", "int", "len", "list", "max",
    "min", "range", "reversed", "set", "sorted", "str", "sum", "tuple", "zip",
)
SAFE_ATTRIBUTES = frozenset({
    "append", "extend", "insert", "pop", "remove", "index", "count", "sort", "reverse",
    "copy", "get", "keys", "values", "items", "add", "upper", "lower", "split", "join",
    "strip",
})
FORBIDDEN_NODES = (
    ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.ClassDef, ast.With,
    ast.AsyncWith, ast.AsyncFunctionDef, ast.AsyncFor, ast.Await, ast.Try, ast.Raise,
    ast.Delete, ast.Yield, ast.YieldFrom, ast.JoinedStr, ast.NamedExpr,
)
TIMEOUT_S = 2.0
MEMORY_BYTES = 512 * 2**20

# The test program: defines the candidate with the safe builtins only, then runs every
# test; it runs to its end (the sandbox's "passed") only when every test passes.
_PROGRAM = """
import builtins, json
job = json.loads({job!r})
ns = {{"__builtins__": {{k: getattr(builtins, k) for k in job["builtins"]}}}}
exec(compile(job["source"], "<candidate>", "exec"), ns)
fn = ns[job["name"]]
for args, expected in job["tests"]:
    got = fn(*json.loads(json.dumps(args)))
    if type(got) is not type(expected) or got != expected:
        raise SystemExit(1)
"""


class UnsafeCode(ValueError):
    """The source uses a construct the sandbox does not allow."""


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
    from ..evaluate.sandbox import Limits, run_program

    try:
        validate(source)
    except UnsafeCode:
        return False
    job = json.dumps({"source": source, "name": func_name, "tests": tests, "builtins": SAFE_BUILTINS})
    # the limit includes the interpreter's start (a few tens of ms in the sandbox)
    result = run_program(_PROGRAM.format(job=job), Limits(timeout=timeout, memory_mb=MEMORY_BYTES >> 20))
    return result.passed
