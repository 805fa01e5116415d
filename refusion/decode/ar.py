"""The AR baseline (SPEC §4): left to right with a KV cache, one token per forward."""

from __future__ import annotations

from ..cache import KVCache
from .config import DecodeConfig
from .engine import Forward, Progress, make_room
from .sampling import Sampler


class ARDecoder:
    """Rows step together, one token each per forward; a row that hits EOS or gen_length
    leaves (its cache row is dropped) and new rows may join between steps: a joining row's
    prompt is prefilled in the same forward as the others' next token (continuous batching)."""

    def __init__(self, fwd: Forward, progress: Progress, sampler: Sampler, cfg: DecodeConfig, eos_ids: set[int],
                 max_rows: int = 0) -> None:
        self.fwd, self.progress, self.sampler, self.cfg, self.eos_ids = fwd, progress, sampler, cfg, eos_ids
        self.max_rows = max_rows  # rows in flight at most: the cache reserves storage for them
        self.rids: list[int] = []  # prompt index of each cache row
        self.prompt_len: list[int] = []
        self.done: list[int] = []  # tokens generated per row
        self.feed: list[list[int]] = []  # what each row feeds next: its prompt, then its last token
        self.cache: KVCache | None = None

    @property
    def active(self) -> int:
        return len(self.rids)

    def admit(self, prompts: list[list[int]], rids: list[int]) -> None:
        for rid in rids:
            self.progress.start(rid, self.cfg.gen_length)
        self.cache = make_room(self.fwd.model, self.cache, prompts, max(self.prompt_len, default=0), self.cfg.gen_length, self.max_rows)
        self.rids += rids
        self.prompt_len += [len(p) for p in prompts]
        self.done += [0] * len(prompts)
        self.feed += [list(p) for p in prompts]

    def step(self) -> None:
        """One forward for every row, then one token per row."""
        n_fed = [len(f) for f in self.feed]
        positions = [self._positions(b, n) for b, n in enumerate(n_fed)]
        logits = self.fwd.run(self.rids, self.feed, positions, self.cache, [(n - 1, n) for n in n_fed])
        self.cache.advance(n_fed)
        keep = []
        for b, lg in enumerate(logits):
            tok = int(self.sampler.pick(lg[None], [self.rids[b]])[0, 0])
            rid = self.rids[b]
            self.progress.commit(rid, "ar", [(self.done[b], [tok])])
            self.done[b] += 1
            self.feed[b] = [tok]
            if tok in self.eos_ids or self.done[b] == self.cfg.gen_length or self.progress.check_cancelled(rid):
                self.fwd.finish(rid)
            else:
                keep.append(b)
        if len(keep) < self.active:  # finished rows leave; their storage stays for rows that join
            order = self.cache.retain(keep)
            self.rids, self.prompt_len, self.done, self.feed = ([xs[b] for b in order] for xs in (self.rids, self.prompt_len, self.done, self.feed))

    def _positions(self, b: int, n: int) -> list[int]:
        """A joining row feeds its prompt at 0..P-1; a running row its last token at P+done-1."""
        start = self.prompt_len[b] + self.done[b] - n if self.done[b] else 0
        return list(range(start, start + n))
