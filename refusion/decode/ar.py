"""The AR baseline (SPEC §4): left to right with a KV cache, one token per forward."""

from __future__ import annotations

from .config import DecodeConfig
from .engine import Forward, Progress
from .sampling import Sampler


def decode_ar(fwd: Forward, progress: Progress, sampler: Sampler, cfg: DecodeConfig, prompts: list[list[int]], rids: list[int], eos_ids: set[int]) -> None:
    """Prefill every prompt in one batched forward, then one token per row per forward;
    a row that hits EOS or gen_length leaves the batch (its cache row is dropped)."""
    L = cfg.gen_length
    for rid in rids:
        progress.start(rid, L)
    cache = fwd.model.new_cache(len(prompts), max(len(p) for p in prompts) + L)
    lengths = [len(p) for p in prompts]
    logits = fwd.run(rids, prompts, [list(range(n)) for n in lengths], cache, [(n - 1, n) for n in lengths])
    cache.advance(lengths)
    done_count = [0] * len(prompts)  # tokens generated per row
    active = list(range(len(prompts)))
    while active:
        nxt = [int(sampler.pick(lg[None], [rids[b]])[0, 0]) for b, lg in zip(active, logits)]
        keep = []
        for j, (b, tok) in enumerate(zip(active, nxt)):
            progress.commit(rids[b], "ar", [(done_count[b], [tok])])
            done_count[b] += 1
            if tok in eos_ids or done_count[b] == L or progress.check_cancelled(rids[b]):
                fwd.finish(rids[b])
            else:
                keep.append(j)
        if len(keep) < len(active):
            if not keep:
                break
            cache = cache.select(keep)
            active, nxt = [active[j] for j in keep], [nxt[j] for j in keep]
        logits = fwd.run(
            [rids[b] for b in active],
            [[t] for t in nxt],
            [[len(prompts[b]) + done_count[b] - 1] for b in active],
            cache,
            [(0, 1)] * len(active),
        )
        cache.advance(1)
