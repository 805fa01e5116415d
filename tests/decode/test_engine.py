"""The engine: requests with different settings in one batch share its forwards and each
decodes exactly what it decodes alone."""

import pytest
import torch
from golden_data import CASES, load_tiny

from refusion.decode import DecodeConfig, Engine, EngineConfig, generate
from refusion.errors import ConfigError, MissingMaskTokenError

EOS = 298

# 8 requests, 8 settings: ar and refusion; thresholds, slot sizes, serial blocks and
# lengths all differ; two sample with seeds (one ar, one refusion)
MIXED = [
    DecodeConfig(method="ar", gen_length=40),
    DecodeConfig(
        method="refusion",
        gen_length=64,
        slot_size=8,
        serial_blocks=2,
        slot_threshold=0.5,
        token_threshold=0.2,
    ),
    DecodeConfig(
        method="refusion",
        gen_length=48,
        slot_size=4,
        serial_blocks=3,
        slot_threshold=0.7,
        token_threshold=0.3,
    ),
    DecodeConfig(method="ar", gen_length=24, temperature=1.0, top_k=20, seed=3),
    DecodeConfig(
        method="refusion",
        gen_length=32,
        slot_size=16,
        serial_blocks=1,
        slot_threshold=0.9,
        token_threshold=0.1,
    ),
    DecodeConfig(
        method="refusion",
        gen_length=40,
        slot_size=4,
        serial_blocks=5,
        slot_threshold=0.6,
        token_threshold=0.4,
        temperature=0.8,
        top_p=0.9,
        seed=11,
    ),
    DecodeConfig(
        method="refusion",
        gen_length=64,
        slot_size=8,
        serial_blocks=4,
        slot_threshold=0.3,
        token_threshold=0.5,
    ),
    DecodeConfig(method="ar", gen_length=56, stop_token_ids=(250,)),
]


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def drain(engine: Engine) -> dict:
    done = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def test_mixed_settings_share_forwards_and_decode_as_alone(tiny):
    assert len({repr(c) for c in MIXED}) == 8 and sum(c.temperature > 0 for c in MIXED) == 2
    prompts = [c["prompt_ids"] for c in CASES[:8]]
    alone = []
    for p, cfg in zip(prompts, MIXED):
        solo = Engine(tiny)
        solo.add_request(p, cfg, request_id="x")
        alone.append((drain(solo)["x"], solo.forwards))
    engine = Engine(tiny)
    ids = [engine.add_request(p, cfg) for p, cfg in zip(prompts, MIXED)]
    outs = drain(engine)
    for rid, (solo, _), cfg in zip(ids, alone, MIXED):
        assert outs[rid].token_ids == solo.token_ids, cfg
        assert outs[rid].stats.nfe == solo.stats.nfe  # a row counts only the forwards it took part in
    assert all(len(o.token_ids) > 4 for o, _ in alone)
    assert engine.forwards <= sum(f for _, f in alone) / 2


def test_sampled_requests_are_reproducible_and_seed_dependent(tiny):
    """A seeded request samples the same tokens alone, in a mixed batch, and again; another
    seed gives other tokens (so the equality above is not greedy by accident)."""
    hot = DecodeConfig(method="refusion", gen_length=32, slot_size=4, temperature=3.0, seed=1)
    p = CASES[0]["prompt_ids"]
    runs = [generate(tiny, None, [p], hot.replace(seed=s))[0].token_ids for s in (1, 2, 3)]
    assert len({tuple(r) for r in runs}) > 1
    batched = generate(tiny, None, [p, CASES[1]["prompt_ids"]], [hot, MIXED[0]])
    assert batched[0].token_ids == runs[0]


def test_outputs_stream_the_final_prefix_and_text(tiny, tiny_tokenizer):
    """Each step reports the requests whose final prefix grew: the prefix only grows, the
    deltas add up to the text, and the last output is finished."""
    engine = Engine(tiny, tiny_tokenizer)
    engine.add_request(
        [5, 6, 7],
        DecodeConfig(gen_length=32, slot_size=4, slot_threshold=0.5, token_threshold=0.2),
        request_id="a",
    )
    seen = []
    with torch.inference_mode():
        while engine.has_unfinished():
            seen += engine.step()
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    for a, b in zip(seen, seen[1:]):
        assert (
            b.token_ids[: len(a.token_ids)] == a.token_ids
            and len(b.token_ids) > len(a.token_ids)
            or b.finished
        )
    assert "".join(o.delta for o in seen) == seen[-1].text


def test_a_request_not_streamed_is_reported_once_when_finished(tiny, tiny_tokenizer):
    """stream=False: no output until the end, then one with all the text as its delta, the
    same text and tokens as the streamed request."""
    cfg = DecodeConfig(method="ar", gen_length=16, stop_token_ids=())
    engine = Engine(tiny, tiny_tokenizer)
    engine.add_request([5, 6, 7], cfg, request_id="live")
    engine.add_request([5, 6, 7], cfg, request_id="quiet", stream=False)
    seen: dict[str, list] = {"live": [], "quiet": []}
    with torch.inference_mode():
        while engine.has_unfinished():
            for o in engine.step():
                seen[o.request_id].append(o)
    (quiet,) = seen["quiet"]
    live = seen["live"][-1]
    assert len(seen["live"]) > 1 and quiet.finished and quiet.delta == quiet.text == live.text
    assert quiet.token_ids == live.token_ids and quiet.text


def test_gen_length_cuts_the_output_and_stops_the_row(tiny):
    """gen_length 10 with slots of 8: the region is 16 positions, the output 10 tokens,
    and the row stops as soon as its first 10 tokens are final."""
    cfg = DecodeConfig(gen_length=10, slot_size=8, stop_token_ids=())
    out = generate(tiny, None, [[5, 6, 7]], cfg)[0]
    full = generate(tiny, None, [[5, 6, 7]], cfg.replace(gen_length=16))[0]
    assert len(out.token_ids) == 10 and out.token_ids == full.token_ids[:10] and out.finish_reason == "length"
    assert out.stats.nfe <= full.stats.nfe


def test_stop_strings_end_the_request(tiny, tiny_tokenizer):
    """A stop string ends the text before it, with finish_reason stop, and frees the row."""
    cfg = DecodeConfig(method="ar", gen_length=40, stop_token_ids=())
    full = generate(tiny, tiny_tokenizer, [[5, 6, 7]], cfg)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = generate(tiny, tiny_tokenizer, [[5, 6, 7]], cfg.replace(stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    assert cut.stats.nfe < full.stats.nfe


def test_bad_requests_raise_before_anything_is_queued(tiny):
    engine = Engine(tiny)
    with pytest.raises(ConfigError, match="empty"):
        engine.add_request([], DecodeConfig())
    with pytest.raises(ConfigError, match="token ids"):
        engine.add_request([tiny.config.vocab_size], DecodeConfig())
    with pytest.raises(ConfigError, match="stop strings need a tokenizer"):
        engine.add_request([1, 2], DecodeConfig(stop=("x",)))
    engine.add_request([1, 2], DecodeConfig(), request_id="same")
    with pytest.raises(ConfigError, match="already in use"):
        engine.add_request([1, 2], DecodeConfig(), request_id="same")
    saved, tiny.config.mask_token_id = tiny.config.mask_token_id, None
    try:
        with pytest.raises(MissingMaskTokenError, match="refusion convert"):
            Engine(tiny).add_request([1, 2], DecodeConfig(method="mdm"))
    finally:
        tiny.config.mask_token_id = saved
    assert engine.num_waiting == 1 and engine.forwards == 0


def test_bounds_are_named_in_the_errors():
    with pytest.raises(ConfigError, match="mdm_steps must be between 1 and 65536, got 70000"):
        DecodeConfig(mdm_steps=70000)
    with pytest.raises(ConfigError, match="slot_threshold must be between 0.0 and 1.0"):
        DecodeConfig(slot_threshold=1.5)


def test_engine_config_is_checked():
    with pytest.raises(ConfigError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)
    with pytest.raises(ConfigError, match="memory_budget_gb"):
        EngineConfig(memory_budget_gb=-1.0)


def test_steps_keep_no_autograd_state(tiny):
    """A server steps the engine from its own thread, outside any inference_mode: the step
    must still record no autograd graph (one did, and the cache then held every step's)."""
    engine = Engine(tiny)
    engine.add_request([5, 6, 7], DecodeConfig(gen_length=16, slot_size=4))
    with torch.enable_grad():
        engine.step()
    assert engine.cache is not None and not any(t.requires_grad for t in engine.cache.k + engine.cache.v)


def test_a_request_with_other_settings_joining_late_fits_the_cache(tiny):
    """An AR row grown for 46 steps, then a ReFusion row (another region, a block of MASKs
    to feed) joins: the cache must hold the longest growth plus the widest feed of any
    row, not of one row. Both decode what they decode alone."""
    prompt = [2 + i % 200 for i in range(100)]
    ar, rf = (
        DecodeConfig(method="ar", gen_length=50, stop_token_ids=()),
        DecodeConfig(gen_length=8, slot_size=8, stop_token_ids=()),
    )
    engine = Engine(tiny)
    engine.add_request(prompt, ar, request_id="ar")
    done = {}
    with torch.inference_mode():
        for _ in range(46):
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.add_request(prompt, rf, request_id="rf")
    done.update(drain(engine))
    assert done["ar"].token_ids == generate(tiny, None, [prompt], ar)[0].token_ids
    assert done["rf"].token_ids == generate(tiny, None, [prompt], rf)[0].token_ids


def test_the_cache_reserves_no_more_rows_than_the_budget_holds(tiny):
    """16 requests queued, a budget for 2: the cache's storage is for 2 rows, not 16."""
    cfg = DecodeConfig(method="ar", gen_length=16, stop_token_ids=())
    from refusion.decode.methods import method_of
    from refusion.model.sizing import cache_bytes, entry_bytes

    need = method_of(cfg).cache_need(cfg, 10)
    budget = cache_bytes([need] * 2, entry_bytes(tiny.config, tiny.dtype), joining=True) / 2**30
    engine = Engine(tiny, None, EngineConfig(max_batch_size=16, memory_budget_gb=budget))
    for i in range(16):
        engine.add_request(CASES[i]["prompt_ids"][:10] + [1] * (10 - len(CASES[i]["prompt_ids"][:10])), cfg)
    with torch.inference_mode():
        engine.step()
    assert engine.num_running == 2 and engine.cache.reserved_rows <= 2
    assert len(drain(engine)) == 16


def test_a_failed_step_loses_no_request(tiny, monkeypatch):
    """Storage that cannot be had (out of memory, say) fails the step, but the requests it
    admitted wait again and an aborted request's output is still reported."""
    engine = Engine(tiny)
    engine.add_request([5, 6, 7], DecodeConfig(method="ar", gen_length=8), request_id="a")
    engine.add_request([8, 9], DecodeConfig(method="ar", gen_length=8), request_id="b")
    assert engine.abort("b")
    calls = []

    def no_memory(*args):
        calls.append(1)
        raise RuntimeError("out of memory")

    monkeypatch.setattr("refusion.decode.scheduler.make_room", no_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step()
    assert calls and engine.num_waiting == 1 and engine.num_running == 0
    monkeypatch.undo()
    done = drain(engine)
    assert done["b"].finish_reason == "cancelled"
    assert (
        done["a"].token_ids
        == generate(tiny, None, [[5, 6, 7]], DecodeConfig(method="ar", gen_length=8))[0].token_ids
    )


def test_mdm_fixes_its_whole_block_past_an_eos(tiny):
    """The MDM baseline keeps LLaDA's schedule: a row stops after the block in which its
    EOS lies is complete, not as soon as the output is final (its NFE counts the block)."""
    stops = 0
    for c in CASES:
        cfg = DecodeConfig(method="mdm", gen_length=32, mdm_block_length=16, stop_token_ids=(c["eos_id"],))
        out = generate(tiny, None, [c["prompt_ids"]], cfg, trace=True)[0]
        blocks = -(-len(out.token_ids) // 16)
        assert (
            sum(n for ev in out.trace for _, n in ev.spans) == blocks * 16
        )  # every position of the last block
        assert out.stats.nfe == blocks * 16  # one position a step (mdm_steps defaults to the region)
        stops += out.finish_reason == "stop" and len(out.token_ids) % 16 > 0
    assert stops >= 5  # EOS inside a block: where stopping early would show
