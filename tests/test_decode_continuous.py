"""Continuous batching: rows leave when done and new prompts join a running batch between
steps (from the waiting list, or from an `admit` callback such as a server's queue).
Each row's decisions depend only on its own logits, so every output must equal the
prompt decoded alone, token for token."""

import json

import pytest
from golden_data import CASES, load_tiny

from refusion.decode import DecodeConfig, check_prompts, generate
from refusion.errors import ContextLengthError


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def golden_config(c: dict, **changes) -> DecodeConfig:
    return DecodeConfig(
        method="refusion", gen_length=c["gen_length"], slot_size=c["slot_size"], serial_blocks=c["serial_blocks"],
        slot_threshold=c["slot_threshold"], token_threshold=c["token_threshold"], eos_id=c["eos_id"],
        mask_id=c["mask_id"],
    ).replace(**changes)


def test_golden_cases_through_one_place(tiny):
    """The golden cases that share a config, through one place: each row joins the
    batch (and its cache) when the one before finishes; the decodings still equal the
    authors' reference."""
    by_cfg: dict[str, list[dict]] = {}
    for c in CASES:
        by_cfg.setdefault(json.dumps(golden_config(c).__dict__, sort_keys=True, default=str), []).append(c)
    groups = [cs for cs in by_cfg.values() if len(cs) >= 2]
    assert groups, "the golden set has configs shared by several prompts"
    for cs in groups:
        outs = generate(tiny, None, [c["prompt_ids"] for c in cs], golden_config(cs[0], max_batch_size=1))
        assert [o.token_ids for o in outs] == [c["expected_ids"] for c in cs]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_all_golden_prompts_through_two_places(tiny, k):
    """All 42 golden prompts under one golden config through 2 places (rows of different
    lengths joining a cache with rows mid-generation) equal each prompt decoded alone."""
    cfg = golden_config(CASES[k * 7], max_batch_size=2)
    prompts = [c["prompt_ids"] for c in CASES]
    outs = generate(tiny, None, prompts, cfg)
    assert [o.token_ids for o in outs] == [generate(tiny, None, [p], cfg)[0].token_ids for p in prompts]


@pytest.mark.parametrize("method", ["ar", "refusion"])
def test_admitted_prompts_join_the_running_batch(tiny, method):
    """One prompt starts; `admit` hands over two more at the first chance and one later;
    all four equal their decodings alone, callbacks see the new indices, and `admit` is
    never offered more room than the batch has."""
    c = CASES[0]
    cfg = golden_config(c, method=method, max_batch_size=3)
    first = c["prompt_ids"]
    later = [CASES[5]["prompt_ids"], CASES[9]["prompt_ids"][:7], CASES[2]["prompt_ids"] + [11, 12, 13]]
    calls, rooms, seen = [], [], set()

    def admit(room: int, max_len: int):
        assert max_len >= max(len(p) for p in later)  # the default budget fits these
        rooms.append(room)
        calls.append(len(calls))
        if len(calls) == 1:
            return later[:2]
        if len(calls) == 2:
            return later[2:]
        return []

    outs = generate(tiny, None, [first], cfg, admit=admit, on_prefix=lambda i, ids, done: seen.add(i))
    assert len(outs) == 4 and seen == {0, 1, 2, 3}
    assert all(1 <= r <= 3 for r in rooms) and rooms[0] == 2
    alone = [generate(tiny, None, [p], cfg)[0] for p in [first] + later]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert outs[3].stats.nfe == alone[3].stats.nfe  # a joining row pays only for its own steps


def test_many_prompts_through_few_places_keep_their_order(tiny):
    """More prompts than places: outputs come back in the order given, each as alone."""
    cfg = DecodeConfig(method="ar", gen_length=12, eos_id=CASES[0]["eos_id"], max_batch_size=2)
    prompts = [c["prompt_ids"][: 3 + i] for i, c in enumerate(CASES[:5])]
    outs = generate(tiny, None, prompts, cfg)
    assert [o.token_ids for o in outs] == [generate(tiny, None, [p], cfg)[0].token_ids for p in prompts]


def test_check_prompts_raises_what_generate_would(tiny):
    cfg = golden_config(CASES[0])
    check_prompts(tiny, None, cfg, [CASES[0]["prompt_ids"]])
    too_long = [1] * tiny.config.max_position_embeddings
    with pytest.raises(ContextLengthError):
        check_prompts(tiny, None, cfg, [too_long])
    with pytest.raises(ContextLengthError):
        generate(tiny, None, [too_long], cfg)


def test_joining_prompts_are_bounded_by_the_memory_budget(tiny):
    """With a budget that fits 2 rows of at most ~20-token prompts, `admit` is told that
    bound, and a prompt over it is refused rather than outgrowing the budget."""
    from refusion.decode import _bytes_per_entry, batch_size_for, longest_that_fits

    c = CASES[0]
    cfg = golden_config(c, max_batch_size=4)
    two_rows_of_20 = 2 * _bytes_per_entry(tiny, cfg) * (20 + 2 * cfg.padded_length)
    cfg = cfg.replace(memory_budget_gb=two_rows_of_20 / 2**30)
    first = c["prompt_ids"][:10]
    assert batch_size_for(tiny, cfg, len(first)) == 2
    bound = longest_that_fits(tiny, cfg, 2)
    assert 18 <= bound <= 20
    seen: list[int] = []

    def admit(room: int, max_len: int):
        seen.append(max_len)
        return [[5] * (max_len + 1)] if len(seen) == 1 else []

    with pytest.raises(ValueError, match="at most"):
        generate(tiny, None, [first], cfg, admit=admit)
    assert seen == [bound]


@pytest.mark.parametrize("method", ["ar", "refusion"])
def test_cache_storage_is_reserved_for_the_rows_that_can_be_in_flight(tiny, method, monkeypatch):
    """A fixed set of prompts reserves cache rows for at most that many prompts (not for
    max_batch_size); a caller with an `admit` queue reserves the whole batch up front, so
    rows that join later take spare storage instead of reallocating the cache."""
    cfg = golden_config(CASES[0], method=method, max_batch_size=8)
    reserved: list[int] = []
    new_cache = tiny.new_cache
    monkeypatch.setattr(tiny, "new_cache", lambda b, cap, reserve=0: reserved.append(reserve) or new_cache(b, cap, reserve))
    prompts = [c["prompt_ids"] for c in CASES[:3]]
    generate(tiny, None, prompts, cfg)
    queue = [c["prompt_ids"] for c in CASES[3:5]]
    outs = generate(tiny, None, prompts[:1], cfg, admit=lambda room, max_len: [queue.pop()] if queue else [])
    assert reserved == [3, 8] and len(outs) == 3


def test_stats_count_the_tokens_fed_and_the_logits_asked_for(tiny):
    """AR feeds the prompt, then every generated token but the last, and asks for one
    row of logits per token: the counts `bench decode` turns into GFLOP/s."""
    c = CASES[0]
    out = generate(tiny, None, [c["prompt_ids"]], golden_config(c, method="ar"))[0]
    n = len(out.token_ids)
    assert out.stats.fed == len(c["prompt_ids"]) + n - 1 and out.stats.logit_rows == n
