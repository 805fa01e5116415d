"""The MDM baseline (docs/algorithm.md#mdm): LLaDA-style masked diffusion with low-confidence remasking.

Semi-autoregressive blocks of MASK tokens; every step feeds the whole context again (no
KV reuse, as the papers' baseline does) and fixes the k most confident masked positions
of the current block (or, with `mdm_threshold`, every position above it, at least one).
On a ReFusion model the MASK predictions are the denoiser. The model is causal, so
blocks to the right of the current one cannot influence it and are not fed.
"""

from __future__ import annotations

import torch

from .request import Request
from .rows import Feed
from .sampling import token_probs


def transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """How many positions to fix at each of `steps` steps: as even as possible, the
    remainder spread over the first steps (the linear schedule of LLaDA)."""
    base, extra = divmod(n_masked, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


class MDMRow:
    """One request's blocks: each engine step feeds its prompt and every block up to the
    current one, and fixes the scheduled number of the current block's masked positions."""

    stops_early = False  # the baseline fixes its whole block, even past an EOS, as LLaDA does

    def __init__(self, req: Request, mask_id: int) -> None:
        cfg = req.cfg
        self.req, self.blk = req, cfg.mdm_block_length
        self.n_blocks = cfg.region_length // self.blk
        steps_total = cfg.mdm_steps if cfg.mdm_steps is not None else cfg.region_length
        self.schedule = transfer_schedule(self.blk, min(self.blk, max(1, -(-steps_total // self.n_blocks))))
        self.gen = [mask_id] * cfg.region_length  # what is fed: MASK where not yet fixed
        self.fixed = [False] * cfg.region_length
        self.block = self.step = 0
        self.done = False

    def feed(self) -> Feed:
        seq = self.req.prompt + self.gen[: (self.block + 1) * self.blk]
        P, lo = len(self.req.prompt), self.block * self.blk
        return Feed(seq, list(range(len(seq))), (P + lo, P + lo + self.blk))

    def take(self, logits: torch.Tensor) -> None:
        """Fix positions of the block from its logits (blk, V); move on when it is complete."""
        k = self.schedule[self.step] if self.step < len(self.schedule) else self.blk
        lo, hi = self.block * self.blk, (self.block + 1) * self.blk
        self._fix_most_confident(logits, k, lo)
        self.step += 1
        if not all(self.fixed[lo:hi]):
            return
        if any(t in self.req.eos_ids for t in self.gen[:hi]) or self.block == self.n_blocks - 1:
            self.done = True
        else:
            self.block, self.step = self.block + 1, 0

    def _fix_most_confident(self, lg: torch.Tensor, k: int, lo: int) -> None:
        """Fix k still-masked positions of the block: the most confident (or, with
        mdm_threshold, every one above it, at least one)."""
        threshold = self.req.cfg.mdm_threshold
        drafts = self.req.sampler.pick(lg)  # (blk,)
        conf = token_probs(lg, drafts)
        open_ = torch.tensor([not f for f in self.fixed[lo : lo + len(drafts)]], device=conf.device)
        conf = conf.masked_fill(~open_, -1.0)
        if threshold is not None:
            chosen = ((conf > threshold) & open_).nonzero().flatten().tolist() or [int(conf.argmax())]
        else:
            chosen = torch.topk(conf, min(max(k, 1), int(open_.sum()))).indices.tolist()
        spans = []
        for i in sorted(chosen):
            self.gen[lo + i] = int(drafts[i])
            self.fixed[lo + i] = True
            spans.append((lo + i, [int(drafts[i])]))
        self.req.commit("mdm", spans)
