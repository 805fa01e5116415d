"""From a model's answer to a program the sandbox can run (HumanEval, MBPP).

A chat model answers with prose around a fenced code block, sometimes with a truncated
block (generation ran out of length), sometimes with bare code, sometimes with only the
function body (HumanEval completion style). `extract_code` finds the code; `sanitize`
keeps the definitions and imports and drops top-level statements (example calls, prints,
the model's own asserts) that would run, and could fail, before the benchmark's tests.
The `*_program` functions build the sandbox's `Check`: the program, and the benchmark's
tests for the trusted checker.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys

from ..sandbox import Check

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^(?:def |async def |class |import |from \S+ import |@)", re.MULTILINE)


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The code in a response: the fenced block that defines entry_point (else the first
    python block, else the first block); without fences, the whole text if it is Python,
    else the text from the first line that starts code. MBPP's '[BEGIN]' / '[DONE]' markers are removed."""
    text = text.replace("[BEGIN]", "").split("[DONE]")[0]
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    if blocks:
        if entry_point:
            for _, body in blocks:
                if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", body):
                    return body
        for lang, body in blocks:
            if lang in ("python", "py", "python3"):
                return body
        return blocks[0][1]
    if text[:1] in (" ", "\t"):  # a bare function body, to follow the prompt
        return text
    if _compiles(text):  # bare code, module-level constants included
        return text
    m = _CODE_START.search(text)
    return text[m.start() :] if m else text


_KEEP = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
)


def sanitize(code: str) -> str:
    """Keep top-level imports, definitions and assignments; drop other statements. Code
    that does not parse is trimmed from the end (prose after the code) until it does; if
    nothing parses it is returned unchanged (it will fail its tests and say why)."""
    lines = code.splitlines()
    for end in range(len(lines), 0, -1):
        try:
            tree = ast.parse("\n".join(lines[:end]))
            break
        except SyntaxError:
            continue
    else:
        return code
    kept: list[str] = []
    for node in tree.body:
        if isinstance(node, _KEEP):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            kept.extend(lines[first - 1 : node.end_lineno])
    return "\n".join(kept) + "\n"


def defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def _compiles(source: str) -> bool:
    try:
        compile(source, "<program>", "exec")
        return True
    except (SyntaxError, ValueError):
        return False


def humaneval_program(problem: dict, completion: str) -> Check:
    """The program: prompt + completion. The test: the benchmark's `check(entry_point)`,
    run in the checker after the prompt (its imports and helpers, which some tests call;
    the entry point there is the proxy of the program's).

    A completion that defines the entry point itself is sanitised and placed after the
    prompt (the prompt keeps its imports and helpers; the new definition wins). A bare
    body continues the prompt's open function.
    """
    entry = problem["entry_point"]
    code = extract_code(completion, entry)
    solution = sanitize(code)
    if defines(solution, entry):
        body = problem["prompt"] + "\n" + solution
    else:
        body = problem["prompt"] + code
        if not _compiles(body):
            body = problem["prompt"] + "\n" + solution
    return Check(
        program=body, setup=problem["prompt"], test=f"{problem['test']}\n\ncheck({entry})\n", calls=(entry,)
    )


def mbpp_program(record: dict, completion: str) -> Check:
    """The program: MBPP's imports, the model's code (sanitised), then MBPP's setup code
    (it builds the test's inputs, often from the program's own classes). The test: its
    asserts, after its imports, in the checker; the names they use that the test does
    not define are the program's."""
    code = sanitize(extract_code(completion))
    imports = "\n".join(record.get("test_imports") or []) + "\n"
    tests = "\n".join(record["test_list"]) + "\n"
    program = f"{imports}{code}\n{record.get('test_setup_code') or ''}\n"
    return Check(program=program, setup=imports, test=tests, calls=called_names(tests, imports))


def shared_imports(program: str, test: str) -> str:
    """Import lines for the standard-library modules the program imports at top level and
    the test uses (`assert math.isclose(...)` after the program's `import math`): where
    program and test share one namespace, the test sees them, and a module is not plain
    data the sandbox can hand over, so the trusted side imports its own copy."""
    try:
        program_tree, test_tree = ast.parse(program), ast.parse(test)
    except (SyntaxError, ValueError):
        return ""
    used = {n.id for n in ast.walk(test_tree) if isinstance(n, ast.Name)}
    lines = []
    for node in program_tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if bound in used and alias.name.split(".")[0] in sys.stdlib_module_names:
                    lines.append(f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else ""))
    return "\n".join(dict.fromkeys(lines))


def called_names(test: str, setup: str = "") -> tuple[str, ...]:
    """The names a test uses that neither it nor its setup defines, nor Python's builtins
    provide: the functions (and values) it expects the program to define. A test whose
    asserts call builtin names only (`assert sum(10, 15) == 6`: the program defines
    `sum`) gets the function its asserts call first."""
    defined: set[str] = set()
    used: list[str] = []
    for source in (setup, test):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                defined.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Name) and source is test and node.id not in used:
                used.append(node.id)
    builtin = set(dir(builtins))
    names = tuple(n for n in used if n not in defined and n not in builtin)
    return names or tuple(n for n in _asserted_calls(test)[:1] if n not in defined)


def _asserted_calls(test: str) -> list[str]:
    """The names of the calls on the left of each `assert NAME(...) == ...`, in order."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return []
    heads = []
    for node in tree.body:
        left = node.test.left if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) else None
        if isinstance(left, ast.Call) and isinstance(left.func, ast.Name):
            heads.append(left.func.id)
    return heads
