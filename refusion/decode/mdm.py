"""The MDM baseline (SPEC §4): LLaDA-style masked diffusion with low-confidence remasking.

Semi-autoregressive blocks of MASK tokens; every step feeds the whole context again (no
KV reuse, as the papers' baseline does) and fixes the k most confident masked positions
of the current block (or, with `mdm_threshold`, every position above it, at least one).
On a ReFusion model the MASK predictions are the denoiser. The model is causal, so
blocks to the right of the current one cannot influence it and are not fed.
"""

from __future__ import annotations

import torch

from .config import DecodeConfig
from .engine import Forward, Progress
from .sampling import Sampler, token_probs


def transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """How many positions to fix at each of `steps` steps: as even as possible, the
    remainder spread over the first steps (the linear schedule of LLaDA)."""
    base, extra = divmod(n_masked, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def decode_mdm(fwd: Forward, progress: Progress, sampler: Sampler, cfg: DecodeConfig, prompts: list[list[int]], rids: list[int], mask_id: int, eos_ids: set[int]) -> None:
    blk = cfg.mdm_block_length
    n_blocks = -(-cfg.gen_length // blk)
    L = n_blocks * blk
    steps_total = cfg.mdm_steps if cfg.mdm_steps is not None else L
    schedule = transfer_schedule(blk, min(blk, max(1, -(-steps_total // n_blocks))))
    for rid in rids:
        progress.start(rid, L)
    gen = [[mask_id] * L for _ in prompts]  # what is fed: MASK where not yet fixed
    fixed = [[False] * L for _ in prompts]
    active = list(range(len(prompts)))
    for block in range(n_blocks):
        lo, hi = block * blk, (block + 1) * blk
        step = 0
        while True:
            todo = [b for b in active if not all(fixed[b][lo:hi])]
            if not todo:
                break
            k = schedule[step] if step < len(schedule) else blk
            seqs = [prompts[b] + gen[b][:hi] for b in todo]
            want = [(len(prompts[b]) + lo, len(prompts[b]) + hi) for b in todo]
            logits = fwd.run([rids[b] for b in todo], seqs, [list(range(len(q))) for q in seqs], None, want)
            for b, lg in zip(todo, logits):
                _fix_most_confident(lg, k, lo, gen[b], fixed[b], sampler, cfg, rids[b], progress)
            step += 1
        still = []
        for b in active:
            if any(t in eos_ids for t in gen[b][:hi]) or block == n_blocks - 1 or progress.check_cancelled(rids[b]):
                fwd.finish(rids[b])
            else:
                still.append(b)
        active = still


def _fix_most_confident(lg: torch.Tensor, k: int, lo: int, gen: list[int], fixed: list[bool], sampler: Sampler, cfg: DecodeConfig, rid: int, progress: Progress) -> None:
    """Fix k still-masked positions of one row's block: the most confident (or, with
    mdm_threshold, every one above it, at least one)."""
    drafts = sampler.pick(lg[None], [rid])[0]  # (blk,)
    conf = token_probs(lg, drafts)
    open_ = torch.tensor([not f for f in fixed[lo : lo + len(drafts)]], device=conf.device)
    conf = conf.masked_fill(~open_, -1.0)
    if cfg.mdm_threshold is not None:
        chosen = ((conf > cfg.mdm_threshold) & open_).nonzero().flatten().tolist() or [int(conf.argmax())]
    else:
        chosen = torch.topk(conf, min(max(k, 1), int(open_.sum()))).indices.tolist()
    spans = []
    for i in sorted(chosen):
        gen[lo + i] = int(drafts[i])
        fixed[lo + i] = True
        spans.append((lo + i, [int(drafts[i])]))
    progress.commit(rid, "mdm", spans)
