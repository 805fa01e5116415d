"""Continuous batching: rows leave when done and new requests join a running batch between
steps. Each row's decisions depend only on its own logits, so every output must equal the
request decoded alone, token for token."""

import dataclasses
import json

import pytest
import torch
from golden_data import CASES, golden_config, load_tiny

from refusion.decode import DecodeConfig, Engine, EngineConfig, generate
from refusion.decode.methods import method_of
from refusion.errors import ContextLengthError
from refusion.model.sizing import cache_bytes, entry_bytes


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def run(engine: Engine, between=None) -> dict:
    """Step until done; `between(step_index)` runs before each step. Final outputs by id."""
    done, k = {}, 0
    with torch.inference_mode():
        while engine.has_unfinished():
            if between is not None:
                between(k)
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            k += 1
    return done


def test_golden_cases_through_one_place(tiny):
    """The golden cases that share a config, through one place: each row joins the
    batch (and its cache) when the one before finishes; the decodings still equal the
    authors' reference."""
    by_cfg: dict[str, list[dict]] = {}
    for c in CASES:
        by_cfg.setdefault(
            json.dumps(dataclasses.asdict(golden_config(c)), sort_keys=True, default=str), []
        ).append(c)
    groups = [cs for cs in by_cfg.values() if len(cs) >= 2]
    assert groups, "the golden set has configs shared by several prompts"
    for cs in groups:
        outs = generate(
            tiny,
            None,
            [c["prompt_ids"] for c in cs],
            golden_config(cs[0]),
            engine_config=EngineConfig(max_batch_size=1),
        )
        assert [o.token_ids for o in outs] == [c["expected_ids"] for c in cs]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_all_golden_prompts_through_two_places(tiny, k):
    """All 42 golden prompts under one golden config through 2 places (rows of different
    lengths joining a cache with rows mid-generation) equal each prompt decoded alone."""
    cfg = golden_config(CASES[k * 7])
    prompts = [c["prompt_ids"] for c in CASES]
    outs = generate(tiny, None, prompts, cfg, engine_config=EngineConfig(max_batch_size=2))
    assert [o.token_ids for o in outs] == [generate(tiny, None, [p], cfg)[0].token_ids for p in prompts]


@pytest.mark.parametrize("method", ["ar", "refusion"])
def test_requests_added_while_others_run_join_at_the_next_step(tiny, method):
    """One request starts; two more are added after its first step and one after its
    third: each joins at the next step (it is running after that step, not waiting), and
    all four equal their decodings alone; a joining row pays only for its own steps."""
    c = CASES[0]
    cfg = golden_config(c, method=method)
    first = c["prompt_ids"]
    later = [CASES[5]["prompt_ids"], CASES[9]["prompt_ids"][:7], CASES[2]["prompt_ids"] + [11, 12, 13]]
    engine = Engine(tiny, None, EngineConfig(max_batch_size=3))
    engine.add_request(first, cfg, request_id="0")
    running_after: dict[int, int] = {}

    def between(k: int) -> None:
        running_after[k] = engine.num_running
        if k == 1:
            engine.add_request(later[0], cfg, request_id="1")
            engine.add_request(later[1], cfg, request_id="2")
        if k == 3:
            engine.add_request(later[2], cfg, request_id="3")

    outs = run(engine, between)
    assert running_after[1] == 1 and running_after[2] == 3 and engine.num_waiting == 0
    alone = [generate(tiny, None, [p], cfg)[0] for p in [first] + later]
    assert [outs[str(i)].token_ids for i in range(4)] == [o.token_ids for o in alone]
    assert outs["3"].stats.nfe == alone[3].stats.nfe


def test_a_step_is_one_forward_or_one_infilling_round_and_requests_join_between_them(tiny):
    """A request that arrives waits for the step in progress: the plan, the verification
    and every infilling round are each a step of their own (two forwards at most), so
    requests join between an infilling's rounds and between a plan and its verification;
    a row aborted in the middle of its infilling commits nothing, and every other output
    equals its request decoded alone."""
    cfg = golden_config(CASES[0], method="refusion")  # the paper's rule: infills often
    prompts = [CASES[i]["prompt_ids"] for i in (0, 5, 9, 2, 7)]
    engine = Engine(tiny, None, EngineConfig(max_batch_size=4))
    engine.add_request(prompts[0], cfg, request_id="0")
    forwards, seen = [], {"mid_infill": 0, "aborted": None}
    added = iter(range(1, len(prompts)))

    def between(k: int) -> None:
        forwards.append(engine.forwards)
        if engine.infill.running:
            seen["mid_infill"] += 1
            if seen["aborted"] is None and k > 2:  # a row of the infilling in progress goes
                seen["aborted"] = engine.infill.rows[0].req.id
                assert engine.abort(seen["aborted"])
        if k % 3 == 1:
            i = next(added, None)
            if i is not None:
                engine.add_request(prompts[i], cfg, request_id=str(i))

    outs = run(engine, between)
    assert max(b - a for a, b in zip(forwards, forwards[1:])) <= 2
    assert seen["mid_infill"] > 3 and seen["aborted"] is not None
    assert outs[seen["aborted"]].finish_reason == "cancelled"
    for i, p in enumerate(prompts):
        if str(i) != seen["aborted"]:
            assert outs[str(i)].token_ids == generate(tiny, None, [p], cfg)[0].token_ids


LOSSLESS = dict(ar_correction=True, first_token_check=True, token_threshold=0.5)


SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 3}


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["ar", "refusion"])
def test_a_joining_request_streams_its_first_token_after_one_forward(tiny, method, sampling):
    """The step a request joins in is its prefill forward alone (a running ReFusion row
    waits through it, a running AR row takes a token in it), and the joining row's first
    token (a lossless row's: the AR prediction the first-token check read at its prompt's
    end) is reported after that one forward; then every output still equals its request
    decoded alone."""
    # one slot per block: lossless at any temperature
    cfg = golden_config(CASES[0], method=method, serial_blocks=8, **LOSSLESS, **sampling)
    assert cfg.lossless_now and cfg.slots_per_block == 1
    first, later = CASES[0]["prompt_ids"], CASES[5]["prompt_ids"]
    engine = Engine(tiny, None, EngineConfig(max_batch_size=2))
    engine.add_request(first, cfg, request_id="0")
    with torch.inference_mode():
        engine.step()
        engine.add_request(later, cfg, request_id="1")
        before = engine.forwards
        joined = {o.request_id: o for o in engine.step()}
    assert engine.forwards == before + 1
    assert len(joined["1"].token_ids) == 1
    assert ("0" in joined) == (method == "ar")  # an AR row takes a token in any forward; a ReFusion row waits
    done = run(engine) | {k: o for k, o in joined.items() if o.finished}
    alone = [generate(tiny, None, [p], cfg)[0] for p in (first, later)]
    assert [done[str(i)].token_ids for i in range(2)] == [o.token_ids for o in alone]
    assert joined["1"].token_ids == alone[1].token_ids[:1]


@pytest.mark.parametrize(
    "layout", [dict(serial_blocks=8), dict(serial_blocks=2, left_check=True)], ids=["one slot", "left check"]
)
def test_a_greedy_lossless_row_joining_running_rows_feeds_its_prompt_alone(tiny, layout):
    """A greedy lossless row that joins rows already running feeds its prompt alone in the
    step it joins in (no plan MASKs: a join as short as an AR row's), commits its first
    token from the prediction at the prompt's end and plans at the batch's next plan; a
    row that has not planned yet is left out of the verification. With requests added
    while the others await their verification and mid-infilling (one traced), every output
    equals its request decoded alone; the first request, alone, plans in its first forward."""
    cfg = golden_config(CASES[0], method="refusion", **LOSSLESS, **layout)
    assert cfg.lossless_now and cfg.greedy
    prompts = [CASES[i]["prompt_ids"] for i in (0, 5, 9, 2, 7, 11, 3)]
    engine = Engine(tiny, None, EngineConfig(max_batch_size=len(prompts)))
    engine.add_request(prompts[0], cfg, request_id="0")
    fed_at_join: dict[str, int] = {}
    at = dict(zip([2, 4, 5, 7, 10, 11], range(1, len(prompts))))  # step -> the request added before it
    phases = []

    def between(k: int) -> None:
        for row in engine.rows:  # rows that joined in the last step: what they fed there
            if row.req.id not in fed_at_join:
                fed_at_join[row.req.id] = row.req.stats.fed
        if k in at:
            phases.append("verify" if engine._verifying else "infill" if engine.infill.running else "plan")
            engine.add_request(prompts[at[k]], cfg, request_id=str(at[k]), trace=at[k] == 3)

    outs = run(engine, between)
    assert {"verify", "infill"} <= set(phases)
    assert fed_at_join["0"] > len(prompts[0])  # alone: its prompt and its plan's MASKs
    for i, p in enumerate(prompts):
        assert outs[str(i)].token_ids == generate(tiny, None, [p], cfg)[0].token_ids
        if i:
            assert fed_at_join[str(i)] == len(p)


def test_a_traced_request_streams_its_first_token_early_and_traces_it_once(tiny):
    """A traced lossless row reports its first token after the forward it joins in, as an
    untraced one does; its trace records that token once, when its slot commits it, and
    the trace's commits hold exactly the output."""
    cfg = golden_config(CASES[0], method="refusion", serial_blocks=8, **LOSSLESS)
    engine = Engine(tiny, None, EngineConfig(max_batch_size=1))
    engine.add_request(CASES[5]["prompt_ids"], cfg, request_id="0", trace=True)
    with torch.inference_mode():
        first = engine.step()
    assert len(first[0].token_ids) == 1 and not first[0].trace
    out = run(engine)["0"]
    assert out.token_ids[:1] == first[0].token_ids
    assert out.token_ids == generate(tiny, None, [CASES[5]["prompt_ids"]], cfg)[0].token_ids
    offsets = [s + i for e in out.trace for (s, n) in e.spans for i in range(n)]
    assert sorted(offsets) == list(range(len(offsets))) and len(offsets) >= len(out.token_ids)
    assert offsets.count(0) == 1


def test_a_lossy_row_commits_nothing_before_its_verification(tiny):
    """Settings that are not lossless (the paper's rule) keep their first token until
    verification decides it: the step a row joins in reports nothing of it."""
    cfg = golden_config(CASES[0], method="refusion", ar_correction=False, first_token_check=False)
    engine = Engine(tiny, None, EngineConfig(max_batch_size=2))
    engine.add_request(CASES[0]["prompt_ids"], cfg, request_id="0")
    with torch.inference_mode():
        engine.step()
        engine.add_request(CASES[5]["prompt_ids"], cfg, request_id="1")
        assert [o.request_id for o in engine.step()] == []


def test_abort_frees_the_row_and_the_others_go_on(tiny):
    """An aborted request leaves the batch (and its cache row) at once; the next step
    reports it cancelled with the tokens it had; the rows beside it decode as alone."""
    cfg = golden_config(CASES[0], method="ar", stop_token_ids=())
    prompts = [CASES[i]["prompt_ids"] for i in range(3)]
    engine = Engine(tiny, None, EngineConfig(max_batch_size=3))
    for i, p in enumerate(prompts):
        engine.add_request(p, cfg, request_id=str(i))
    rows = {}

    def between(k: int) -> None:
        if k == 4:
            rows["before"] = (engine.num_running, engine.cache.batch_size)
            assert engine.abort("1") and not engine.abort("1")
            rows["after"] = (engine.num_running, engine.cache.batch_size)

    outs = run(engine, between)
    assert rows == {"before": (3, 3), "after": (2, 2)}
    assert outs["1"].finish_reason == "cancelled" and len(outs["1"].token_ids) == 4
    alone = [generate(tiny, None, [p], cfg)[0].token_ids for p in prompts]
    assert outs["1"].token_ids == alone[1][:4]
    assert [outs["0"].token_ids, outs["2"].token_ids] == [alone[0], alone[2]]
    assert not engine.abort("0")  # finished: nothing to abort


def test_many_prompts_through_few_places_keep_their_order(tiny):
    """More prompts than places: outputs come back in the order given, each as alone."""
    cfg = DecodeConfig(method="ar", gen_length=12, stop_token_ids=(CASES[0]["eos_id"],))
    two = EngineConfig(max_batch_size=2)
    prompts = [c["prompt_ids"][: 3 + i] for i, c in enumerate(CASES[:5])]
    outs = generate(tiny, None, prompts, cfg, engine_config=two)
    assert [o.token_ids for o in outs] == [generate(tiny, None, [p], cfg)[0].token_ids for p in prompts]


def test_prepare_raises_what_add_request_would(tiny):
    cfg = golden_config(CASES[0])
    engine = Engine(tiny)
    engine.prepare(CASES[0]["prompt_ids"], cfg)
    too_long = [1] * tiny.config.max_position_embeddings
    with pytest.raises(ContextLengthError):
        engine.prepare(too_long, cfg)
    with pytest.raises(ContextLengthError):
        engine.add_request(too_long, cfg)
    with pytest.raises(ContextLengthError):
        generate(tiny, None, [too_long], cfg)
    assert not engine.has_unfinished()


def budget_for(tiny, cfg: DecodeConfig, rows: int, longest: int) -> float:
    """The memory budget (GiB) that holds `rows` requests of cfg with prompts up to
    `longest` joining a running batch, by the engine's sizing rule."""
    needs = [method_of(cfg).cache_need(cfg, longest)] * rows
    return cache_bytes(needs, entry_bytes(tiny.config, tiny.dtype), joining=True) / 2**30


def test_the_memory_budget_bounds_the_batch_and_a_long_prompt_is_not_overtaken(tiny):
    """A budget that holds 2 rows of 20-token prompts: two 10-token requests run, the next
    waits; a 40-token prompt waits at the head until the batch has drained enough, and the
    short request queued behind it does not overtake it. Outputs equal alone."""
    cfg = golden_config(CASES[0])
    engine = Engine(tiny, None, EngineConfig(max_batch_size=4, memory_budget_gb=budget_for(tiny, cfg, 2, 20)))
    short = [CASES[i]["prompt_ids"][:10] for i in range(3)]
    long_ = (CASES[3]["prompt_ids"] * 4)[:40]
    for i, p in enumerate([short[0], short[1], long_, short[2]]):
        engine.add_request(p, cfg, request_id=str(i))
    started: list[str] = []
    running: list[int] = []

    def between(_k: int) -> None:
        running.append(engine.num_running)
        for r in engine.requests.values():
            if r.started and r.id not in started:
                started.append(r.id)

    outs = run(engine, between)
    assert max(running) == 2 and started.index("2") < started.index("3")
    prompts = [short[0], short[1], long_, short[2]]
    assert [outs[str(i)].token_ids for i in range(4)] == [
        generate(tiny, None, [p], cfg)[0].token_ids for p in prompts
    ]


@pytest.mark.parametrize("method", ["ar", "refusion"])
def test_cache_storage_is_reserved_for_the_rows_that_can_be_in_flight(tiny, method, monkeypatch):
    """The cache reserves rows for the requests that can be in flight (running and waiting,
    up to max_batch_size), not for max_batch_size: rows that join later take spare
    storage instead of reallocating the cache."""
    cfg = golden_config(CASES[0], method=method)
    reserved: list[int] = []
    new_cache = tiny.new_cache
    monkeypatch.setattr(
        tiny, "new_cache", lambda b, cap, reserve=0: reserved.append(reserve) or new_cache(b, cap, reserve)
    )
    generate(
        tiny, None, [c["prompt_ids"] for c in CASES[:3]], cfg, engine_config=EngineConfig(max_batch_size=8)
    )
    generate(
        tiny, None, [c["prompt_ids"] for c in CASES[:12]], cfg, engine_config=EngineConfig(max_batch_size=8)
    )
    assert reserved == [3, 8]


def test_stats_count_the_tokens_fed_and_the_logits_asked_for(tiny):
    """AR feeds the prompt, then every generated token but the last, and asks for one
    row of logits per token: the counts `bench decode` turns into GFLOP/s."""
    c = CASES[0]
    out = generate(tiny, None, [c["prompt_ids"]], golden_config(c, method="ar"))[0]
    n = len(out.token_ids)
    assert out.stats.fed == len(c["prompt_ids"]) + n - 1 and out.stats.logit_rows == n
