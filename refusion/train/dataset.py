"""Training data: read {"query", "response"} or chat {"messages": [...]} records, tokenise
them with the tokenizer's chat template, and serve deterministic batches.

Files: a JSON list (`[{...}, ...]`, read whole) or JSONL (one object per line, streamed line
by line, so only the token ids are kept in memory). A record that cannot be used (invalid
JSON, not UTF-8, missing keys, empty response, too long) is skipped and counted; `DataStats`
says how many of each. A missing file or a file with no usable record raises `DataError`.

Tokenisation: prompt = chat template over the prompt messages with the generation prompt
added (the assistant header); response = the response text's tokens + EOS. The tokens live
in one flat int32 array with offsets (`TokenizedDataset`).

Batches: `IndexStream` is an endless, seeded sequence of example indices, a fresh
permutation per epoch. A batch is a window of it, so the data position of a run is one
integer (samples consumed) and resuming is exact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from ..errors import DataError
from ..files import JSONProblem, lone_surrogate, open_regular, parse_json
from ..model.prompts import chat_text, tokenize_batch
from ..settings.train import DATA_FIX

_CHUNK = 512  # records tokenised per tokenizer call
_MAX_SHOWN = 5  # bad records quoted in the summary


@dataclass
class DataStats:
    """What reading a data file found."""

    path: str
    records: int = 0  # records (lines of JSONL, items of a JSON list) seen
    kept: int = 0
    too_long: int = 0  # skipped: prompt + response + EOS longer than max_length
    max_length: int = 0  # the limit in tokens that "too long" was measured against
    context: int | None = None  # the model's max_position_embeddings, the ceiling of max_length
    too_long_lengths: list[int] = field(default_factory=list)  # tokens of each record skipped as too long
    bad: Counter = field(default_factory=Counter)  # reason -> count of skipped records
    examples: list[str] = field(default_factory=list)  # the first few bad records, located
    notes: list[str] = field(default_factory=list)

    def add_bad(self, where: str, reason: str) -> None:
        self.bad[reason] += 1
        if len(self.examples) < _MAX_SHOWN:
            self.examples.append(f"{where}: {reason}")

    def summary(self) -> str:
        parts = [f"{self.path}: {self.kept} of {self.records} records kept"]
        parts += [f"{n} {reason}" for reason, n in sorted(self.bad.items())]
        if self.too_long:
            parts.append(f"{self.too_long} too long ({self.too_long_reason()})")
        text = ", ".join(parts)
        if self.examples:
            text += "\n  first skipped: " + "; ".join(self.examples)
        for note in self.notes:
            text += f"\n  note: {note}"
        return text

    def too_long_reason(self) -> str:
        """Why records were too long and what would keep them: the limit that applied, how
        long the skipped records are, and how far --max-length can go (never past the
        model's context, the positions it was built for)."""
        lengths = sorted(self.too_long_lengths)
        if not lengths:  # counted by hand, lengths not recorded
            return f"over the limit of {self.max_length} tokens"
        longest, context = lengths[-1], self.context
        text = (
            f"over the limit of {self.max_length} tokens: median {lengths[len(lengths) // 2]}, "
            f"longest {longest}"
        )
        if context is None:
            return text
        fit = sum(n <= context for n in lengths)
        if self.max_length >= context or not fit:
            return (
                f"{text}; {context} tokens is the model's context (max_position_embeddings), "
                "which --max-length cannot exceed: shorten those records "
                "or train a model with a longer context"
            )
        if fit == len(lengths):
            return f"{text}; pass --max-length {longest} to keep them"
        return (
            f"{text}; pass --max-length {context} (the model's context, the most it allows) "
            f"to keep {fit} of them"
        )


@dataclass
class TokenizedDataset:
    """Examples as one flat int32 token array; example i is tokens[offsets[i]:offsets[i+1]],
    of which the first prompt_lens[i] are the prompt."""

    tokens: np.ndarray  # (total,) int32
    offsets: np.ndarray  # (N + 1,) int64
    prompt_lens: np.ndarray  # (N,) int32

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]], int(self.prompt_lens[i])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def subset(self, indices: np.ndarray) -> TokenizedDataset:
        lens = self.lengths()[indices]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        parts = [self.tokens[self.offsets[i] : self.offsets[i + 1]] for i in indices]
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return TokenizedDataset(tokens.astype(np.int32), offsets, self.prompt_lens[indices])


# ------------------------------------------------------------------------------ reading
def iter_records(path: str | Path, stats: DataStats) -> Iterator[tuple[str, Any]]:
    """(location, parsed JSON value) for every record; unreadable records go to `stats`.
    The file must be a regular one (a FIFO would block, `/dev/zero` is one endless line)."""
    path = Path(path)
    with open_regular(path, DataError, fix=DATA_FIX) as f:
        head = f.read(4096).lstrip()
        if head.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
            head = head[3:].lstrip()
        f.seek(0)
        if head.startswith(b"["):
            yield from _iter_json_list(f, path, stats)
        else:
            yield from _iter_jsonl(f, stats)


def _iter_json_list(f: IO[bytes], path: Path, stats: DataStats) -> Iterator[tuple[str, Any]]:
    try:
        items = parse_json(f.read())
    except JSONProblem as e:
        raise DataError(f"{path} starts like a JSON list but {e}; {DATA_FIX}") from None
    if not isinstance(items, list):
        raise DataError(f"{path} holds a JSON {type(items).__name__}, expected a list of records")
    for i, item in enumerate(items):
        stats.records += 1
        yield f"item {i}", item


def _iter_jsonl(f: IO[bytes], stats: DataStats) -> Iterator[tuple[str, Any]]:
    for line_no, raw in enumerate(f, start=1):
        if not raw.strip():
            continue
        stats.records += 1
        try:
            yield f"line {line_no}", parse_json(raw)
        except JSONProblem as e:
            stats.add_bad(f"line {line_no}", e.kind)


def record_messages(record: Any) -> tuple[list[dict[str, str]], str]:
    """(prompt messages, response text) of a record, or ValueError(reason)."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' is not a non-empty list")
        for msg in msgs:
            if not (
                isinstance(msg, dict)
                and isinstance(msg.get("role"), str)
                and isinstance(msg.get("content"), str)
            ):
                raise ValueError("a message lacks a string 'role' or 'content'")
        if msgs[-1]["role"] != "assistant":
            raise ValueError("the last message is not the assistant's")
        if len(msgs) < 2:
            raise ValueError("no prompt message before the assistant's")
        prompt, response = (
            [{"role": m["role"], "content": m["content"]} for m in msgs[:-1]],
            msgs[-1]["content"],
        )
    else:
        missing = [k for k in ("query", "response") if k not in record]
        if missing:
            raise ValueError("missing key " + " and ".join(repr(k) for k in missing))
        query, response = record["query"], record["response"]
        if not isinstance(query, str) or not isinstance(response, str):
            raise ValueError("'query' or 'response' is not a string")
        prompt = [{"role": "user", "content": query}]
    if not response.strip():
        raise ValueError("empty response")
    return prompt, response


# --------------------------------------------------------------------------- tokenising
def load_dataset(
    path: str | Path, tokenizer, max_length: int, eos_id: int | None = None, context: int | None = None
) -> tuple[TokenizedDataset, DataStats]:
    """Read and tokenise a data file. Raises DataError when nothing usable is left.

    context: the model's max_position_embeddings, when max_length was capped to it; named
    in the summary so that it says whether --max-length can keep the records too long."""
    eos_id = tokenizer.eos_token_id if eos_id is None else eos_id
    if eos_id is None:
        raise DataError("the tokenizer has no EOS token; cannot end the responses")
    stats = DataStats(str(path), max_length=max_length, context=context)
    if getattr(tokenizer, "chat_template", None) is None:
        stats.notes.append("the tokenizer has no chat template: prompts are the plain message texts")
    tokens: list[np.ndarray] = []
    lens: list[int] = []
    prompt_lens: list[int] = []
    chunk: list[tuple[str, list[dict[str, str]], str]] = []

    def flush() -> None:
        for p, r in _tokenise_chunk(tokenizer, chunk, eos_id):
            if len(p) + len(r) > max_length:
                stats.too_long += 1
                stats.too_long_lengths.append(len(p) + len(r))
                continue
            tokens.append(np.asarray(p + r, dtype=np.int32))
            lens.append(len(p) + len(r))
            prompt_lens.append(len(p))
            stats.kept += 1
        chunk.clear()

    for where, record in iter_records(path, stats):
        try:
            if lone_surrogate(record):  # valid JSON ("\\ud800"), but no tokenizer can encode it
                raise ValueError("a lone UTF-16 surrogate")
            prompt, response = record_messages(record)
        except ValueError as e:
            stats.add_bad(where, str(e))
            continue
        chunk.append((where, prompt, response))
        if len(chunk) >= _CHUNK:
            flush()
    flush()
    if not stats.kept:
        raise DataError(f"no usable example in {path}\n{stats.summary()}")
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ds = TokenizedDataset(np.concatenate(tokens), offsets, np.asarray(prompt_lens, dtype=np.int32))
    return ds, stats


def _tokenise_chunk(tokenizer, chunk, eos_id: int) -> list[tuple[list[int], list[int]]]:
    if not chunk:
        return []
    texts = [chat_text(tokenizer, p) for _, p, _ in chunk]
    # without the tokenizer's "sequence length is longer than the specified maximum":
    # records too long are counted and explained in DataStats instead.
    prompts = tokenize_batch(tokenizer, texts, add_special_tokens=False)
    responses = tokenize_batch(tokenizer, [r for _, _, r in chunk], add_special_tokens=False)
    return [(p, r + [eos_id]) for p, r in zip(prompts, responses)]


def split_eval(
    ds: TokenizedDataset, fraction: float, max_examples: int, seed: int
) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    """(train, held-out eval) after a seeded shuffle; eval gets min(fraction * N, max_examples)
    examples, at least one when fraction > 0, and never all of them."""
    n_eval = min(int(round(fraction * len(ds))), max_examples, len(ds) - 1)
    if fraction > 0 and len(ds) > 1:
        n_eval = max(n_eval, 1)
    if n_eval <= 0:
        return ds, None
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(ds))
    return ds.subset(np.sort(order[n_eval:])), ds.subset(np.sort(order[:n_eval]))


# ------------------------------------------------------------------------------ batching
class IndexStream:
    """Endless seeded sequence of example indices: epoch e is a permutation of 0..N-1 drawn
    from (seed, e). Position k of the stream is example perm_{k // N}[k % N]."""

    def __init__(self, n: int, seed: int) -> None:
        if n <= 0:
            raise DataError("no training example")
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, np.zeros(0, np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perm

    def take(self, start: int, count: int) -> np.ndarray:
        """Stream positions start .. start + count - 1."""
        out = np.empty(count, np.int64)
        for k in range(count):
            pos = start + k
            out[k] = self._permutation(pos // self.n)[pos % self.n]
        return out


def collate(
    ds: TokenizedDataset, indices, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded tokens (B, T) int64 with prompt_lens (B,) and lengths (B,)."""
    rows = [ds[int(i)] for i in indices]
    T = max(len(t) for t, _ in rows)
    tokens = torch.full((len(rows), T), pad_id, dtype=torch.int64)
    for b, (t, _) in enumerate(rows):
        tokens[b, : len(t)] = torch.from_numpy(t.astype(np.int64))
    prompt_lens = torch.tensor([p for _, p in rows], dtype=torch.int64)
    lengths = torch.tensor([len(t) for t, _ in rows], dtype=torch.int64)
    return tokens, prompt_lens, lengths
