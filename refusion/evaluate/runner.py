"""Run a benchmark end to end: prompts -> completions -> scores -> results on disk.

Completions come from an injectable `generate_fn(queries) -> outputs` (a query is the
sample's user message, or a `Chat` where the protocol asks for a whole conversation; each
output has `.text` and optionally `.stats`; the eval command's binding of
`refusion.generate` in real runs, a fake in tests) or from a predictions file made
elsewhere. Results go to OUT/:

- samples.jsonl  one line per sample as soon as it is scored (prompt, output, extracted,
                 gold, correct, stats); a rerun with the same settings skips these;
- summary.json   accuracy with its Wilson 95% interval, speed, latency, the settings;
- run.json       the settings, checked on resume so runs are never mixed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..files import JSONProblem, lone_surrogate, open_regular, parse_json
from ..sandbox import Limits, isolation
from ..settings.fields import shown
from .benchmarks import Benchmark, Chat, CodeBenchmark, Sample, Scored
from .completion import Completion, as_completion
from .errors import PredictionsError, ResumeMismatchError
from .paper_rules import finish
from .registry import get_benchmark
from .report import GENERATION_ERROR, one_line, summarize

GenerateFn = Callable[[list[str | Chat]], Sequence[Any]]


# ------------------------------------------------------------------------ predictions
_ID_KEYS = ("task_id", "id", "sample_id", "question_id")
_INDEX_KEYS = ("index", "idx", "doc_id")
_TEXT_KEYS = ("completion", "output", "text", "response", "prediction", "resps")


_FIX_PREDICTIONS = "fix the line, or write the file again (one JSON object per line)"


def read_predictions(path: str | os.PathLike) -> tuple[dict[str, str], dict[int, str]]:
    """Completions by sample id and by dataset index from a JSONL file: a regular file,
    each line a JSON object whose completion is text and whose index is a whole number;
    a PredictionsError naming the line otherwise."""
    p = Path(path)
    by_id: dict[str, str] = {}
    by_index: dict[int, str] = {}
    with open_regular(p, PredictionsError, fix="pass --predictions a JSONL file") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                key, text = _prediction(raw, f"{p}:{n}")
                if isinstance(key, str):
                    by_id[key] = text
                else:
                    by_index[key] = text
    return by_id, by_index


def _prediction(raw: bytes, where: str) -> tuple[str | int, str]:
    """(sample id or dataset index, completion) of one line."""
    try:
        row = parse_json(raw)
    except JSONProblem as e:
        raise PredictionsError(f"{where}: the line {e}; {_FIX_PREDICTIONS}") from None
    if not isinstance(row, dict) or not any(k in row for k in _TEXT_KEYS):
        raise PredictionsError(
            f"{where}: expected a JSON object with a completion ({', '.join(_TEXT_KEYS)}); {_FIX_PREDICTIONS}"
        )
    name = next(k for k in _TEXT_KEYS if k in row)
    text = row[name]
    while isinstance(text, list):  # lm-eval's "resps": [["..."]]
        text = text[0] if text else ""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)  # a bare number as the answer
    if not isinstance(text, str):
        raise PredictionsError(f"{where}: {name}={shown(text)} is not text; {_FIX_PREDICTIONS}")
    if lone_surrogate(text):
        raise PredictionsError(
            f"{where}: {name} holds a lone UTF-16 surrogate (such as \\ud800), which is not text; "
            + _FIX_PREDICTIONS
        )
    key = next((k for k in _ID_KEYS if k in row), None)
    if key is not None:
        if isinstance(row[key], bool) or not isinstance(row[key], (str, int)) or lone_surrogate(row[key]):
            raise PredictionsError(f"{where}: {key}={shown(row[key])} is not a sample id; {_FIX_PREDICTIONS}")
        return str(row[key]), text
    key = next((k for k in _INDEX_KEYS if k in row), None)
    if key is None:
        raise PredictionsError(
            f"{where}: no sample id ({', '.join(_ID_KEYS)}) or index ({', '.join(_INDEX_KEYS)}); "
            + _FIX_PREDICTIONS
        )
    index = row[key]
    if isinstance(index, str) and index.isascii() and index.isdigit() and len(index) <= 18:
        index = int(index)  # "7": a number written as a string
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 2**63:
        raise PredictionsError(
            f"{where}: {key}={shown(index)} is not a dataset index (a whole number from 0); "
            + _FIX_PREDICTIONS
        )
    return index, text


# -------------------------------------------------------------------------- results
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


# --------------------------------------------------------------------------- the run
def evaluate(
    task: str | Benchmark,
    generate_fn: GenerateFn | None = None,
    *,
    predictions: str | os.PathLike | None = None,
    raw_predictions: bool = False,
    tokenizer: Any = None,
    data: str | None = None,
    limit: int | None = None,
    batch_size: int = 1,
    out_dir: str | os.PathLike | None = None,
    config: Any = None,
    model: str | None = None,
    limits: Limits | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    samples: Sequence[Sample] | None = None,
    replicas: ReplicaShare | None = None,
) -> dict:
    """Evaluate `generate_fn` (or a predictions file) on a benchmark; returns the summary.

    `raw_predictions`: the file holds raw generations of another engine, which get the
    post-processing the paper protocol gives a generation here (`paper_rules.finish`: the
    task's stop strings, special tokens removed with `tokenizer` when given, the
    python-block rule); by default a prediction is taken as the harness's finished
    output (lm-eval's `resps`). `config` (a DecodeConfig or dict) and `model` are
    recorded, and a resumed run must match them. `samples` overrides loading (tests,
    custom subsets). With `replicas`, this process evaluates its share and the first
    replica's summary covers them all.
    """
    part = replicas or ReplicaShare()
    bench = get_benchmark(task) if isinstance(task, str) else task
    if (generate_fn is None) == (predictions is None):
        raise ValueError("pass exactly one of generate_fn and predictions")
    if raw_predictions and (predictions is None or bench.protocol != "paper"):
        raise ConfigError(
            "raw predictions get the paper protocol's post-processing: give a predictions file and "
            "--protocol paper (robust scores an output as it is)"
        )
    samples, complete, missing = _samples_and_source(bench, samples, data, limit, generate_fn, predictions)
    if raw_predictions:
        complete = _finishing(complete, tokenizer)
    is_instance = dataclasses.is_dataclass(config) and not isinstance(config, type)
    config_dict = dataclasses.asdict(config) if is_instance else config
    settings = _settings(bench, model, config_dict, data, predictions, limit, raw_predictions)
    out = out_dir or Path("runs") / "eval" / bench.name
    results, done = _open_results(out, settings, overwrite, part)
    records = [done[s.id] for s in samples if s.id in done]
    chunk = max(1, batch_size) if predictions is None else 64  # predictions: batch the sandbox
    started = time.perf_counter()
    score = functools.partial(
        _batch_records, bench, complete=complete, limits=limits, workers=workers, timed=predictions is None
    )
    _run_pending(bench.name, samples, done, records, results, part, chunk, score, progress and part.first)
    records = _all_records(results, samples, records, part)
    resumed = len({s.id for s in samples} & done.keys())
    summary = _summary(bench, settings, records, resumed, missing, started, part, results)
    if part.first:  # the others hold their share only
        results.write_summary(summary)
    summary["line"] = one_line(bench.name, summary)
    return summary


def _samples_and_source(
    bench: Benchmark,
    samples: Sequence[Sample] | None,
    data: str | None,
    limit: int | None,
    generate_fn: GenerateFn | None,
    predictions: str | os.PathLike | None,
) -> tuple[list[Sample], Callable[[list[Sample]], list[Completion]], int]:
    """(the samples to run, what completes a batch of them, how many samples have no
    prediction): with a predictions file, only the samples it answers are run."""
    if samples is None:
        samples = bench.load(data, limit)
    samples = _unique_ids(samples)
    if predictions is not None:
        return _from_predictions(samples, predictions)
    assert generate_fn is not None  # evaluate takes exactly one of the two
    return samples, _from_generate(generate_fn), 0


def _settings(
    bench: Benchmark,
    model: str | None,
    config: Any,
    data: str | None,
    predictions: str | os.PathLike | None,
    limit: int | None,
    raw_predictions: bool = False,
) -> dict:
    """What run.json records: a resumed run must match it."""
    return {
        "task": bench.name,
        "protocol": bench.protocol,
        "model": model,
        "config": config,
        "data": data or "default",
        "predictions": str(predictions) if predictions else None,
        "raw_predictions": raw_predictions,
        "limit": limit,
    }


def _open_results(
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


def _run_pending(
    name: str,
    samples: Sequence[Sample],
    done: dict[str, dict],
    records: list[dict],
    results: ResultsDir,
    part: ReplicaShare,
    chunk: int,
    score: Callable[[list[Sample]], list[dict]],
    progress: bool,
) -> None:
    """The samples not yet done, batch by batch: each batch's records are appended to the
    results as soon as it is scored, and to `records`."""
    with _progress(len(samples), len(records), name, progress) as bar:
        if records:
            bar.write(
                f"{name}: resuming {results.path}: "
                f"{len(records)} of {len(samples)} samples already scored "
                "(--overwrite starts afresh)",
                file=sys.stderr,
            )
        for batch in _batches(samples, done, chunk, part.claim):
            new = score(batch)
            results.append(new)
            records.extend(new)
            bar.update(
                min(len(batch) * part.count, bar.total - bar.n)
            )  # the other replicas keep about the same pace
            bar.set_postfix(acc=f"{sum(r['correct'] for r in records) / len(records):.3f}")


def _batch_records(
    bench: Benchmark,
    batch: list[Sample],
    *,
    complete: Callable[[list[Sample]], list[Completion]],
    limits: Limits | None,
    workers: int | None,
    timed: bool,
) -> list[dict]:
    """A batch completed, scored and recorded; when `timed` (the completions were
    generated here), each record holds its share of the batch's generation time."""
    t0 = time.perf_counter()
    completions = complete(batch)
    gen_seconds = (time.perf_counter() - t0) if timed else None
    scored = _score(bench, batch, completions, limits, workers)
    share = None if gen_seconds is None else gen_seconds / len(batch)
    return [_record(s, c, sc, share) for s, c, sc in zip(batch, completions, scored)]


def _all_records(
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


def _summary(
    bench: Benchmark,
    settings: dict,
    records: list[dict],
    resumed: int,
    missing: int,
    started: float,
    part: ReplicaShare,
    results: ResultsDir,
) -> dict:
    """summary.json: the scores with the settings, the speed and where the files are.
    `resumed` records were there before the run; the speed counts the others only."""
    summary = {
        "task": bench.name,
        "protocol": bench.protocol,
        "model": settings["model"],
        **summarize(records, bench.extracts),
        "config": settings["config"],
        "first_generation_error": _first_generation_error(records),
        "data": settings["data"],
        "predictions": settings["predictions"],
        "raw_predictions": settings["raw_predictions"],
        "limit": settings["limit"],
        "resumed": resumed,
        "missing_predictions": missing,
        "elapsed_s": time.perf_counter() - started,
        "replicas": part.count,
        "samples_per_s": (len(records) - resumed) / max(time.perf_counter() - started, 1e-9),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": {"samples": str(results.samples), "summary": str(results.summary)},
    }
    if isinstance(bench, CodeBenchmark):
        summary["sandbox"] = isolation().describe()
    if bench.notes():
        summary["scoring"] = bench.notes()
    return summary


def _first_generation_error(records: list[dict]) -> str | None:
    """The first sample's generation error, if any sample failed to generate."""
    return next(
        (r["detail"]["error"] for r in records if (r.get("detail") or {}).get("reason") == GENERATION_ERROR),
        None,
    )


def _batches(samples: Sequence[Sample], done: dict, chunk: int, claim: Callable[[], int] | None):
    """The batches this process evaluates: the samples not yet done, `chunk` at a time;
    with `claim`, the chunks of the dataset's order it wins (less those done)."""
    if claim is None:
        pending = [s for s in samples if s.id not in done]
        for i in range(0, len(pending), chunk):
            yield pending[i : i + chunk]
        return
    while True:
        k = claim()
        window = samples[k * chunk : (k + 1) * chunk]
        if not window:
            return
        batch = [s for s in window if s.id not in done]
        if batch:
            yield batch


def _unique_ids(samples: Sequence[Sample]) -> list[Sample]:
    seen: set[str] = set()
    out = []
    for s in samples:
        if s.id in seen:
            s = dataclasses.replace(s, id=f"{s.id}#{s.index}")
        seen.add(s.id)
        out.append(s)
    return out


def _from_generate(generate_fn: GenerateFn) -> Callable[[list[Sample]], list[Completion]]:
    """A prompt the model refuses (too long for its context, say) is recorded as a
    generation error (and a wrong answer), as harnesses do, instead of ending the run; the
    rest of its batch is retried alone."""

    def complete(batch: list[Sample]) -> list[Completion]:
        try:
            outputs = list(generate_fn([s.query for s in batch]))
        except ConfigError as e:  # ContextLengthError among them: the request's fault, not the run's
            if len(batch) == 1:
                return [Completion("", error=str(e))]
            return [c for s in batch for c in complete([s])]
        if len(outputs) != len(batch):
            raise ValueError(f"generate_fn returned {len(outputs)} outputs for {len(batch)} prompts")
        return [as_completion(o) for o in outputs]

    return complete


def _finishing(
    complete: Callable[[list[Sample]], list[Completion]], tokenizer: Any
) -> Callable[[list[Sample]], list[Completion]]:
    """`complete`, each text then finished as the paper protocol finishes a generation
    (the sample's stop strings, special tokens, the python-block rule)."""

    def finished(batch: list[Sample]) -> list[Completion]:
        return [
            dataclasses.replace(c, text=finish(c.text, s.request.until if s.request else (), tokenizer))
            for s, c in zip(batch, complete(batch))
        ]

    return finished


def _from_predictions(
    samples: list[Sample], path: str | os.PathLike
) -> tuple[list[Sample], Callable[[list[Sample]], list[Completion]], int]:
    by_id, by_index = read_predictions(path)
    found = {s.id: by_id.get(s.id, by_index.get(s.index)) for s in samples}
    text = {key: t for key, t in found.items() if t is not None}
    kept = [s for s in samples if s.id in text]
    if not kept:
        raise PredictionsError(f"{path}: no prediction matches a sample of this task (by id or index)")
    return kept, (lambda batch: [Completion(text[s.id]) for s in batch]), len(samples) - len(kept)


def _score(
    bench: Benchmark,
    batch: list[Sample],
    completions: list[Completion],
    limits: Limits | None,
    workers: int | None,
) -> list[Scored]:
    """Scores of a batch; a sample that failed to generate is not scored (nor run) but
    marked as a generation error, so that it is not mistaken for a wrong answer."""
    ok = [i for i, c in enumerate(completions) if c.error is None]
    scored = (
        bench.score([batch[i] for i in ok], [completions[i].text for i in ok], limits=limits, workers=workers)
        if ok
        else []
    )
    out = [Scored(None, False, {"reason": GENERATION_ERROR})] * len(batch)
    for i, sc in zip(ok, scored):
        out[i] = sc
    return out


def _record(sample: Sample, completion: Completion, scored: Scored, gen_seconds: float | None) -> dict:
    request = (
        {"messages": list(sample.request.messages), "until": list(sample.request.until)}
        if sample.request
        else {}
    )
    return {
        "id": sample.id,
        "index": sample.index,
        "prompt": sample.prompt,
        **request,
        "output": completion.text,
        "extracted": scored.extracted,
        "gold": sample.gold,
        "correct": bool(scored.correct),
        "stats": completion.stats,
        "gen_seconds": gen_seconds,
        "detail": {**scored.detail, "error": completion.error}
        if completion.error
        else (scored.detail or None),
    }


def _progress(total: int, initial: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total, initial=initial, desc=desc, unit="sample", disable=not enabled, dynamic_ncols=True
    )
