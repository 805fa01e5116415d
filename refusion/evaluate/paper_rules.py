"""The rules of the authors' evaluation, written from their behaviour: what their harness
does to a generation, and how the lm-evaluation-harness 0.4.9.1 tasks they ran (some as
they edited them) filter and score it. `paper.py` puts them together per benchmark.

Model side (their `eval.py`, `generate_until`): the whole generation is decoded with its
special tokens, cut at each of the task's stop strings in turn, re-tokenised and decoded
without special tokens; an output holding a ```` ```python ```` block is replaced by the
first one (`finish`).

Task side (lm-eval): a regex filter takes the first (or last) match, or "[invalid]"; a
multiple-choice filter falls back to the options' texts; exact match compares after
removing regexes, case and ASCII punctuation; Minerva's answer normaliser and equivalence
score MATH; HumanEval keeps the longest parseable span of the output and the definitions
its entry point reaches.
"""

from __future__ import annotations

import ast
import functools
import re
import signal
import string
import sys
import threading
import unicodedata
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

from ..model.prompts import tokenize

INVALID = "[invalid]"  # lm-eval's regex filters' fallback


# ------------------------------------------------------------------- the model side
def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """The text before each stop string, applied one stop after the other, in order."""
    for stop in until:
        if stop in text:
            text = text.split(stop)[0]
    return text


_PYTHON_BLOCK = re.compile(r"```python\n(.*?)\n```", re.DOTALL)


def first_python_block(text: str) -> str:
    """The body of the first ```` ```python ```` block closed on its own line, else the text."""
    match = _PYTHON_BLOCK.search(text)
    return match.group(1) if match else text


def finish(raw: str, until: Sequence[str], tokenizer: Any = None) -> str:
    """What the authors' harness hands the task for a generation whose text, special
    tokens included, is `raw`: cut at the stops, special tokens removed by re-tokenising
    (with a tokenizer), then the python-block rule, which applies to every task."""
    text = cut_at_stops(raw, until)
    if tokenizer is not None:
        text = tokenizer.decode(tokenize(tokenizer, text), skip_special_tokens=True)
    return first_python_block(text)


# --------------------------------------------------------------------- lm-eval filters
def regex_extract(text: str, pattern: str, group_select: int = 0, fallback: str = INVALID) -> str:
    """lm-eval's `regex` filter with `take_first`: match number `group_select` of
    `re.findall` (0 the first, -1 the last); of a match with several groups, the first
    non-empty one; stripped. `fallback` when nothing matches."""
    found = re.findall(pattern, text)
    if not found:
        return fallback
    match = found[group_select]
    if isinstance(match, tuple):
        groups = [g for g in match if g]
        match = groups[0] if groups else fallback
    return match.strip()


@functools.cache
def _unicode_punctuation() -> dict[int, None]:
    return dict.fromkeys(i for i in range(sys.maxunicode) if unicodedata.category(chr(i)).startswith("P"))


def multi_choice_extract(
    text: str,
    choices: Sequence[str],
    pattern: str = r"(\([A-Z]\))",
    group_select: int = -1,
    ignore_case: bool = True,
    ignore_punctuation: bool = True,
) -> str:
    """lm-eval's `multi_choice_regex` filter: the `pattern` match (here the last "(X)");
    else the last option text found in the output (compared without case and Unicode
    punctuation), as its "(X)"; else the last ": X"; else "[invalid]"."""

    def ignoring(s: str) -> str:
        s = s.lower() if ignore_case else s
        return s.translate(_unicode_punctuation()) if ignore_punctuation else s

    def find(regex: re.Pattern, s: str, convert: dict[str, str] | None = None) -> str:
        found = regex.findall(s)
        if not found:
            return ""
        match = found[group_select]
        if isinstance(match, tuple):
            match = [g for g in match if g][0]
        match = match.strip()
        return convert.get(match, match) if match and convert else match

    letters = [chr(ord("A") + i) for i in range(len(choices))]
    keys = [ignoring(c.strip()) for c in choices]
    by_text = dict(zip(keys, (f"({x})" for x in letters)))
    by_letter = {x: f"({x})" for x in letters}
    return (
        find(re.compile(pattern), text)
        or find(re.compile("|".join(re.escape(k) for k in keys)), ignoring(text), by_text)
        or find(re.compile(rf":[\s]*({'|'.join(letters)})"), text, by_letter)
        or INVALID
    )


_ASCII_PUNCTUATION = str.maketrans("", "", string.punctuation)


def exact_match(
    prediction: str,
    reference: str,
    regexes_to_ignore: Sequence[str] = (),
    ignore_case: bool = False,
    ignore_punctuation: bool = False,
) -> bool:
    """lm-eval's `exact_match` (the Hugging Face metric): both sides with the regexes
    removed, lower-cased and ASCII punctuation removed as asked, then compared."""
    for regex in regexes_to_ignore:
        prediction, reference = re.sub(regex, "", prediction), re.sub(regex, "", reference)
    if ignore_case:
        prediction, reference = prediction.lower(), reference.lower()
    if ignore_punctuation:
        prediction, reference = (
            prediction.translate(_ASCII_PUNCTUATION),
            reference.translate(_ASCII_PUNCTUATION),
        )
    return prediction == reference


# ------------------------------------------------------------------- Minerva (MATH)
def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` (braces balanced) or `\\fbox{...}` with its command; a
    `\\boxed ` followed by a space wins and runs to the next `$`."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """`\\boxed{x}` -> x, `\\boxed x` -> x."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a boxed answer: {boxed!r}")
    return boxed[len("\\boxed{") : -1]


# Appendix D of Lewkowycz et al. (2022), as the minerva_math task applies it.
_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "ft",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's normaliser: the part after the last "=", units and spacing removed, the
    math inside $...$, \\text{}/\\textbf{}/\\overline{}/\\boxed{} unwrapped, \\fracab and
    \\sqrta braced, thousands separators of a plain integer dropped."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for removed in _REMOVED:
        answer = answer.replace(removed, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer


def minerva_answer(output: str) -> str:
    """The answer of Minerva's format, "Final Answer: The final answer is X. I hope it is
    correct." (the last sentence may be missing), stripped; else "[invalidanswer]"."""
    match = re.search(
        r"Final Answer: The final answer is(.*?). I hope it is correct.", output + "I hope it is correct."
    )
    return match.group(1).strip() if match else "[invalidanswer]"


@contextmanager
def _deadline(seconds: int):
    """A TimeoutError after `seconds` (SIGALRM: on the main thread only; elsewhere none)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _parse_latex() -> tuple[Callable[[str], Any], str]:
    """sympy's LaTeX parser, which the task uses; it loads with antlr4 4.11, the runtime
    the `math` extra pins (as the authors' lm-eval did), and with no other. Where another
    runtime is installed, math-verify's own LaTeX-to-sympy parser stands in (recorded with
    the results: `minerva_parser`)."""
    from sympy.parsing.latex import parse_latex

    try:
        parse_latex("1")
        return parse_latex, "sympy"
    except ImportError:
        from latex2sympy2_extended import latex2sympy

        return latex2sympy, "latex2sympy2_extended"


def minerva_equivalent(a: str, b: str) -> bool:
    """Minerva's `is_equiv` of two normalised answers: both parse as LaTeX and their
    difference simplifies to 0 (5 s at most); any failure is "not equivalent"."""
    import sympy

    parse, _ = _parse_latex()
    try:
        with _deadline(5):
            return sympy.simplify(parse(a) - parse(b)) == 0
    except Exception:  # unparsable, not subtractable, timed out: the task counts it wrong
        return False


def minerva_parser() -> str:
    """Which LaTeX parser `minerva_equivalent` uses here (recorded with the results)."""
    return _parse_latex()[1]


def math_verify_equal(solution: str, output: str) -> bool:
    """math-verify of the whole output against the whole reference solution, as the
    authors' task calls it: `verify(parse(solution), parse(output))`. math-verify finds
    the answer in the solution itself (a `\\boxed{}` first, read as LaTeX); handed only
    the normalised answer, without the `$...$` that marks LaTeX, it parses nothing for
    `\\sqrt{2}`, `\\dfrac{3}{4}`, tuples and intervals, and 3 for `3\\pi`."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        return bool(
            verify(
                parse(solution, parsing_timeout=timeout),
                parse(output, parsing_timeout=timeout),
                timeout_seconds=timeout,
            )
        )
    except Exception:  # math-verify parses untrusted LaTeX; a failure is "not equal"
        return False


def scorer_versions() -> dict[str, str | None]:
    """The versions of the packages that score MATH here (recorded with the results, to
    set beside the `math` extra's pins, which are the authors')."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in ("math-verify", "latex2sympy2_extended", "antlr4-python3-runtime", "sympy"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


# ----------------------------------------------------------------- HumanEval sanitiser
def _parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, MemoryError, ValueError, RecursionError):
        return False


def longest_parseable_span(text: str, max_lines: int = 100) -> str:
    """Of the first `max_lines` lines, the contiguous span that parses as Python with the
    most non-blank lines (the first such span; "" when none parses)."""
    lines = text.splitlines()[:max_lines]
    nonblank = [bool(line.strip()) for line in lines]
    best, best_span = 0, ""
    for i in range(len(lines)):
        if sum(nonblank[i:]) <= best:  # no span from here can beat the best
            break
        for j in range(len(lines) - 1, i - 1, -1):  # a longer span never has fewer lines
            count = sum(nonblank[i : j + 1])
            if count <= best:
                break
            span = "\n".join(lines[i : j + 1])
            if _parses(span):
                best, best_span = count, span
                break
    return best_span


def _names_used(node: ast.AST) -> set[str]:
    """Names a definition refers to: every Name's id and Attribute's attribute name (an
    attribute's object is not looked into)."""
    used: set[str] = set()
    stack = [node]
    while stack:
        for child in ast.iter_child_nodes(stack.pop()):
            if isinstance(child, ast.Name):
                used.add(child.id)
            elif isinstance(child, ast.Attribute):
                used.add(child.attr)
            else:
                stack.append(child)
    return used


def _definitions(tree: ast.Module) -> tuple[list[ast.stmt], dict[str, ast.stmt]]:
    """Top-level imports, and definitions by name: classes, functions that return
    something, assignments to a name (a later one replaces an earlier in place)."""
    imports: list[ast.stmt] = []
    defined: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif isinstance(node, ast.ClassDef):
            defined[node.name] = node
        elif isinstance(node, ast.FunctionDef):
            if any(isinstance(n, ast.Return) for n in ast.walk(node)):
                defined[node.name] = node
        elif isinstance(node, ast.Assign) and node.targets and isinstance(node.targets[0], ast.Name):
            defined[node.targets[0].id] = node
    return imports, defined


def sanitize_reachable(text: str, entry_point: str | None = None) -> str:
    """The HumanEval sanitiser: tabs as four spaces, the longest parseable span, then its
    imports and the definitions the entry point reaches (all of them without one), each
    re-printed by `ast.unparse`."""
    text = text.replace("\t", "    ").replace("\r\n", "\n").replace("\r", "\n").strip() + "\n"
    imports, defined = _definitions(ast.parse(longest_parseable_span(text)))
    keep = set(defined)
    if entry_point:
        uses = {name: _names_used(node) for name, node in defined.items()}
        keep, todo = set(), [entry_point]
        while todo:
            name = todo.pop(0)
            if name not in keep:
                keep.add(name)
                todo.extend(uses.get(name, set()) - keep)
    kept = [ast.unparse(n) for n in imports] + [ast.unparse(n) for name, n in defined.items() if name in keep]
    return "\n".join(kept)
