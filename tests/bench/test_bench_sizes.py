"""`refusion/bench/` stays readable: modules of a few hundred lines, functions that fit on
a screen (docs: the house style). Counted as a reader counts them: a module's lines, and
a function's from its `def` to the end of its body, docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "refusion" / "bench"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def function_lengths(source: str) -> dict[str, int]:
    """Every function's and method's length in lines, by name."""
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def test_the_counting_reads_def_to_end_of_body():
    source = (
        'def f(x):\n    """Doc."""\n    y = x\n    return y\n\n\nclass C:\n    def g(self):\n        pass\n'
    )
    assert function_lengths(source) == {"f": 4, "g": 2}


def test_bench_modules_and_functions_stay_under_the_limits():
    too_long = []
    for module in sorted(BENCH.glob("*.py")):
        source = module.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{module.name}: {len(source.splitlines())} lines")
        too_long += [
            f"{module.name}: {name}() {n} lines"
            for name, n in function_lengths(source).items()
            if n > MAX_FUNCTION_LINES
        ]
    assert not too_long, (
        f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: {too_long}"
    )
