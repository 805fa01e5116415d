"""A preallocated KV cache with the named operations that plan-and-infill decoding needs.

Each batch row is an independent sequence in *physical* (generation) order: entry j of
row b is the j-th token fed to that row, whatever its position id. Keys are stored
after RoPE, so an entry computed in one row (an infill row, say) can be copied into
another row and stay valid: that copy is ReFusion's KV reuse (docs/algorithm.md#commit).

Rows may hold different lengths. Entries at or beyond a row's length are garbage and
are never attended to: the model masks them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ContextLengthError
from ..settings.model import ModelConfig


def storage_mask(query_cols: torch.Tensor, end: int) -> torch.Tensor:
    """(B, 1, T, end) bool: causal in physical order, the query at column query_cols[b, t]
    of row b sees every column j <= it (a row's own entries, in the order they were fed)."""
    j = torch.arange(end, device=query_cols.device)
    return (j[None, None, :] <= query_cols[:, :, None])[:, None]


class KVCache:
    """Per layer `k`, `v`: (B, H_kv, capacity, D); per row: `lengths[b]` valid entries,
    with the `tokens` and `positions` (B, capacity) they were computed from."""

    def __init__(
        self,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        lengths: Sequence[int],
    ) -> None:
        # the storage may hold more rows than `lengths` (spare rows): `grow` fills them in
        # place and `retain` frees them in place, so a continuous batch does not reallocate
        # (and copy) the whole cache each time a row joins or leaves
        self._store = (k, v, tokens, positions)
        self.lengths = [int(n) for n in lengths]
        self._view()

    def _view(self) -> None:
        """Point `k`, `v`, `tokens`, `positions` at the storage's first batch_size rows."""
        B = len(self.lengths)
        k, v, tokens, positions = self._store
        self.k, self.v = [t[:B] for t in k], [t[:B] for t in v]
        self.tokens, self.positions = tokens[:B], positions[:B]  # (B, capacity) int64 each

    def _tensors(self) -> list[torch.Tensor]:
        """Every storage tensor, rows first: keys and values of each layer, tokens, positions."""
        k, v, tokens, positions = self._store
        return [*k, *v, tokens, positions]

    # ------------------------------------------------------------------ creation
    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        reserve: int = 0,
    ) -> KVCache:
        """An empty cache of `batch_size` rows, each able to hold `capacity` entries, with
        storage for `reserve` rows in all (rows that join later take them in place)."""
        rows = max(batch_size, reserve)
        shape = (rows, config.num_key_value_heads, capacity, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
            torch.zeros(rows, capacity, dtype=torch.long, device=device),
            torch.zeros(rows, capacity, dtype=torch.long, device=device),
            [0] * batch_size,
        )

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def reserved_rows(self) -> int:
        """Rows the storage holds (batch_size of them in use)."""
        return self._store[2].shape[0]

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def used(self) -> int:
        """The longest row: entries beyond it are never read."""
        return max(self.lengths, default=0)

    # ------------------------------------------------------------------ append (forward pass)
    def check_room(self, n_new: int) -> None:
        """Raise before any compute if `n_new` more entries would overflow a row."""
        need = self.used() + n_new
        if need > self.capacity:
            raise ContextLengthError(
                f"the KV cache holds {self.capacity} entries per row; this step needs {need}. "
                "Shorten the prompt or gen_length, or allocate a larger cache."
            )

    def packed_write(
        self,
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        *,
        whole_cache: bool = False,
        plan_runs: bool = False,
    ) -> PackedWrite:
        """The layout of a forward over ragged rows (row b feeds tokens[b], any number, none
        included), as the tensors `Transformer.packed_hidden` takes: the real tokens packed,
        where each sits in the rows' (B, T) layout, each query's column, and the storage it
        reads and writes. Only the window in use (used + T columns) is read, unless
        `whole_cache` (a contiguous read: what a compiled one-token step prefers). With
        `plan_runs`, attention may run in two runs of rows (see `attention_runs`).
        Nothing is written here; the caller keeps what it wants with `advance`."""
        dev = self.device
        T = max(1, max((len(t) for t in tokens), default=0))
        if len(tokens) != self.batch_size:
            raise ValueError(f"cache has {self.batch_size} rows, the forward feeds {len(tokens)}")
        self.check_room(T)

        def flat(xs) -> torch.Tensor:
            return torch.tensor([x for row in xs for x in row], dtype=torch.long, device=dev)

        where = flat([range(b * T, b * T + len(t)) for b, t in enumerate(tokens)])
        query_cols = torch.tensor(self.lengths, dtype=torch.long, device=dev)[:, None] + torch.arange(
            T, device=dev
        )
        end = self.capacity if whole_cache else self.used() + T
        segments = attention_runs(self.lengths, [len(t) for t in tokens]) if plan_runs else None
        # one new token per row at equal lengths reads exactly the window: no mask is needed
        masked = whole_cache or T > 1 or len(set(self.lengths)) > 1 or any(len(t) != 1 for t in tokens)
        return PackedWrite(
            flat(tokens),
            flat(positions),
            where,
            query_cols,
            [t[:, :, :end] for t in self.k],
            [t[:, :, :end] for t in self.v],
            self.tokens[:, :end],
            self.positions[:, :end],
            segments,
            masked,
        )

    def advance(self, n_new: int | Sequence[int]) -> None:
        """Make the entries just written valid (all of them, or the first n_new[b] per row)."""
        if isinstance(n_new, int):
            n_new = [n_new] * self.batch_size
        self.lengths = [n + int(d) for n, d in zip(self.lengths, n_new)]

    # ------------------------------------------------------------------ named operations
    def select(
        self,
        rows: Sequence[int] | torch.Tensor,
        capacity: int | None = None,
        empty: int = 0,
        out: KVCache | None = None,
    ) -> KVCache:
        """A cache made of the given rows (repeats allowed: that is a fork), copying only
        the used region, then `empty` empty rows. `capacity` defaults to this cache's.
        `out` (a scratch cache from an earlier call) is reused when its storage is big
        enough: no allocation, and its old entries are overwritten or never read."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else [int(r) for r in rows]
        cap = capacity if capacity is not None else self.capacity
        lengths = [self.lengths[r] for r in rows]
        used = max(lengths, default=0)
        if used > cap:
            raise ContextLengthError(f"rows of length {used} do not fit a cache of capacity {cap}")
        n = len(lengths)
        if out is None or out is self or out.reserved_rows < n + empty or out.capacity < cap:  # not reusable
            out = self._empty_like(n + empty, cap)
        runs = row_runs(rows)
        for src, dst in zip(self._tensors(), out._tensors()):
            col = 1 if src.dim() == 2 else 2  # entries along dim 1 (tokens) or 2 (keys, values)
            src, dst = src.narrow(col, 0, used), dst.narrow(col, 0, used)
            # a run is copied in place: a gather would copy twice, through a temporary
            for at, first, count, step in runs:
                part = src.narrow(0, first, count if step else 1)
                dst.narrow(0, at, count).copy_(part.expand(count, *part.shape[1:]))
        out.lengths = lengths + [0] * empty
        out._view()
        return out

    def _empty_like(self, rows: int, capacity: int) -> KVCache:
        def zeros(t: torch.Tensor) -> torch.Tensor:
            shape = list(t.shape)
            shape[0], shape[1 if t.dim() == 2 else 2] = rows, capacity
            return t.new_zeros(shape)

        k, v, tokens, positions = self._store
        return KVCache(
            [zeros(t) for t in k], [zeros(t) for t in v], zeros(tokens), zeros(positions), [0] * rows
        )

    def grow(self, n: int, capacity: int = 0, reserve: int = 0) -> None:
        """Add n empty rows in place (rows joining a running batch), each able to hold at
        least `capacity` entries. Spare rows are taken as they are; only when rows or
        capacity run out is the storage reallocated (for `reserve` rows in all, if more)
        and the used region copied."""
        B = self.batch_size
        if B + n > self.reserved_rows or capacity > self.capacity:
            # capacity grows by half at least: rows joining one after another (each a little
            # longer, say) then reallocate a few times, not at every join
            cap = (
                max(capacity, self.capacity + self.capacity // 2)
                if capacity > self.capacity
                else self.capacity
            )
            bigger = self.select(range(B), cap, empty=max(n, reserve - B))
            self._store = bigger._store
        self.lengths += [0] * n
        self._view()

    def retain(self, keep: Sequence[int]) -> list[int]:
        """Keep only the rows in `keep`, in place: the last kept rows move into the places
        of dropped ones (copying only their used region), and the rest of the storage
        becomes spare. Returns the new row order: the old index of each row now."""
        keep = sorted(set(int(b) for b in keep))
        n = len(keep)
        kept = set(keep)
        holes = [b for b in range(n) if b not in kept]
        movers = [b for b in keep if b >= n]  # as many as holes
        order = list(range(n))
        for h, m in zip(holes, movers):
            order[h] = m
        if holes:
            used = max(self.lengths[m] for m in movers)
            for t in self._tensors():
                t = t.narrow(1 if t.dim() == 2 else 2, 0, used)
                for h, m in zip(holes, movers):  # kept rows and dropped ones: no row is both
                    t[h].copy_(t[m])
        self.lengths = [self.lengths[b] for b in order]
        self._view()
        return order

    def copy_written(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """For each (src, dst, count), the `count` entries just written at src's end (not
        yet kept) copied to dst's end: a forward that fed a prompt to src alone writes what
        feeding it to dst too would have (both rows at the same length)."""
        for src, dst, _ in copies:
            if self.lengths[src] != self.lengths[dst]:
                raise ValueError(f"rows {src} and {dst} are {self.lengths[src]} and {self.lengths[dst]} long")
        for t in self._tensors():
            col = 0 if t.dim() == 2 else 1  # a row's entries: dim 0 (tokens) or 1 (keys, values)
            for src, dst, n in copies:
                start = self.lengths[src]
                t[dst].narrow(col, start, n).copy_(t[src].narrow(col, start, n))

    def append_from(
        self,
        src: KVCache,
        src_rows: Sequence[int],
        src_starts: Sequence[int],
        counts: Sequence[int],
        dst_rows: Sequence[int],
    ) -> None:
        """Append src[src_rows[i], src_starts[i] : src_starts[i] + counts[i]] to the end of
        row dst_rows[i], for each i in order (several segments may go to one row)."""
        lengths = list(self.lengths)
        segments = []  # (dst row, dst start, src row, src start, count)
        for sr, ss, n, dr in zip(src_rows, src_starts, counts, dst_rows):
            if ss + n > src.lengths[sr]:
                raise ValueError(f"source row {sr} holds {src.lengths[sr]} entries, asked for {ss}..{ss + n}")
            if n:
                segments.append((dr, lengths[dr], sr, ss, n))
            lengths[dr] += n
        if max(lengths, default=0) > self.capacity:
            raise ContextLengthError(
                f"appending would make a row {max(lengths)} entries long; capacity is {self.capacity}"
            )
        for dst, from_ in zip(self._tensors(), src._tensors()):
            col = 0 if dst.dim() == 2 else 1  # a row's entries: dim 0 (tokens) or 1 (keys, values)
            for dr, at, sr, ss, n in segments:  # a slot's entries: one slice copy each
                dst[dr].narrow(col, at, n).copy_(from_[sr].narrow(col, ss, n))
        self.lengths = lengths


def row_runs(rows: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """`rows` as runs (at, first, count, step): places at .. at + count - 1 take rows first,
    first + step, ..., with step 1 (rows in order: a copy of every row) or 0 (one row again
    and again: its forks)."""
    runs, i = [], 0
    while i < len(rows):
        step = 1 if i + 1 == len(rows) or rows[i + 1] != rows[i] else 0
        j = i + 1
        while j < len(rows) and rows[j] == rows[j - 1] + step:
            j += 1
        runs.append((i, rows[i], j - i, step))
        i = j
    return runs


# Transformer.packed_hidden's tensor arguments, in order: tokens, positions, where,
# query_cols, k and v (per layer), cache_tokens, cache_positions
PackedArgs = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    list[torch.Tensor],
    list[torch.Tensor],
    torch.Tensor,
    torch.Tensor,
]


@dataclass
class PackedWrite:
    """A forward's layout over the cache, tensors only (see `KVCache.packed_write`)."""

    tokens: torch.Tensor  # (N,) every row's real tokens, row after row
    positions: torch.Tensor  # (N,)
    where: torch.Tensor  # (N,) each token's place b * T + t in the rows' (B, T) layout
    query_cols: torch.Tensor  # (B, T) the cache column of row b's t-th token (its length + t)
    k: list[torch.Tensor]  # per layer (B, H_kv, window, D): written in place
    v: list[torch.Tensor]
    cache_tokens: torch.Tensor  # (B, window), written in place
    cache_positions: torch.Tensor
    segments: list[tuple[int, int, int, int]] | None = None  # attention in runs of rows (eager only)
    masked: bool = True  # False: every query sees its whole window (one token per row, equal lengths)

    def tensors(self) -> PackedArgs:
        """The arguments of `Transformer.packed_hidden` (what a compiled graph takes)."""
        return (
            self.tokens,
            self.positions,
            self.where,
            self.query_cols,
            self.k,
            self.v,
            self.cache_tokens,
            self.cache_positions,
        )


def attention_runs(
    starts: Sequence[int], fed: Sequence[int], worth: float = 0.6
) -> list[tuple[int, int, int, int]] | None:
    """Attention in two runs of rows, when that saves work: [(first row, end row, queries,
    keys), ...], each run attending with only as many query and key columns as its own
    rows need (None: one run). The common case is a join: rows that decode one token each
    beside a new row that prefills its prompt, which would otherwise make every row pay
    for the prompt's width. Row b holds starts[b] entries and feeds fed[b] tokens. Kept
    only if it costs under `worth` x one run."""
    B, T = len(starts), max(fed, default=0)
    if B < 2 or (T <= 1 and len(set(starts)) == 1):
        return None
    t = [max(1, min(int(n), T)) for n in fed]  # a row that feeds nothing still has a query
    e = [s + n for s, n in zip(starts, t)]  # keys a row's real queries can see
    pre_t, pre_e, mt, me = [], [], 0, 0
    for tb, eb in zip(t, e):
        mt, me = max(mt, tb), max(me, eb)
        pre_t.append(mt)
        pre_e.append(me)
    full, best, at = B * mt * me, B * mt * me, 0
    st = se = 0
    for a in range(B - 1, 0, -1):  # rows [0, a) and [a, B)
        st, se = max(st, t[a]), max(se, e[a])
        cost = a * pre_t[a - 1] * pre_e[a - 1] + (B - a) * st * se
        if cost < best:
            best, at, suffix = cost, a, (st, se)
    if at and best < worth * full:
        return [(0, at, pre_t[at - 1], pre_e[at - 1]), (at, B, *suffix)]
    return None
