"""Properties of all three decoding methods over many random configurations and prompts."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from refusion.decode import DecodeConfig, generate
from refusion.decode.widths import drafting_of
from refusion.errors import ConfigError, ContextLengthError, MissingMaskTokenError
from refusion.model.transformer import Transformer
from refusion.settings.model import ModelConfig

GOLDEN = Path(__file__).parents[1] / "golden"
# tokens the sharpened tiny model emits often: as EOS they make early stops frequent
EOS_CHOICES = [298, 165, 250, 93]


@pytest.fixture(scope="module")
def tiny():
    model = Transformer(ModelConfig.from_json(GOLDEN / "tiny-qwen3" / "config.json"))
    model.load_state_dict(load_file(GOLDEN / "tiny-qwen3" / "model.safetensors"), strict=False)
    # the draft widths time a few forwards at their first use and every few minutes after
    # (`widths.ForwardCost`): done here, once for the module, so that the forwards a test
    # counts are the decoding's own
    lossless = DecodeConfig(
        slot_size=2, gen_length=2, token_threshold=0.9, ar_correction=True, first_token_check=True
    )
    generate(model.eval(), None, [[1, 2]], lossless)
    cost = drafting_of(model).cost
    assert cost.calibrated
    cost.every = float("inf")
    return model


class CountingModel:
    """Counts forward passes by wrapping `packed_hidden` (every forward with a KV cache)
    and `hidden` (MDM's, without one)."""

    NAMES = ("hidden", "packed_hidden")

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __enter__(self):
        for name in self.NAMES:
            orig = getattr(self.model, name)

            def counted(*a, _orig=orig, **k):
                self.calls += 1
                return _orig(*a, **k)

            setattr(self.model, name, counted)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            delattr(self.model, name)


@st.composite
def decode_configs(draw):
    method = draw(st.sampled_from(["refusion", "ar", "mdm"]))
    s = draw(st.sampled_from([1, 2, 4, 8]))
    n_slots = draw(st.integers(1, 8))
    blocks = draw(st.sampled_from([b for b in (1, 2, 4) if n_slots % b == 0]))
    return DecodeConfig(
        method=method,
        gen_length=n_slots * s - draw(st.integers(0, s - 1)),  # not always a multiple of s
        slot_size=s,
        serial_blocks=blocks,
        slot_threshold=draw(st.floats(0, 1)),
        token_threshold=draw(st.floats(0, 1)),
        mdm_block_length=draw(st.sampled_from([4, 8])),
        mdm_steps=draw(st.sampled_from([None, 4, 16])),
        stop_token_ids=(draw(st.sampled_from(EOS_CHOICES)),),
        ar_correction=draw(st.booleans()),
        first_token_check=draw(st.booleans()),
        infill_window=draw(st.sampled_from([None, 1, 2, 3])),
        left_check=draw(st.booleans()),
    )


prompts_st = st.lists(st.lists(st.integers(0, 297), min_size=1, max_size=24), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=decode_configs(), prompts=prompts_st)
def test_every_position_filled_once_up_to_eos(tiny, cfg, prompts):
    with CountingModel(tiny) as counter:
        outs = generate(tiny, None, prompts, cfg, trace=True)
    (eos,) = cfg.stop_token_ids
    for out in outs:
        ids = out.token_ids
        assert eos not in ids[:-1], "nothing may follow the first EOS"
        if ids and ids[-1] == eos:
            assert out.finish_reason == "stop"
        else:
            assert len(ids) == cfg.gen_length and out.finish_reason == "length"
        # committed spans never overlap, and cover the output contiguously from its start
        filled = [0] * cfg.region_length
        for ev in out.trace:
            for start, n in ev.spans:
                for i in range(start, start + n):
                    filled[i] += 1
        assert all(f == 1 for f in filled[: len(ids)])
        assert max(filled, default=0) <= 1
        # the trace replays the output
        replay = [None] * cfg.region_length
        for ev in out.trace:
            for (start, _), toks in zip(ev.spans, ev.tokens):
                replay[start : start + len(toks)] = toks
        assert replay[: len(ids)] == ids
        # stats add up
        assert out.stats.tokens == len(ids)
        assert out.stats.tpf == pytest.approx(len(ids) / out.stats.nfe)
        assert 1 <= out.stats.nfe <= counter.calls
    if len(prompts) == 1:
        assert outs[0].stats.nfe == counter.calls


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=decode_configs(), prompts=prompts_st)
def test_batched_equals_one_at_a_time(tiny, cfg, prompts):
    batched = generate(tiny, None, prompts, cfg)
    alone = [generate(tiny, None, [p], cfg)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]


def test_refusion_plans_and_infills_in_parallel(tiny):
    """On the sharpened tiny model ReFusion commits several tokens per forward for some configs."""
    cfg = DecodeConfig(
        gen_length=48, slot_size=8, slot_threshold=0.5, token_threshold=0.2, stop_token_ids=(298,)
    )
    out = generate(tiny, None, [[5, 6, 7, 8, 9]], cfg)[0]
    assert out.stats.tpf > 1


def test_finished_rows_stop_costing_compute(tiny):
    """A prompt that stops early takes part in fewer forwards than one that runs long."""
    cfg = DecodeConfig(method="ar", gen_length=40, stop_token_ids=(191,))  # the 1st prompt emits 191 third
    outs = generate(tiny, None, [[99, 276, 183], [1, 2, 3, 4]], cfg)
    short, long_ = sorted(outs, key=lambda o: len(o.token_ids))
    assert short.finish_reason == "stop" and long_.stats.nfe > short.stats.nfe
    assert short.stats.nfe == len(short.token_ids)


def test_sampling_is_seeded_and_batch_invariant(tiny):
    cfg = DecodeConfig(
        gen_length=32, slot_size=4, temperature=1.0, top_k=20, top_p=0.9, seed=7, stop_token_ids=(298,)
    )
    a = generate(tiny, None, [[3, 4, 5], [9, 9]], cfg)
    b = generate(tiny, None, [[9, 9]], cfg)
    assert a[1].token_ids == b[0].token_ids
    hot = cfg.replace(temperature=3.0, top_k=0, top_p=1.0)  # the sharpened model needs heat to vary
    runs = {tuple(generate(tiny, None, [[9, 9]], hot.replace(seed=seed))[0].token_ids) for seed in (1, 2, 3)}
    assert len(runs) > 1
    again = [generate(tiny, None, [[9, 9]], hot.replace(seed=1))[0].token_ids for _ in range(2)]
    assert again[0] == again[1]


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(slot_size=0), ConfigError),
        (dict(serial_blocks=0), ConfigError),
        (dict(top_k=-1), ConfigError),
        (dict(mdm_steps=0), ConfigError),
        (dict(stop=("",)), ConfigError),
        (dict(stop_token_ids=(-1,)), ConfigError),
        (dict(slot_threshold=1.5), ConfigError),
        (dict(token_threshold=-0.1), ConfigError),
        (dict(method="beam"), ConfigError),
        (dict(gen_length=0), ConfigError),
        (dict(temperature=-1.0), ConfigError),
    ],
)
def test_bad_configs_fail_before_compute(bad, error):
    with pytest.raises(error):
        DecodeConfig(**bad)


def test_bad_requests_fail_before_compute(tiny):
    with CountingModel(tiny) as counter:
        with pytest.raises(ContextLengthError, match="context"):
            generate(tiny, None, [[1] * 500], DecodeConfig(gen_length=64))
        with pytest.raises(ConfigError, match="no prompts"):
            generate(tiny, None, [], DecodeConfig())
        with pytest.raises(
            ContextLengthError, match="context"
        ):  # a bad prompt after a good one: nothing runs
            generate(tiny, None, [[1, 2], [1] * 500], DecodeConfig(gen_length=64))
        tiny.config.mask_token_id, saved = None, tiny.config.mask_token_id
        try:
            for method in ("refusion", "mdm"):
                with pytest.raises(MissingMaskTokenError, match="refusion convert"):
                    generate(tiny, None, [[1, 2]], DecodeConfig(method=method))
        finally:
            tiny.config.mask_token_id = saved
    assert counter.calls == 0


def test_streaming_prefixes_grow_to_the_output(tiny):
    seen = []
    cfg = DecodeConfig(
        gen_length=32, slot_size=4, slot_threshold=0.5, token_threshold=0.2, stop_token_ids=(298,)
    )
    out = generate(
        tiny, None, [[7, 8, 9]], cfg, on_output=lambda i, o: seen.append((list(o.token_ids), o.finished))
    )[0]
    assert seen[-1] == (out.token_ids, True)
    for (a, _), (b, _) in zip(seen, seen[1:]):
        assert b[: len(a)] == a  # a final prefix never changes


def test_a_stream_stopped_early_stops_the_decoding(tiny, tiny_tokenizer):
    """`stream` runs the engine in the caller's thread: a consumer that stops after the
    first piece leaves no work running behind it."""
    from refusion.decode import stream

    cfg = DecodeConfig(method="ar", gen_length=40, stop_token_ids=())
    with CountingModel(tiny) as counter:
        pieces = stream(tiny, tiny_tokenizer, [1, 2, 3], cfg)
        first = next(pieces)
        pieces.close()
    assert first and counter.calls < 40
    whole = "".join(stream(tiny, tiny_tokenizer, [1, 2, 3], cfg))
    assert whole == generate(tiny, tiny_tokenizer, [[1, 2, 3]], cfg)[0].text and whole.startswith(first)
