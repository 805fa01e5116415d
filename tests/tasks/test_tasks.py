"""The synthetic task suite: determinism, splits, and the checkers."""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refusion.tasks import (
    FAMILIES,
    TEST_PER_FAMILY,
    Item,
    check,
    is_test_prompt,
    lists,
    load_test_items,
    make_split,
    read_jsonl,
    strings,
    write_jsonl,
)
from refusion.tasks.code_check import UnsafeCode, run_tests, validate

# Changes whenever the held-out set changes. If you changed a template on
# purpose, update it, and retrain: models trained on the old suite are
# evaluated on a different test set now.
TEST_SET_SHA256 = "bb71a45ca17395b60c1f4d8366661cc3c912d06a08f83ce95d838ff645d6c384"


@pytest.fixture(scope="module")
def test_items() -> list[Item]:
    return load_test_items()


def _by_family(items, family, n=None):
    chosen = [it for it in items if it.family == family]
    return chosen if n is None else chosen[:n]


# --- splits -----------------------------------------------------------------


def test_families_registered():
    assert set(FAMILIES) == {"arithmetic", "lists", "strings", "code"}
    for name, family in FAMILIES.items():
        assert family.name == name
        assert family.generate(random.Random(0)).family == name


def test_make_split_is_deterministic_by_seed():
    a, b = make_split("train", 40, seed=3), make_split("train", 40, seed=3)
    assert a == b
    assert [it.prompt for it in make_split("train", 40, seed=4)] != [it.prompt for it in a]
    assert [it.prompt for it in make_split("test", 40, seed=3)] != [it.prompt for it in a]


def test_make_split_is_balanced_and_interleaved():
    items = make_split("train", 10, seed=1)
    assert Counter(it.family for it in items) == {"arithmetic": 3, "lists": 3, "strings": 2, "code": 2}
    assert [it.family for it in items[:4]] == list(FAMILIES)
    sub = make_split("train", 6, seed=1, families=["code", "lists"])
    assert [it.family for it in sub] == ["code", "lists"] * 3
    with pytest.raises(ValueError):
        make_split("dev", 4)
    with pytest.raises(ValueError):
        make_split("train", 4, families=["poetry"])


def test_held_out_set_is_large_balanced_and_unique(test_items):
    assert len(test_items) >= 500
    assert Counter(it.family for it in test_items) == {f: TEST_PER_FAMILY for f in FAMILIES}
    assert len({it.prompt for it in test_items}) == len(test_items)
    assert load_test_items(10) == test_items[:10]
    assert Counter(it.family for it in load_test_items(8)) == {f: 2 for f in FAMILIES}


def test_held_out_set_is_pinned(test_items):
    blob = json.dumps([it.to_dict() for it in test_items], sort_keys=True).encode()
    assert hashlib.sha256(blob).hexdigest() == TEST_SET_SHA256


def test_train_never_contains_test_prompts(test_items):
    test_prompts = {it.prompt for it in test_items}
    assert all(is_test_prompt(p) for p in test_prompts)
    train = make_split("train", 4000, seed=0) + make_split("train", 2000, seed=1)
    assert not any(is_test_prompt(it.prompt) for it in train)
    assert not test_prompts & {it.prompt for it in train}


def test_jsonl_round_trip(tmp_path, test_items):
    items = test_items[:8]
    path = write_jsonl(items, tmp_path / "m.jsonl", with_answer=True)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["messages"][0] == {"role": "user", "content": items[0].prompt}
    assert lines[0]["messages"][1] == {"role": "assistant", "content": items[0].response}
    assert lines[0]["family"] == items[0].family
    assert read_jsonl(path) == items
    path = write_jsonl(items, tmp_path / "q.jsonl", fmt="query")
    record = json.loads(path.read_text().splitlines()[1])
    assert record == {"query": items[1].prompt, "response": items[1].response, "family": items[1].family}
    with pytest.raises(ValueError):
        write_jsonl(items, tmp_path / "x.jsonl", fmt="chat")


# --- the items themselves --------------------------------------------------


def test_arithmetic_numbers_stay_small(test_items):
    for it in _by_family(test_items, "arithmetic"):
        assert all(0 <= int(n) <= 99 for n in re.findall(r"\d+", it.prompt + it.response))
        assert 2 <= len(it.meta["steps"]) <= 3
        assert it.response.endswith(f"Answer: {it.answer}")


def _evaluate(expr: str) -> int:
    """Left to right: "30 - 4" -> 26, "5 x 5" -> 25 (one operator at most here)."""
    tokens = expr.split()
    value = int(tokens[0])
    for op, arg in zip(tokens[1::2], tokens[2::2]):
        value = {"+": value + int(arg), "-": value - int(arg), "x": value * int(arg)}[op]
    return value


def test_arithmetic_worked_steps_are_true(test_items):
    n = 0
    for it in _by_family(test_items, "arithmetic"):
        for line in it.response.splitlines()[1:-1]:
            for chain in line.split(": ", 1)[1].rstrip(".").split(", "):
                sides = [_evaluate(side) for side in chain.split(" = ")]
                assert len(sides) >= 2 and len(set(sides)) == 1, line
                n += 1
    assert n > 300


def test_every_operation_appears(test_items):
    ops = Counter((it.family, it.meta.get("op")) for it in test_items if it.family != "arithmetic")
    assert {op for fam, op in ops if fam == "lists"} == set(lists.OPS)
    assert {op for fam, op in ops if fam == "strings"} == set(strings.OPS)
    assert {op for fam, op in ops if fam == "code"} >= {"count_filtered", "piecewise", "range_sum"}


# --- checkers accept the reference ----------------------------------------


def test_checkers_accept_reference_responses(test_items):
    for it in test_items:
        if it.family == "code":
            continue  # run below on a sample: each check is a subprocess
        assert check(it, it.response), it
        assert check(it, it.response + "<|im_end|>"), it
        assert check(it, "\n" + it.response + "  \n<|im_end|><|endoftext|>garbage after eos"), it


def test_code_checker_accepts_reference_responses(test_items):
    for it in _by_family(test_items, "code", 12):
        assert check(it, it.response), it
        assert check(it, it.response + "\n<|im_end|>")
        assert check(it, f"```python\n{it.response}\n```")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), family=st.sampled_from(["arithmetic", "lists", "strings"]))
def test_generated_items_pass_their_own_check(seed, family):
    it = FAMILIES[family].generate(random.Random(seed))
    assert check(it, it.response)
    assert not check(it, it.response.rsplit("\n", 1)[0])  # answer line missing


def test_checked_items_survive_json(tmp_path, test_items):
    sample = [_by_family(test_items, f)[0] for f in FAMILIES]
    loaded = read_jsonl(write_jsonl(sample, tmp_path / "t.jsonl", with_answer=True))
    assert all(check(it, it.response) for it in loaded)


# --- checkers reject wrong answers -----------------------------------------


def _replace_answer(response: str, new_answer: str) -> str:
    head, _ = response.rsplit("Answer:", 1)
    return f"{head}Answer: {new_answer}"


def test_arithmetic_rejects_wrong_or_missing_answers(test_items):
    for it in _by_family(test_items, "arithmetic", 30):
        r = it.response
        assert not check(it, _replace_answer(r, str(it.answer + 1)))
        assert not check(it, _replace_answer(r, f"{it.answer}0"))
        assert not check(it, _replace_answer(r, ""))
        assert not check(it, r + "\nAdd 1.")  # answer not on the last line
        assert not check(it, r.replace("Answer:", "Result:"))
        assert not check(it, "")


def test_lists_reject_wrong_order_missing_or_extra_items(test_items):
    n_order = 0
    for it in _by_family(test_items, "lists"):
        r = it.response
        if isinstance(it.answer, int):
            assert not check(it, _replace_answer(r, str(it.answer + 1)))
            continue
        ans = list(it.answer)
        swapped = next(((i, i + 1) for i in range(len(ans) - 1) if ans[i] != ans[i + 1]), None)
        if swapped:
            i, j = swapped
            wrong = ans[:i] + [ans[j], ans[i]] + ans[j + 1 :]
            assert not check(it, _replace_answer(r, ", ".join(map(str, wrong))))
            n_order += 1
        assert not check(it, _replace_answer(r, ", ".join(map(str, ans[:-1]))))  # missing item
        assert not check(it, _replace_answer(r, ", ".join(map(str, ans + [ans[0]]))))  # extra item
        if len(ans) > 1:
            assert not check(it, _replace_answer(r, " ".join(map(str, ans))))  # not a list
        if any(a >= 10 for a in ans):  # an item split into digits is not the item
            assert not check(it, _replace_answer(r, ", ".join(" ".join(str(a)) for a in ans)))
    assert n_order > 50


def test_strings_reject_wrong_words_order_or_case(test_items):
    for it in _by_family(test_items, "strings"):
        r, words = it.response, list(it.answer)
        assert not check(it, _replace_answer(r, ", ".join(words[:-1])))  # missing word
        assert not check(it, _replace_answer(r, ", ".join(words + words[:1])))  # extra word
        if words != words[::-1]:
            assert not check(it, _replace_answer(r, ", ".join(words[::-1])))  # wrong order
        if any(w != w.upper() for w in words):
            assert not check(it, _replace_answer(r, ", ".join(w.upper() for w in words)))  # wrong case
        if len(words) > 1:
            assert not check(it, _replace_answer(r, " ".join(words)))  # not a list
        assert check(it, _replace_answer(r, " ,  ".join(words) + "  "))  # spacing is not the answer


def test_code_rejects_wrong_code(test_items):
    it = next(x for x in _by_family(test_items, "code") if x.meta["op"] == "sum_filtered")
    good = it.response
    assert check(it, good)
    name = it.answer["name"]
    wrong_constant = re.sub(r"(\d+)", lambda m: str(int(m.group(1)) + 1), good, count=1)
    assert not check(it, wrong_constant)
    assert not check(it, good.replace("    return total", "    return total + 1"))
    assert not check(it, good.replace("return total", "return str(total)"))
    assert not check(it, good.replace(":", "", 1))  # syntax error
    assert not check(it, good.replace(f"def {name}", "def other"))  # wrong name
    assert not check(it, good.replace("\n        ", "\n  ", 1))  # broken indentation
    assert not check(it, "")


def test_code_infinite_loop_fails_without_hanging(test_items):
    it = _by_family(test_items, "code")[0]
    name = it.answer["name"]
    arg = "xs" if "(xs)" in it.prompt else ("x" if "(x)" in it.prompt else "n")
    looping = f"def {name}({arg}):\n    while True:\n        pass"
    start = time.monotonic()
    assert not check(it, looping)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "source",
    [
        "import os\ndef f(xs):\n    return 6",
        "def f(xs):\n    return xs.__class__",
        "def f(xs):\n    return __import__('os').getpid()",
        "def f(xs):\n    return open('/etc/passwd').read()",
        "class A:\n    pass\ndef f(xs):\n    return 6",
        "def f(xs):\n    return [0] * 10**10",
        "def f(xs):\n    return 2 ** 10 ** 10",
    ],
)
def test_sandbox_refuses_or_contains_hostile_code(source):
    assert not run_tests(source, "f", [[[[1, 2, 3]], 6]], timeout=1.0)


def test_sandbox_static_check():
    validate("def f(xs):\n    out = []\n    for x in xs:\n        out.append(x)\n    return out")
    for bad in ("import sys", "f.__globals__", "getattr(f, 'x').y", "from os import path", "x = _secret"):
        with pytest.raises(UnsafeCode):
            validate(bad)


def test_sandbox_compares_type_and_value():
    tests = [[[[1, 2]], 3]]
    assert run_tests("def f(xs):\n    return sum(xs)", "f", tests)
    assert not run_tests("def f(xs):\n    return 3.0", "f", tests)
    assert not run_tests("def f(xs):\n    xs.append(1)\n    return 4", "f", tests)
