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
from ..errors import CompileError
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
    """`Transformer.packed_hidden` under `torch.compile`: a forward over ragged rows as one
    graph (norms, rotations, the cache writes fused; no per-op Python). Shapes are dynamic
    (rows, tokens per row, cache capacity), so a model compiles a few graphs at most
    (dynamo specialises sizes of one: one row, one token), whatever its prompts, caches and
    batches. The first uses compile for a minute or so on a laptop CPU; later processes
    reuse inductor's on-disk cache. It needs a C++ compiler on CPU (inductor writes C++).
    Dynamo counts the graphs of every model in the process against one limit, which the
    step raises to `graph_limit` while it runs (a few models' worth); past it, forwards run
    `packed_hidden` eagerly: the same numbers, a warning, no crash."""

    def __init__(self, graph_limit: int = 64) -> None:
        self.fn = torch.compile(Transformer.packed_hidden, fullgraph=True, dynamic=True)
        self.graph_limit = graph_limit
        self.warned = False

    def __call__(self, model: Transformer, tokens: Sequence[Sequence[int]], positions: Sequence[Sequence[int]],
                 cache: KVCache) -> torch.Tensor:
        """Row b's tokens (any number, none included) are written at its end, not advanced
        (the caller keeps what it wants with `cache.advance`). Returns the final hidden
        states of the real tokens, row after row: (sum of lengths, hidden)."""
        dev = cache.device
        T = max(1, max(len(t) for t in tokens))
        cache.check_room(T)

        def flat(xs: Sequence[Sequence[int]]) -> torch.Tensor:
            return torch.tensor([x for row in xs for x in row], dtype=torch.long, device=dev)

        where = flat([range(b * T, b * T + len(t)) for b, t in enumerate(tokens)])
        if where.numel() == 0:  # nothing fed, nothing written: no graph for an empty batch
            return cache.k[0].new_zeros(0, model.config.hidden_size)
        query_cols = torch.tensor(cache.lengths, dtype=torch.long, device=dev)[:, None] + torch.arange(T, device=dev)
        # columns past used + T are never seen: a forward of several tokens per row reads only the
        # window before them (a plan's cache is often half empty); a one-token step reads the
        # whole, contiguous cache, which measured faster than a strided window of most of it
        end = cache.used() + T if T > 1 else cache.capacity
        k, v = [t[:, :, :end] for t in cache.k], [t[:, :, :end] for t in cache.v]
        args = (flat(tokens), flat(positions), where, query_cols, k, v, cache.tokens[:, :end], cache.positions[:, :end])
        try:
            with torch._dynamo.config.patch(recompile_limit=self.graph_limit):
                return self.fn(model, *args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # raised before any write: run it eagerly
            self._warn_limit()
            return model.packed_hidden(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # inductor could not build it (no C++ compiler, say)
            raise CompileError(f"torch.compile could not build the forward ({type(e.inner_exception).__name__}: "
                              f"{str(e.inner_exception).splitlines()[0][:200]}). Run without --compile (compile=False), "
                              "or install a C++ compiler (inductor needs one on CPU).") from e

    def _warn_limit(self) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"torch.compile holds its limit of {self.graph_limit} graphs for the forward in this process "
                          "(recompile_limit); forwards of new shapes or models run eagerly (same results, slower). "
                          "Make the step with a larger graph_limit to compile more.", RuntimeWarning, stacklevel=3)


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
    compiled: "CompiledStep | None" = None  # the compiled forward (DecodeConfig.compile), for forwards with a cache

    def run(
        self,
        row_ids: Sequence[int],  # prompt index of each cache row
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        cache: KVCache | None,
        want: Sequence[tuple[int, int]],  # per row: logits for entries [a, b)
    ) -> list[torch.Tensor]:
        device = self.model.device
        t0 = time.perf_counter()
        if self.compiled is not None and cache is not None:
            hidden = self.compiled(self.model, tokens, positions, cache)  # (N, hidden), row after row
            start = [0]
            for t in tokens[:-1]:
                start.append(start[-1] + len(t))
            index = [start[b] + i for b, (a, e) in enumerate(want) for i in range(a, e)]
            picked = hidden[torch.tensor(index, dtype=torch.long, device=device)]  # (n_logits, hidden)
        else:
            picked = self._ragged(tokens, positions, cache, want)
        logits = self.model.lm_head(picked).float()  # (n_logits, V)
        sync(device)
        seconds = time.perf_counter() - t0
        for rid in set(row_ids):
            self.progress.stats[rid].nfe += 1
            self.progress.stats[rid].forward_time += seconds
        for rid, t, (a, e) in zip(row_ids, tokens, want):
            self.progress.stats[rid].fed += len(t)
            self.progress.stats[rid].logit_rows += e - a
        return list(logits.split([e - a for a, e in want]))

    def _ragged(self, tokens: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], cache: KVCache | None,
                want: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The eager forward over right-padded rows; the hidden states at the wanted entries."""
        device = self.model.device
        T = max(1, max(len(t) for t in tokens))  # a row may feed nothing this step
        tok = torch.full((len(tokens), T), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(tokens), T), dtype=torch.long)
        for b, (t, p) in enumerate(zip(tokens, positions)):
            tok[b, : len(t)] = torch.as_tensor(t, dtype=torch.long)
            pos[b, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        lengths = [len(t) for t in tokens]
        hidden = self.model.hidden(tok.to(device), pos.to(device), cache, n_new=0 if cache is not None else None, lengths=lengths)
        rows = [b for b, (a, e) in enumerate(want) for _ in range(e - a)]
        cols = [i for a, e in want for i in range(a, e)]
        idx = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return hidden[idx(rows), idx(cols)]  # (N, hidden)

    def finish(self, rid: int) -> None:
        """Stamp a prompt's wall time (from when it started decoding)."""
        sync(self.model.device)
        self.progress.stats[rid].wall_time = time.perf_counter() - self.progress.started[rid]
