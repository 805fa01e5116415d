"""Which requests decode in the next step, and the cache they decode in.

The engine's batch: the rows of its KV cache (AR and ReFusion, `rows.Row`), the group of
rows that reuse no cache (MDM, `rows.GroupRow`), and the requests waiting to join. Each
step first admits waiting requests in order while the batch has room and the KV memory
budget holds them, sized by the one sizing rule (`model.sizing`: what each request's
method asks, `methods.Method.cache_need`); a request that does not fit waits at the head
(none overtakes it), and a request alone in the engine always starts. Joining rows get
cache rows as long as every step of the batch needs, with storage reserved for the rows
that can be in flight. Finished rows leave; their storage stays for rows that join.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from ..model.kv_cache import KVCache
from ..model.sizing import CacheNeed, cache_bytes, row_capacity
from ..model.transformer import Transformer
from ..settings.decode import EngineConfig
from .forward import make_room
from .methods import method_of
from .request import Request
from .rows import GroupRow, Row


def need_of(req: Request) -> CacheNeed:
    return method_of(req.cfg).cache_need(req.cfg, len(req.prompt))


class Scheduler:
    """The batch and its cache. `new_row(req)` makes a request's row (the engine's: it
    knows the MASK id and the draft-width policy)."""

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig,
        entry_bytes: int,
        new_row: Callable[[Request], Any],
    ) -> None:
        self.model, self.config, self.entry_bytes, self.new_row = model, config, entry_bytes, new_row
        self.waiting: deque[Request] = deque()
        self.rows: list[Row] = []  # one per row of `cache`
        self.group: list[GroupRow] = []  # rows of methods that reuse no cache
        self.cache: KVCache | None = None

    @property
    def running(self) -> int:
        return len(self.rows) + len(self.group)

    def every_row(self) -> list[Any]:
        return [*self.rows, *self.group]

    def admit(self) -> None:
        """Waiting requests join the batch in order while it has room (see the module
        docstring)."""
        new: list[Row] = []
        while self.waiting and self.running + len(new) < self.config.max_batch_size:
            req = self.waiting[0]
            if (self.running or new) and not self._fits(req, new):
                break
            self.waiting.popleft()
            req.start()
            if method_of(req.cfg).uses_cache:
                new.append(self.new_row(req))
            else:
                self.group.append(self.new_row(req))
        if new:
            try:
                self._make_room(new)
            except BaseException:  # (out of memory, say): the requests wait again, nothing is lost
                for row in reversed(new):
                    row.req.started = 0.0
                    self.waiting.appendleft(row.req)
                raise
            self.rows += new

    def _fits(self, req: Request, new: list[Row]) -> bool:
        """Would the cache rows of every running request, of the ones admitted this step and
        of `req` fit the memory budget, sized by the one rule (`cache_bytes`)?"""
        reqs = [r.req for r in self.rows] + [r.req for r in self.group] + [r.req for r in new] + [req]
        needs = [need_of(q) for q in reqs]
        return (
            cache_bytes(needs, self.entry_bytes, joining=bool(self.rows))
            <= self.config.memory_budget_gb * 2**30
        )

    def _make_room(self, new: list[Row]) -> None:
        """Cache rows for `new`, each as long as the sizing rule says every step of the
        running and new rows needs (`row_capacity`), with storage reserved for the rows
        that can be in flight (running and waiting, up to max_batch_size) within the budget."""
        needs = [need_of(r.req) for r in self.rows + new]
        capacity = row_capacity(needs, joining=bool(self.rows))
        waiting = sum(method_of(q.cfg).uses_cache for q in self.waiting)
        budget_rows = int(self.config.memory_budget_gb * 2**30 // max(capacity * self.entry_bytes, 1))
        rows = len(self.rows) + len(new)
        reserve = max(rows, min(self.config.max_batch_size, rows + waiting, budget_rows))
        self.cache = make_room(self.model, self.cache, len(new), capacity, reserve)

    def retire(self) -> None:
        """Finished rows leave; their cache storage stays for rows that join."""
        keep = [b for b, r in enumerate(self.rows) if not r.done]
        if len(keep) < len(self.rows) and self.cache is not None:
            self.rows = [self.rows[b] for b in self.cache.retain(keep)]
        self.group = [r for r in self.group if not r.done]

    def drop_running(self) -> None:
        """Every running row and the cache go (a step failed half-way: its state is not to
        be trusted); waiting requests stay."""
        self.rows, self.group, self.cache = [], [], None
