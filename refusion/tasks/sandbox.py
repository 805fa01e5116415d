"""Run untrusted Python functions against test cases, safely enough.

The code family checks a model's output by running it, and a model's output
is arbitrary text. Three layers keep that harmless:

1. a static check of the syntax tree: no imports, no names or attributes
   starting with an underscore, no class/with/try/global statements, only a
   short list of attribute names (``xs.append``);
2. a separate, isolated interpreter (``python -I -S``, empty environment,
   fresh temporary working directory) whose ``exec`` sees only a few harmless
   builtins, under CPU, memory and file-size limits where the platform has
   them;
3. a wall-clock timeout, after which the process is killed (infinite loops
   count as failures, never as hangs).
"""

from __future__ import annotations

import ast
import json
import secrets
import subprocess
import sys
import tempfile

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

# Runs in the child: reads {source, name, tests, nonce} from stdin and prints
# nonce + "1" when every test passes. The tested code cannot print (print is
# not among its builtins), so it cannot fake the verdict.
_RUNNER = r"""
import builtins, json, sys
job = json.loads(sys.stdin.read())
try:
    import resource
    for limit, value in ((resource.RLIMIT_CPU, job["cpu_s"]), (resource.RLIMIT_AS, job["memory"]),
                         (resource.RLIMIT_FSIZE, 0)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass
except ImportError:  # not on POSIX: the wall-clock timeout still applies
    pass
safe = {k: getattr(builtins, k) for k in job["builtins"]}
ok = False
try:
    ns = {"__builtins__": safe}
    exec(compile(job["source"], "<candidate>", "exec"), ns)
    fn = ns[job["name"]]
    ok = True
    for args, expected in job["tests"]:
        got = fn(*json.loads(json.dumps(args)))
        if type(got) is not type(expected) or got != expected:
            ok = False
            break
except BaseException:
    ok = False
sys.stdout.write("\n" + job["nonce"] + ("1" if ok else "0") + "\n")
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
    try:
        validate(source)
    except UnsafeCode:
        return False
    nonce = secrets.token_hex(8)
    job = json.dumps({"source": source, "name": func_name, "tests": tests,
                      "nonce": nonce, "builtins": SAFE_BUILTINS,
                      "cpu_s": int(timeout) + 1, "memory": MEMORY_BYTES})
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _RUNNER],
                input=job, capture_output=True, text=True, timeout=timeout, cwd=tmp,
                env={},
            )
        except subprocess.TimeoutExpired:
            return False
    lines = proc.stdout.strip().splitlines()
    return proc.returncode == 0 and bool(lines) and lines[-1] == nonce + "1"
