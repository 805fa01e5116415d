"""Data parallelism on two CPU processes: `refusion eval --data-parallel-size 2` writes
the per-sample records DP=1 writes, in dataset order, and a killed run resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from refusion.cli import main

KEYS = ("id", "index", "prompt", "output", "extracted", "gold", "correct")


def records(out: Path) -> list[dict]:
    return [{k: r[k] for k in KEYS} for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())]


def run_eval(out: Path, dp: int, limit: int = 12) -> int:
    return main(["eval", "--task", "suite", "--limit", str(limit), "--out", str(out), "--no-progress",
                 "--data-parallel-size", str(dp)])


def test_two_replicas_write_the_records_of_one(tmp_path):
    assert run_eval(tmp_path / "dp1", 1) == 0
    assert run_eval(tmp_path / "dp2", 2) == 0
    assert records(tmp_path / "dp2") == records(tmp_path / "dp1")
    summary = json.loads((tmp_path / "dp2" / "summary.json").read_text())
    assert summary["replicas"] == 2 and summary["n"] == 12


def test_a_killed_two_replica_run_resumes(tmp_path):
    assert run_eval(tmp_path / "dp1", 1, limit=16) == 0
    out = tmp_path / "dp2"
    cmd = [sys.executable, "-m", "refusion.cli", "eval", "--task", "suite", "--limit", "16", "--out", str(out),
           "--no-progress", "--data-parallel-size", "2"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = out / "samples.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not samples.exists() or len(samples.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the parent and both replicas, mid-run
    proc.wait()
    done = len(samples.read_text().splitlines())
    assert 3 <= done < 16
    assert run_eval(out, 2, limit=16) == 0
    assert records(out) == records(tmp_path / "dp1")  # each sample once, in dataset order
    assert json.loads((out / "summary.json").read_text())["resumed"] >= 3
