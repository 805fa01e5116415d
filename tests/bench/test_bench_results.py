"""`--results`: a bench command writes what it printed into a markdown page under a header
block (command as run, commit, machine, date); a second run of the same command replaces
its own block and keeps the rest of the page."""

from __future__ import annotations

import importlib
import shlex
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from refusion.bench import results
from refusion.cli.commands.bench import BENCHES
from refusion.cli.dispatch import build_parser, main

HEADER = results.Header("refusion bench train --steps 1", "abc1234", "a CPU", "2030-01-02 03:04 UTC")


def test_a_new_page_gets_a_title_and_the_block(tmp_path):
    page = tmp_path / "sub" / "train.md"
    results.write_block(page, HEADER, "objective tokens/s\nrefusion 565\n")
    text = page.read_text()
    assert text.startswith("# Results: train\n")
    assert "- command: `refusion bench train --steps 1`" in text and "- commit: `abc1234`" in text
    assert "- machine: a CPU" in text and "- date: 2030-01-02 03:04 UTC" in text
    assert "Written by the command below" in text
    assert "```text\nobjective tokens/s\nrefusion 565\n```" in text


def test_the_same_command_replaces_its_block_and_keeps_the_rest(tmp_path):
    page = tmp_path / "train.md"
    page.write_text("# Training\n\nWhat these are.\n\n## Moved from the README\n\nold figures 5,421\n")
    results.write_block(page, HEADER, "first run 1.0\n")
    other = results.Header("refusion bench train --steps 2", "abc1234", "a CPU", "2030-01-02 04:00 UTC")
    results.write_block(page, other, "other command 3.0\n")
    again = results.Header(
        HEADER.command + " --results docs/x.md", "def5678", "a CPU", "2030-01-03 00:00 UTC"
    )
    results.write_block(page, again, "second run 2.0\n")
    text = page.read_text()
    assert "first run" not in text and "second run 2.0" in text and "other command 3.0" in text
    assert text.count("bench-results begin") == 2 == text.count("bench-results end")
    # newest first, under the page's introduction, above what was there
    assert (
        text.index("What these are.") < text.index("other command") < text.index("## Moved from the README")
    )
    assert text.index("second run") < text.index("## Moved from the README")
    assert text.endswith("## Moved from the README\n\nold figures 5,421\n")


def test_a_fence_longer_than_any_backticks_in_the_output(tmp_path):
    page = tmp_path / "p.md"
    results.write_block(page, HEADER, "a ```` b\n")
    assert "`````text\na ```` b\n`````" in page.read_text()


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def test_commit_is_dirty_only_for_code_outside_docs(tmp_path):
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    (repo / "docs" / "page.md").write_text("# page\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert results.commit(repo) == head
    (repo / "docs" / "page.md").write_text("# page, rewritten by a run\n")
    (repo / "untracked.txt").write_text("not code of the commit\n")
    assert results.commit(repo) == head
    (repo / "code.py").write_text("x = 2\n")
    assert results.commit(repo) == head + "-dirty"
    assert results.commit(tmp_path) == "unknown"


def test_cpu_model_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Example CPU @ 3.0GHz\n")
    assert results.cpu_model(info) == "Example CPU @ 3.0GHz"
    assert results.cpu_model(tmp_path / "none")  # elsewhere: what platform knows, never empty


def test_every_bench_command_takes_results_with_its_topic_page():
    for name in BENCHES:
        argv = ["bench", name, *(["RUN"] if name == "curve" else []), "--results"]
        args = build_parser(argv).parse_args(argv)
        assert args.results.startswith("docs/results/") and args.results.endswith(".md"), name
        run = importlib.import_module(f"refusion.bench.{name}").run
        assert run.__wrapped__, f"bench {name}'s run does not write its page"


def test_a_bench_command_writes_and_refreshes_its_page(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    page = tmp_path / "training.md"
    argv = ["bench", "train", "--steps", "1", "--repeats", "2", "--seq-len", "16", "--batch-size", "2"]
    assert main([*argv, "--results", str(page)]) == 0
    printed = capsys.readouterr().out
    text = page.read_text()
    table = [line for line in printed.splitlines() if line.startswith(("refusion ", "ar ", "ratio "))]
    assert len(table) == 3 and all(line in text.splitlines() for line in table)
    assert f"- command: `OMP_NUM_THREADS=1 refusion {shlex.join([*argv, '--results', str(page)])}`" in text
    commit = text.split("- commit: `", 1)[1].split("`", 1)[0]
    assert commit == results.commit()  # the checkout's short hash (and -dirty), or unknown outside one
    assert f"torch {torch.__version__}" in text and results.cpu_model() in text
    assert f"- date: {datetime.now(timezone.utc):%Y-%m-%d}" in text
    assert f"results page: {page}" in printed
    assert main([*argv, f"--results={page}"]) == 0  # the same command again: its block refreshed
    assert page.read_text().count("bench-results begin") == 1


def test_a_failed_run_writes_no_page(tmp_path):
    page = tmp_path / "training.md"
    assert (
        main(["bench", "train", "--init-config", str(tmp_path / "missing.json"), "--results", str(page)]) == 2
    )
    assert not page.exists()


@pytest.mark.parametrize(
    "command, measured",
    [
        ("refusion bench suite --limit 4 --results", "refusion bench suite --limit 4"),
        ("refusion bench suite --results docs/results/suite.md --limit 4", "refusion bench suite --limit 4"),
        ("refusion bench suite --results=x.md --no-sweep", "refusion bench suite --no-sweep"),
    ],
)
def test_where_a_page_is_written_does_not_make_another_measurement(command, measured):
    assert results._without_results(command) == measured
