"""Run a benchmark end to end: prompts -> completions -> scores -> results on disk.

Completions come from an injectable `generate_fn(queries) -> outputs` (a query is the
sample's user message, or a `Chat` where the protocol asks for a whole conversation; each
output has `.text` and optionally `.stats`; the eval command's binding of
`refusion.generate` in real runs, a fake in tests) or from a predictions file made
elsewhere (`predictions.py`). Results go to OUT/ (`results.py`):

- samples.jsonl  one line per sample as soon as it is scored (prompt, output, extracted,
                 gold, correct, stats, and the key of its inputs); a rerun with the same
                 settings skips these, unless a sample's inputs (its prompt, gold, tests,
                 prediction) changed since: those are scored again;
- summary.json   accuracy with its Wilson 95% interval, speed, latency, the settings;
- run.json       the settings (the model's files and the sandbox's limits among them),
                 checked on resume so runs are never mixed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..sandbox import Limits, isolation
from .benchmarks import Benchmark, Chat, CodeBenchmark, Sample, Scored
from .completion import Completion, as_completion
from .predictions import finishing, from_predictions
from .registry import get_benchmark
from .report import GENERATION_ERROR, one_line, summarize
from .results import ReplicaShare, ResultsDir, all_records, open_results, record_key

GenerateFn = Callable[[list[str | Chat]], Sequence[Any]]


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
    model_files: str | None = None,
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
    output (lm-eval's `resps`). `config` (a DecodeConfig or dict), `model`, `model_files`
    (`refusion.io.checkpoint_fingerprint`) and a code task's `limits` are recorded, and a
    resumed run must match them (a sample whose own inputs changed is scored again).
    `samples` overrides loading. With `replicas`, this process evaluates its share and
    the first replica's summary covers them all."""
    part = replicas or ReplicaShare()
    bench = get_benchmark(task) if isinstance(task, str) else task
    _check_source(bench, generate_fn, predictions, raw_predictions)
    samples, complete, given, missing = _samples_and_source(
        bench, samples, data, limit, generate_fn, predictions
    )
    if raw_predictions:
        complete = finishing(complete, tokenizer)
    settings = _settings(bench, model, config, data, predictions, limit, raw_predictions)
    settings |= {"model_files": model_files, "limits": _limits(bench, limits)}
    out = out_dir or Path("runs") / "eval" / bench.name
    results, written = open_results(out, settings, overwrite, part)
    keys = {s.id: record_key(s, given.get(s.id)) for s in samples}
    done = _unchanged(written, keys)
    records = [done[s.id] for s in samples if s.id in done]
    chunk = max(1, batch_size) if predictions is None else 64  # predictions: batch the sandbox
    started = time.perf_counter()
    score = functools.partial(_batch_records, bench, complete=complete, keys=keys, limits=limits)
    score = functools.partial(score, workers=workers, timed=predictions is None)
    _run_pending(bench.name, samples, done, records, results, part, chunk, score, progress and part.first)
    records = all_records(results, samples, records, part)
    resumed = len({s.id for s in samples} & done.keys())
    summary = _summary(bench, settings, records, resumed, missing, started, part, results)
    if part.first:  # the others hold their share only
        results.write_summary(summary)
    summary["line"] = one_line(bench.name, summary)
    return summary


def _unchanged(written: dict[str, dict], keys: dict[str, str]) -> dict[str, dict]:
    """The records a resumed run reuses: those of its samples whose inputs' key is the
    one they were scored under (and those of other samples, which it only keeps)."""
    return {k: r for k, r in written.items() if k not in keys or r.get("key") == keys[k]}


def _check_source(
    bench: Benchmark,
    generate_fn: GenerateFn | None,
    predictions: str | os.PathLike | None,
    raw_predictions: bool,
) -> None:
    """One source of completions, and raw predictions only where the paper protocol can
    finish them."""
    if (generate_fn is None) == (predictions is None):
        raise ValueError("pass exactly one of generate_fn and predictions")
    if raw_predictions and (predictions is None or bench.protocol != "paper"):
        raise ConfigError(
            "raw predictions get the paper protocol's post-processing: give a predictions file and "
            "--protocol paper (robust scores an output as it is)"
        )


def _samples_and_source(
    bench: Benchmark,
    samples: Sequence[Sample] | None,
    data: str | None,
    limit: int | None,
    generate_fn: GenerateFn | None,
    predictions: str | os.PathLike | None,
) -> tuple[list[Sample], Callable[[list[Sample]], list[Completion]], dict[str, str], int]:
    """(the samples to run, what completes a batch of them, each one's prediction by id
    where a file gives them, how many samples have no prediction): with a predictions
    file, only the samples it answers are run."""
    if samples is None:
        samples = bench.load(data, limit)
    samples = _unique_ids(samples)
    if predictions is not None:
        kept, text, missing = from_predictions(samples, predictions)
        return kept, (lambda batch: [Completion(text[s.id]) for s in batch]), text, missing
    assert generate_fn is not None  # evaluate takes exactly one of the two
    return samples, _from_generate(generate_fn), {}, 0


def _limits(bench: Benchmark, limits: Limits | None) -> dict | None:
    """The sandbox's limits as run.json records them: a code task's verdicts depend on them."""
    if not isinstance(bench, CodeBenchmark):
        return None
    return dataclasses.asdict(limits or Limits())


def _settings(
    bench: Benchmark,
    model: str | None,
    config: Any,
    data: str | None,
    predictions: str | os.PathLike | None,
    limit: int | None,
    raw_predictions: bool = False,
) -> dict:
    """What run.json records: a resumed run must match it (`config`, a DecodeConfig or a
    dict, as a dict)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
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
                f"{len(records)} of {len(samples)} samples already scored with the same inputs "
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
    keys: dict[str, str],
    limits: Limits | None,
    workers: int | None,
    timed: bool,
) -> list[dict]:
    """A batch completed, scored and recorded, each record with the key of its inputs;
    when `timed` (the completions were generated here), each record holds its share of
    the batch's generation time."""
    t0 = time.perf_counter()
    completions = complete(batch)
    gen_seconds = (time.perf_counter() - t0) if timed else None
    scored = _score(bench, batch, completions, limits, workers)
    share = None if gen_seconds is None else gen_seconds / len(batch)
    return [_record(s, c, sc, share) | {"key": keys[s.id]} for s, c, sc in zip(batch, completions, scored)]


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
