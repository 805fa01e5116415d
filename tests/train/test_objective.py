"""The slot reorganisation and hybrid loss of docs/algorithm.md#training (refusion/train/objective.py).

`naive_example` below builds one training sequence with plain Python lists, step by step
as docs/algorithm.md words it; the vectorised transform must equal it on every random draw, and the
properties the docs name are checked directly as well."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refusion.errors import ConfigError
from refusion.model.transformer import Transformer
from refusion.settings.model import ModelConfig
from refusion.train import LossModel
from refusion.train.objective import (
    IGNORE,
    ObjectiveConfig,
    SlotDraws,
    ar_batch,
    draw_slots,
    loss_targets,
    refusion_batch,
    weighted_loss,
)

MASK = 999
PAD = 7


def hybrid_loss(logits: torch.Tensor, batch, ar_reduction: str = "token"):
    """The hybrid loss from full logits (B, T, V), through the trainer's pieces: the loss
    targets picked out of every position, then their weighted cross-entropy."""
    targets = loss_targets(batch, ar_reduction)
    return weighted_loss(logits.flatten(0, 1)[targets.flat_index], targets)


# ------------------------------------------------------------------ the naive reference
def naive_example(
    prompt: list[int],
    response: list[int],
    draws: SlotDraws,
    b: int,
    mask_id: int = MASK,
    boundary: bool = False,
) -> dict:
    """One example's training sequence from draws row b, written out as
    docs/algorithm.md#slot-reorganisation says; with `boundary`, a clean token's label is the
    next response token even across a slot's end, and the prompt's last token is labelled with
    the first response token."""
    s = int(draws.slot_size[b])
    p = float(draws.p[b])
    frontier = bool(draws.frontier[b])
    boundary = boundary or bool(draws.plain[b]) or frontier  # plain and frontier: clean slots in order
    slots = [
        list(range(i, min(i + s, len(response)))) for i in range(0, len(response), s)
    ]  # response offsets
    masked = [bool(draws.masked[b, k]) for k in range(len(slots))]
    if frontier:  # one slot masked, the response cut after it, its MDM part the slot's mean CE
        cut = min(int(float(draws.cut[b]) * len(slots)), len(slots) - 1)
        slots = slots[: cut + 1]
        response = response[: slots[-1][-1] + 1]
        masked = [k == cut for k in range(len(slots))]
        p = len(slots[-1]) / len(response)
    clean = sorted(
        (k for k in range(len(slots)) if not masked[k]), key=lambda k: (float(draws.order_key[b, k]), k)
    )
    seq = {"input_ids": [], "position_ids": [], "ar_labels": [], "mdm_labels": [], "mdm_weights": []}

    def put(token, position, ar=IGNORE, mdm=IGNORE, weight=0.0):
        for key, value in zip(seq, (token, position, ar, mdm, weight)):
            seq[key].append(value)

    for i, tok in enumerate(prompt):  # the prompt, no loss
        put(tok, i, ar=response[0] if boundary and i == len(prompt) - 1 else IGNORE)
    for k in clean:  # clean slots in random order, label = next token of the same slot
        for j, off in enumerate(slots[k]):
            nxt = response[slots[k][j + 1]] if j + 1 < len(slots[k]) else IGNORE
            if boundary:
                nxt = response[off + 1] if off + 1 < len(response) else IGNORE
            put(response[off], len(prompt) + off, ar=nxt)
    for k in range(len(slots)):  # masked slots in their order, MASK in, own token out
        if masked[k]:
            for off in slots[k]:
                put(mask_id, len(prompt) + off, mdm=response[off], weight=1.0 / (p * len(response)))
    return seq


def naive_loss(logits: torch.Tensor, seq: dict) -> tuple[float, float, int]:
    """(sum of AR CE, MDM part, number of AR labels) of one example from its logits (T, V)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    ar_sum, mdm, n_ar = 0.0, 0.0, 0
    for t in range(len(seq["input_ids"])):
        if seq["ar_labels"][t] != IGNORE:
            ar_sum -= float(logp[t, seq["ar_labels"][t]])
            n_ar += 1
        if seq["mdm_labels"][t] != IGNORE:
            mdm -= float(logp[t, seq["mdm_labels"][t]]) * seq["mdm_weights"][t]
    return ar_sum, mdm, n_ar


def padded(examples: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(p) + len(r) for p, r in examples)
    tokens = torch.full((len(examples), T), PAD)
    for b, (p, r) in enumerate(examples):
        tokens[b, : len(p) + len(r)] = torch.tensor(p + r)
    prompt_lens = torch.tensor([len(p) for p, _ in examples])
    lengths = torch.tensor([len(p) + len(r) for p, r in examples])
    return tokens, prompt_lens, lengths


token_ids = st.integers(min_value=10, max_value=500)
examples_st = st.lists(
    st.tuples(st.lists(token_ids, max_size=12), st.lists(token_ids, min_size=1, max_size=80)),
    min_size=1,
    max_size=4,
)
slot_sets = st.lists(st.sampled_from([1, 2, 3, 4, 5, 8, 16, 32]), min_size=1, max_size=4, unique=True)


# ------------------------------------------------------------------ the transform
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    examples=examples_st,
    sizes=slot_sets,
    seed=st.integers(0, 2**31 - 1),
    boundary=st.booleans(),
    mixes=st.sampled_from([(0.0, 0.0), (0.5, 0.0), (1.0, 0.0), (0.0, 1.0), (0.25, 0.5)]),
)
def test_transform_equals_the_naive_reading_of_the_spec(examples, sizes, seed, boundary, mixes):
    ar_mix, frontier_mix = mixes
    cfg = ObjectiveConfig(
        slot_sizes=tuple(sizes), boundary_labels=boundary, ar_mix=ar_mix, frontier_mix=frontier_mix
    )
    tokens, prompt_lens, lengths = padded(examples)
    draws = draw_slots(
        len(examples), cfg.max_slots(tokens.shape[1]), cfg, torch.Generator().manual_seed(seed)
    )
    batch = refusion_batch(tokens, prompt_lens, lengths, MASK, cfg, draws=draws)
    for b, (prompt, response) in enumerate(examples):
        want = naive_example(prompt, response, draws, b, boundary=boundary)
        n = len(want["input_ids"])
        for key, values in want.items():
            got = getattr(batch, key)[b, :n].tolist()
            if key == "mdm_weights":
                assert got == pytest.approx(values, rel=1e-6), key
            else:
                assert got == values, key
        # padding: after every real token, no loss, positions past the text
        assert batch.ar_labels[b, n:].eq(IGNORE).all() and batch.mdm_labels[b, n:].eq(IGNORE).all()
        assert batch.mdm_weights[b, n:].eq(0).all()
        assert sorted(batch.position_ids[b, n:].tolist()) == list(range(n, tokens.shape[1]))


@settings(max_examples=300, deadline=None)
@given(examples=examples_st, sizes=slot_sets, seed=st.integers(0, 2**31 - 1))
def test_transform_properties(examples, sizes, seed):
    """The properties docs/algorithm.md#slot-reorganisation names, checked directly (not through
    the naive builder), given the draws (slot size s and mask ratio p of each row)."""
    cfg = ObjectiveConfig(slot_sizes=tuple(sizes))
    tokens, prompt_lens, lengths = padded(examples)
    draws = draw_slots(
        len(examples), cfg.max_slots(tokens.shape[1]), cfg, torch.Generator().manual_seed(seed)
    )
    batch = refusion_batch(tokens, prompt_lens, lengths, MASK, cfg, draws=draws)
    for b, (prompt, response) in enumerate(examples):
        m, L, n = len(prompt), len(prompt) + len(response), len(response)
        s, p = int(draws.slot_size[b]), float(draws.p[b])
        assert s in sizes and cfg.eps <= p <= 1.0
        text = prompt + response
        pos = batch.position_ids[b, :L].tolist()
        inp, ar, mdm = (getattr(batch, k)[b, :L].tolist() for k in ("input_ids", "ar_labels", "mdm_labels"))
        w = batch.mdm_weights[b, :L].tolist()
        # positions: a permutation of 0..L-1; the prompt first, in order, without loss
        assert sorted(pos) == list(range(L))
        assert pos[:m] == list(range(m)) and inp[:m] == prompt
        assert all(x == IGNORE for x in ar[:m] + mdm[:m])
        # every response token exactly once: clean (itself) or masked (MASK, labelled with
        # itself, weight 1 / (p |R|))
        is_masked = [inp[t] == MASK for t in range(L)]
        for t in range(m, L):
            if is_masked[t]:
                assert mdm[t] == text[pos[t]] and ar[t] == IGNORE
                assert w[t] == pytest.approx(1.0 / (p * n), rel=1e-6)
            else:
                assert inp[t] == text[pos[t]] and mdm[t] == IGNORE and w[t] == 0
        # whole slots of s tokens are masked or clean
        masked_offsets = sorted(pos[t] - m for t in range(m, L) if is_masked[t])
        for q in masked_offsets:
            assert set(range(q - q % s, min(q - q % s + s, n))) <= set(masked_offsets)
        # physical order: the clean slots first (each contiguous, in order inside, AR label =
        # next token of its slot, none on its last token), then the masked slots in order
        n_clean = n - len(masked_offsets)
        assert not any(is_masked[m : m + n_clean]) and all(is_masked[m + n_clean : L])
        assert [pos[t] - m for t in range(m + n_clean, L)] == masked_offsets
        t, seen = m, []
        while t < m + n_clean:
            start = pos[t] - m
            assert start % s == 0, "a clean slot starts at a slot boundary"
            size = min(s, n - start)
            assert pos[t : t + size] == list(range(m + start, m + start + size)), (
                "a clean slot is contiguous, in order"
            )
            assert ar[t : t + size] == response[start + 1 : start + size] + [IGNORE]
            seen.append(start // s)
            t += size
        assert len(set(seen)) == len(seen)


def test_same_seed_same_batch_other_seed_other_batch():
    tokens, prompt_lens, lengths = padded(
        [([11, 12, 13], list(range(20, 90))), ([14], list(range(100, 140)))]
    )

    def make(seed):
        return refusion_batch(
            tokens, prompt_lens, lengths, MASK, generator=torch.Generator().manual_seed(seed)
        )

    a, b, c = make(5), make(5), make(6)
    for key in ("input_ids", "position_ids", "ar_labels", "mdm_labels", "mdm_weights"):
        assert torch.equal(getattr(a, key), getattr(b, key))
    assert not torch.equal(a.position_ids, c.position_ids) or not torch.equal(a.input_ids, c.input_ids)


def test_draws_follow_their_distributions():
    """Slot sizes uniform over the set, p uniform on [eps, 1], slots masked with probability
    p, and every order of the clean slots equally likely."""
    rows = 4000
    cfg = ObjectiveConfig(slot_sizes=(4, 8, 16, 32))
    tokens, prompt_lens, lengths = padded([([11, 12], list(range(20, 32)))] * rows)  # 12 tokens
    draws = draw_slots(rows, cfg.max_slots(tokens.shape[1]), cfg, torch.Generator().manual_seed(0))
    counts = torch.bincount(draws.slot_size)[[4, 8, 16, 32]].float() / rows
    assert torch.all((counts - 0.25).abs() < 0.04), counts
    assert abs(float(draws.p.mean()) - 0.5) < 0.03 and float(draws.p.min()) >= cfg.eps
    assert abs(float(draws.masked.float().mean()) - 0.5) < 0.03
    # with s = 4, the 12 tokens form 3 slots; collect the clean order when all three are clean
    draws.slot_size[:] = 4
    batch = refusion_batch(tokens, prompt_lens, lengths, MASK, cfg, draws=draws)
    all_clean = ~draws.masked[:, :3].any(dim=1)
    slot_starts = batch.position_ids[all_clean][:, 2:14:4] - 2  # (rows, 3) first position of each fed slot
    orders = [tuple(row) for row in (slot_starts // 4).tolist()]
    freq = {perm: orders.count(perm) for perm in itertools.permutations(range(3))}
    expected = len(orders) / 6
    assert len(orders) > 600 and all(abs(f - expected) < 0.3 * expected for f in freq.values()), freq


def test_ar_objective_labels_the_response_only():
    tokens, prompt_lens, lengths = padded([([11, 12, 13], [20, 21, 22]), ([14], [30, 31, 32, 33, 34])])
    batch = ar_batch(tokens, prompt_lens, lengths)
    assert batch.position_ids.tolist() == [list(range(6))] * 2
    assert torch.equal(batch.input_ids, tokens)
    assert batch.ar_labels.tolist() == [
        [IGNORE, IGNORE, 20, 21, 22, IGNORE],
        [30, 31, 32, 33, 34, IGNORE],
    ]
    assert batch.mdm_labels.eq(IGNORE).all() and batch.mdm_weights.eq(0).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_ar_mix_examples_are_the_plain_next_token_ones(seed):
    """With ar_mix 1 every example is the AR objective's, token for token; with ar_mix 0.5
    about half are, the others keep the ReFusion reorganisation."""
    examples = [
        ([11, 12, 13], list(range(20, 57))),
        ([14], list(range(100, 111))),
        ([], list(range(300, 305))),
    ]
    tokens, prompt_lens, lengths = padded(examples)
    plain = ar_batch(tokens, prompt_lens, lengths)
    cfg = ObjectiveConfig(slot_sizes=(2, 4, 8), ar_mix=1.0)
    batch = refusion_batch(tokens, prompt_lens, lengths, MASK, cfg, torch.Generator().manual_seed(seed))
    for b, (p, r) in enumerate(examples):
        n = len(p) + len(r)
        for key in ("input_ids", "position_ids", "ar_labels", "mdm_labels"):
            assert getattr(batch, key)[b, :n].tolist() == getattr(plain, key)[b, :n].tolist(), key
    draws = draw_slots(4000, 8, ObjectiveConfig(ar_mix=0.5), torch.Generator().manual_seed(seed))
    assert 0.45 < draws.plain.float().mean() < 0.55
    assert not draws.masked[draws.plain].any() and draws.masked[~draws.plain].any()


@pytest.mark.parametrize("seed", [0, 1])
def test_frontier_examples_mask_one_slot_after_a_clean_prefix(seed):
    """A frontier example is what lossless decoding drafts from: the prompt and the response
    up to the masked slot clean and in text order, that slot masked, nothing after it; the
    slot is drawn over the whole response, and the share is frontier_mix of all examples."""
    response = list(range(100, 140))  # 40 tokens: 10 slots of 4
    examples = [([11, 12], response)] * 64
    tokens, prompt_lens, lengths = padded(examples)
    cfg = ObjectiveConfig(slot_sizes=(4,), frontier_mix=1.0)
    batch = refusion_batch(tokens, prompt_lens, lengths, MASK, cfg, torch.Generator().manual_seed(seed))
    cuts = set()
    for b in range(len(examples)):
        inp, pos = batch.input_ids[b].tolist(), batch.position_ids[b].tolist()
        mdm = batch.mdm_labels[b].tolist()
        first = inp.index(MASK)
        cut = (first - 2) // 4
        cuts.add(cut)
        assert first == 2 + 4 * cut and pos[: first + 4] == list(range(first + 4)), "in text order"
        assert inp[:first] == [11, 12] + response[: 4 * cut] and inp[first : first + 4] == [MASK] * 4
        assert mdm[first : first + 4] == response[4 * cut : 4 * cut + 4]
        assert batch.mdm_weights[b, first : first + 4].tolist() == [0.25] * 4  # the slot's mean CE
        past = slice(first + 4, None)
        assert batch.mdm_labels[b, past].eq(IGNORE).all() and batch.ar_labels[b, past].eq(IGNORE).all()
        # the AR labels run across slots, up to the masked slot's first token
        assert batch.ar_labels[b, :first].tolist() == [IGNORE] + response[: 4 * cut + 1]
    assert len(cuts) >= 8, "the masked slot is drawn over the whole response"
    mixed = ObjectiveConfig(ar_mix=0.25, frontier_mix=0.5)
    draws = draw_slots(4000, 8, mixed, torch.Generator().manual_seed(seed))
    assert 0.45 < draws.frontier.float().mean() < 0.55 and 0.2 < draws.plain.float().mean() < 0.3
    assert not (draws.frontier & draws.plain).any()


def test_frontier_and_ar_shares_must_fit_in_one():
    with pytest.raises(ConfigError, match=r"frontier_mix must lie in \[0, 1 - ar_mix\] = \[0, 0.25\]"):
        ObjectiveConfig(ar_mix=0.75, frontier_mix=0.5)
    assert ObjectiveConfig(ar_mix=0.25, frontier_mix=0.75).frontier_mix == 0.75


# ------------------------------------------------------------------ the loss
@pytest.fixture(scope="module")
def tiny_model() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mask_token_id=MASK,
    )
    return Transformer(config).eval()


EXAMPLES = [
    ([11, 12, 13], list(range(20, 57))),
    ([14, 15, 16, 17, 18], list(range(100, 111))),
    ([19], list(range(200, 260))),
    ([], list(range(300, 305))),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_equals_the_spec_formula_and_the_mean_of_per_example_losses(tiny_model, seed):
    cfg = ObjectiveConfig(slot_sizes=(2, 4, 8))
    tokens, prompt_lens, lengths = padded(EXAMPLES)
    draws = draw_slots(
        len(EXAMPLES), cfg.max_slots(tokens.shape[1]), cfg, torch.Generator().manual_seed(seed)
    )
    batch = refusion_batch(tokens, prompt_lens, lengths, MASK, cfg, draws=draws)
    with torch.no_grad():
        logits = tiny_model(batch.input_ids, batch.position_ids)
        token_loss = hybrid_loss(logits, batch, "token")
        example_loss = hybrid_loss(logits, batch, "example")
        singles = []
        for b, (prompt, response) in enumerate(EXAMPLES):
            one = refusion_batch(*padded([(prompt, response)]), MASK, cfg, draws=draws[b : b + 1])
            one_logits = tiny_model(one.input_ids, one.position_ids)
            naive = naive_loss(one_logits[0], naive_example(prompt, response, draws, b))
            singles.append((hybrid_loss(one_logits, one, "example"), naive))
    B = len(EXAMPLES)
    # "example": exactly the mean of the per-example losses
    for part in ("total", "ar", "mdm"):
        want = sum(getattr(one, part) for one, _ in singles) / B
        torch.testing.assert_close(getattr(example_loss, part), want, rtol=1e-5, atol=1e-6)
    # both, against the documented formula computed by the naive loop
    ar_sums, mdms, n_ars = zip(*(naive for _, naive in singles))
    assert float(token_loss.ar) == pytest.approx(sum(ar_sums) / sum(n_ars), rel=1e-5)
    assert float(token_loss.mdm) == pytest.approx(sum(mdms) / B, rel=1e-5)
    assert float(example_loss.ar) == pytest.approx(
        sum(a / max(n, 1) for a, n in zip(ar_sums, n_ars)) / B, rel=1e-5
    )
    assert float(token_loss.total) == pytest.approx(float(token_loss.ar + token_loss.mdm), rel=1e-6)
    assert float(token_loss.ar) > 0 and float(token_loss.mdm) > 0


def test_loss_model_computes_only_the_labelled_logits(tiny_model):
    tokens, prompt_lens, lengths = padded(EXAMPLES)
    batch = refusion_batch(tokens, prompt_lens, lengths, MASK, generator=torch.Generator().manual_seed(3))
    targets = loss_targets(batch)
    with torch.no_grad():
        full = hybrid_loss(tiny_model(batch.input_ids, batch.position_ids), batch)
        selected = LossModel(tiny_model)(batch.input_ids, batch.position_ids, targets.flat_index)
        fast = weighted_loss(selected, targets)
    assert selected.shape[0] == int(((batch.ar_labels != IGNORE) | (batch.mdm_labels != IGNORE)).sum())
    assert selected.shape[0] < batch.input_ids.numel()
    torch.testing.assert_close(fast.total, full.total)


def test_bad_inputs_are_refused():
    tokens, prompt_lens, lengths = padded([([11], [20, 21])])
    with pytest.raises(ValueError, match="response of at least one token"):
        refusion_batch(tokens, prompt_lens, torch.tensor([1]), MASK)
    with pytest.raises(ValueError, match="response of at least one token"):
        refusion_batch(tokens, prompt_lens, torch.tensor([5]), MASK)
    with pytest.raises(ConfigError, match="slot sizes"):
        ObjectiveConfig(slot_sizes=(0, 4))
    with pytest.raises(ConfigError, match="eps"):
        ObjectiveConfig(eps=0.0)
    with pytest.raises(ConfigError, match="ar_reduction"):
        ObjectiveConfig(ar_reduction="mean")
    too_few = draw_slots(1, 1, ObjectiveConfig(slot_sizes=(1,)))
    with pytest.raises(ValueError, match="too few"):
        refusion_batch(tokens, prompt_lens, lengths, MASK, draws=too_few)
