"""Answer extraction and scoring per benchmark, on the cases that trip harnesses up."""

from __future__ import annotations

import importlib.util

import pytest

from refusion.evaluate import answers, get_benchmark, programs
from refusion.evaluate.report import percentile, wilson_interval

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="math-verify is not installed"
)

LONG_REASONING = (
    "Let me think. First she buys 3 boxes of 12 eggs, that is 36 eggs. She uses 4 a day for 7 days, "
    "28 eggs. 36 - 28 = 8 eggs remain. Each sells for $2, so 8 * 2 = 16 dollars.\n"
)


# ------------------------------------------------------------------------------ GSM8K
@pytest.mark.parametrize(
    "output, gold, correct",
    [
        ("#### 1000", "1000", True),
        ("The answer is $1,000.", "1000", True),  # dollar sign, thousands comma, full stop
        ("The answer is: **$1,000.00**", "1000", True),
        (LONG_REASONING + "The answer is 16.", "16", True),
        (LONG_REASONING + "So she makes 16 dollars.", "16", True),  # no marker: last number
        (LONG_REASONING + "The answer is 17.", "16", False),
        ("The answer is 16, not 8 as one might think at first.", "16", True),  # marker beats last number
        ("\\boxed{18}", "18", True),
        ("Answer: -5", "-5", True),
        ("I cannot solve this.", "16", False),  # no answer at all
        ("", "16", False),
    ],
)
def test_gsm8k_scoring(output, gold, correct):
    bench = get_benchmark("gsm8k")
    sample = bench.sample({"question": "q?", "answer": f"some working\n#### {gold}"}, 0)
    assert sample.gold == gold
    assert bench.score_one(sample, output).correct is correct


def test_gsm8k_gold_and_no_answer_extracted():
    assert answers.gsm8k_gold("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 1,072") == "1072"
    assert answers.extract_number("no digits here") is None
    assert answers.numbers_equal("18.00", "18") and not answers.numbers_equal("18.5", "18")


# ------------------------------------------------------------------------------- MATH
@pytest.mark.parametrize(
    "output, gold, correct",
    [
        ("So the probability is $\\boxed{\\frac{1}{2}}$.", "0.5", True),
        ("The value is \\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", True),
        ("\\boxed{1,000}", "1000", True),
        pytest.param("The roots give \\boxed{x^2+1}", "1+x^2", True, marks=needs_math_verify),  # symbolic
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", True),
        ("First \\boxed{3} was wrong; finally \\boxed{4}", "4", True),  # the last box counts
        ("Final Answer: The final answer is $7$. I hope it is correct.", "7", True),  # Minerva's format
        ("\\boxed{\\frac{1}{3}}", "0.5", False),
        ("I do not know.", "3", False),  # no answer at all
    ],
)
def test_math_scoring(output, gold, correct):
    bench = get_benchmark("math")
    sample = bench.sample({"problem": "p", "solution": "s", "answer": gold}, 0)
    assert bench.score_one(sample, output).correct is correct


def test_math_gold_from_boxed_solution_with_nested_braces():
    bench = get_benchmark("math")
    sample = bench.sample({"problem": "p", "solution": "We get $\\boxed{\\frac{a}{\\sqrt{b}}}$."}, 3)
    assert sample.gold == "\\frac{a}{\\sqrt{b}}" and sample.id == "math/3"


def test_math_fallback_normaliser_without_math_verify(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name.startswith("math_verify"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    assert answers.math_equal("0.5", "\\frac{1}{2}")
    assert answers.math_equal("\\dfrac12", "\\frac{1}{2}")
    assert answers.math_equal("\\text{(C)}", "(C)")
    assert answers.math_equal("x = 5", "5")
    assert not answers.math_equal("\\frac{1}{3}", "0.5")
    assert not answers.math_equal(None, "3", "no answer")


# ---------------------------------------------------------------------- multiple choice
@pytest.mark.parametrize(
    "output, expected",
    [
        ("The answer is (C)", "C"),
        ("Let me reason at length. (A) is wrong because ... (B) fails too.\nThe answer is (C).", "C"),
        ("Answer: B", "B"),
        ("the correct answer is **D**.", "D"),
        ("C", "C"),
        ("A. Paris", "A"),
        ("The best answer is C", "C"),
        ("so \\boxed{C}", "C"),
        ("The answer is (C) ... on reflection, the answer is (D).", "D"),  # the last statement wins
        ("A cat sat on the mat.", None),  # an article is not an answer
        ("I am not sure.", None),
    ],
)
def test_extract_choice(output, expected):
    assert answers.extract_choice(output, "ABCD") == expected


def test_mmlu_pro_ten_options_and_answer_index():
    bench = get_benchmark("mmlu_pro")
    record = {
        "question_id": 7,
        "question": "q",
        "options": [f"o{i}" for i in range(10)],
        "answer_index": 9,
        "category": "law",
    }
    sample = bench.sample(record, 0)
    assert sample.gold == "J" and sample.id == "7" and "J. o9" in sample.prompt
    assert bench.score_one(sample, "... so the answer is (J)").correct
    assert not bench.score_one(sample, "... so the answer is (I)").correct


def test_arc_numeric_labels_map_to_letters():
    bench = get_benchmark("arc_challenge")
    record = {
        "id": "x1",
        "question": "Which?",
        "choices": {"text": ["a", "b", "c", "d"], "label": ["1", "2", "3", "4"]},
        "answerKey": "3",
    }
    sample = bench.sample(record, 0)
    assert sample.gold == "C"
    assert bench.score_one(sample, "The best answer is C").correct


def test_gpqa_shuffle_is_seeded_by_question_not_order():
    bench = get_benchmark("gpqa")
    rec = {
        "Question": "What is 2+2?",
        "Correct Answer": "4",
        "Incorrect Answer 1": "3",
        "Incorrect Answer 2": "5",
        "Incorrect Answer 3": "22",
    }
    a, b = bench.sample(rec, 0), bench.sample(rec, 99)
    assert a.data["options"] == b.data["options"] and sorted(a.data["options"]) == ["22", "3", "4", "5"]
    assert a.data["options"]["ABCD".index(a.gold)] == "4"
    assert bench.score_one(a, f"The answer is ({a.gold})").correct
    # across many questions the correct option lands on every letter
    golds = {bench.sample(dict(rec, Question=f"q{i}"), i).gold for i in range(40)}
    assert golds == set("ABCD")


# ------------------------------------------------------------------------------- code
def test_extract_code_prefers_the_block_defining_the_entry_point():
    text = "Example:\n```python\nprint(f(1))\n```\nSolution:\n```python\ndef f(x):\n    return x\n```\nDone."
    assert programs.extract_code(text, "f").startswith("def f(x)")


def test_extract_code_unclosed_fence_and_mbpp_markers():
    assert programs.extract_code("```python\ndef g():\n    return 1\n").startswith("def g")
    assert (
        programs.extract_code("[BEGIN]\ndef h():\n    return 2\n[DONE] trailing").strip()
        == "def h():\n    return 2"
    )


def test_sanitize_drops_top_level_calls_and_trailing_prose():
    code = (
        "import math\n\ndef f(x):\n    return math.sqrt(x)\n\n"
        "print(f(4))\nassert f(4) == 3\nThis works because..."
    )
    out = programs.sanitize(code)
    assert "def f" in out and "import math" in out
    assert "print" not in out and "assert" not in out and "because" not in out


def test_humaneval_program_from_body_and_from_full_function():
    problem = {
        "prompt": 'def add(a, b):\n    """Add."""\n',
        "test": "def check(c):\n    assert c(2, 3) == 5\n",
        "entry_point": "add",
    }
    body = programs.humaneval_program(problem, "    return a + b\n")
    full = programs.humaneval_program(
        problem, "Sure!\n```python\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))\n```"
    )
    for check in (body, full):
        ns: dict = {}
        exec(compile(check.program, "p", "exec"), ns)  # the program defines the entry point
        assert ns["add"](2, 3) == 5
        assert (
            check.calls == ("add",)
            and check.test.endswith("check(add)\n")
            and check.setup == problem["prompt"]
        )
    assert "print(add" not in full.program


def test_mbpp_check_proxies_the_functions_its_asserts_call():
    record = {
        "test_list": [
            "assert remove_Occ('hello', 'l') == 'heo'",
            "assert math.isclose(area(2), 12.56, rel_tol=0.01)",
        ],
        "test_imports": ["import math"],
        "test_setup_code": "root = Node(1)\n",
    }
    check = programs.mbpp_program(
        record, "def remove_Occ(s, c):\n    return s\ndef area(r):\n    return 3.14 * r * r\n"
    )
    assert check.calls == ("remove_Occ", "area")  # not math, not builtins
    assert (
        "import math" in check.program
        and "root = Node(1)" in check.program
        and check.setup.strip() == "import math"
    )
    # asserts that call builtin names only: the function under test is the program's `sum`
    assert programs.called_names("assert sum(10, 15) == 6\nassert sum(4, 6) == 3\n") == ("sum",)
    # ... but never a builtin beside the program's own function: `abs` stays the checker's
    assert programs.called_names("assert abs(f(1) - 2) < 1e-6\n") == ("f",)


# ------------------------------------------------------------------------------ stats
def test_wilson_interval_known_values():
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0) and wilson_interval(0, 0) == (0.0, 1.0)


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
