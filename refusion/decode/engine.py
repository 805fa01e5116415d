"""What every decoding method shares: the counted forward pass over ragged rows, stats,
per-row progress (for streaming and traces) and the output record.

Metrics are kept out of the algorithms (DESIGN §8): a method calls `Forward.run`, which
counts NFE for the batch and for each row that took part, and reports commits to a
`Progress`, which turns them into final left-to-right prefixes for streaming.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..model import Transformer


@dataclass
class DecodeStats:
    """Counts for one prompt (or a whole batch). SPEC §3: NFE = forward passes (a batched
    forward counts once), TPF = tokens / NFE over the whole generation, TPS = tokens / s."""

    tokens: int = 0
    nfe: int = 0
    wall_time: float = 0.0
    # seconds inside the forward passes this prompt took part in (model + logits); the rest
    # of wall_time is the decoder's own per-step overhead (exact at batch size 1)
    forward_time: float = 0.0
    fed: int = 0  # real tokens this prompt fed to the model (padding excluded)
    logit_rows: int = 0  # positions whose logits it asked for

    @property
    def tpf(self) -> float:
        return self.tokens / self.nfe if self.nfe else 0.0

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"tokens": self.tokens, "nfe": self.nfe, "tpf": self.tpf, "wall_time": self.wall_time, "tps": self.tps,
                "forward_time": self.forward_time, "fed": self.fed, "logit_rows": self.logit_rows}


@dataclass
class TraceEvent:
    """One commit: which slots (start position, length) entered the cache, by which path."""

    step: int  # 0-based index of the commit within this prompt's generation
    nfe: int  # this prompt's forward count when the commit happened
    path: str  # "fast" (global verification), "infill" (parallel AR infilling), "ar", "mdm"
    spans: list[tuple[int, int]]  # (first position relative to the generation start, length)
    tokens: list[list[int]]  # the committed tokens of each span


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]  # generated tokens in position order, cut after the first EOS
    stats: DecodeStats
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS), "length", or "cancelled"
    trace: list[TraceEvent] | None = None


def make_room(model: Transformer, cache: KVCache | None, prompts: Sequence[Sequence[int]], running_longest: int,
              extra: int, reserve: int) -> KVCache:
    """The decoder's cache with one new empty row per prompt (rows joining, or the first
    batch), storage reserved for `reserve` rows. A new cache holds a row and its widest
    step (the longest prompt + `extra`). A ragged step writes every row from the longest
    row's end, so a running cache needs room for a prefill there: 2 x the longest prompt,
    running or new, + `extra`."""
    longest = max(len(p) for p in prompts)
    if cache is None:
        return model.new_cache(len(prompts), longest + extra, reserve=reserve)
    cache.grow(len(prompts), 2 * max(longest, running_longest) + extra, reserve=reserve)
    return cache


class CompiledStep:
    """`Transformer.fixed_step` under `torch.compile`: the AR decode step as one compiled
    graph (norms, rotations and the cache write fused; no per-op Python), for a small model
    on a CPU about a fifth less time per token. Shapes are dynamic (rows, capacity), so a
    model compiles twice at most (one row, several rows), however long its prompts and
    caches: the first use takes a minute or so on a laptop CPU, and later processes reuse
    inductor's on-disk cache. It needs a C++ compiler on CPU (inductor writes C++). Past
    dynamo's recompile limit (many models in one process), steps run `fixed_step` eagerly:
    the same numbers, a warning, no crash."""

    def __init__(self) -> None:
        self.fn = torch.compile(Transformer.fixed_step, fullgraph=True, dynamic=True)
        self.warned = False

    def __call__(self, model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens, positions (B, 1); writes each row's entry at its end and advances it.
        The step runs on all of the cache's storage rows (its reserved rows), not just the B
        in use, so rows leaving and joining a continuous batch keep the shapes, and the
        graph, as they are; spare rows compute on a pad token at their column 0, which
        nothing reads."""
        B, R = cache.batch_size, cache.reserved_rows
        cache.check_room(1)
        pad = R - B
        lengths = torch.tensor(cache.lengths + [0] * pad, dtype=torch.long, device=tokens.device)
        if pad:
            tokens = torch.cat((tokens, tokens.new_zeros(pad, 1)))
            positions = torch.cat((positions, positions.new_zeros(pad, 1)))
        try:
            logits = self.fn(model, tokens, positions, lengths, *cache.storage())
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # raised before any write: run it eagerly
            self._warn_limit()
            logits = model.fixed_step(tokens, positions, lengths, *cache.storage())
        cache.advance(1)
        return logits[:B]

    def _warn_limit(self) -> None:
        if not self.warned:
            self.warned = True
            limit = torch._dynamo.config.recompile_limit
            warnings.warn(f"torch.compile holds its limit of {limit} graphs for the AR step in this process; "
                          "steps of new shapes or models run eagerly (same results, slower). "
                          "Raise torch._dynamo.config.recompile_limit to compile more.", RuntimeWarning, stacklevel=3)


_COMPILED: list[CompiledStep] = []


def compiled_step() -> CompiledStep:
    """The compiled step, made once per process (generate is called again and again); it
    takes the model as an argument, so it keeps no model alive."""
    if not _COMPILED:
        _COMPILED.append(CompiledStep())
    return _COMPILED[0]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Progress:
    """Per prompt: which generated positions are filled, and callbacks for streaming.

    `on_prefix(prompt_index, ids, done)` receives the final left-to-right prefix (cut after
    EOS) each time it grows, and once more with done=True. `is_cancelled(prompt_index)`
    lets a caller (a server whose client left) stop a row; it is polled once per step.
    """

    def __init__(
        self,
        n_prompts: int,
        eos_ids: set[int],
        on_prefix: Callable[[int, list[int], bool], None] | None = None,
        is_cancelled: Callable[[int], bool] | None = None,
        trace: bool = False,
    ) -> None:
        self.eos_ids = eos_ids
        self.filled: list[list[int | None]] = [[] for _ in range(n_prompts)]
        self.prefix_len = [0] * n_prompts
        self.on_prefix, self.is_cancelled = on_prefix, is_cancelled
        self.traces: list[list[TraceEvent]] | None = [[] for _ in range(n_prompts)] if trace else None
        self.stats = [DecodeStats() for _ in range(n_prompts)]
        self.cancelled = [False] * n_prompts
        self.started = [0.0] * n_prompts

    def extend(self, n: int) -> list[int]:
        """Room for n more prompts (joining a running batch); returns their indices."""
        first = len(self.filled)
        self.filled += [[] for _ in range(n)]
        self.prefix_len += [0] * n
        if self.traces is not None:
            self.traces += [[] for _ in range(n)]
        self.stats += [DecodeStats() for _ in range(n)]
        self.cancelled += [False] * n
        self.started += [0.0] * n
        return list(range(first, first + n))

    def start(self, rid: int, gen_length: int) -> None:
        """A prompt starts decoding now (its wall time counts from here)."""
        self.filled[rid] = [None] * gen_length
        self.started[rid] = time.perf_counter()

    def commit(self, rid: int, path: str, spans: Sequence[tuple[int, list[int]]]) -> None:
        """Tokens enter the committed sequence at generation offsets (start, tokens)."""
        row = self.filled[rid]
        for start, toks in spans:
            row[start : start + len(toks)] = toks
        if self.traces is not None:
            ev = TraceEvent(len(self.traces[rid]), self.stats[rid].nfe, path, [(s, len(t)) for s, t in spans], [list(t) for _, t in spans])
            self.traces[rid].append(ev)
        self._advance_prefix(rid)

    def _advance_prefix(self, rid: int) -> None:
        row, n = self.filled[rid], self.prefix_len[rid]
        start = n
        while n < len(row) and row[n] is not None and (n == 0 or row[n - 1] not in self.eos_ids):
            n += 1
        self.prefix_len[rid] = n
        if n > start and self.on_prefix is not None:
            self.on_prefix(rid, row[:n], False)

    def output_ids(self, rid: int) -> list[int]:
        """Generated tokens in position order, cut after the first EOS (and at the first hole)."""
        out = []
        for t in self.filled[rid]:
            if t is None:
                break
            out.append(t)
            if t in self.eos_ids:
                break
        return out

    def check_cancelled(self, rid: int) -> bool:
        if not self.cancelled[rid] and self.is_cancelled is not None and self.is_cancelled(rid):
            self.cancelled[rid] = True
        return self.cancelled[rid]


@dataclass
class Forward:
    """The counted forward pass. Each row feeds its own token list (ragged: padded on the
    right and written with n_new=0, so the caller decides afterwards how many entries
    each row keeps with `cache.advance`). Returns logits only at the requested entries,
    so the vocabulary projection is not paid for prompt tokens."""

    model: Transformer
    progress: Progress
    pad_id: int
    compiled: "CompiledStep | None" = None  # the fixed-shape one-token step, when asked for

    def run(
        self,
        row_ids: Sequence[int],  # prompt index of each cache row
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        cache: KVCache | None,
        want: Sequence[tuple[int, int]],  # per row: logits for entries [a, b)
    ) -> list[torch.Tensor]:
        device = self.model.device
        T = max(1, max(len(t) for t in tokens))  # a row may feed nothing this step
        tok = torch.full((len(tokens), T), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(tokens), T), dtype=torch.long)
        for b, (t, p) in enumerate(zip(tokens, positions)):
            tok[b, : len(t)] = torch.as_tensor(t, dtype=torch.long)
            pos[b, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        lengths = [len(t) for t in tokens]
        t0 = time.perf_counter()
        hidden = self.model.hidden(tok.to(device), pos.to(device), cache, n_new=0 if cache is not None else None, lengths=lengths)
        rows = [b for b, (a, e) in enumerate(want) for _ in range(e - a)]
        cols = [i for a, e in want for i in range(a, e)]
        idx = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        picked = hidden[idx(rows), idx(cols)]  # (N, hidden)
        logits = self.model.lm_head(picked).float()  # (N, V)
        sync(device)
        seconds = time.perf_counter() - t0
        for rid in set(row_ids):
            self.progress.stats[rid].nfe += 1
            self.progress.stats[rid].forward_time += seconds
        for rid, t, (a, e) in zip(row_ids, tokens, want):
            self.progress.stats[rid].fed += len(t)
            self.progress.stats[rid].logit_rows += e - a
        return list(logits.split([e - a for a, e in want]))

    def step(self, row_ids: Sequence[int], tokens: Sequence[int], positions: Sequence[int], cache: KVCache) -> torch.Tensor:
        """One token per row through `compiled` (the fixed-shape step), counted like `run`;
        each row's entry is written and made valid. Logits (B, vocab) in float32."""
        device = self.model.device
        tok = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
        pos = torch.tensor(positions, dtype=torch.long, device=device)[:, None]
        t0 = time.perf_counter()
        logits = self.compiled(self.model, tok, pos, cache).float()
        sync(device)
        seconds = time.perf_counter() - t0
        for rid in row_ids:
            stats = self.progress.stats[rid]
            stats.nfe, stats.forward_time, stats.fed, stats.logit_rows = (
                stats.nfe + 1, stats.forward_time + seconds, stats.fed + 1, stats.logit_rows + 1)
        return logits

    def finish(self, rid: int) -> None:
        """Stamp a prompt's wall time (from when it started decoding)."""
        sync(self.model.device)
        self.progress.stats[rid].wall_time = time.perf_counter() - self.progress.started[rid]
