"""Data parallelism on two CPU processes: `refusion eval --data-parallel-size 2` writes
the per-sample records DP=1 writes, in dataset order, and a killed run resumes;
`refusion bench suite` over two replicas (or split in two) decodes every item as one
process does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from refusion.cli.dispatch import main

KEYS = ("id", "index", "prompt", "output", "extracted", "gold", "correct")


def records(out: Path) -> list[dict]:
    return [
        {k: r[k] for k in KEYS} for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())
    ]


def run_eval(out: Path, dp: int, limit: int = 12) -> int:
    return main(
        [
            "eval",
            "--task",
            "suite",
            "--limit",
            str(limit),
            "--out",
            str(out),
            "--no-progress",
            "--data-parallel-size",
            str(dp),
        ]
    )


def test_two_replicas_write_the_records_of_one(tmp_path):
    assert run_eval(tmp_path / "dp1", 1) == 0
    assert run_eval(tmp_path / "dp2", 2) == 0
    assert records(tmp_path / "dp2") == records(tmp_path / "dp1")
    summary = json.loads((tmp_path / "dp2" / "summary.json").read_text())
    assert summary["replicas"] == 2 and summary["n"] == 12


def test_a_killed_two_replica_run_resumes(tmp_path):
    assert run_eval(tmp_path / "dp1", 1, limit=16) == 0
    out = tmp_path / "dp2"
    cmd = [
        sys.executable,
        "-m",
        "refusion.cli",
        "eval",
        "--task",
        "suite",
        "--limit",
        "16",
        "--out",
        str(out),
        "--no-progress",
        "--data-parallel-size",
        "2",
    ]
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


def test_a_shorter_run_with_replicas_keeps_the_records_it_did_not_ask_for(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_eval(ref, 1, limit=12) == 0
    lines = (ref / "samples.jsonl").read_text().splitlines(keepends=True)
    out.mkdir()
    (out / "samples.jsonl").write_text("".join(lines[6:]))  # a directory holding samples 6-11 only
    (out / "run.json").write_text((ref / "run.json").read_text())
    assert run_eval(out, 2, limit=6) == 0  # samples 0-5, by two replicas
    assert records(out) == records(ref)  # theirs in dataset order, then the ones it did not ask for
    assert json.loads((out / "summary.json").read_text())["n"] == 6  # the run's own samples


def test_predictions_are_not_split(tmp_path, capsys):
    preds = tmp_path / "p.jsonl"
    preds.write_text(json.dumps({"index": 0, "output": "x"}) + "\n")
    assert main(["eval", "--task", "suite", "--predictions", str(preds), "--data-parallel-size", "2"]) == 2
    assert "drop --data-parallel-size" in capsys.readouterr().err


def _suite_records(out: Path, *flags: str) -> list:
    assert (
        main(["bench", "suite", "--limit", "8", "--chunk", "2", "--no-sweep", "--out", str(out), *flags]) == 0
    )
    table = json.loads((out / "suite.json").read_text())["table"]
    return [
        (row["key"], [(r["index"], r["correct"], r["tokens"], r["nfe"]) for r in row["records"]])
        for row in table
    ]


def test_bench_suite_over_two_replicas_or_split_decodes_as_one_process(tmp_path, capfd):
    alone = _suite_records(tmp_path / "one")
    assert [len(r) for _, r in alone] == [8] * len(alone) and len(alone) >= 4
    capfd.readouterr()
    assert _suite_records(tmp_path / "dp2", "--data-parallel-size", "2") == alone
    assert capfd.readouterr().out.count("ReFusion L2R") == 1  # one table, from the first replica
    assert _suite_records(tmp_path / "tp2", "--tensor-parallel-size", "2") == alone
