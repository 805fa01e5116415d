"""The server's parts without HTTP: stop strings, request validation, length fitting,
metrics text, and the engine loop driven by a scripted engine."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from served import fit_length

from refusion.decode import (
    DecodeConfig,
    DecodeStats,
    EngineConfig,
    RequestOutput,
    StopText,
)
from refusion.decode.admit import PreparedRequest
from refusion.decode.fit import NoRoomError, fit_to_room
from refusion.errors import ConfigError
from refusion.serve.client import EngineClient, RequestFailed
from refusion.serve.jobs import ChoiceOutput, Job
from refusion.serve.loop import EngineLoop, QueueFull, ShuttingDown
from refusion.serve.metrics import Metrics
from refusion.serve.protocol.checks import as_request_error
from refusion.serve.protocol.errors import APIError, library_error
from refusion.serve.protocol.requests import (
    DECODE_FIELDS,
    CompletionRequest,
    parse_request,
    request_config,
)
from refusion.settings.fields import FieldError


# ---------------------------------------------------------------------------- stop strings
@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
)
def test_stop_text_releases_exactly_the_text_before_the_first_stop(text, cuts, stops):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    st_, out, hit = StopText(stops), "", False
    for a, b in zip(bounds, bounds[1:]):
        piece, hit = st_.feed(text[a:b], final=b == len(text))
        out += piece
        if hit:
            break
    else:
        if len(bounds) == 1:
            out, hit = st_.feed("", final=True)
    firsts = [i for s in stops if (i := text.find(s)) >= 0]
    assert out == (text[: min(firsts)] if firsts else text)
    assert hit == bool(firsts)


def test_stop_text_holds_back_a_possible_stop():
    s = StopText(["END"])
    assert s.feed("hello E", False) == ("hello ", False)
    assert s.feed("N", False) == ("", False)
    assert s.feed("x", False) == ("ENx", False)
    assert s.feed("..EN", True) == ("..EN", False)


# ---------------------------------------------------------------------------- requests
def test_parse_accepts_neutral_and_null_fields():
    req = parse_request(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "user", "content": "q", "name": "me"},
            ],
            "n": 1,
            "presence_penalty": 0,
            "logprobs": False,
            "user": "u",
            "temperature": None,
            "max_completion_tokens": 9,
            "stop": "x",
            "stream": True,
            "stream_options": {"include_usage": True},
            "slot_size": 4,
            "preset": "gsm8k",
        },
        "chat",
    )
    assert req.messages == [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "q", "name": "me"},
    ]
    assert (req.max_tokens, req.stop, req.stream, req.include_usage, req.preset) == (
        9,
        ["x"],
        True,
        True,
        "gsm8k",
    )
    assert req.overrides == {"slot_size": 4, "presence_penalty": 0.0}


@pytest.mark.parametrize(
    "prompt,want",
    [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_forms(prompt, want):
    assert parse_request({"prompt": prompt}, "completion").prompts == want


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "a", "stop": ["", "x"]}, "stop"),
        ({"prompt": "a", "seed": 1.5}, "seed"),
        ({"prompt": "a", "messages": []}, "messages"),
        ({"prompt": "a", "best_of": 3, "n": 4}, "best_of"),
        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "a", "stream_options": {"x": 1}}, "stream_options"),
    ],
)
def test_parse_rejects(body, param):
    with pytest.raises(APIError) as e:
        parse_request(body, "completion")
    assert e.value.status == 400 and e.value.param == param


def test_request_fields_are_derived_from_decode_config():
    """The request's decode knobs are DecodeConfig's fields, with its bounds: no second list."""
    assert set(DECODE_FIELDS) == {
        "method",
        "slot_size",
        "serial_blocks",
        "slot_threshold",
        "token_threshold",
        "mdm_block_length",
        "mdm_steps",
        "mdm_threshold",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop_token_ids",
        "ar_correction",
        "first_token_check",
        "infill_window",
        "left_check",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    }
    for body, param in [
        ({"slot_size": 5000}, "slot_size"),
        ({"temperature": 101}, "temperature"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"top_k": 1.5}, "top_k"),
        ({"ar_correction": 1}, "ar_correction"),
        ({"infill_window": 0}, "infill_window"),
    ]:
        with pytest.raises(APIError) as e:
            parse_request({"prompt": "a", **body}, "completion")
        assert e.value.param == param
    assert parse_request(
        {"prompt": "a", "stop_token_ids": [3, 4], "temperature": 1}, "completion"
    ).overrides == {"stop_token_ids": (3, 4), "temperature": 1.0}
    assert parse_request({"prompt": "a", "ar_correction": True}, "completion").overrides == {
        "ar_correction": True
    }


@pytest.mark.parametrize(
    "field,value,code",
    [
        ("slot_size", 5000, "invalid_value"),
        ("temperature", -1, "invalid_value"),
        ("method", "beam", "invalid_value"),
        ("infill_window", 0, "invalid_value"),
        ("top_p", "high", "invalid_type"),
        ("seed", 1.5, "invalid_type"),
        ("ar_correction", 1, "invalid_type"),
        ("mdm_threshold", float("nan"), "invalid_type"),
        ("stop_token_ids", [3, -1], "invalid_value"),
        ("stop", ["x"] * 17, "invalid_value"),
        ("stop", 5, "invalid_type"),
    ],
)
def test_a_bad_decoding_field_is_decode_configs_own_error(field, value, code):
    """The HTTP request's decoding fields are checked by DecodeConfig: the 400 carries the
    error DecodeConfig raises for that value, with the field as param."""
    with pytest.raises(FieldError) as own:
        DecodeConfig(**{field: value})
    assert own.value.field == field and own.value.wrong_type == (code == "invalid_type")
    with pytest.raises(APIError) as e:
        parse_request({"prompt": "a", field: value}, "completion")
    assert (e.value.status, e.value.param, e.value.code) == (400, field, code)
    if isinstance(value, list):  # the library quotes the tuple it keeps, the server the list it was sent
        assert e.value.message.split(", got")[0] == str(own.value).split(", got")[0]
    else:
        assert e.value.message == str(own.value)


def test_config_errors_map_to_the_request_field():
    with pytest.raises(APIError) as e, as_request_error("max_completion_tokens"):
        raise FieldError("gen_length", "gen_length must be an integer, got 'x' (str)", wrong_type=True)
    assert (e.value.param, e.value.code) == ("max_completion_tokens", "invalid_type")
    with pytest.raises(APIError) as e, as_request_error():
        raise FieldError("top_k", "top_k must be between 0 and 9, got 10")
    assert (e.value.param, e.value.code) == ("top_k", "invalid_value")
    with pytest.raises(APIError) as e, as_request_error():
        raise ConfigError("these settings do not go together")
    assert (e.value.param, e.value.code, e.value.message) == (
        None,
        "invalid_config",
        "these settings do not go together",
    )


def test_max_tokens_is_checked_like_a_decoding_field():
    for value, code in [("ten", "invalid_type"), (True, "invalid_type"), (0, "invalid_value")]:
        with pytest.raises(APIError) as e:
            parse_request({"prompt": "a", "max_tokens": value}, "completion")
        with pytest.raises(FieldError) as own:
            DecodeConfig(gen_length=value)
        assert (e.value.param, e.value.code) == ("max_tokens", code)
        assert (
            e.value.message.split(", got")[1] == str(own.value).split(", got")[1]
        )  # the same words about the value


def test_request_config_preset_keeps_the_servers_sampling():
    base = DecodeConfig(temperature=0.7, seed=9, top_p=0.8)
    cfg = request_config(
        base, CompletionRequest("completion", None, preset="gpqa", overrides={"top_k": 5}, stop=["##"])
    )
    assert (cfg.slot_size, cfg.serial_blocks, cfg.slot_threshold, cfg.method) == (8, 32, 0.8, "refusion")
    assert (cfg.temperature, cfg.seed, cfg.top_p, cfg.top_k, cfg.stop) == (0.7, 9, 0.8, 5, ("##",))
    # any slot layout is valid: the region rounds up to whole slots in equal blocks
    cfg = request_config(
        DecodeConfig(gen_length=32),
        CompletionRequest("completion", None, overrides={"slot_size": 4, "serial_blocks": 3}),
    )
    assert (cfg.gen_length, cfg.region_length) == (32, 36)


def test_fit_length():
    cfg = DecodeConfig(gen_length=64, slot_size=8, serial_blocks=2)
    c = fit_length(cfg, 10, 10, 512, "prompt")
    assert (c.gen_length, c.region_length) == (10, 16)  # whole slots in equal blocks; the output is cut to 10
    c = fit_length(cfg, 480, None, 512, "prompt")
    assert (c.gen_length, c.region_length) == (32, 32)  # the default is capped to the room left
    for args, param in [
        ((512, None), "prompt"),
        ((500, 13), "max_tokens"),
        ((500, 10), "slot_size"),
    ]:  # 10 rounds to 16 > 12
        with pytest.raises(APIError) as e:
            fit_length(cfg, *args, 512, "prompt")
        assert (e.value.param, e.value.code) == (param, "context_length_exceeded")
    c = fit_length(cfg.replace(method="ar"), 500, 12, 512, "prompt")
    assert c.gen_length == 12


@pytest.mark.parametrize("prompt,max_tokens", [(512, None), (500, 13), (500, 10), (508, None), (470, 64)])
def test_fit_length_is_the_decode_layers_fit(prompt, max_tokens):
    """The server's context errors are fit_to_room's, with max_tokens named as the request
    names it and param the setting the advice changes (the prompt's field for the prompt)."""
    cfg = DecodeConfig(gen_length=64, slot_size=8, serial_blocks=2)
    with pytest.raises(NoRoomError) as own:
        fit_to_room(cfg, prompt, 512, max_tokens, name="max_tokens")
    with pytest.raises(APIError) as e:
        fit_length(cfg, prompt, max_tokens, 512, "messages")
    assert e.value.message == str(own.value) and e.value.code == "context_length_exceeded"
    assert e.value.param == (own.value.setting or "messages")


# ---------------------------------------------------------------------------- metrics
def test_metrics_text_format():
    m = Metrics()
    m.requests.inc(1, "/v1/completions", "200")
    m.requests.inc(2, "/v1/completions", "200")
    m.errors.inc(1, 'weird"type')
    for v in (1, 3, 3, 1000):
        m.rows_per_step.observe(v)
    text = m.render()
    assert "# TYPE refusion_rows_per_step histogram" in text
    assert 'refusion_requests_total{route="/v1/completions",status="200"} 3' in text
    assert 'refusion_errors_total{type="weird\\"type"} 1' in text
    for le, n in [("1", 1), ("2", 1), ("4", 3), ("128", 3), ("+Inf", 4)]:
        assert f'refusion_rows_per_step_bucket{{le="{le}"}} {n}' in text
    assert "refusion_rows_per_step_sum 1007" in text and "refusion_rows_per_step_count 4" in text


# ---------------------------------------------------------------------------- engine loop
class ScriptedEngine:
    """Stands in for `Engine`: request p yields `script[p[0]]`, one token per step, text
    "t<id>" per token; an unknown prompt is refused when added (as a bad request is)."""

    def __init__(self, script: dict[int, list[int]], max_batch_size: int = 2) -> None:
        self.script, self.config = script, EngineConfig(max_batch_size=max_batch_size)
        self.requests: dict[str, SimpleNamespace] = {}
        self.waiting: list[str] = []
        self.finished_outputs: list[RequestOutput] = []
        self.forwards = self.rows_last_step = 0

    @property
    def num_running(self) -> int:
        return len(self.requests) - len(self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.finished_outputs)

    def add_request(self, prepared, request_id):
        ids = prepared.ids
        if ids[0] not in self.script:
            raise ConfigError("unknown prompt")
        self.requests[request_id] = SimpleNamespace(toks=self.script[ids[0]], n=0, started=0)
        self.waiting.append(request_id)

    def abort(self, rid):
        r = self.requests.pop(rid, None)
        if r is not None:
            self.waiting = [w for w in self.waiting if w != rid]
            self.finished_outputs.append(self._out(rid, r, "cancelled"))
        return r is not None

    def abort_running(self):
        return []

    def step(self):
        time.sleep(0.005)
        outs, self.finished_outputs = self.finished_outputs, []
        while self.waiting and self.num_running < self.config.max_batch_size:
            self.requests[self.waiting.pop(0)].started = 1
        running = [(rid, r) for rid, r in self.requests.items() if r.started]
        self.rows_last_step = len(running)
        self.forwards += 1
        for rid, r in running:
            r.n += 1
            done = r.n == len(r.toks)
            outs.append(self._out(rid, r, "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    @staticmethod
    def _out(rid, r, reason):
        toks = r.toks[: r.n]
        return RequestOutput(
            rid,
            toks,
            "".join(f"t{t}" for t in toks),
            f"t{toks[-1]}" if toks and reason != "cancelled" else "",
            reason is not None,
            reason,
            DecodeStats(len(toks), len(toks)),
            1,
        )


def prepared(first: int) -> PreparedRequest:
    cfg = DecodeConfig()
    return PreparedRequest((first,), cfg, frozenset(), cfg.gen_length)


def job(first: int) -> tuple[Job, list]:
    events: list = []
    return Job(prepared(first), events.append), events


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, ChoiceOutput))


def test_engine_loop_streams_outputs_and_isolates_a_bad_request():
    engine = ScriptedEngine({1: [5, 6, 7], 2: [8]}, max_batch_size=2)
    loop = EngineLoop(engine, max_queue=8)
    (a, ea), (b, eb), (bad, ebad), (c, ec) = job(1), job(2), job(9), job(1)
    loop.submit([a, b, bad, c])
    loop.start()
    end = time.monotonic() + 10
    while (
        not all(j.finished for j in (a, b, bad, c)) and time.monotonic() < end
    ):  # c waits for room: shutdown would refuse it
        time.sleep(0.01)
    loop.shutdown(10)
    assert text_of(ea) == "t5t6t7" and (ea[-1].finish_reason, ea[-1].completion_tokens) == ("length", 3)
    assert text_of(eb) == "t8" and (eb[-1].finish_reason, eb[-1].completion_tokens) == ("length", 1)
    assert len(ebad) == 1 and isinstance(ebad[0], ConfigError)
    assert text_of(ec) == "t5t6t7"
    m = loop.metrics
    assert m.finished.value("length") == 3 and m.finished.value("error") == 1
    assert m.rows_per_step.count() == engine.forwards and m.queue_wait.count() == 3


def test_engine_loop_queue_bound_and_shutdown():
    loop = EngineLoop(ScriptedEngine({1: [5]}), max_queue=2)
    (j1, e1), (j2, _), (j3, _) = job(1), job(1), job(1)
    loop.submit([j1])
    with pytest.raises(QueueFull) as e:
        loop.submit([j2, j3])  # all or nothing
    assert e.value.retry_after >= 1 and loop.queue_length == 1
    loop.shutdown(0.1)  # the worker never started: queued work fails
    assert isinstance(e1[-1], ShuttingDown)
    with pytest.raises(ShuttingDown):
        loop.submit([j2])


def test_cancelled_jobs_never_reach_the_engine_and_running_ones_are_aborted():
    engine = ScriptedEngine({1: list(range(50))})
    loop = EngineLoop(engine)
    (j1, e1), (j2, e2) = job(1), job(1)
    j1.cancel()
    loop.submit([j1, j2])
    loop.start()
    threading.Event().wait(0.05)
    j2.cancel()
    loop.shutdown(10)
    assert e1 == [ChoiceOutput(0, finish_reason="cancelled", completion_tokens=0)]
    assert e2[-1].finish_reason == "cancelled" and e2[-1].completion_tokens < 50 and not engine.requests


def test_engine_client_merges_a_requests_choices_and_refuses_or_cancels_them_whole():
    """One request's choices come through one async iterator, each output tagged with its
    choice; a failed choice raises; a full queue refuses every choice; closing the outputs
    cancels the choices still running."""
    engine = ScriptedEngine({1: [5, 6, 7], 2: [8], 3: list(range(200))}, max_batch_size=4)
    loop = EngineLoop(engine, max_queue=2)
    client = EngineClient(loop)

    async def run() -> tuple:
        outs = [o async for o in client.generate([prepared(1), prepared(2)])]
        with pytest.raises(QueueFull):
            client.generate([prepared(1), prepared(1), prepared(1)])
        queued = loop.queue_length  # none of the three
        with pytest.raises(RequestFailed) as failed:
            [o async for o in client.generate([prepared(9)])]
        long = client.generate([prepared(3)])
        first = await anext(long)
        await long.aclose()
        rest = [o async for o in long]
        return outs, queued, failed.value.error, first, rest

    loop.start()
    outs, queued, error, first, rest = asyncio.run(run())
    loop.shutdown(10)
    assert "".join(o.text for o in outs if o.index == 0) == "t5t6t7"
    assert "".join(o.text for o in outs if o.index == 1) == "t8"
    assert [(o.index, o.finish_reason) for o in outs if o.finished] == [(1, "length"), (0, "length")]
    assert queued == 0 and loop.metrics.rejected.value() == 1 and isinstance(error, ConfigError)
    assert first.text == "t0" and rest[-1].finish_reason == "cancelled" and rest[-1].completion_tokens < 200


def test_library_errors_map_to_statuses():
    """A request's own fault (context, config) is a 400; the server's (a compile that the
    machine cannot do, a crash) is a 500; shutting down is a 503; a full queue a 429
    that says when to retry."""
    from refusion.errors import CompileError, ContextLengthError

    cases = [
        (ContextLengthError("too long"), 400, "context_length_exceeded"),
        (ConfigError("bad"), 400, "invalid_config"),
        (CompileError("no C++ compiler"), 500, "compile_failed"),
        (RuntimeError("boom"), 500, "internal_error"),
        (ShuttingDown("bye"), 503, "shutting_down"),
        (QueueFull(3, 8), 429, "queue_full"),
    ]
    for err, status, code in cases:
        e = library_error(err)
        assert (e.status, e.code) == (status, code)
    assert library_error(QueueFull(3, 8)).headers == {"Retry-After": "3"}


def test_loadtest_method_ratio_is_the_median_of_each_rounds_own_ratio():
    """Rounds of (AR, ReFusion) phases: each round's ratio is taken from phases moments
    apart, then the median; the medians' ratio would mix rounds of a drifting machine."""
    from refusion.serve.loadtest import paired_ratio

    rounds = [(100.0, 300.0), (200.0, 200.0), (50.0, 200.0)]
    pairs = [({"tokens_per_s": a}, {"tokens_per_s": b}) for a, b in rounds]
    assert paired_ratio(pairs) == 3.0  # per round 3, 1, 4; the medians' ratio: 200 / 100 = 2
    assert paired_ratio([({"tokens_per_s": 0.0}, {"tokens_per_s": 5.0})]) is None
