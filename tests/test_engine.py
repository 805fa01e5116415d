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
    DecodeConfig(method="refusion", gen_length=64, slot_size=8, serial_blocks=2, slot_threshold=0.5, token_threshold=0.2),
    DecodeConfig(method="refusion", gen_length=48, slot_size=4, serial_blocks=3, slot_threshold=0.7, token_threshold=0.3),
    DecodeConfig(method="ar", gen_length=24, temperature=1.0, top_k=20, seed=3),
    DecodeConfig(method="refusion", gen_length=32, slot_size=16, serial_blocks=1, slot_threshold=0.9, token_threshold=0.1),
    DecodeConfig(method="refusion", gen_length=40, slot_size=4, serial_blocks=5, slot_threshold=0.6, token_threshold=0.4,
                 temperature=0.8, top_p=0.9, seed=11),
    DecodeConfig(method="refusion", gen_length=64, slot_size=8, serial_blocks=4, slot_threshold=0.3, token_threshold=0.5),
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
    engine.add_request([5, 6, 7], DecodeConfig(gen_length=32, slot_size=4, slot_threshold=0.5, token_threshold=0.2),
                       request_id="a")
    seen = []
    with torch.inference_mode():
        while engine.has_unfinished():
            seen += engine.step()
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    for a, b in zip(seen, seen[1:]):
        assert b.token_ids[: len(a.token_ids)] == a.token_ids and len(b.token_ids) > len(a.token_ids) or b.finished
    assert "".join(o.delta for o in seen) == seen[-1].text


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
