"""How far a model's MASK drafts reach: at points of its own greedy AR answer, the share of
drafts that equal the AR token at each distance past what is known.

Lossless decoding (docs/algorithm.md#lossless) drafts a slot from MASKs fed after the
committed text and keeps a draft only while it equals AR's next token, so these shares,
measured on the model's own greedy answers, bound what any draft width can commit per
forward, whatever the decoder does with them; they need no timing. `refusion bench curve`
prints them per checkpoint: where a run stands, and what more training has to raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..model.transformer import Transformer

OFFSETS = 4  # distances measured: the next token and the three after it
EVERY = 4  # a point every this many answer tokens
ROWS = 16  # points per forward


@dataclass
class Reach:
    """Draft matches of one answer: matches[i][k] for point i and distance k + 1."""

    matches: list[list[bool]]

    @property
    def points(self) -> int:
        return len(self.matches)


@torch.inference_mode()
def draft_reach(
    model: Transformer,
    prompt: Sequence[int],
    answer: Sequence[int],
    offsets: int = OFFSETS,
    every: int = EVERY,
) -> Reach:
    """At every `every`-th token t of `answer` (prompt and answer[:t] known), `offsets` MASKs
    are fed after the known text with their true positions, and each draft (its argmax) is
    compared with answer[t + k]. Points too close to the end for every distance are left
    out, so each distance is counted over the same points. One prefill, then one forward
    of every point's MASKs as rows of a cache forked from it."""
    mask = model.config.mask_token_id
    if mask is None:
        raise ValueError("the model has no MASK token: convert it for ReFusion first")
    cuts = list(range(0, len(answer) - offsets + 1, every))
    if not cuts:
        return Reach([])
    P = len(prompt)
    text = torch.tensor([*prompt, *answer], device=model.device)[None]  # (1, P + n)
    cache = model.new_cache(1, P + len(answer) + offsets)
    model(text, torch.arange(text.shape[1], device=model.device)[None], cache)
    matches, forks = [], None
    for at in range(0, len(cuts), ROWS):  # a few forks at a time: each copies the whole text's cache
        part = cuts[at : at + ROWS]
        forks = cache.select([0] * len(part), out=forks)
        forks.lengths = [P + t for t in part]  # each point sees the prompt and answer[:t] only
        tokens = torch.full((len(part), offsets), mask, device=model.device)  # (R, K)
        positions = torch.tensor([[P + t + k for k in range(offsets)] for t in part], device=model.device)
        drafts = model(tokens, positions, forks).argmax(-1).tolist()  # (R, K)
        matches += [[d[k] == answer[t + k] for k in range(offsets)] for d, t in zip(drafts, part)]
    return Reach(matches)


def summarise_reach(reaches: Sequence[Reach]) -> dict[str, object]:
    """The share of drafts equal to AR's token at each distance, and the mean run of equal
    drafts from the first: what a verification pass over them would accept besides its
    own correction."""
    rows = [m for r in reaches for m in r.matches]
    if not rows:
        return {"points": 0, "match": [], "run": 0.0}
    k = len(rows[0])
    runs = [next((i for i, ok in enumerate(m) if not ok), k) for m in rows]
    return {
        "points": len(rows),
        "match": [sum(m[i] for m in rows) / len(rows) for i in range(k)],
        "run": sum(runs) / len(rows),
    }
