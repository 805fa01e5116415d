"""The counted forward pass over ragged rows that every decoding method calls, eager or
compiled (`CompiledStep`), and the cache it runs on (`make_room`).

Each row of a forward belongs to a `Request`; `Forward.run` counts the pass once for the
engine and once for each request that fed it something or asked for logits, so a
request's NFE is the same alone and in any batch.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import CompileError
from ..model.kv_cache import KVCache
from ..model.transformer import Transformer
from ..timing import sync

if TYPE_CHECKING:
    from .request import Request


def make_room(
    model: Transformer, cache: KVCache | None, joining: int, capacity: int, reserve: int
) -> KVCache:
    """The decoder's cache with `joining` new empty rows (rows joining, or the first
    batch), each able to hold `capacity` entries (`model.sizing.row_capacity`), storage
    reserved for `reserve` rows."""
    if cache is None:
        return model.new_cache(joining, capacity, reserve=reserve)
    cache.grow(joining, capacity, reserve=reserve)
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

    def __call__(
        self,
        model: Transformer,
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        cache: KVCache,
    ) -> torch.Tensor:
        """Row b's tokens (any number, none included) are written at its end, not advanced
        (the caller keeps what it wants with `cache.advance`). Returns the final hidden
        states of the real tokens, row after row: (sum of lengths, hidden)."""
        T = max(1, max((len(t) for t in tokens), default=0))
        # a one-token step reads the whole, contiguous cache, which measured faster compiled
        # than a strided window of most of it; wider forwards read only the window in use
        layout = cache.packed_write(tokens, positions, whole_cache=T == 1)
        if layout.where.numel() == 0:  # nothing fed, nothing written: no graph for an empty batch
            return cache.k[0].new_zeros(0, model.config.hidden_size)
        args = layout.tensors()
        try:
            with torch._dynamo.config.patch(recompile_limit=self.graph_limit):
                return self.fn(model, *args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # raised before any write: run it eagerly
            self._warn_limit()
            return model.packed_hidden(*args)
        except (
            torch._dynamo.exc.BackendCompilerFailed
        ) as e:  # inductor could not build it (no C++ compiler, say)
            raise CompileError(
                f"torch.compile could not build the forward ({type(e.inner_exception).__name__}: "
                f"{str(e.inner_exception).splitlines()[0][:200]}). Run without --compile (compile=False), "
                "or install a C++ compiler (inductor needs one on CPU)."
            ) from e

    def _warn_limit(self) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"torch.compile holds its limit of {self.graph_limit} graphs for the forward in this process "
                "(recompile_limit); forwards of new shapes or models run eagerly (same results, slower). "
                "Make the step with a larger graph_limit to compile more.",
                RuntimeWarning,
                stacklevel=3,
            )


_COMPILED: list[CompiledStep] = []


def compiled_step() -> CompiledStep:
    """The compiled step, made once per process (generate is called again and again); it
    takes the model as an argument, so it keeps no model alive."""
    if not _COMPILED:
        _COMPILED.append(CompiledStep())
    return _COMPILED[0]


def shared_prefills(
    tokens: Sequence[Sequence[int]],
    positions: Sequence[Sequence[int]],
    want: Sequence[tuple[int, int]],
    cache: KVCache | None,
) -> dict[int, int]:
    """Rows that may take another row's forward as their own: {row: the row it copies},
    for rows of an empty cache row that feed the same tokens at the same positions and want
    the same logits as an earlier such row (the n choices of one prompt, prefilled in the
    step they join in). Their KV entries and logits are the copied row's, exactly."""
    if cache is None:
        return {}
    first: dict[tuple, int] = {}
    shared = {}
    for b, (t, p, w) in enumerate(zip(tokens, positions, want)):
        if cache.lengths[b] or len(t) < 2:
            continue
        key = (tuple(t), tuple(p), w)
        if key in first:
            shared[b] = first[key]
        else:
            first[key] = b
    return shared


@dataclass
class Forward:
    """The counted forward pass. Each row feeds its own token list (ragged, none included);
    with a cache the new entries are written at each row's end but not kept, so the caller
    decides afterwards how many each row keeps with `cache.advance`. Returns logits only
    at the requested entries, so the vocabulary projection is not paid for prompt tokens."""

    model: Transformer
    pad_id: int
    compiled: CompiledStep | None = (
        None  # the compiled forward (EngineConfig.compile), for forwards with a cache
    )
    mask_id: int | None = None  # the model's MASK: fed, it is no token of a context (shaping.py)

    forwards: int = 0  # forward passes run so far
    seconds: float = 0.0  # and the time they took
    nonfinite: bool = False  # a forward gave NaN or infinite logits (broken weights, an overflowing dtype)

    def run(
        self,
        reqs: Sequence[Request],  # the request of each cache row
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        cache: KVCache | None,
        want: Sequence[tuple[int, int]],  # per row: logits for entries [a, b)
        held: Sequence[dict[int, int] | None] | None = None,  # per row: slot tokens its cache holds
    ) -> list[torch.Tensor]:
        """Each row's logits at its wanted entries, as its request shapes them (its
        penalties and bias applied, its log-probabilities recorded: `shaping.py`; `held`
        are an infilling fork's accepted tokens, which its cache holds but no feed shows)."""
        device = self.model.device
        fed, at, asked = tokens, positions, want  # as the rows feed and want them: counted and shaped so
        shared = shared_prefills(tokens, positions, want, cache) if self.compiled is None else {}
        if shared:  # a prompt several fresh rows feed alike is fed once (n choices of one prompt)
            tokens = [[] if b in shared else t for b, t in enumerate(tokens)]
            positions = [[] if b in shared else p for b, p in enumerate(positions)]
            want = [(0, 0) if b in shared else w for b, w in enumerate(want)]
        t0 = time.perf_counter()
        if cache is not None:
            hidden = self._packed(tokens, positions, cache)  # (N, hidden), row after row
            start = [0]
            for t in tokens[:-1]:
                start.append(start[-1] + len(t))
            index = [start[b] + i for b, (a, e) in enumerate(want) for i in range(a, e)]
            picked = hidden[torch.tensor(index, dtype=torch.long, device=device)]  # (n_logits, hidden)
        else:
            picked = self._plain(tokens, positions, want)
        logits = self.model.lm_head(picked).float()  # (n_logits, V)
        self._check_finite(logits)
        sync(device)
        seconds = time.perf_counter() - t0
        self.forwards += 1
        self.seconds += seconds
        took_part: dict[int, Request] = {}
        for b, (req, t, (a, e)) in enumerate(zip(reqs, fed, asked)):
            if t or e > a:
                took_part[id(req)] = req
            req.stats.fed += 0 if b in shared else len(t)  # tokens it fed itself
            req.stats.logit_rows += e - a
        for req in took_part.values():
            req.stats.nfe += 1
            req.stats.forward_time += seconds
            req.stats.forward_share += seconds / len(took_part)
        parts = list(logits.split([e - a for a, e in want]))
        if shared:
            assert cache is not None  # rows are shared only in a forward with a cache
            cache.copy_written([(src, b, len(fed[b])) for b, src in shared.items()])
            for b, src in shared.items():
                parts[b] = parts[src].clone()
        for b, req in enumerate(reqs):
            if req.shaping is not None and parts[b].shape[0]:
                feed = (fed[b], at[b], asked[b])
                parts[b] = req.shaping(req, parts[b], feed, self.mask_id, held[b] if held else None)
        return parts

    def time_shapes(self, shapes: Sequence[tuple[int, int, int]], repeats: int = 5) -> list[float]:
        """Seconds of a forward of each shape (rows, tokens per row, entries cached per row),
        with the logits of each row's last token, best of `repeats`: calibration samples for
        the draft widths (widths.ForwardCost), on caches of their own (one per rows and
        context; a forward writes past the rows' ends and keeps nothing). The repeats go
        round the shapes in turn, so that a moment when the machine is busy slows one
        sample of each shape rather than every sample of one."""
        device, caches = self.model.device, {}
        feeds = []
        for rows, per_row, context in shapes:
            if (rows, context) not in caches:
                longest = max(k for r, k, c in shapes if (r, c) == (rows, context))
                cache = caches[rows, context] = self.model.new_cache(rows, context + longest)
                self._packed([[self.pad_id] * context] * rows, [list(range(context))] * rows, cache)
                cache.advance([context] * rows)
            tokens = [[self.pad_id] * per_row] * rows
            positions = [list(range(context, context + per_row))] * rows
            self._packed(tokens, positions, caches[rows, context])  # a first call of a shape allocates
            feeds.append((tokens, positions, caches[rows, context], per_row))
        best = [float("inf")] * len(shapes)
        for _ in range(repeats):
            for i, (tokens, positions, cache, per_row) in enumerate(feeds):
                sync(device)
                t0 = time.perf_counter()
                hidden = self._packed(tokens, positions, cache)  # (rows * per_row, hidden)
                self.model.lm_head(hidden[per_row - 1 :: per_row]).float()
                sync(device)
                best[i] = min(best[i], time.perf_counter() - t0)
        return best

    def _check_finite(self, logits: torch.Tensor) -> None:
        """Warn once when logits are not finite: the tokens sampled from them are noise.
        Checked on the first forward and every 64th after it, which costs next to nothing."""
        if self.nonfinite or self.forwards % 64 or logits.numel() == 0 or bool(torch.isfinite(logits).all()):
            return
        self.nonfinite = True
        warnings.warn(
            "the model's logits are not finite (NaN or inf): its output is meaningless. Check the weights "
            "(a broken or mis-converted checkpoint) or run in float32 (--dtype float32)",
            RuntimeWarning,
            stacklevel=2,
        )

    def _packed(
        self, tokens: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], cache: KVCache
    ) -> torch.Tensor:
        """Every forward with a cache: `Transformer.packed_hidden` over the cache's packed
        layout, compiled (`CompiledStep`) or eager (attention then in runs of rows when a
        prompt is prefilled beside one-token steps)."""
        if self.compiled is not None:
            return self.compiled(self.model, tokens, positions, cache)
        layout = cache.packed_write(tokens, positions, plan_runs=True)
        if layout.where.numel() == 0:
            return cache.k[0].new_zeros(0, self.model.config.hidden_size)
        return self.model.packed_hidden(*layout.tensors(), segments=layout.segments, masked=layout.masked)

    def _plain(
        self,
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        want: Sequence[tuple[int, int]],
    ) -> torch.Tensor:
        """A forward without a cache (MDM), over right-padded rows: the hidden states at the
        wanted entries."""
        device = self.model.device
        T = max(1, max(len(t) for t in tokens))
        tok = torch.full((len(tokens), T), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(tokens), T), dtype=torch.long)
        for b, (t, p) in enumerate(zip(tokens, positions)):
            tok[b, : len(t)] = torch.as_tensor(t, dtype=torch.long)
            pos[b, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        hidden = self.model.hidden(tok.to(device), pos.to(device), lengths=[len(t) for t in tokens])
        rows = [b for b, (a, e) in enumerate(want) for _ in range(e - a)]
        cols = [i for a, e in want for i in range(a, e)]
        idx = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return hidden[idx(rows), idx(cols)]  # (N, hidden)
