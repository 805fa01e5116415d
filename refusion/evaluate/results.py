"""A run's results directory and its replicas: OUT/samples.jsonl (append-only,
resumable), summary.json and run.json, and how replicas share one run (`ReplicaShare`).

What a record depends on is written with it, so that a resumed run never reuses a
verdict whose inputs changed: run.json holds the run's settings (the task, the model and
a fingerprint of its files, the decoding settings, the sandbox's limits), refused on
resume if any differs; each record holds the key of its own inputs (the sample's prompt
and gold, its prediction), and a record whose key no longer matches is scored again.
Every failure of the disk (full, read-only, not a directory) is one ResultsError line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..files import JSONProblem, open_regular, parse_json
from .benchmarks import Sample
from .errors import ResultsError, ResumeMismatchError

# the settings a resumed run must share with the run that wrote OUT, and how they are named
SETTINGS = {
    "task": "the task",
    "protocol": "the protocol",
    "model": "the model",
    "model_files": "the model's files",
    "config": "the decoding settings",
    "data": "the data",
    "predictions": "the predictions file",
    "raw_predictions": "--raw-predictions",
    "limits": "the sandbox's limits",
}


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
        self.samples = self.path / "samples.jsonl"
        self.summary = self.path / "summary.json"
        run = self.path / "run.json"
        with disk(self.path, "write the results into"):
            self.path.mkdir(parents=True, exist_ok=True)
            if overwrite and prepare:
                for f in (self.samples, self.summary, run):
                    f.unlink(missing_ok=True)
        if run.exists() and self.samples.exists():
            self._check_resume(run, settings)
        if writes and prepare:
            _replace(run, json.dumps(settings, indent=2, default=str) + "\n")

    def _check_resume(self, run: Path, settings: dict) -> None:
        """Refuse to add to a run made with other settings, naming what differs."""
        before = _read_json(run)
        before.setdefault("protocol", "robust")  # written before there were protocols
        before.setdefault("raw_predictions", False)
        changed = [
            f"{name} ({key})" for key, name in SETTINGS.items() if before.get(key) != settings.get(key)
        ]
        if changed:
            raise ResumeMismatchError(
                f"{self.path} holds a run with other settings ({', '.join(changed)} differ): its verdicts "
                "would not be this run's; pass --overwrite or another --out"
            )

    def done(self, repair: bool = True) -> dict[str, dict]:
        """Records already written, by id. A line cut short by an interrupt is dropped, and
        with `repair` cut from the file (never while other replicas may be appending)."""
        if not self.samples.exists():
            return {}
        with disk(self.samples, "read"), open_regular(self.samples, ResultsError, _FIX) as f:
            raw = f.read()
        if raw and not raw.endswith(b"\n"):  # interrupted mid-line: cut back to the last whole line
            raw = raw[: raw.rfind(b"\n") + 1]
            if self.writes and repair:  # in one call: a kill now leaves the file as it was, or cut
                with disk(self.samples, "write"):
                    os.truncate(self.samples, len(raw))
        records = {}
        for line in raw.decode("utf-8", "replace").splitlines():
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
        with disk(self.samples, "write"), open(self.samples, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(_lines(records))
            f.flush()
            os.fsync(f.fileno())

    def rewrite(self, records: Sequence[dict]) -> None:
        """samples.jsonl as exactly these records, in this order (atomically)."""
        _replace(self.samples, _lines(records))

    def write_summary(self, summary: dict) -> None:
        _replace(self.summary, json.dumps(summary, indent=2, default=str) + "\n")


def _replace(path: Path, text: str) -> None:
    """`path` with `text` as its content, atomically: a run killed while writing it leaves
    the old file whole (run.json, rewritten by every resumed run, once read back empty)."""
    tmp = path.with_name(path.name + ".tmp")
    with disk(path, "write"):
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)


_FIX = "choose another --out, or --overwrite to start it afresh"


@contextlib.contextmanager
def disk(path: Path, doing: str) -> Iterator[None]:
    """An OSError of the disk as one ResultsError line saying what to do, as `train` says
    it of its output directory."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # a full disk, a quota, a file size limit
            fix = "free some space on its disk, or choose another --out"
        elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            fix = "choose a --out this user can write"
        else:
            fix = "choose another --out"
        raise ResultsError(f"cannot {doing} {path} ({e.strerror or type(e).__name__}): {fix}") from None


def _read_json(path: Path) -> dict:
    """run.json, a JSON object; a ResultsError naming it otherwise."""
    with disk(path, "read"), open_regular(path, ResultsError, _FIX) as f:
        raw = f.read(2**24)
    try:
        value = parse_json(raw)
    except JSONProblem as e:
        raise ResultsError(f"{path} {e}; {_FIX}") from None
    if not isinstance(value, dict):
        raise ResultsError(f"{path} does not hold a JSON object; {_FIX}")
    return value


def record_key(sample: Sample, given: Any = None) -> str:
    """The key of what a sample's verdict depends on besides the run's settings: its id,
    prompt, request, gold and scoring data (a code task's tests), and `given` (its
    prediction, when the completions come from a file). A resumed run reuses a record
    only under the same key."""
    request = (list(sample.request.messages), list(sample.request.until)) if sample.request else None
    inputs = [sample.id, sample.prompt, request, sample.gold, sample.data, given]
    text = json.dumps(inputs, default=str, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


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
