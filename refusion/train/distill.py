"""Self-distillation data: prompts answered by the model's own greedy AR decoding, so that
ReFusion training teaches a model to draft what it would write anyway and its lossless
decoding stays the original model's (docs/own-model.md#self-distillation).

Prompts come from files (`{"query"}` or `{"messages"}` records, the training format), from
the synthetic suite (the CLI adds them), and from the model itself: given only the opening of a user turn as
its chat template writes it, an instruct model writes a user's request (sampled, seeded,
one per seed). Each prompt is answered once, greedily, in batches by the engine; each
answer that ends (EOS before `max_new_tokens`) is appended to the output file as one JSON
line as soon as it is done, so a run stopped at any moment loses at most the answers in
flight, and running the same command again answers only the prompts not yet in the file.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..decode.admit import Admission, PreparedRequest
from ..decode.api import generate
from ..errors import ContextLengthError, DataError
from ..model.prompts import chat_text, tokenize
from ..settings.decode import DecodeConfig, EngineConfig
from .dataset import DataStats, iter_records


@dataclass(frozen=True)
class Prompt:
    """A prompt to answer, and where it came from ("suite", "self", or a file's name); a
    file's prompt also carries the answer the file gives it, if any."""

    text: str
    source: str
    answer: str | None = None

    @property
    def key(self) -> str:
        """What identifies it in the output file: the hash of its text."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


@dataclass
class DistillStats:
    """What a run did: prompts answered now, found answered before, and dropped (cut at
    `max_new_tokens`, or empty)."""

    todo: int = 0  # prompts this run decodes
    answered: int = 0
    done_before: int = 0
    too_long: int = 0  # prompts with no room for max_new_tokens in the context: not asked
    cut: int = 0
    empty: int = 0
    tokens: int = 0
    nfe: int = 0
    by_source: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------- prompts
def file_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of a training-format file: each record's query, or its first user message,
    with its answer: the record's response, or the assistant message after that user message."""
    name = Path(path).name
    out = []
    for _, r in iter_records(path, DataStats(str(path))):  # the trainer's reader: JSON list or JSONL
        if not isinstance(r, dict):
            continue
        query, answer = r.get("query"), r.get("response")
        if query is None and isinstance(r.get("messages"), list):
            turns = [m for m in r["messages"] if isinstance(m, dict)]
            first = next((i for i, m in enumerate(turns) if m.get("role") == "user"), None)
            query = None if first is None else turns[first].get("content")
            after = turns[first + 1] if first is not None and first + 1 < len(turns) else {}
            answer = after.get("content") if after.get("role") == "assistant" else None
        if isinstance(query, str) and query.strip():
            out.append(Prompt(query, name, answer if isinstance(answer, str) else None))
    if not out:
        raise DataError(f"{path}: no record with a query or a user message")
    return out


def self_prompts(model: Any, tokenizer: Any, n: int, seed: int, max_tokens: int = 96) -> list[Prompt]:
    """n requests the model writes itself: the opening of a user turn as its chat template
    writes it, continued by AR sampling (temperature 1, top-p 0.95, one seed each); kept
    when the turn ends before `max_tokens` and is not empty. Duplicates are dropped."""
    opening = chat_text(tokenizer, [{"role": "user", "content": ""}], add_generation_prompt=False)
    ids = tokenize(tokenizer, opening, add_special_tokens=False)
    cfg = DecodeConfig(method="ar", temperature=1.0, top_p=0.95, gen_length=max_tokens)
    outs = generate(model, tokenizer, [ids] * n, [cfg.replace(seed=seed + i) for i in range(n)])
    seen, out = set(), []
    for o in outs:
        text = o.text.strip()
        if o.finish_reason == "stop" and text and text not in seen:
            seen.add(text)
            out.append(Prompt(text, "self"))
    return out


def unique(prompts: Iterable[Prompt]) -> list[Prompt]:
    """The prompts in order, each text once."""
    seen: set[str] = set()
    return [p for p in prompts if not (p.key in seen or seen.add(p.key))]  # type: ignore[func-returns-value]


# ---------------------------------------------------------------------------- answering them
def answered_keys(out: Path) -> set[str]:
    """The keys of the prompts the output file already answers (a line cut by a stop is skipped)."""
    if not out.exists():
        return set()
    keys = set()
    for line in out.read_text(encoding="utf-8").splitlines():
        try:
            keys.add(json.loads(line)["key"])
        except (ValueError, KeyError, TypeError):
            continue
    return keys


def distill(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    out: Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    on_answer: Callable[[DistillStats], None] | None = None,
) -> DistillStats:
    """Answer each prompt not yet in `out` by greedy AR decoding, appending each answer that
    ends as a `{"query", "response", "source", "key"}` line as soon as it is done."""
    stats = DistillStats()
    done = answered_keys(out)
    todo = [p for p in prompts if p.key not in done]
    stats.done_before = len(prompts) - len(todo)
    if not todo:
        return stats
    cfg = DecodeConfig(method="ar", gen_length=max_new_tokens)
    ready, todo = _fitting(model, tokenizer, todo, cfg, stats)
    stats.todo = len(todo)
    if not todo:
        return stats
    out.parent.mkdir(parents=True, exist_ok=True)
    cut_line = out.exists() and out.stat().st_size > 0 and not out.read_bytes().endswith(b"\n")
    with out.open("a", encoding="utf-8") as f:
        if cut_line:  # a run stopped in the middle of a line: the next answer starts a line of its own
            f.write("\n")

        def write(i: int, o: Any) -> None:
            if not o.finished:
                return
            stats.tokens, stats.nfe = stats.tokens + o.stats.tokens, stats.nfe + o.stats.nfe
            p, text = todo[i], o.text.strip()
            if o.finish_reason != "stop":
                stats.cut += 1
            elif not text:
                stats.empty += 1
            else:
                record = {"query": p.text, "response": text, "source": p.source, "key": p.key}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()
                stats.answered += 1
                stats.by_source[p.source] = stats.by_source.get(p.source, 0) + 1
            if on_answer is not None:
                on_answer(stats)

        generate(
            model, tokenizer, ready, engine_config=EngineConfig(max_batch_size=batch_size), on_output=write
        )
    return stats


def _fitting(
    model: Any, tokenizer: Any, prompts: list[Prompt], cfg: DecodeConfig, stats: DistillStats
) -> tuple[list[PreparedRequest], list[Prompt]]:
    """The prompts prepared (through the chat template), less those that leave no room for
    max_new_tokens in the context (counted in `stats.too_long`)."""
    admission = Admission(model.config, tokenizer, cfg)
    ready, kept = [], []
    for p in prompts:
        try:
            ready.append(admission.prepare(p.text, cfg))
        except ContextLengthError:
            stats.too_long += 1
            continue
        kept.append(p)
    return ready, kept


def shuffled(prompts: list[Prompt], seed: int) -> list[Prompt]:
    """The prompts in a seeded order, so that a run stopped early answered a mix of sources."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    return order
