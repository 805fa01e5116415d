"""Each `KVCache` operation on its own, against a reference that does not use it.

Where the arithmetic is the same (copies, or a forward over identical cache contents
with identical shapes) results must be bit-equal; where the batch shape or the
attention path differs, assert_close with default float32 tolerances.
"""

from __future__ import annotations

import pytest
import torch

from refusion import Transformer
from refusion.errors import ContextLengthError
from refusion.model.kv_cache import KVCache

MASK = 63  # any id: the model does not know it is special


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def rand_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 60, (n,), generator=torch.Generator().manual_seed(seed))


def prefilled(
    model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, capacity: int = 64
) -> KVCache:
    """A one-row cache holding `tokens` (T,) at `positions` (T,)."""
    cache = model.new_cache(1, capacity)
    model(tokens[None], positions[None], cache)
    return cache


def entries_equal(
    a: KVCache, row_a: int, b: KVCache, row_b: int, start: int, stop: int, start_b: int | None = None
):
    """Bit-equality of k, v, tokens and positions over a range of physical columns."""
    sb = start if start_b is None else start_b
    n = stop - start
    for layer in range(len(a.k)):
        assert torch.equal(a.k[layer][row_a, :, start:stop], b.k[layer][row_b, :, sb : sb + n])
        assert torch.equal(a.v[layer][row_a, :, start:stop], b.v[layer][row_b, :, sb : sb + n])
    assert torch.equal(a.tokens[row_a, start:stop], b.tokens[row_b, sb : sb + n])
    assert torch.equal(a.positions[row_a, start:stop], b.positions[row_b, sb : sb + n])


# ---------------------------------------------------------------------------- append (forward)
def test_prefill_then_incremental_steps_equal_one_full_forward(tiny_model):
    """Chunks of 5, 3, then single tokens, at shuffled positions, reproduce the uncached logits."""
    tokens = rand_tokens(12, seed=0)[None]  # (1, 12)
    positions = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:12][None]
    full = tiny_model(tokens, positions)  # (1, 12, V)
    cache = tiny_model.new_cache(1, 16)
    pieces, start = [], 0
    for n in (5, 3, 1, 1, 1, 1):
        pieces.append(tiny_model(tokens[:, start : start + n], positions[:, start : start + n], cache))
        start += n
    assert cache.lengths == [12]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)


def test_ragged_rows_with_n_new_padding_equal_each_row_alone(tiny_model):
    """Right-padded prefill (n_new per row), then steps from different row lengths."""
    a, b = rand_tokens(6, seed=1), rand_tokens(3, seed=2)
    steps_a, steps_b = rand_tokens(4, seed=3), rand_tokens(4, seed=4)
    cache = tiny_model.new_cache(2, 16)
    padded = torch.stack([a, torch.cat([b, torch.zeros(3, dtype=torch.long)])])  # (2, 6)
    pre = tiny_model(padded, torch.arange(6).expand(2, -1), cache, n_new=[6, 3])
    assert cache.lengths == [6, 3]
    step_logits = []
    for i in range(0, 4, 2):  # two steps of two tokens, each row at its own length
        toks = torch.stack([steps_a[i : i + 2], steps_b[i : i + 2]])
        pos = torch.tensor([[6 + i, 7 + i], [3 + i, 4 + i]])
        step_logits.append(tiny_model(toks, pos, cache))
    steps = torch.cat(step_logits, dim=1)  # (2, 4, V)
    for row, (prompt, cont) in enumerate([(a, steps_a), (b, steps_b)]):
        seq = torch.cat([prompt, cont])[None]
        alone = tiny_model(seq, torch.arange(seq.shape[1])[None])
        n = len(prompt)
        torch.testing.assert_close(pre[row, :n], alone[0, :n])
        torch.testing.assert_close(steps[row], alone[0, n:])


def test_ragged_rows_equal_each_row_alone(tiny_model):
    """Rows feeding 7, 2, 0 and 5 tokens in one cached forward (only the real tokens are
    projected, rotated and stored): each row's outputs equal the row recomputed alone
    without a cache, outputs at the padding are zeros, and each row's entries equal a
    cache that held the row alone. Then a step from unequal lengths, 1 or 3 tokens a row."""
    rows = [rand_tokens(n, seed=20 + n) for n in (7, 2, 0, 5)]  # a row may feed nothing
    T = max(len(r) for r in rows)
    tokens = torch.stack([torch.cat([r, torch.zeros(T - len(r), dtype=torch.long)]) for r in rows])
    positions = torch.arange(T).expand(len(rows), -1)
    lengths = [len(r) for r in rows]
    cache = tiny_model.new_cache(len(rows), 16)
    out = tiny_model.cached_hidden(tokens, positions, cache, n_new=lengths)  # (4, 7, hidden)
    assert cache.lengths == lengths
    for b, (r, n) in enumerate(zip(rows, lengths)):
        assert not out[b, n:].any()
        if n:
            torch.testing.assert_close(out[b, :n], tiny_model.hidden(r[None], torch.arange(n)[None])[0])
            alone = prefilled(tiny_model, r, torch.arange(n), capacity=16)
            for layer in range(len(cache.k)):
                torch.testing.assert_close(cache.k[layer][b, :, :n], alone.k[layer][0, :, :n])
                torch.testing.assert_close(cache.v[layer][b, :, :n], alone.v[layer][0, :, :n])
    step = torch.stack([rand_tokens(3, seed=30 + b) for b in range(len(rows))])  # (4, 3)
    step_pos = torch.tensor(lengths)[:, None] + torch.arange(3)[None]
    step_len = [1, 3, 1, 1]
    got = tiny_model.cached_hidden(step, step_pos, cache, n_new=step_len)
    for b, (r, n) in enumerate(zip(rows, step_len)):
        seq = torch.cat([r, step[b, :n]])[None]
        alone = tiny_model.hidden(seq, torch.arange(seq.shape[1])[None])
        torch.testing.assert_close(got[b, :n], alone[0, len(r) :])


def test_rows_that_all_feed_fewer_than_t_tokens_keep_the_t_columns(tiny_model):
    """Right padding wider than every row's feed: the output still has T columns, zeros
    past each row's tokens, and each row's outputs equal the row alone."""
    rows = [rand_tokens(n, seed=60 + n) for n in (3, 2)]
    tokens = torch.stack([torch.cat([r, torch.zeros(6 - len(r), dtype=torch.long)]) for r in rows])  # (2, 6)
    cache = tiny_model.new_cache(2, 16)
    out = tiny_model.cached_hidden(tokens, torch.arange(6).expand(2, -1), cache, n_new=[3, 2])
    assert out.shape[:2] == (2, 6) and cache.lengths == [3, 2]
    for b, r in enumerate(rows):
        torch.testing.assert_close(
            out[b, : len(r)], tiny_model.hidden(r[None], torch.arange(len(r))[None])[0]
        )
        assert not out[b, len(r) :].any()


def test_attention_runs_plan_a_join_as_two_runs_and_keep_one_run_otherwise():
    from refusion.model.kv_cache import attention_runs

    # four rows decode one token, a new row prefills 8
    assert attention_runs([6, 3, 5, 4, 0], [1, 1, 1, 1, 8]) == [(0, 4, 1, 7), (4, 5, 8, 8)]
    assert attention_runs([6, 3, 5, 4], [3, 2, 3, 3]) is None  # no run of rows is much narrower: one run
    assert attention_runs([5, 5], [1, 1]) is None  # one token per row at equal lengths


def test_a_join_step_in_two_runs_equals_each_row_alone(tiny_model):
    """Rows at different lengths decode one token each while a new row prefills its
    prompt in the same forward: attention then runs per run of rows (`attention_runs`);
    every row's outputs equal the row recomputed alone without a cache."""
    prompts = [rand_tokens(n, seed=40 + n) for n in (6, 3, 5, 4)]
    new_prompt = rand_tokens(8, seed=50)
    cache = tiny_model.new_cache(4, 32, reserve=5)
    T = max(len(p) for p in prompts)
    tokens = torch.stack([torch.cat([p, torch.zeros(T - len(p), dtype=torch.long)]) for p in prompts])
    tiny_model.cached_hidden(tokens, torch.arange(T).expand(4, -1), cache, n_new=[len(p) for p in prompts])
    cache.grow(1, 32)
    nxt = rand_tokens(4, seed=51)
    tokens = torch.zeros(5, 8, dtype=torch.long)
    positions = torch.zeros(5, 8, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, 0], positions[b, 0] = nxt[b], len(p)
    tokens[4], positions[4] = new_prompt, torch.arange(8)
    lengths = [1, 1, 1, 1, 8]
    assert (
        cache.packed_write(
            [t[:n].tolist() for t, n in zip(tokens, lengths)],
            [p[:n].tolist() for p, n in zip(positions, lengths)],
            plan_runs=True,
        ).segments
        is not None
    )
    split = tiny_model.cached_hidden(tokens, positions, cache, n_new=lengths)
    for b, p in enumerate(prompts):
        alone = tiny_model.hidden(torch.cat([p, nxt[b : b + 1]])[None], torch.arange(len(p) + 1)[None])
        torch.testing.assert_close(split[b, :1], alone[0, len(p) :])
    torch.testing.assert_close(split[4], tiny_model.hidden(new_prompt[None], torch.arange(8)[None])[0])


# ---------------------------------------------------------------------------- named operations
def test_select_forks_rows_bit_equal_and_independent(tiny_model):
    """Repeating a row (one copy of the committed cache per slot, as infilling does)."""
    cache = prefilled(tiny_model, rand_tokens(6, seed=12), torch.arange(6), capacity=16)
    before = [k.clone() for k in cache.k]
    forked = cache.select([0, 0, 0])
    assert forked.lengths == [6, 6, 6] and forked.capacity == 16
    for row in range(3):
        entries_equal(forked, row, cache, 0, 0, 6)
    # each forked row continues with its own slot, as infilling does
    slots = torch.stack([rand_tokens(3, seed=s) for s in (13, 14, 15)])  # (3, 3)
    slot_pos = torch.tensor([[6, 7, 8], [9, 10, 11], [12, 13, 14]])
    out = tiny_model(slots, slot_pos, forked)
    assert cache.lengths == [6] and all(torch.equal(k, b) for k, b in zip(cache.k, before))
    for row in range(3):
        alone = prefilled(tiny_model, rand_tokens(6, seed=12), torch.arange(6), capacity=16)
        torch.testing.assert_close(out[row], tiny_model(slots[row][None], slot_pos[row][None], alone)[0])


def test_select_repeats_rows_in_order(tiny_model):
    cache = tiny_model.new_cache(3, 16)
    prompts = torch.stack([rand_tokens(4, seed=s) for s in (16, 17, 18)])  # (3, 4)
    tiny_model(prompts, torch.arange(4).expand(3, -1), cache, n_new=[4, 2, 3])
    forked = cache.select([0, 0, 2])
    assert forked.lengths == [4, 4, 3]
    for dst, src in enumerate([0, 0, 2]):
        entries_equal(forked, dst, cache, src, 0, cache.lengths[src])


def test_select_reorders_rows_and_sets_capacity(tiny_model):
    cache = tiny_model.new_cache(3, 16)
    prompts = torch.stack([rand_tokens(5, seed=s) for s in (19, 20, 21)])  # (3, 5)
    tiny_model(prompts, torch.arange(5).expand(3, -1), cache, n_new=[5, 2, 4])
    picked = cache.select([2, 0], capacity=8)
    assert picked.lengths == [4, 5] and picked.capacity == 8 and picked.batch_size == 2
    entries_equal(picked, 0, cache, 2, 0, 4)
    entries_equal(picked, 1, cache, 0, 0, 5)
    with pytest.raises(ContextLengthError):
        cache.select([0], capacity=4)  # row 0 holds 5 entries


def test_select_copies_runs_and_scattered_rows_as_a_gather_would(tiny_model):
    """Rows in order, repeated rows and scattered rows in one selection: every tensor's used
    region equals the reference gather of the same rows (copied in runs, no temporary)."""
    cache = tiny_model.new_cache(5, 16)
    prompts = torch.stack([rand_tokens(6, seed=s) for s in range(40, 45)])  # (5, 6)
    tiny_model(prompts, torch.arange(6).expand(5, -1), cache, n_new=[6, 3, 5, 2, 4])
    rows = [3, 3, 0, 1, 2, 2, 4, 1, 0, 0]
    picked = cache.select(rows, capacity=12)
    assert picked.lengths == [cache.lengths[r] for r in rows]
    idx = torch.tensor(rows)
    for got, src in zip(picked._tensors(), cache._tensors()):
        used = 6  # the longest selected row
        if src.dim() == 2:
            assert torch.equal(got[: len(rows), :used], src[idx, :used])
        else:
            assert torch.equal(got[: len(rows), :, :used], src[idx, :, :used])


def three_rows(model: Transformer, reserve: int = 0) -> KVCache:
    """Rows of 5, 2 and 4 entries in a cache of capacity 16."""
    cache = model.new_cache(3, 16, reserve=reserve)
    prompts = torch.stack([rand_tokens(5, seed=s) for s in (30, 31, 32)])  # (3, 5)
    model(prompts, torch.arange(5).expand(3, -1), cache, n_new=[5, 2, 4])
    return cache


def test_retain_moves_the_last_rows_into_dropped_places_in_place(tiny_model):
    cache, ref = three_rows(tiny_model), three_rows(tiny_model)
    storage = cache.k[0].data_ptr()
    order = cache.retain([1, 2])  # row 0 leaves: row 2 takes its place, row 1 stays
    assert order == [2, 1] and cache.lengths == [4, 2] and cache.batch_size == 2
    assert cache.k[0].data_ptr() == storage and cache.reserved_rows == 3  # no reallocation
    for new, old in enumerate(order):
        entries_equal(cache, new, ref, old, 0, ref.lengths[old])
    assert cache.retain([]) == [] and cache.batch_size == 0


def test_grow_takes_spare_rows_in_place_then_reallocates_keeping_entries(tiny_model):
    cache, ref = three_rows(tiny_model, reserve=4), three_rows(tiny_model)
    storage = cache.k[0].data_ptr()
    cache.retain([0, 2])
    cache.grow(2, capacity=16)  # 2 rows in use + 2 spare: fits
    assert cache.k[0].data_ptr() == storage and cache.lengths == [5, 4, 0, 0]
    cache.grow(1, capacity=24, reserve=6)  # out of rows and capacity: a bigger storage
    assert cache.reserved_rows == 6 and cache.capacity == 24 and cache.lengths == [5, 4, 0, 0, 0]
    entries_equal(cache, 0, ref, 0, 0, 5)
    entries_equal(cache, 1, ref, 2, 0, 4)


def test_rows_joining_spare_storage_decode_like_a_fresh_cache(tiny_model):
    """A row that takes a freed row's storage computes what it computes in a new cache:
    the freed row's stale entries beyond the new row's length lie inside the step's key
    span (the other row is longer) and are never attended to."""
    cache = tiny_model.new_cache(3, 16, reserve=3)
    rows = torch.stack([rand_tokens(5, seed=s) for s in (30, 31, 32)])  # (3, 5)
    tiny_model(rows, torch.arange(5).expand(3, -1), cache)  # every row's storage holds 5 written columns
    cache.retain([2])  # row 2 moves to row 0; rows 1 and 2 become spare, stale
    cache.grow(1, capacity=16)
    prompt = rand_tokens(3, seed=33)  # writes columns 0..2: stale columns 3, 4 stay
    tokens = torch.stack([torch.cat([rand_tokens(1, seed=34), torch.zeros(2, dtype=torch.long)]), prompt])
    positions = torch.stack([torch.tensor([5, 0, 0]), torch.arange(3)])
    out = tiny_model(tokens, positions, cache, n_new=[1, 3])  # keys span columns 0..5
    assert cache.positions[1, 3:5].tolist() == [3, 4]  # the stale entries are still there
    fresh = prefilled(tiny_model, prompt, torch.arange(3), capacity=16)
    torch.testing.assert_close(
        out[1], tiny_model.lm_head(tiny_model.hidden(prompt[None], torch.arange(3)[None]))[0]
    )
    for layer in range(len(cache.k)):
        torch.testing.assert_close(cache.k[layer][1, :, :3], fresh.k[layer][0, :, :3])
    query, q_pos = rand_tokens(1, seed=35)[None], torch.tensor([[3]])
    both = tiny_model(
        torch.cat([torch.zeros(1, 1, dtype=torch.long), query]),
        torch.cat([torch.tensor([[3]]), q_pos]),
        cache,
    )
    torch.testing.assert_close(both[1], tiny_model(query, q_pos, fresh)[0])


def test_select_into_a_scratch_cache_reuses_its_storage(tiny_model):
    cache = three_rows(tiny_model)
    scratch = cache.select([0, 0, 1, 2], capacity=12)
    storage = scratch.k[0].data_ptr()
    again = cache.select([2, 1], capacity=10, out=scratch)  # fits: same storage, new rows
    assert again is scratch and scratch.k[0].data_ptr() == storage and scratch.lengths == [4, 2]
    entries_equal(scratch, 0, cache, 2, 0, 4)
    entries_equal(scratch, 1, cache, 1, 0, 2)
    bigger = cache.select([0, 1, 2, 0, 1], capacity=12, out=scratch)  # more rows than it holds
    assert bigger is not scratch and bigger.lengths == [5, 2, 4, 5, 2]


def test_append_from_copies_segments_in_order(tiny_model):
    """Infill pattern: fork the committed row, feed one slot per row in one batch, then
    append both slots to the committed row in position order."""
    P = 5
    committed = prefilled(tiny_model, rand_tokens(P, seed=22), torch.arange(P), capacity=32)
    infill = committed.select([0, 0])
    slot_a, slot_b = rand_tokens(4, seed=23), rand_tokens(4, seed=24)
    tiny_model(torch.stack([slot_a, slot_b]), torch.tensor([[9, 10, 11, 12], [5, 6, 7, 8]]), infill)
    committed.append_from(infill, src_rows=[1, 0], src_starts=[P, P], counts=[4, 4], dst_rows=[0, 0])
    assert committed.lengths == [P + 8]
    entries_equal(committed, 0, infill, 1, P, P + 4)  # slot b (positions 5..8) first
    entries_equal(committed, 0, infill, 0, P + 4, P + 8, start_b=P)
    tokens, positions = committed.tokens[0, : P + 8], committed.positions[0, : P + 8]
    assert positions[P:].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert torch.equal(tokens[P:], torch.cat([slot_b, slot_a]))


def test_append_from_a_fork_equals_feeding_directly(tiny_model):
    """Entries computed in a forked row and appended back behave like entries fed in place."""
    P, prompt, slot = 6, rand_tokens(6, seed=25), rand_tokens(3, seed=26)
    committed = prefilled(tiny_model, prompt, torch.arange(P), capacity=16)
    row = committed.select([0])
    tiny_model(slot[None], torch.arange(P, P + 3)[None], row)
    committed.append_from(row, src_rows=[0], src_starts=[P], counts=[3], dst_rows=[0])
    direct = prefilled(tiny_model, torch.cat([prompt, slot]), torch.arange(P + 3), capacity=16)
    query, qpos = rand_tokens(2, seed=27)[None], torch.arange(P + 3, P + 5)[None]
    torch.testing.assert_close(tiny_model(query, qpos, committed), tiny_model(query, qpos, direct))


def test_append_from_checks_source_range_and_capacity(tiny_model):
    src = prefilled(tiny_model, rand_tokens(6, seed=28), torch.arange(6), capacity=16)
    dst = prefilled(tiny_model, rand_tokens(6, seed=29), torch.arange(6), capacity=8)
    with pytest.raises(ValueError):
        dst.append_from(src, src_rows=[0], src_starts=[4], counts=[3], dst_rows=[0])  # src holds 6
    with pytest.raises(ContextLengthError):
        dst.append_from(src, src_rows=[0], src_starts=[0], counts=[3], dst_rows=[0])  # 6 + 3 > 8
    assert dst.lengths == [6]


def test_overflow_raises_before_any_layer_runs(tiny_model):
    cache = prefilled(tiny_model, rand_tokens(6, seed=30), torch.arange(6), capacity=8)
    tokens_before = cache.tokens.clone()
    calls = []
    hook = tiny_model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ContextLengthError):
            tiny_model(rand_tokens(3, seed=31)[None], torch.arange(6, 9)[None], cache)
    finally:
        hook.remove()
    assert calls == [] and cache.lengths == [6] and torch.equal(cache.tokens, tokens_before)
