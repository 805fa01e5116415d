"""The AR baseline (docs/algorithm.md#ar): left to right with a KV cache, one token per forward.

An AR row takes part in every forward of the engine's main cache: a ReFusion row's plan
and its verification both give it a token, so AR rows batched with ReFusion rows share
their forwards. Its first forward prefills the prompt (beside whatever the other rows
feed: continuous batching).
"""

from __future__ import annotations

import torch

from .request import Request
from .rows import Feed


class ARRow:
    """One request decoded left to right: its prompt first, then its last token."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.prompt_len = len(req.prompt)
        self.n_done = 0  # tokens generated
        self.pending = list(req.prompt)  # what the row feeds next
        self.done = False

    stops_early = True  # finished once its output is final (EOS or gen_length)

    # both forwards of a step give it a token; it has no infilling
    def plan_feed(self) -> Feed:
        return self.feed()

    def take_plan(self, logits: torch.Tensor, feed: Feed) -> int:
        return self.take(logits)

    def join_feed(self, running: bool) -> Feed:
        return self.feed()

    def take_join(self, logits: torch.Tensor, feed: Feed) -> int:
        return self.take(logits)

    def verify_feed(self) -> Feed | None:
        return None if self.done else self.feed()

    def take_verify(self, logits: torch.Tensor, feed: Feed) -> int:
        return self.take(logits)

    def infills(self) -> bool:
        return False

    def end_step(self) -> None:
        pass

    drafting = adaptive = False  # it drafts nothing: no draft widths
    verifies = False  # it takes a token in a verification forward when a ReFusion row runs one

    def fed_per_forward(self) -> int:
        return 1

    @property
    def joining(self) -> bool:
        return self.n_done == 0

    def feed(self) -> Feed:
        """A joining row feeds its prompt at 0..P-1; a running row its last token at P+done-1."""
        n = len(self.pending)
        start = self.prompt_len + self.n_done - n if self.n_done else 0
        return Feed(self.pending, list(range(start, start + n)), (n - 1, n))

    def take(self, logits: torch.Tensor) -> int:
        """One token from the logits (1, V) of the last entry fed; returns the entries kept."""
        tok = int(self.req.sampler.pick(logits)[0])
        self.req.commit("ar", [(self.n_done, [tok])])
        kept = len(self.pending)
        self.n_done += 1
        self.pending = [tok]
        self.done = tok in self.req.eos_ids or self.n_done == self.req.cfg.gen_length
        return kept
