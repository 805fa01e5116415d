"""A run's results directory and its replicas: OUT/samples.jsonl (append-only,
resumable), summary.json and run.json, and how replicas share one run (`ReplicaShare`)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from .benchmarks import Sample
from .errors import ResumeMismatchError


@dataclasses.dataclass(frozen=True)
class ReplicaShare:
    """How this process shares a run with `count` replicas (data parallelism). `claim()`
    returns the next unclaimed chunk number of the run, shared by all replicas (each
    chunk is batch_size samples of the dataset's order), so that a replica with short
    samples takes more of them. `writes`: it appends its records (false for the other
    ranks of a tensor-parallel group, which repeat their leader's work); `first`: it
    prepares the results directory and, once every replica is done, writes the samples
    in dataset order and the summary. `barrier` waits for all processes."""

    count: int = 1
    claim: Callable[[], int] | None = None
    writes: bool = True
    first: bool = True
    barrier: Callable[[], None] = lambda: None


class ResultsDir:
    """OUT/samples.jsonl (append-only, resumable), OUT/summary.json, OUT/run.json."""

    def __init__(
        self,
        path: str | os.PathLike,
        settings: dict,
        overwrite: bool = False,
        writes: bool = True,
        prepare: bool = True,
    ) -> None:
        """`prepare`: clear it (with overwrite) and record the settings; replicas open the
        directory their first one prepared with prepare=False (and writes=False, the
        ranks that only follow)."""
        self.writes = writes
        settings = json.loads(json.dumps(settings, default=str))  # as a resumed run reads them back
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.samples = self.path / "samples.jsonl"
        self.summary = self.path / "summary.json"
        run = self.path / "run.json"
        if overwrite and prepare:
            for f in (self.samples, self.summary, run):
                f.unlink(missing_ok=True)
        if run.exists() and self.samples.exists():
            before = json.loads(run.read_text())
            before.setdefault("protocol", "robust")  # written before there were protocols
            before.setdefault("raw_predictions", False)
            keys = ("task", "protocol", "model", "config", "data", "predictions", "raw_predictions")
            if any(before.get(k) != settings.get(k) for k in keys):
                changed = [k for k in keys if before.get(k) != settings.get(k)]
                raise ResumeMismatchError(
                    f"{self.path} holds a run with other settings ({', '.join(changed)} differ); "
                    "pass --overwrite or another --out"
                )
        if writes and prepare:
            run.write_text(json.dumps(settings, indent=2, default=str) + "\n")

    def done(self, repair: bool = True) -> dict[str, dict]:
        """Records already written, by id. A line cut short by an interrupt is dropped, and
        with `repair` cut from the file (never while other replicas may be appending)."""
        if not self.samples.exists():
            return {}
        raw = self.samples.read_bytes()
        if raw and not raw.endswith(b"\n"):  # interrupted mid-line: cut back to the last whole line
            raw = raw[: raw.rfind(b"\n") + 1]
            if self.writes and repair:
                self.samples.write_bytes(raw)
        records = {}
        for line in raw.decode("utf-8").splitlines():
            try:
                record = json.loads(line)
                records[str(record["id"])] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        return records

    def append(self, records: Sequence[dict]) -> None:
        """Whole lines, under a lock: replicas append to the same file."""
        if not self.writes:
            return
        with open(self.samples, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(_lines(records))
            f.flush()
            os.fsync(f.fileno())

    def rewrite(self, records: Sequence[dict]) -> None:
        """samples.jsonl as exactly these records, in this order (atomically)."""
        tmp = self.samples.with_suffix(".jsonl.tmp")
        tmp.write_text(_lines(records), encoding="utf-8")
        tmp.replace(self.samples)

    def write_summary(self, summary: dict) -> None:
        tmp = self.summary.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        tmp.replace(self.summary)


def _lines(records: Sequence[dict]) -> str:
    """Records as JSON lines, as samples.jsonl holds them."""
    return "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)


def open_results(
    out: str | os.PathLike, settings: dict, overwrite: bool, part: ReplicaShare
) -> tuple[ResultsDir, dict[str, dict]]:
    """The results directory and the records already in it. The first replica prepares
    the directory (overwrite, a line cut short) before anyone reads it; the others read
    what was there, and their own appends come later."""
    if part.first:
        results = ResultsDir(out, settings, overwrite)
        done = results.done()
    part.barrier()
    if not part.first:
        results = ResultsDir(out, settings, writes=part.writes, prepare=False)
        done = results.done(repair=False)
    return results, done


def all_records(
    results: ResultsDir, samples: Sequence[Sample], records: list[dict], part: ReplicaShare
) -> list[dict]:
    """The records the summary covers, once every replica is done: with replicas, the
    first one takes every replica's records and rewrites samples.jsonl in dataset order
    (earlier runs' other records after)."""
    part.barrier()
    if part.count > 1 and part.first:
        wanted = {s.id for s in samples}
        everyone = results.done()
        records = [everyone[s.id] for s in samples if s.id in everyone]
        results.rewrite(records + [r for k, r in everyone.items() if k not in wanted])
    return records
