"""An evaluation's state on disk against a hostile or unlucky world: a full or read-only
--out (one line, exit 2), verdicts that must not outlive their inputs (predictions
rewritten in place, data changed, another model's files, other sandbox limits), a run
killed at random moments that resumes to exactly the uninterrupted result, and the
sandbox folders a killed run leaves behind."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from test_eval_runner import GSM8K, FakeGenerate, gsm8k_file, lines, write_jsonl  # noqa: F401

from refusion.cli.dispatch import main
from refusion.evaluate import Limits, ResumeMismatchError, evaluate

MBPP = {
    "task_id": 11,
    "text": "Write a function to add two numbers.",
    "code": "def add(a, b):\n    return a + b",
    "test_list": ["assert add(1, 2) == 3"],
    "test_setup_code": "",
}
RIGHT, WRONG = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"


def predictions_file(path: Path, answers: dict[int, str]) -> Path:
    return write_jsonl(path, [{"task_id": i, "completion": text} for i, text in answers.items()])


def mbpp_data(tmp_path: Path, n: int = 1) -> Path:
    return write_jsonl(tmp_path / "mbpp.jsonl", [{**MBPP, "task_id": 11 + i} for i in range(n)])


def run_eval(capsys, *argv) -> tuple[int, str, str]:
    code = main(["eval", *map(str, argv), "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------- a disk that fails
def eval_cli(tmp_path: Path, out: Path | str) -> list:
    data = mbpp_data(tmp_path)
    preds = predictions_file(tmp_path / "preds.jsonl", {11: RIGHT})
    return ["--task", "mbpp", "--data", data, "--predictions", preds, "--out", out]


def assert_one_line(code: int, out: str, err: str, *words: str) -> None:
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith("refusion eval: error: "), err
    assert all(w in err for w in words), err


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs /sys, a folder no one may write in")
def test_an_out_on_a_read_only_disk_is_one_line(tmp_path, capsys):
    code, out, err = run_eval(capsys, *eval_cli(tmp_path, "/sys/refusion-eval-out"))
    assert_one_line(code, out, err, "/sys/refusion-eval-out", "choose a --out this user can write")


@pytest.mark.parametrize("write", ["write_text", "fsync"], ids=["run.json", "samples.jsonl"])
def test_an_out_on_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch, write):
    """A disk that fills up as run.json or the first records are written."""
    argv = eval_cli(tmp_path, tmp_path / "out")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path if write == "write_text" else os, write, full)
    code, out, err = run_eval(capsys, *argv)
    assert_one_line(
        code, out, err, "run.json" if write == "write_text" else "samples.jsonl", "free some space"
    )


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("run.json", "{not json", "not valid JSON"),
        ("run.json", "[1, 2]", "not hold a JSON object"),
        ("samples.jsonl", "/dev/zero", "character device"),
        ("samples.jsonl", "directory", "is a directory"),
    ],
)
def test_a_damaged_results_directory_is_one_line(tmp_path, capsys, name, content, words):
    out_dir = tmp_path / "out"
    assert run_eval(capsys, *eval_cli(tmp_path, out_dir))[0] == 0
    target = out_dir / name
    target.unlink()
    if content == "/dev/zero":
        target.symlink_to("/dev/zero")
    elif content == "directory":
        target.mkdir()
    else:
        target.write_text(content)
    code, out, err = run_eval(capsys, *eval_cli(tmp_path, out_dir))
    assert_one_line(code, out, err, name, words)


# ---------------------------------------------------------------------------- verdicts keyed by their inputs
def test_predictions_rewritten_in_place_are_scored_again(tmp_path, capsys):
    """The same --out and file name, other completions: the old verdicts are not reported
    as resumed; the samples whose prediction is unchanged are."""
    data = mbpp_data(tmp_path, 3)
    preds = tmp_path / "preds.jsonl"
    out_dir = tmp_path / "out"
    argv = ["--task", "mbpp", "--data", data, "--predictions", preds, "--out", out_dir, "--json"]
    predictions_file(preds, {11: RIGHT, 12: RIGHT, 13: RIGHT})
    first = json.loads(run_eval(capsys, *argv)[1])
    assert (first["correct"], first["resumed"]) == (3, 0)
    predictions_file(preds, {11: WRONG, 12: RIGHT, 13: WRONG})
    second = json.loads(run_eval(capsys, *argv)[1])
    assert (second["correct"], second["resumed"]) == (1, 1), second
    verdicts = {r["id"]: r["correct"] for r in lines(out_dir / "samples.jsonl")}  # the last line of each id
    assert verdicts == {"11": False, "12": True, "13": False}


def test_a_changed_gold_answer_is_scored_again(tmp_path, gsm8k_file):  # noqa: F811
    out = tmp_path / "out"
    evaluate("gsm8k", FakeGenerate(), data=str(gsm8k_file), out_dir=out, progress=False)
    rows = [dict(r) for r in GSM8K]
    rows[1]["answer"] = rows[1]["answer"].replace("#### 4", "#### 5")  # sample 2's gold is now 5
    write_jsonl(gsm8k_file, rows)
    again = FakeGenerate()
    summary = evaluate("gsm8k", again, data=str(gsm8k_file), out_dir=out, progress=False)
    assert len(again.prompts) == 1 and "What is 2 + 2?" in again.prompts[0]
    assert (summary["resumed"], summary["correct"]) == (5, 2)


def test_another_models_files_are_refused_saying_why(tmp_path, gsm8k_file):  # noqa: F811
    out = tmp_path / "out"
    common = dict(data=str(gsm8k_file), out_dir=out, progress=False, model="ckpt", config={"gen_length": 8})
    evaluate("gsm8k", FakeGenerate(), model_files="before", **common)
    with pytest.raises(ResumeMismatchError, match=r"the model's files \(model_files\) differ"):
        evaluate("gsm8k", FakeGenerate(), model_files="after", **common)
    assert evaluate("gsm8k", FakeGenerate(), model_files="before", **common)["resumed"] == 6


def test_a_checkpoint_saved_again_has_another_fingerprint(tmp_path):
    import shutil

    from refusion.io import checkpoint_fingerprint
    from refusion.io.resolve import BUNDLED_DIR

    model = tmp_path / "model"
    shutil.copytree(BUNDLED_DIR, model)
    before = checkpoint_fingerprint(model)
    assert checkpoint_fingerprint(model) == before
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # written again
    assert checkpoint_fingerprint(model) != before


def test_other_sandbox_limits_are_refused_for_a_code_task(tmp_path):
    data = mbpp_data(tmp_path)
    preds = predictions_file(tmp_path / "preds.jsonl", {11: RIGHT})
    out = tmp_path / "out"
    evaluate("mbpp", predictions=preds, data=str(data), out_dir=out, limits=Limits(timeout=5), progress=False)
    with pytest.raises(ResumeMismatchError, match=r"the sandbox's limits \(limits\) differ"):
        evaluate(
            "mbpp", predictions=preds, data=str(data), out_dir=out, limits=Limits(timeout=1), progress=False
        )


# ---------------------------------------------------------------------------- killed, resumed, the same
KILLABLE = """
import json, sys, time
sys.path.insert(0, {tests!r})
from test_eval_runner import FakeGenerate
from refusion.evaluate import evaluate

class Slow(FakeGenerate):
    def __call__(self, prompts):
        time.sleep(0.05)
        return super().__call__(prompts)

summary = evaluate("gsm8k", Slow(), data={data!r}, out_dir={out!r}, batch_size=2, progress=False,
                   config={{"method": "fake"}}, model="m")
print(json.dumps({{"n": summary["n"], "correct": summary["correct"]}}))
"""


def test_an_eval_killed_at_random_moments_resumes_to_the_uninterrupted_result(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(1, 61)]
    data = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    tests = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def script(out: Path) -> list[str]:
        return [sys.executable, "-c", KILLABLE.format(tests=tests, data=str(data), out=str(out))]

    whole = subprocess.run(script(tmp_path / "whole"), env=env, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed_dir, rng = tmp_path / "killed", random.Random(0)
    for k in range(6):  # the first kills while it starts (run.json written), the others while it scores
        proc = subprocess.Popen(script(killed_dir), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if k >= 2:
            deadline = time.monotonic() + 120
            while not (killed_dir / "samples.jsonl").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0) if k >= 2 else rng.uniform(1.0, 4.0))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    resumed = subprocess.run(script(killed_dir), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads(resumed.stdout) == json.loads(whole.stdout)

    def verdicts(out: Path) -> dict:
        return {r["id"]: (r["output"], r["extracted"], r["correct"]) for r in lines(out / "samples.jsonl")}

    assert verdicts(killed_dir) == verdicts(tmp_path / "whole")


def test_a_run_killed_while_it_writes_its_settings_resumes(tmp_path, gsm8k_file, monkeypatch):  # noqa: F811
    """A kill in the middle of writing a file (here: the file opened, and so emptied, and
    nothing written) leaves the file as it was before."""
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        evaluate("gsm8k", FakeGenerate(fail_after=3), data=str(gsm8k_file), out_dir=out, progress=False)
    real_write = Path.write_text

    def killed_while_writing(self, *args, **kwargs):
        real_write(self, "")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(Path, "write_text", killed_while_writing)
        evaluate("gsm8k", FakeGenerate(), data=str(gsm8k_file), out_dir=out, progress=False)
    summary = evaluate("gsm8k", FakeGenerate(), data=str(gsm8k_file), out_dir=out, progress=False)
    assert (summary["n"], summary["resumed"], summary["correct"]) == (6, 3, 3)


# ---------------------------------------------------------------------------- sandbox folders left by a kill
SLOW_CHECK = """
from refusion.sandbox import Check, Limits, run_check
slow = Check(program="import time\\ndef f():\\n    time.sleep(60)\\n", test="f()", calls=("f",))
run_check(slow, Limits(timeout=60))
"""


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def sandbox_folders() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("refusion-sandbox-*"))


def test_the_folders_of_a_killed_check_are_removed_by_the_next_run(tmp_path):
    """A check holds the benchmark's test code in temporary folders; an evaluation killed
    mid-check cannot remove them, so the next run of the sandbox does."""
    from refusion.sandbox import Check, run_check
    from refusion.sandbox.checks import remove_leftovers

    before = sandbox_folders()
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SLOW_CHECK)], env={**os.environ})
    deadline = time.monotonic() + 120
    while not any("sleep(60)" in _text(p / "program.py") for p in sandbox_folders() - before):
        assert time.monotonic() < deadline, "the slow check did not start"
        time.sleep(0.1)
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    left = sandbox_folders() - before
    assert len(left) >= 2 and all(str(proc.pid) in p.name for p in left), left
    remove_leftovers.cache_clear()
    assert run_check(Check(program="def f():\n    return 1\n", test="assert f() == 1", calls=("f",))).passed
    assert not left & sandbox_folders(), "a killed run's folders are still there"


def test_folders_of_live_runs_and_other_names_stay(tmp_path):
    from refusion.io.staging import writer_tag
    from refusion.sandbox.checks import remove_leftovers

    root = Path(tempfile.gettempdir())
    host = writer_tag().rsplit("-", 1)[0]
    mine = root / f"refusion-sandbox-{writer_tag()}-keepmine"
    other_host = root / "refusion-sandbox-elsewhere.example-1-keepthis"
    untagged = root / "refusion-sandbox-oldstyle1"
    try:
        for folder in (mine, other_host, untagged):
            folder.mkdir()
        remove_leftovers.cache_clear()
        remove_leftovers()
        assert mine.is_dir() and other_host.is_dir() and untagged.is_dir()
        assert host != "elsewhere.example"
    finally:
        for folder in (mine, other_host, untagged):
            folder.rmdir()
