"""Answer extraction and comparison for the non-code benchmarks.

Each benchmark's model output is free text (chain of thought, then an answer in whatever
form the model chose). Extraction looks for the most explicit answer marker first (GSM8K's
"#### N", a `\\boxed{}`, "The answer is ..."), and only then for weaker signals (the last
number, a lone "(C)"). Comparison is numeric for GSM8K, symbolic for MATH (math-verify,
with a string normaliser as fallback), and by letter for multiple choice.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

# ------------------------------------------------------------------------- numbers (GSM8K)
_NUM = r"-?\\?\$?\s?-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_NUMBER_MARKERS = [
    re.compile(rf"####\s*({_NUM})"),
    re.compile(rf"\\boxed\{{\s*(?:\\text\{{)?\s*({_NUM})"),
    re.compile(
        rf"(?i:final answer\s*(?:is|:|=)?|answer\s*(?:is|:|=))\s*[:*\s]*(?:approximately\s*)?({_NUM})"
    ),
]
_ANY_NUMBER = re.compile(_NUM)


def normalize_number(s: str) -> str:
    """'$1,000.00' -> '1000.00', '- 5' -> '-5', trailing '.' dropped."""
    s = s.replace(",", "").replace("$", "").replace("\\", "").replace(" ", "")
    return s.rstrip(".")


def extract_number(text: str | None) -> str | None:
    """The final numeric answer of a free-text solution, normalised; None when there is none."""
    if not text:
        return None
    for pattern in _NUMBER_MARKERS:
        found = pattern.findall(text)
        if found:
            return normalize_number(found[-1])
    found = _ANY_NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def gsm8k_gold(answer: str) -> str:
    """GSM8K's reference solutions end with '#### N'."""
    return normalize_number(answer.split("####")[-1].strip())


def numbers_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        x, y = Fraction(normalize_number(a)), Fraction(normalize_number(b))
    except (ValueError, ZeroDivisionError):
        return normalize_number(a) == normalize_number(b)
    return x == y


# ------------------------------------------------------------------------------- MATH
def last_boxed(text: str | None) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if absent."""
    if not text:
        return None
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*", text)]
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[start + 1 : i].strip()
        else:  # "\boxed 5"
            m = re.match(r"([^\s$]+)", text[start:])
            if m:
                return m.group(1)
    return None


_FINAL_ANSWER = [
    re.compile(r"[Ff]inal [Aa]nswer: The final answer is (.+?)\. I hope"),  # Minerva's format
    re.compile(r"(?i:final answer)\s*(?:is|:)\s*(.+)"),
    re.compile(r"(?i:the answer is)\s*:?\s*(.+)"),
]


def extract_math_answer(text: str | None) -> str | None:
    """The final answer of a MATH solution: last \\boxed{}, else a stated final answer."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if not text:
        return None
    for pattern in _FINAL_ANSWER:
        found = pattern.findall(text)
        if found:
            answer = found[-1].strip().rstrip(".").strip()
            if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
                answer = answer.strip("$")
            return answer or None
    return None


def math_gold(record_answer: str | None, solution: str | None) -> str | None:
    """MATH-500 has an `answer` field; the original MATH has only the boxed solution."""
    if record_answer:
        return record_answer.strip()
    return last_boxed(solution)


def math_equal(pred: str | None, gold: str | None, full_text: str | None = None) -> bool:
    """Symbolic equivalence by math-verify when installed; else (and also) normalised strings.

    With no extracted answer, math-verify may still find one in the full text (its last
    expression), as standard harnesses that hand it the whole response do.
    """
    if gold is None:
        return False
    if pred is not None and normalize_math(pred) == normalize_math(gold):
        return True
    if pred is not None and _as_number(pred) is not None and _as_number(pred) == _as_number(gold):
        return True
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    in_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main else None  # math-verify's timeouts use SIGALRM: main thread only
    try:
        gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=timeout)
        target = "\\boxed{" + pred + "}" if pred is not None else (full_text or "")
        pred_parsed = parse(target, parsing_timeout=timeout)
        return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # math-verify parses untrusted LaTeX; any failure is "not equal"
        return False


_REMOVE = [
    r"\left",
    r"\right",
    r"\!",
    r"\,",
    r"\;",
    r"\:",
    r"\displaystyle",
    "^\\circ",
    "^{\\circ}",
    r"\$",
    "$",
]


def normalize_math(s: str) -> str:
    """Fallback normaliser (Hendrycks-style): strip spacing, units, \\text{}, dfrac, ...."""
    s = s.strip()
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{\s*([^{}]*)\}", r"\1", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\%", "").replace("%", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)  # "x = 5" -> "5"
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"(\d),(\d\d\d)(?!\d)", r"\1\2", s)  # 1,000 -> 1000
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    if s.startswith("."):
        s = "0" + s
    return s


def _as_number(s: str) -> Fraction | None:
    """Plain numbers, a/b and \\frac{a}{b} as exact fractions; None for anything else."""
    s = normalize_math(s)
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(
        r"(-?)([\d.]+)/([\d.]+)", s
    )
    try:
        if m:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) else value
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


# --------------------------------------------------------------------- multiple choice
def choice_letters(n: int) -> str:
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def extract_choice(text: str | None, letters: str = "ABCD") -> str | None:
    """The chosen option letter: 'The answer is (C)', 'Answer: C', '\\boxed{C}', '(C)', 'C.'."""
    if not text:
        return None
    L = re.escape(letters)
    letter = rf"[\s*_]*\(?[\s*_]*([{L}])[\s*_]*\)?(?![A-Za-z0-9])"
    patterns = [
        rf"(?i:(?:correct|best|final)?\s*answer\s*(?:is|would be|should be|:)|correct (?:option|choice) is)"
        rf"\s*:?\s*(?:option|choice)?{letter}",
        rf"\\boxed\{{\s*(?:\\text\{{)?\s*\(?([{L}])\)?",
        rf"^{letter}[.:)]?\s*$",
        rf"\*\*\(?([{L}])\)?\*\*",
        rf"\(([{L}])\)",
        rf"^\s*\(?([{L}])[.:)]\s",
    ]
    for pattern in patterns:
        found = re.findall(pattern, text, flags=re.MULTILINE)
        if found:
            return found[-1]
    return None
