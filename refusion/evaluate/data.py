"""Benchmark records: from a local file (JSONL, JSON, Parquet) or the Hugging Face hub.

Records keep the public datasets' field names; each benchmark maps them to a Sample.
Offline without a file we fail at once with a typed error that names the dataset and
--data, instead of letting `datasets` retry the network for half a minute.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from .errors import DatasetUnavailableError


@dataclass(frozen=True)
class HubSource:
    """Where a benchmark lives on the Hugging Face hub."""

    path: str
    configs: tuple[str | None, ...] = (None,)  # several: concatenated (MATH's subjects)
    split: str = "test"

    def describe(self) -> str:
        configs = ",".join(c for c in self.configs if c)
        return f"{self.path}" + (f" [{configs}]" if configs else "") + f" split={self.split}"


def read_records(path: str | os.PathLike) -> list[dict]:
    """Rows of a .jsonl / .json / .parquet file as dicts."""
    p = Path(path)
    if not p.is_file():
        raise DatasetUnavailableError(f"data file not found: {p}")
    suffix = "".join(p.suffixes[-2:]) if p.suffix == ".gz" else p.suffix
    try:
        if suffix in (".jsonl", ".jsonl.gz", ".ndjson"):
            return _read_jsonl(p)
        if suffix == ".json":
            return _rows_of(json.loads(p.read_text(encoding="utf-8")), p)
        if suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise DatasetUnavailableError(
                    f"reading {p} needs pyarrow: pip install 'refusion[eval]', "
                    "or scripts/setup.sh eval in a checkout (or convert it to JSONL)"
                ) from e
            return pq.read_table(p).to_pylist()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetUnavailableError(f"cannot parse {p}: {e}") from e
    raise DatasetUnavailableError(
        f"unsupported data file type {p.suffix!r} ({p}): use .jsonl, .json or .parquet"
    )


def _read_jsonl(p: Path) -> list[dict]:
    import gzip

    opener = gzip.open if p.suffix == ".gz" else open
    rows = []
    with opener(p, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DatasetUnavailableError(f"{p}:{n}: not valid JSON: {e}") from e
    return rows


def _rows_of(obj, p: Path) -> list[dict]:
    """A JSON file may hold a list of rows, or {split-or-"data": [rows]}."""
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        for key in ("test", "data", "rows", "train", "validation"):
            if isinstance(obj.get(key), list):
                return obj[key]
        lists = [v for v in obj.values() if isinstance(v, list)]
        if len(lists) == 1:
            return lists[0]
    raise DatasetUnavailableError(f"{p}: expected a list of records (or an object holding one)")


def _hub_reachable(timeout: float = 3.0) -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


def _offline_env() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def load_hub(source: HubSource, task: str, fields: str) -> list[dict]:
    """Rows of a hub dataset via `datasets` (its cache serves offline runs with HF_*_OFFLINE=1)."""
    how = (
        "download it where there is network and pass --data FILE "
        f"(JSONL, JSON or Parquet with fields {fields})"
    )
    if not _offline_env() and not _hub_reachable():
        raise DatasetUnavailableError(
            f"{task}: the Hugging Face hub is unreachable (offline?), so {source.describe()} cannot be "
            f"loaded; {how}, or set HF_DATASETS_OFFLINE=1 to use a copy in the datasets cache"
        )
    try:
        import datasets
    except ImportError as e:
        raise DatasetUnavailableError(
            f"{task}: loading {source.path} needs `datasets` "
            f"(pip install 'refusion[eval]', or scripts/setup.sh eval in a checkout); or {how}"
        ) from e
    rows: list[dict] = []
    try:
        for config in source.configs:
            rows.extend(datasets.load_dataset(source.path, config, split=source.split).to_list())
    except Exception as e:  # datasets raises many kinds (connection, gated, cache miss)
        raise DatasetUnavailableError(
            f"{task}: cannot load {source.describe()} ({type(e).__name__}: {str(e)[:200]}); {how}"
        ) from e
    return rows
