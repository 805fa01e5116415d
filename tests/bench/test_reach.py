"""`bench.reach.draft_reach`: the MASK drafts past each point of an answer, through one
prefill and a forked cache, equal those of the same MASKs fed after the known text alone."""

from __future__ import annotations

import pytest
import torch
from conftest import randomise_, tiny_config

from refusion.bench.reach import Reach, draft_reach, summarise_reach
from refusion.model.transformer import Transformer

MASK = 63


@pytest.fixture(scope="module")
def model() -> Transformer:
    model = Transformer(tiny_config(mask_token_id=MASK))
    randomise_(model, seed=0)
    return model.eval()


def test_drafts_equal_masks_fed_after_the_known_text_alone(model):
    prompt = [5, 9, 2]
    answer = torch.randint(0, 60, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    reach = draft_reach(model, prompt, answer, offsets=3, every=1)  # 28 points: two forwards of forks
    cuts = list(range(0, len(answer) - 3 + 1))
    assert reach.points == len(cuts)
    for t, got in zip(cuts, reach.matches):
        known = prompt + answer[:t]
        fed = torch.tensor([known + [MASK] * 3])
        with torch.no_grad():
            drafts = model(fed, torch.arange(fed.shape[1])[None])[0, len(known) :].argmax(-1).tolist()
        assert got == [d == a for d, a in zip(drafts, answer[t : t + 3])]
    # an answer made of the model's own drafts is matched at the first distance everywhere
    own = []
    for _ in range(12):
        fed = torch.tensor([prompt + own + [MASK]])
        with torch.no_grad():
            own.append(int(model(fed, torch.arange(fed.shape[1])[None])[0, -1].argmax()))
    assert all(m[0] for m in draft_reach(model, prompt, own, offsets=2, every=1).matches)


def test_summary_counts_shares_and_runs():
    rows = Reach([[True, True, False], [True, False, True], [False, True, True]])
    summary = summarise_reach([rows, Reach([])])
    assert summary["points"] == 3
    assert summary["match"] == pytest.approx([2 / 3, 2 / 3, 2 / 3])
    assert summary["run"] == pytest.approx((2 + 1 + 0) / 3)
    assert summarise_reach([]) == {"points": 0, "match": [], "run": 0.0}
