"""Completions made elsewhere, scored without a model: a JSONL file of predictions read
line by line (each line checked), matched to the samples by id or dataset index, and
raw generations of another engine finished as the paper protocol finishes its own."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..files import JSONProblem, lone_surrogate, open_regular, parse_json
from ..settings.fields import shown
from .benchmarks import Sample
from .completion import Completion
from .errors import PredictionsError
from .paper_rules import finish

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


def from_predictions(
    samples: list[Sample], path: str | os.PathLike
) -> tuple[list[Sample], dict[str, str], int]:
    """(the samples the file answers, each one's prediction by sample id, how many
    samples it leaves unanswered)."""
    by_id, by_index = read_predictions(path)
    found = {s.id: by_id.get(s.id, by_index.get(s.index)) for s in samples}
    text = {key: t for key, t in found.items() if t is not None}
    kept = [s for s in samples if s.id in text]
    if not kept:
        raise PredictionsError(f"{path}: no prediction matches a sample of this task (by id or index)")
    return kept, text, len(samples) - len(kept)


def finishing(
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
