"""The `paper` protocol: each benchmark prompted, cut and scored as the ReFusion authors'
evaluation did (their eval.sh / eval.py, and the lm-evaluation-harness 0.4.9.1 tasks
gsm8k_cot, minerva_math, mbpp, humaneval_instruct_noprefix, gpqa_main_generative_n_shot,
arc_challenge_chat and mmlu_pro, zero-shot with the chat template), so that a score
here can be set beside the paper's.

Each class keeps its robust benchmark's records (datasets, splits, ids, decoding preset)
and replaces the prompt and the scoring:

- the prompt is a `Chat`: the task's description as a system turn (GPQA, MMLU-Pro), the
  user turn in the task's own text (templates reproduced character for character, quirks
  included: literal backslash-n in ARC's and GSM8K's), and a pre-filled assistant turn
  (ARC, HumanEval), rendered by the tokenizer's template with `enable_thinking=True`;
- the generation is the full preset length, cut afterwards at the task's stop strings,
  with the python-block rule for every task (`paper_rules.finish`);
- the scores are the task's filters and metrics under their lm-eval names; the first of
  `metrics` is the sample's `correct`, the rest are reported beside it.
"""

from __future__ import annotations

import random
import re
from typing import Any

from ..sandbox import Check
from . import benchmarks as robust
from .benchmarks import Chat, Sample, Scored, record_id
from .completion import Completion
from .paper_rules import (
    INVALID,
    exact_match,
    finish,
    last_boxed_only_string,
    math_verify_equal,
    minerva_answer,
    minerva_equivalent,
    minerva_parser,
    multi_choice_extract,
    normalize_final_answer,
    regex_extract,
    remove_boxed,
    sanitize_reachable,
    scorer_versions,
)
from .programs import called_names, shared_imports

TEMPLATE_OPTIONS = (("enable_thinking", True),)  # what their eval.py passes to the chat template


class PaperPrompt:
    """The conversation of a paper-protocol request."""

    protocol = "paper"
    system: str | None = None  # the task's description: lm-eval puts it in a system turn
    prefill: str | None = None  # lm-eval's gen_prefix: the start of the assistant's turn
    until: tuple[str, ...] = ()  # the task's stop strings, applied after generation
    metrics: tuple[str, ...] = ()  # the task's reported scores, the first is the sample's `correct`

    def chat(self, user: str, system: str | None = None) -> Chat:
        system = system or self.system
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        if self.prefill:
            messages.append({"role": "assistant", "content": self.prefill})
        return Chat(tuple(messages), self.until, TEMPLATE_OPTIONS)


class PaperScored(PaperPrompt):
    """Scored by the task's filters: `measure` gives each metric's (filtered answer, correct)."""

    def measure(self, sample: Sample, output: str) -> dict[str, tuple[str | None, bool]]:
        raise NotImplementedError

    def score_one(self, sample: Sample, output: str) -> Scored:
        measured = self.measure(sample, output)
        extracted, correct = measured[self.metrics[0]]
        if extracted in (INVALID, "[invalidanswer]"):
            extracted = None
        return Scored(
            extracted,
            bool(correct),
            {
                "metrics": {k: bool(c) for k, (_, c) in measured.items()},
                "filtered": {k: e for k, (e, _) in measured.items()},
            },
        )


def _with_template(sample: Sample, user: str, request: Chat) -> Sample:
    sample.prompt, sample.request = user, request
    return sample


# ------------------------------------------------------------------------------ GSM8K
class GSM8K(PaperScored, robust.GSM8K):
    template = (
        "Solve the following math problem. You need to think step-by-step, show your detailed reasoning, and "
        'end with "The answer is [result]," where [result] is the answer you get.\\nQ: {question}\nA:'
    )
    until = ("Q:", "</s>", "<|im_end|>")
    metrics = ("flexible-extract", "strict-match")
    ignored = (",", "\\$", "(?s).*#### ", "\\.$")

    def sample(self, record, index):
        user = self.template.format(question=record["question"])
        gold = record["answer"].split("####")[-1].strip()
        return Sample(record_id(record, "id", self.name, index), index, user, gold, request=self.chat(user))

    def measure(self, sample, output):
        strict = regex_extract(output, r"The answer is (\-?[0-9\.\,]+).")
        flexible = regex_extract(output, r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)
        return {
            name: (got, exact_match(got, sample.gold, self.ignored, ignore_case=True))
            for name, got in (("flexible-extract", flexible), ("strict-match", strict))
        }


# ------------------------------------------------------------------------------- MATH
class MATH(PaperScored, robust.MATH):
    """minerva_math, zero-shot, as the authors edited its `process_results`: math_verify
    is `verify(parse(solution), parse(output))`, the whole reference solution against the
    whole output; exact_match compares Minerva's "Final Answer: The final answer is X"
    sentence, normalised, with the gold, Minerva's normalisation of the solution's last
    boxed answer (sympy's LaTeX parser, then `simplify` of the difference). The seven
    subjects are averaged weighted by size, which is the mean over all problems."""

    fields = "problem, solution"
    until = ("Problem:",)
    metrics = ("math_verify", "exact_match")
    extracts = False  # math_verify judges the whole output

    def sample(self, record, index):
        solution = record["solution"]
        gold = normalize_final_answer(remove_boxed(last_boxed_only_string(solution) or ""))
        user = "Problem:" + "\n" + record["problem"] + "\n\n" + "Solution:"
        return Sample(
            record_id(record, "unique_id", self.name, index),
            index,
            user,
            gold,
            {"solution": solution},
            request=self.chat(user),
        )

    def measure(self, sample, output):
        stated = minerva_answer(output)
        normalized = normalize_final_answer(stated)
        matched = stated != "[invalidanswer]" and minerva_equivalent(normalized, sample.gold)
        return {
            "math_verify": (stated, math_verify_equal(sample.data["solution"], output)),
            "exact_match": (normalized, matched),
        }

    def notes(self) -> dict:
        return {"exact_match_latex_parser": minerva_parser(), "versions": scorer_versions()}


# ---------------------------------------------------------------------- multiple choice
class ARCChallenge(PaperScored, robust.ARCChallenge):
    """arc_challenge_chat: at most four options shown (a fifth is dropped, and an item
    whose answer it is cannot be scored right), the answer pre-filled up to its letter,
    cut at "." and blank lines, the stripped rest compared as the letter."""

    template = (
        "Given the following question and four candidate answers (A, B, C and D), choose the best answer."
        '\\nQuestion: {question}\\nA. {a}\\nB. {b}\\nC. {c}{d}\\nYour response should end with "The best '
        'answer is [the_answer_letter]" where the [the_answer_letter] is one of A, B, C or D.'
    )
    prefill = "The best answer is"
    until = ("\n\n", ".")
    metrics = ("exact_match",)

    def sample(self, record, index):
        texts = list(record["choices"]["text"])
        d = "\\nD. " + texts[3] if len(texts) > 3 else ""
        user = self.template.format(
            question=record["question"].strip(), a=texts[0], b=texts[1], c=texts[2], d=d
        )
        key = str(record["answerKey"])
        gold = "ABCD"[int(key) - 1] if key in "1234" else key
        return Sample(record_id(record, "id", self.name, index), index, user, gold, request=self.chat(user))

    def measure(self, sample, output):
        answer = output.lstrip()
        return {
            "exact_match": (
                answer,
                exact_match(answer, sample.gold, ignore_case=True, ignore_punctuation=True),
            )
        }


def gpqa_option(text: Any) -> str:
    """GPQA's option cleaning: stripped, " [title]" as ". ", every [bracketed] span deleted,
    one pass of double spaces made single."""
    if text is None:
        return " "
    text = str(text).strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


class GPQA(PaperScored, robust.GPQA):
    """gpqa_main_generative_n_shot, zero-shot: the instruction in a system turn; the
    options [incorrect 1, 2, 3, correct] shuffled by one `random.Random(0)` drawn in
    dataset order (lm-eval seeds Python's `random` with 0 before building the task, and
    the datasets cache keeps that first shuffle), so an item's order depends on the items
    before it: run on the dataset's own order."""

    until = ("</s>", "Question:", "<|im_end|>")
    metrics = ("flexible-extract", "strict-match")
    seed = 0

    system = robust.GPQA.description

    def load(self, data=None, limit=None):
        self._shuffle = random.Random(self.seed)
        return super().load(data, limit)

    def sample(self, record, index):
        if not hasattr(self, "_shuffle"):
            self._shuffle = random.Random(self.seed)
        correct = gpqa_option(record["Correct Answer"])
        options = [gpqa_option(record[f"Incorrect Answer {k}"]) for k in (1, 2, 3)] + [correct]
        self._shuffle.shuffle(options)
        gold = f"({'ABCD'[options.index(correct)]})"
        listed = "".join(f"({letter}) {text}\n" for letter, text in zip("ABCD", options))
        user = f"Question: {record['Question']}\nChoices:\n{listed}Answer:"
        return Sample(
            record_id(record, "Record ID", self.name, index),
            index,
            user,
            gold,
            {"options": options},
            request=self.chat(user),
        )

    def measure(self, sample, output):
        strict = regex_extract(output, r"(?<=The answer is )(.*)(?=.)")
        flexible = multi_choice_extract(output, sample.data["options"])
        return {
            name: (got, exact_match(got, sample.gold, ignore_case=True, ignore_punctuation=True))
            for name, got in (("flexible-extract", flexible), ("strict-match", strict))
        }


class MMLUPro(PaperScored, robust.MMLUPro):
    """mmlu_pro, zero-shot: the subject's description in a system turn, the first
    "answer is (X)" of the output, no fallback; the 14 subjects weighted by size, which
    is the mean over all questions."""

    until = ("Question:",)
    metrics = ("custom-extract",)
    description = (
        "The following are multiple choice questions (with answers) about {subject}. Think step by step "
        'and then finish your answer with "the answer is (X)" where X is the correct letter choice.\n'
    )

    def sample(self, record, index):
        options = list(record["options"])[:10]
        listed = "".join(f"{letter}. {text}\n" for letter, text in zip("ABCDEFGHIJ", options))
        user = (
            "Question:\n"
            + record["question"]
            + "\n"
            + "Options:\n"
            + listed
            + "Answer: Let's think step by step."
        )
        gold = record.get("answer")
        if gold not in tuple("ABCDEFGHIJ"):
            gold = "ABCDEFGHIJ"[int(record["answer_index"])]
        system = self.description.format(subject=record["category"])
        return Sample(
            record_id(record, "question_id", self.name, index),
            index,
            user,
            gold,
            request=self.chat(user, system),
        )

    def measure(self, sample, output):
        got = regex_extract(output, r"answer is \(?([ABCDEFGHIJ])\)?")
        return {
            "custom-extract": (got, exact_match(got, sample.gold, ignore_case=True, ignore_punctuation=True))
        }


# ------------------------------------------------------------------------------- code
class PaperCode(PaperPrompt, robust.CodeBenchmark):
    """pass@1 of one greedy sample, each program run against the task's tests for 3 s
    (the code_eval metric's default; ours counts the interpreters' start in it)."""

    metrics = ("pass@1",)
    timeout = 3.0

    def score(self, samples, outputs, *, limits=None, workers=None):
        scored = super().score(samples, outputs, limits=limits, workers=workers)
        for sc in scored:
            sc.detail["metrics"] = {"pass@1": bool(sc.correct)}
        return scored


def _check(program: str, test: str) -> Check:
    """The program, and its test as code_eval runs it, after the program in one namespace:
    the test's own names, the program's functions through the sandbox, the standard
    modules the program imported as the checker's own."""
    setup = shared_imports(program, test)
    return Check(program=program, test=test, calls=called_names(test, setup), setup=setup)


class HumanEval(PaperCode, robust.HumanEval):
    """humaneval_instruct_noprefix: the problem in a plain fence, "```python\\n" pre-filled,
    cut at "\\nassert" and "\\n# Test"; the program is the sanitised prompt + completion
    (its imports and what the entry point reaches), then the task's check."""

    template = (
        "Write a solution to the following problem and make sure that it passes the tests:\n```{prompt}```"
    )
    prefill = "```python\n"
    until = ("\nassert", "\n# Test")

    def sample(self, record, index):
        sample = super().sample(record, index)
        user = self.template.format(prompt=record["prompt"])
        return _with_template(sample, user, self.chat(user))

    def extract(self, sample, output):
        completion = output.split("```python\n", 1)[-1].split("```")[0]
        return sanitize_reachable(sample.data["prompt"] + "\n" + completion, sample.data["entry_point"])

    def program(self, sample, output):
        return _check(
            self.extract(sample, output), f"{sample.data['test']}\ncheck({sample.data['entry_point']})"
        )


class MBPP(PaperCode, robust.MBPP):
    """mbpp, zero-shot: the robust benchmark's prompt, which is theirs word for word; the
    output as it is (after the python-block rule) run with the first three asserts,
    without the dataset's setup code or imports."""

    until = ("[DONE]",)

    def sample(self, record, index):
        sample = super().sample(record, index)
        return _with_template(sample, sample.prompt, self.chat(sample.prompt))

    def extract(self, sample, output):
        return output

    def program(self, sample, output):
        return _check(output, "\n".join(sample.data["test_list"][:3]))


def finish_output(out: Any, chat: Chat, tokenizer: Any) -> Completion:
    """A generation as the authors' harness hands it to the task: its tokens decoded with
    the special ones, then `paper_rules.finish` (the stops, the python-block rule)."""
    raw = tokenizer.decode(list(out.token_ids), skip_special_tokens=False)
    return Completion(finish(raw, chat.until, tokenizer), out.stats)


__all__ = ["TEMPLATE_OPTIONS", "finish", "finish_output"]
