"""Measuring on the held-out suite, for `refusion bench suite` (and `bench curve`,
`bench diagnose`): each item decoded alone and scored by the evaluator's own scorer, every
run interleaved chunk by chunk (data-parallel replicas claim chunks), and a row's or a
sweep point's figures computed from its per-item records only, so a reader of the JSON can
recompute every one.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from ..decode import DecodeConfig, EngineConfig, RequestOutput, generate
from ..timing import sync
from .aup import aup


@dataclass
class Run:
    """One decoding setting to measure: which weights ("refusion" or "ar"), which config."""

    key: str
    label: str
    weights: str
    cfg: DecodeConfig
    group: str = ""  # the sweep's method (AUP is computed per group)


@dataclass
class Record:
    """One item decoded by one run: what it takes to recompute every figure."""

    index: int  # position in the held-out list that was run
    family: str
    correct: bool
    tokens: int
    nfe: int
    seconds: float


def decode_item(
    model,
    tokenizer,
    item,
    index: int,
    cfg: DecodeConfig,
    engine: EngineConfig,
    score: Callable[[Any, int, RequestOutput], bool] | None = None,
) -> tuple[Record, RequestOutput]:
    """Decode one item alone (batch size 1) and score it: its record, and the output. The
    clock covers `generate`, not the check, which is `score` (default: the evaluator's
    scorer of the suite, as `refusion eval --task suite` scores)."""
    sync(model.device)
    t0 = time.perf_counter()
    out = generate(model, tokenizer, [item.prompt], cfg, engine_config=engine)[0]
    sync(model.device)
    seconds = time.perf_counter() - t0
    correct = score(item, index, out) if score is not None else score_item(item, index, out.text)
    return Record(index, item.family, correct, out.stats.tokens, out.stats.nfe, seconds), out


def score_item(item, index: int, text: str) -> bool:
    """Whether `text` answers the held-out item: the evaluator's scorer of the suite
    (`refusion eval --task suite` scores alike)."""
    from ..evaluate.registry import get_benchmark

    suite = get_benchmark("suite")
    return bool(suite.score_one(suite.sample(item, index), text).correct)


def measure(
    runs: Sequence[Run],
    items: Sequence,
    models: dict[str, tuple],
    chunk: int,
    desc: str,
    engine: EngineConfig,
) -> dict[str, list[Record]] | None:
    """Every run on every item, interleaved chunk by chunk; rows rotate their order each
    chunk so none always runs first after a switch of weights. Data-parallel replicas
    claim chunks from one counter, and the first process gets every record, in item
    order (the others get None). Collective: every process calls it."""
    from ..parallel import gather_to_main, is_main, replica_claims

    share = replica_claims(models["refusion"][0])
    warm_up(runs, items[0], models, engine)
    records: dict[str, list[Record]] = {r.key: [] for r in runs}
    n_chunks = -(-len(items) // chunk)
    total = len(runs) * len(items) // (share[0] if share else 1)
    with tqdm(
        total=total, desc=desc, unit="decode", file=sys.stderr, mininterval=1.0, disable=not is_main()
    ) as bar:
        for c in _chunk_numbers(n_chunks, share):
            shift = c % len(runs)
            for run in [*runs[shift:], *runs[:shift]]:
                model, tokenizer = models[run.weights]
                for i in range(c * chunk, min((c + 1) * chunk, len(items))):
                    records[run.key].append(decode_item(model, tokenizer, items[i], i, run.cfg, engine)[0])
                    bar.update()
    parts = gather_to_main(records)
    return None if parts is None else _merged(parts, runs)


def _chunk_numbers(n_chunks: int, share) -> Any:
    """0 .. n_chunks-1 on its own; with replicas, the chunks this one claims."""
    if share is None:
        yield from range(n_chunks)
        return
    claim = share[1]
    while (c := claim()) < n_chunks:
        yield c


def _merged(parts: list[dict[str, list[Record]]], runs: Sequence[Run]) -> dict[str, list[Record]]:
    """Each run's records from every process, one per item (the first rank's, where a
    tensor-parallel group repeated it), in item order."""
    out = {}
    for run in runs:
        by_item: dict[int, Record] = {}
        for part in parts:
            for r in part[run.key]:
                by_item.setdefault(r.index, r)
        out[run.key] = [by_item[i] for i in sorted(by_item)]
    return out


def warm_up(runs: Sequence[Run], item, models: dict[str, tuple], engine: EngineConfig) -> None:
    """One untimed decode per (weights, method), so first-call costs stay out of the figures."""
    seen = set()
    for run in runs:
        if (run.weights, run.cfg.method) not in seen:
            seen.add((run.weights, run.cfg.method))
            model, tokenizer = models[run.weights]
            generate(model, tokenizer, [item.prompt], run.cfg, engine_config=engine)


def summarise(records: Sequence[Record]) -> dict[str, Any]:
    """A row's figures, from its per-item records only (so JSON readers can recompute them)."""
    n = len(records)
    tokens = sum(r.tokens for r in records)
    nfe = sum(r.nfe for r in records)
    seconds = sum(r.seconds for r in records)
    families: dict[str, list[bool]] = {}
    for r in records:
        families.setdefault(r.family, []).append(r.correct)
    return {
        "items": n,
        "accuracy": sum(r.correct for r in records) / n,
        "per_family": {f: sum(v) / len(v) for f, v in families.items()},
        "tokens": tokens,
        "nfe": nfe,
        "nfe_per_item": nfe / n,
        "tpf": tokens / nfe if nfe else 0.0,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }


def table_rows(runs: Sequence[Run], records: dict[str, list[Record]]) -> list[dict[str, Any]]:
    """One dict per row: figures, the tok/s ratio to the AR baseline row, config, records."""
    rows = [
        {
            "key": r.key,
            "label": r.label,
            "weights": r.weights,
            "method": r.cfg.method,
            **summarise(records[r.key]),
            "config": dataclasses.asdict(r.cfg),
            "records": [dataclasses.asdict(x) for x in records[r.key]],
        }
        for r in runs
    ]
    ar = next((row for row in rows if row["key"] == "ar_baseline"), None)
    for row in rows:
        row["vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar and ar["tokens_per_s"] > 0 else None
    return rows


def sweep_points(
    runs: Sequence[Run], records: dict[str, list[Record]]
) -> tuple[list[dict[str, Any]], dict[str, float], float]:
    """(points, AUP per method, y_max): y_max is the best accuracy (%) of any point, as the
    leaderboard takes it."""
    points = [
        {
            "key": r.key,
            "method": r.group,
            "label": r.label,
            **summarise(records[r.key]),
            "config": dataclasses.asdict(r.cfg),
            "records": [dataclasses.asdict(x) for x in records[r.key]],
        }
        for r in runs
    ]
    y_max = max(100 * p["accuracy"] for p in points)
    groups: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        groups.setdefault(p["method"], []).append((p["tpf"], 100 * p["accuracy"]))
    return points, {g: aup(pts, y_max) for g, pts in groups.items()}, y_max
