"""Draft widths that follow the batch (docs/algorithm.md#adaptive-widths).

For the settings whose greedy output cannot depend on draft widths (one slot per block,
ar_correction, first_token_check, token threshold >= 0.5), the engine picks each step a
plan width, an infilling window or a block decoded as AR decoding does. Whatever it picks,
the output must be the fixed engine's token for token, alone and in mixed batches with
late joins and aborts, and the KV cache must equal a direct computation. Rows of other
settings must decode exactly as before. The choice itself must follow the measured cost:
wide drafts where a forward's fixed cost dominates, AR blocks where every fed token costs.
"""

import random

import pytest
import torch
from golden_data import CASES, load_tiny

import refusion
import refusion.decode.width_policy as engine_module
import refusion.decode.widths as widths_module
from refusion.decode import DecodeConfig, Engine, EngineConfig, generate
from refusion.decode.refusion import ReFusionRow
from refusion.decode.widths import (
    Acceptance,
    BlockRecord,
    Drafting,
    ForwardCost,
    Probe,
    StepOverhead,
    Survival,
    block_rate,
    choose,
    equals_greedy_ar,
    lone_drafts,
    nonnegative_least_squares,
    widths_keep_output,
)

LOSSLESS = dict(ar_correction=True, first_token_check=True, token_threshold=0.5, slot_threshold=0.7)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def bundled():
    return refusion.load("bundled:refusion-tiny")


def random_widths(monkeypatch, seed: int) -> list[tuple[int, int]]:
    """Replace the engine's choice by a seeded random one among AR blocks, narrow and wide
    drafts; returns the list of choices made."""
    rng, made = random.Random(seed), []

    def pick(rows, other_rows, other_fed, slot, window, acceptance, cost, **_):
        p = rng.choice([0, 1, 2, slot // 2, slot])
        w = rng.choice([0, 1, max(window // 2, 1), window])
        made.append((p, w))
        return p, w

    monkeypatch.setattr(engine_module, "choose", pick)
    return made


def drain(engine: Engine, joins: dict[int, list] | None = None, abort_at: dict[int, str] | None = None):
    """Step until done; `joins[k]` (prompt, cfg, id) join before step k, `abort_at[k]` is aborted then."""
    done, k = {}, 0
    joins, abort_at = joins or {}, abort_at or {}
    with torch.inference_mode():
        while engine.has_unfinished() or any(j >= k for j in joins):
            for prompt, cfg, rid in joins.get(k, []):
                engine.add_request(prompt, cfg, request_id=rid)
            if k in abort_at:
                engine.abort(abort_at[k])
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            k += 1
    return done


class RecomputingEngine(Engine):
    """After every step, each row's cached entries equal the same tokens at the same
    positions fed to an empty cache, and they are the prompt then the committed tokens."""

    checks = 0

    def _step_cached(self):
        drafted = super()._step_cached()
        for b, row in enumerate(self.rows):
            n = self.cache.lengths[b]
            toks, pos = self.cache.tokens[b, :n], self.cache.positions[b, :n]
            P = len(row.req.prompt)
            assert toks[:P].tolist() == list(row.req.prompt) and pos.tolist() == list(range(n))
            assert toks[P:].tolist() == row.req.filled[: n - P]
            ref = self.model.new_cache(1, n)
            self.model.cached_hidden(toks[None], pos[None], ref)
            for layer in range(len(self.cache.k)):
                torch.testing.assert_close(
                    self.cache.k[layer][b, :, :n], ref.k[layer][0, :, :n], rtol=1e-4, atol=1e-5
                )
                torch.testing.assert_close(
                    self.cache.v[layer][b, :, :n], ref.v[layer][0, :, :n], rtol=1e-4, atol=1e-5
                )
            RecomputingEngine.checks += 1
        return drafted


def lossless(c: dict, s: int = 4, blocks: int = 6) -> DecodeConfig:
    return DecodeConfig(
        gen_length=s * blocks, slot_size=s, serial_blocks=blocks, stop_token_ids=(c["eos_id"],), **LOSSLESS
    )


# ---------------------------------------------------------------------- outputs do not change
def test_the_shipped_settings_are_the_ones_whose_output_cannot_change(bundled):
    model, _ = bundled
    from refusion.settings.recommended import recommended_of

    shipped = recommended_of(model).decode_config()
    assert widths_keep_output(shipped)
    # sampled, the widths keep the distribution; a seeded request keeps its widths so that it
    # draws the same tokens alone or in any batch
    assert widths_keep_output(shipped.replace(temperature=0.7))
    for change in [
        dict(temperature=0.7, seed=1),
        dict(ar_correction=False),
        dict(first_token_check=False),
        dict(token_threshold=0.4),
        dict(serial_blocks=1),  # four slots per block
        dict(method="ar"),
    ]:
        assert not widths_keep_output(shipped.replace(**change)), change
    # several slots per block with the left check also decode greedy AR whichever drafts they
    # verify (the lossless first infilling round takes them), but their widths stay fixed
    two_slots = shipped.replace(serial_blocks=2, slot_size=32, left_check=True)
    assert equals_greedy_ar(two_slots) and not widths_keep_output(two_slots)
    assert not equals_greedy_ar(two_slots.replace(left_check=False))
    assert not equals_greedy_ar(two_slots.replace(token_threshold=0.4))


@pytest.mark.parametrize("seed", range(3))
def test_any_widths_decode_the_fixed_engines_tokens_with_a_cache_equal_to_recompute(tiny, monkeypatch, seed):
    made = random_widths(monkeypatch, seed)
    RecomputingEngine.checks = 0
    for c in CASES[:8]:
        cfg = lossless(c, s=[2, 4, 8][seed])
        fixed = generate(
            tiny, None, [c["prompt_ids"]], cfg, engine_config=EngineConfig(adaptive_drafts=False)
        )
        engine = RecomputingEngine(tiny)
        engine.add_request(c["prompt_ids"], cfg, request_id="x")
        assert drain(engine)["x"].token_ids == fixed[0].token_ids
    assert RecomputingEngine.checks > 20
    assert {p for p, _ in made} >= {0, 1} and {w for _, w in made} >= {0}  # AR blocks, narrow plans, window 0


def test_mixed_batch_with_late_joins_and_aborts_equals_the_fixed_engine(bundled, monkeypatch):
    """Shipped-settings rows beside AR rows, paper-rule rows and MDM rows; some join late,
    one is aborted: every other row decodes what the fixed engine decodes alone."""
    model, tok = bundled
    random_widths(monkeypatch, 7)
    from refusion.settings.recommended import recommended_of
    from refusion.tasks import load_test_items

    shipped = recommended_of(model).decode_config()
    prompts = [it.prompt for it in load_test_items()[:9]]
    cfgs = [
        shipped,
        shipped.replace(method="ar"),
        shipped.replace(serial_blocks=1, ar_correction=False, first_token_check=False, infill_window=None),
        shipped,
        shipped.replace(method="mdm", mdm_block_length=32),
        shipped.replace(gen_length=64),
        shipped,
        shipped.replace(slot_size=16, serial_blocks=8),
        shipped,
    ]
    alone = {}
    for i, (p, cfg) in enumerate(zip(prompts, cfgs)):
        solo = Engine(model, tok, EngineConfig(adaptive_drafts=False))
        solo.add_request(p, cfg, request_id=str(i))
        alone[str(i)] = drain(solo)[str(i)].token_ids
    engine = Engine(model, tok, EngineConfig(max_batch_size=6))
    for i in range(4):
        engine.add_request(prompts[i], cfgs[i], request_id=str(i))
    joins: dict[int, list] = {}
    for k, i in [(1, 4), (2, 5), (2, 6), (4, 7), (5, 8)]:
        joins.setdefault(k, []).append((prompts[i], cfgs[i], str(i)))
    aborted = max("0123", key=lambda rid: len(alone[rid]))  # the longest of the first four: still running
    done = drain(engine, joins, abort_at={1: aborted})
    assert done[aborted].finish_reason == "cancelled"
    for rid, ids in alone.items():
        if rid != aborted:
            assert done[rid].token_ids == ids, rid


def test_the_measured_policy_at_batch_sizes_keeps_the_output(bundled):
    """The engine's own choice (no forcing), alone and in a batch of 16, on the bundled model."""
    model, tok = bundled
    from refusion.settings.recommended import recommended_of
    from refusion.tasks import load_test_items

    cfg = recommended_of(model).decode_config()
    prompts = [it.prompt for it in load_test_items()[:16]]
    fixed = generate(
        model, tok, prompts, cfg, engine_config=EngineConfig(adaptive_drafts=False, max_batch_size=16)
    )
    for b in (1, 16):
        got = generate(model, tok, prompts, cfg, engine_config=EngineConfig(max_batch_size=b))
        assert [o.token_ids for o in got] == [o.token_ids for o in fixed]


def test_rows_of_other_settings_ignore_the_switch(tiny):
    """The paper's rule (the golden settings) decodes the same tokens with the same NFE
    with the switch on and off: its widths are its own."""
    from golden_data import golden_config

    for c in CASES[:6]:
        cfg = golden_config(c)
        on = generate(tiny, None, [c["prompt_ids"]], cfg)[0]
        off = generate(tiny, None, [c["prompt_ids"]], cfg, engine_config=EngineConfig(adaptive_drafts=False))[
            0
        ]
        assert on.token_ids == off.token_ids == c["expected_ids"]
        assert on.stats.nfe == off.stats.nfe and on.stats.fed == off.stats.fed


# ---------------------------------------------------------------------- the choice
def test_least_squares_recovers_a_known_cost():
    shapes = [(n, r, ctx) for n in (1, 8, 64, 300) for r in (1, 4, 16) for ctx in (16, 128)]
    x = [(1.0, float(n), float(r), float(n * ctx)) for n, r, ctx in shapes]
    y = [0.002 + 0.0001 * n + 0.0003 * r + 1e-6 * nc for _, n, r, nc in x]
    a, b, c, d = nonnegative_least_squares(x, y)
    assert a == pytest.approx(0.002, rel=1e-6) and b == pytest.approx(1e-4, rel=1e-6)
    assert c == pytest.approx(3e-4, rel=1e-6) and d == pytest.approx(1e-6, rel=1e-6)
    # a cost that falls with rows cannot be fitted with c < 0: c drops to 0
    y = [0.002 + 0.0001 * n - 0.00001 * r for _, n, r, _ in x]
    assert nonnegative_least_squares(x, y)[2] == 0.0


def test_survival_counts_runs_per_distance():
    s = Survival(decay=1.0)
    for _ in range(200):
        s.add(passed=2, verified=4)  # drafts 0 and 1 pass, 2 fails, 3 is never reached
    passed, whole = s.expected(4)
    assert 1.9 < passed < 2.1 and whole < 0.01
    assert s.expected(2)[1] > 0.98  # the first two nearly always pass


def test_choice_follows_the_cost_of_a_forward():
    """Fixed cost per forward dominating: wide drafts; cost per token dominating: AR blocks;
    and the rate the choice promises is the best of all candidates."""
    acc = Acceptance()
    for _ in range(100):
        acc.plan.add(6, 31)
        acc.infill.add(5, 12)
    fixed_heavy = lambda n, r: 0.01 + 1e-6 * n  # noqa: E731
    token_heavy = lambda n, r: 1e-4 + 1e-4 * n  # noqa: E731
    p, w = choose(1, 0, 0, 32, 12, acc, fixed_heavy)
    assert p >= 16 and w >= 6
    assert choose(64, 0, 0, 32, 12, acc, token_heavy) == (0, 0)
    p, w = choose(8, 0, 0, 32, 12, acc, fixed_heavy)
    best = block_rate(8, 0, 0, 32, p, w, acc, fixed_heavy)
    assert all(
        best >= block_rate(8, 0, 0, 32, q, v, acc, fixed_heavy) for q in (1, 4, 32) for v in (0, 3, 12)
    )


def drafts_that_fail() -> Acceptance:
    """Acceptance as other requests left it: drafts that hardly ever pass."""
    acc = Acceptance()
    for _ in range(100):
        acc.plan.add(0, 31)
        acc.infill.add(0, 12)
    return acc


def test_a_row_alone_keeps_its_settings_widths_whatever_the_estimate():
    """Alone in the batch, a row drafts at its settings' widths even where the estimate
    (pooled acceptance, a cost per token) would narrow it; with a second row the estimate
    decides again."""
    token_heavy = lambda n, r: 1e-4 + 1e-4 * n  # noqa: E731
    assert choose(1, 0, 0, 32, 12, drafts_that_fail(), token_heavy) == (32, 12)
    assert choose(1, 1, 1, 32, 12, drafts_that_fail(), token_heavy) != (32, 12)
    assert choose(2, 0, 0, 32, 12, drafts_that_fail(), token_heavy) != (32, 12)


def test_a_lone_request_takes_the_fixed_widths_forwards_after_a_load(bundled, monkeypatch):
    """With the pooled measurements a load of other requests can leave (drafts that fail, a
    fit that prices forwards per token), one request alone decodes in the forwards of fixed
    widths: it is priced from its own blocks and from one-row forwards, which cost about
    the same at any width here."""
    from refusion.decode.widths import drafting_of
    from refusion.settings.recommended import recommended_of
    from refusion.tasks import load_test_items

    model, tok = bundled
    cost = ForwardCost()
    cost.coef, cost.when = (1e-4, 1e-4, 0.0, 0.0), float("inf")  # priced per token, never stale
    cost.fastest = {(1, 1, 16): 1e-3, (1, 8, 16): 1.02e-3, (1, 32, 16): 1.1e-3, (16, 16, 16): 3e-2}
    monkeypatch.setattr(drafting_of(model), "cost", cost)
    monkeypatch.setattr(drafting_of(model), "acceptance", drafts_that_fail())
    monkeypatch.setattr(drafting_of(model), "lone", BlockRecord())
    cfg = recommended_of(model).decode_config()
    prompt = load_test_items()[0].prompt
    alone = generate(model, tok, [prompt], cfg)[0]
    fixed = generate(model, tok, [prompt], cfg, engine_config=EngineConfig(adaptive_drafts=False))[0]
    assert alone.token_ids == fixed.token_ids and alone.stats.nfe == fixed.stats.nfe
    assert alone.stats.ar_blocks == 0 and alone.stats.draft_steps > 0
    two = generate(model, tok, [prompt, prompt], cfg, engine_config=EngineConfig(max_batch_size=2))
    assert two[0].stats.nfe > fixed.stats.nfe  # in a batch, the same estimate narrows them


def test_one_rows_forward_is_priced_from_one_row_shapes():
    """A forward of one row is read off the one-row shapes' fastest times (linear between
    them, along the last segment past the widest), not off the line fitted over every
    shape; until two such shapes are timed, the line."""
    cost = ForwardCost()
    cost.coef = (1e-4, 1e-4, 0.0, 1e-7)
    assert cost.alone(8) == pytest.approx(cost(8, 1))
    cost.fastest = {(1, 1, 16): 1.0e-3, (1, 8, 16): 1.07e-3, (1, 32, 16): 1.31e-3, (32, 16, 16): 9e-2}
    assert cost.alone(1) == pytest.approx(1.0e-3)
    assert cost.alone(4) == pytest.approx(1.03e-3)
    assert cost.alone(20) == pytest.approx(1.19e-3)
    assert cost.alone(56) == pytest.approx(1.55e-3)
    assert cost.alone(8, context=116) == pytest.approx(1.07e-3 + 1e-7 * 8 * 100)
    # the line prices one row's 32 tokens 16 times one token, as a compute-bound batch's
    assert cost.alone(32) / cost.alone(1) < 1.5 < 10 < cost(32, 1) / cost(1, 1)


def test_a_costly_step_keeps_drafting_where_forwards_alone_would_not():
    """Where a step's own work (bookkeeping, a server's streaming) is costly, AR blocks,
    which take a step per two tokens, lose to drafting, which takes one step a block."""
    acc = Acceptance()
    for _ in range(100):
        acc.plan.add(6, 31)
        acc.infill.add(5, 12)
    token_heavy = lambda n, r: 1e-4 + 1e-4 * n  # noqa: E731
    assert choose(16, 0, 0, 32, 12, acc, token_heavy) == (0, 0)
    assert choose(16, 0, 0, 32, 12, acc, token_heavy, overheads=(0.16, 0.16)) != (0, 0)
    assert choose(16, 0, 0, 32, 12, acc, token_heavy, overheads=(0.16, 0.0)) == (0, 0)  # drafting's own


def test_step_overhead_is_fitted_per_step_and_per_row():
    """A step's own time is part fixed, part per row: fitted over the medians at each batch
    size, so that steps held up by a neighbour move it little, and steps measured at one
    batch size alone price a step, not a row."""
    overhead = StepOverhead()
    for seconds in (0.002, 0.002, 0.5, 0.002, 0.002, 0.002, 0.002):  # one row, one slow outlier
        overhead.add(1, seconds)
    assert overhead.seconds(1) == 0.0  # fewer than 8 steps: not trusted yet
    overhead.add(1, 0.002)
    assert overhead.seconds(1) == pytest.approx(0.002)
    assert overhead.seconds(32) == pytest.approx(0.002)  # one batch size seen: a cost per step
    for _ in range(8):
        overhead.add(32, 0.002 + 31 * 0.0001)
    assert overhead.seconds(1) == pytest.approx(0.002) and overhead.seconds(16) == pytest.approx(0.0035)


def test_forward_cost_calibrates_on_the_real_forward_and_keeps_the_fastest(tiny):
    engine = Engine(tiny, None, EngineConfig(max_batch_size=4))
    cost = ForwardCost()
    assert cost.stale() and not cost.calibrated
    cost.calibrate(engine.fwd.time_shapes, 4)
    assert len(cost.fastest) == 9 and all(t > 0 for t in cost.fastest.values()) and not cost.stale()
    assert cost(1, 1) > 0 and cost(512, 4) >= cost(1, 1) and cost(512, 4, context=128) >= cost(512, 4)
    slow = lambda shapes, repeats=5: [10.0 for _ in shapes]  # noqa: E731 - a machine gone busy
    before, coef = dict(cost.fastest), cost.coef
    cost.when -= cost.every + 1  # five minutes later: timed again, one shape a call, once each
    timed = []
    while cost.stale():
        cost.calibrate(lambda shapes, repeats: timed.append((shapes, repeats)) or slow(shapes), 4)
    assert sorted(s for shapes, _ in timed for s in shapes) == sorted(before)
    assert all(len(shapes) == 1 and repeats == 1 for shapes, repeats in timed)
    assert cost.fastest == before and cost.coef == coef  # a slower timing never replaces a faster one
    assert cost.every == 600 and not cost.stale()  # the next round after twice as long


def test_stats_count_widths_and_shares_add_up(bundled):
    """The request stats say how it drafted, and the forward shares of a batch add up to
    no more than its wall time (the bench's overhead is never negative)."""
    model, tok = bundled
    import time

    from refusion.settings.recommended import recommended_of
    from refusion.tasks import load_test_items

    cfg = recommended_of(model).decode_config()
    prompts = [it.prompt for it in load_test_items()[:4]]
    t0 = time.perf_counter()
    outs = generate(model, tok, prompts, cfg, engine_config=EngineConfig(max_batch_size=4))
    wall = time.perf_counter() - t0
    assert sum(o.stats.forward_share for o in outs) <= wall
    assert sum(o.stats.forward_time for o in outs) > sum(o.stats.forward_share for o in outs)
    for o in outs:
        assert o.stats.draft_steps + o.stats.ar_blocks >= 1
        assert o.stats.plan_width_sum <= 32 * o.stats.draft_steps


def test_a_row_in_an_ar_block_is_a_refusion_row(tiny, monkeypatch):
    """An AR block commits through the request with the path 'ar' and leaves no infilling."""
    monkeypatch.setattr(engine_module, "choose", lambda *a, **k: (0, 0))
    c = CASES[0]
    engine = Engine(tiny)
    engine.add_request(c["prompt_ids"], lossless(c), request_id="x", trace=True)
    with torch.inference_mode():
        engine.step()
    row = engine.rows[0]
    assert isinstance(row, ReFusionRow) and row.to_infill is None
    assert row.req.stats.ar_blocks == 1 and row.req.stats.draft_steps == 0


def test_rows_inside_an_ar_block_are_priced_as_riders_not_choosers(tiny, monkeypatch):
    """A row inside an AR block runs to the block's end whatever the others choose: the
    choice is asked only of the rows at a block's start, and the AR-block rows are among
    the rows that ride along, feeding one token each (they wait through any infilling)."""
    asked = []

    def record(
        rows, other_rows, other_fed, slot, window, acceptance, cost, overheads=(0.0, 0.0), alone_drafts=True
    ):
        asked.append((rows, other_rows, other_fed))
        return (0, 0) if not asked[1:] else (slot, window)  # the first row's block is AR

    monkeypatch.setattr(engine_module, "choose", record)
    c = CASES[0]
    engine = Engine(tiny)
    engine.add_request(c["prompt_ids"], lossless(c, s=8, blocks=3), request_id="a")
    with torch.inference_mode():
        engine.step()  # "a" starts an AR block of 8 tokens: two a step
        assert engine.rows[0].ar_block
        engine.add_request(c["prompt_ids"], lossless(c, s=8, blocks=3), request_id="b")
        engine.step()  # "b" joins and chooses alone; "a" rides along, one token a forward
    assert asked == [(1, 0, 0), (1, 1, 1)]
    assert engine.rows[0].ar_block and not engine.rows[1].ar_block


def test_infilling_verifies_the_plans_own_drafts_first_and_saves_forwards(bundled, monkeypatch):
    """A lossless row's fork verifies the plan's drafts past its accepted prefix before it
    drafts afresh: the same tokens (those of greedy AR decoding), in fewer forwards; with
    the first round drafting as before, more forwards. Alone and in a batch."""
    from refusion.decode.refusion import infill
    from refusion.tasks import load_test_items

    model, tok = bundled
    cfg = DecodeConfig(gen_length=128, slot_size=32, serial_blocks=4, infill_window=12, **LOSSLESS)
    prompts = [it.prompt for it in load_test_items()[:12]]
    ar = [o.token_ids for o in generate(model, tok, prompts, cfg.replace(method="ar"))]

    def decode(b: int) -> tuple[list, int]:
        outs = generate(
            model, tok, prompts, cfg, engine_config=EngineConfig(max_batch_size=b, adaptive_drafts=False)
        )
        return [o.token_ids for o in outs], sum(o.stats.nfe for o in outs)

    with_first = {b: decode(b) for b in (1, 4)}
    monkeypatch.setattr(infill, "plan_drafts_first", lambda f: False)
    without = {b: decode(b) for b in (1, 4)}
    for b in (1, 4):
        assert with_first[b][0] == without[b][0] == ar
        assert with_first[b][1] < without[b][1]


def test_a_lone_row_whose_drafts_fail_decodes_its_later_blocks_as_ar(tiny, monkeypatch):
    """On a model whose drafts hardly pass (the golden tiny model: drafting at fixed widths
    takes about two forwards a token), a lone lossless row drafts its first block, measures
    it slower than AR blocks would be and decodes its later blocks as AR decoding does: the
    same tokens, in at most its first block's extra forwards more than AR's. The next
    request alone on that model starts from the model's lone record: AR blocks throughout,
    AR decoding's forwards exactly."""
    monkeypatch.setitem(widths_module._DRAFTING, tiny, Drafting())  # nothing measured yet
    cfg = DecodeConfig(
        slot_size=16,
        serial_blocks=4,
        gen_length=64,
        ar_correction=True,
        first_token_check=True,
        token_threshold=0.5,
        infill_window=8,
        stop_token_ids=(),
    )
    adaptive = generate(tiny, None, [[5, 6, 7, 8]], cfg)[0]
    fixed = generate(tiny, None, [[5, 6, 7, 8]], cfg, engine_config=EngineConfig(adaptive_drafts=False))[0]
    ar = generate(tiny, None, [[5, 6, 7, 8]], cfg.replace(method="ar"))[0]
    assert adaptive.token_ids == fixed.token_ids == ar.token_ids
    assert fixed.stats.nfe > 1.5 * ar.stats.nfe and adaptive.stats.ar_blocks == 3
    assert adaptive.stats.nfe <= ar.stats.nfe + 16 // 2  # the first block's cost: under 1.5 forwards a token
    after = generate(tiny, None, [[9, 10, 11]], cfg)[0]
    assert after.stats.ar_blocks == 4 and after.stats.draft_steps == 0
    assert after.token_ids == generate(tiny, None, [[9, 10, 11]], cfg.replace(method="ar"))[0].token_ids
    assert after.stats.nfe == 64


def test_a_lone_row_probes_a_losing_record_at_doubling_intervals():
    """A record of drafting that loses keeps AR blocks, but drafts a block after 8 of
    them, then after 16, 32: acceptance can change along a generation, and probes that
    keep failing cost ever less. A winning block starts the intervals again; no record yet
    drafts."""
    losing, winning = BlockRecord(), BlockRecord()
    losing.add(10, 2.0)  # 5 tokens a second
    winning.add(30, 2.0)
    assert lone_drafts(BlockRecord(), Probe(), ar_rate=10.0)
    probe = Probe()
    drafted = [i for i in range(60) if lone_drafts(losing, probe, ar_rate=10.0)]
    assert drafted == [8, 25, 58]
    assert lone_drafts(winning, probe, ar_rate=10.0) and probe.every == 8
    assert [lone_drafts(losing, probe, ar_rate=10.0) for _ in range(9)] == [False] * 8 + [True]
    decayed = BlockRecord(decay=0.5)
    decayed.add(10, 1.0)
    decayed.add(40, 1.0)  # the latest block counts twice the one before
    assert decayed.rate() == pytest.approx((10 * 0.5 + 40) / 1.5)
