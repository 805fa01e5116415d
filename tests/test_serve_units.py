"""The server's parts without HTTP: stop strings, request validation, length fitting,
metrics text, and the scheduler driven by a scripted `generate`."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refusion.decode import DecodeConfig, DecodeStats, GenerationOutput
from refusion.errors import ConfigError
from refusion.serve.metrics import Metrics
from refusion.serve.protocol import APIError, CompletionRequest, fit_length, parse_request, request_config
from refusion.serve.scheduler import Job, QueueFull, Scheduler, ShuttingDown, StopText


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
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "user", "content": "q", "name": "me"}],
         "n": 1, "presence_penalty": 0, "logprobs": False, "user": "u", "temperature": None, "max_completion_tokens": 9,
         "stop": "x", "stream": True, "stream_options": {"include_usage": True}, "slot_size": 4, "preset": "gsm8k"},
        "chat",
    )
    assert req.messages == [{"role": "system", "content": "ab"}, {"role": "user", "content": "q"}]
    assert (req.max_tokens, req.stop, req.stream, req.include_usage, req.preset) == (9, ["x"], True, True, "gsm8k")
    assert req.overrides == {"slot_size": 4}


@pytest.mark.parametrize("prompt,want", [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])])
def test_prompt_forms(prompt, want):
    assert parse_request({"prompt": prompt}, "completion").prompts == want


@pytest.mark.parametrize("body,param", [({"prompt": ["a", 1]}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": "a", "stop": ["", "x"]}, "stop"),
                                        ({"prompt": "a", "seed": 1.5}, "seed"), ({"prompt": "a", "messages": []}, "messages"),
                                        ({"prompt": "a", "best_of": 3}, "best_of"), ({"prompt": "a", "stream_options": {"x": 1}}, "stream_options")])
def test_parse_rejects(body, param):
    with pytest.raises(APIError) as e:
        parse_request(body, "completion")
    assert e.value.status == 400 and e.value.param == param


def test_request_config_preset_keeps_server_batching():
    base = DecodeConfig(max_batch_size=3, memory_budget_gb=1.0, eos_id=7)
    cfg = request_config(base, CompletionRequest("completion", None, preset="gpqa", overrides={"temperature": 0.5}))
    assert (cfg.slot_size, cfg.serial_blocks, cfg.temperature) == (8, 32, 0.5)
    assert (cfg.max_batch_size, cfg.memory_budget_gb, cfg.eos_id) == (3, 1.0, 7)
    # a new slot layout validates: gen_length is provisional and rounded to whole blocks
    cfg = request_config(DecodeConfig(gen_length=32), CompletionRequest("completion", None, overrides={"slot_size": 4, "serial_blocks": 3}))
    assert (cfg.gen_length, cfg.slot_size, cfg.serial_blocks) == (36, 4, 3)


def test_fit_length():
    cfg = DecodeConfig(gen_length=64, slot_size=8, serial_blocks=2)
    c, m = fit_length(cfg, 10, 10, 512, "prompt")
    assert (c.gen_length, m) == (16, 10)  # whole slots in equal blocks; the output is cut to 10
    c, m = fit_length(cfg, 480, None, 512, "prompt")
    assert (c.gen_length, m) == (32, 32)  # the default is capped to the room left
    for args, param in [((512, None), "prompt"), ((500, 13), "max_tokens"), ((500, 10), "max_tokens")]:  # 10 rounds to 16 > 12
        with pytest.raises(APIError) as e:
            fit_length(cfg, *args, 512, "prompt")
        assert (e.value.param, e.value.code) == (param, "context_length_exceeded")
    c, m = fit_length(cfg.replace(method="ar"), 500, 12, 512, "prompt")
    assert (c.gen_length, m) == (12, 12)


# ---------------------------------------------------------------------------- metrics
def test_metrics_text_format():
    m = Metrics()
    m.requests.inc(1, "/v1/completions", "200")
    m.requests.inc(2, "/v1/completions", "200")
    m.errors.inc(1, 'weird"type')
    for v in (1, 3, 3, 1000):
        m.batch_size.observe(v)
    text = m.render()
    assert '# TYPE refusion_batch_size histogram' in text
    assert 'refusion_requests_total{route="/v1/completions",status="200"} 3' in text
    assert 'refusion_errors_total{type="weird\\"type"} 1' in text
    for le, n in [("1", 1), ("2", 1), ("4", 3), ("128", 3), ("+Inf", 4)]:
        assert f'refusion_batch_size_bucket{{le="{le}"}} {n}' in text
    assert "refusion_batch_size_sum 1007" in text and "refusion_batch_size_count 4" in text


# ---------------------------------------------------------------------------- scheduler
class Scripted:
    """A stand-in for `generate`: row i's tokens are `script[prompt[0]]`, streamed one
    prefix at a time while `is_cancelled(i)` is false."""

    def __init__(self, script: dict[int, list[int]]) -> None:
        self.script, self.batches = script, []
        self.opened = threading.Event()
        self.opened.set()

    def __call__(self, model, tok, prompts, cfg, on_prefix, is_cancelled, admit=None):  # never admits: fixed batches
        self.batches.append([p[0] for p in prompts])
        assert self.opened.wait(10)
        if any(p[0] not in self.script for p in prompts):
            raise ConfigError("unknown prompt")
        outs = []
        for i, p in enumerate(prompts):
            toks, n = self.script[p[0]], 0
            while n < len(toks) and not is_cancelled(i):
                n += 1
                on_prefix(i, toks[:n], False)
            on_prefix(i, toks[:n], True)
            outs.append(GenerationOutput("", toks[:n], DecodeStats(n, n), 1, "cancelled" if is_cancelled(i) else "length"))
        return outs


def job(tok, first: int, cfg: DecodeConfig, max_tokens: int = 100, stops=(), eos=frozenset({0})) -> tuple[Job, list]:
    events: list = []
    return Job([first], cfg, max_tokens, list(stops), tok, set(eos), events.append), events


def text_of(events) -> str:
    return "".join(e[1] for e in events if e[0] == "text")


def test_scheduler_batches_equal_configs_and_cuts_rows(tiny_tokenizer):
    tok = tiny_tokenizer
    words = tok("The cat sat on the mat and looked at the dog.")["input_ids"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    script = {1: words, 2: words[:3] + [eos] + words, 3: words}
    gen = Scripted(script)
    gen.opened.clear()
    a, b = DecodeConfig(gen_length=16), DecodeConfig(gen_length=16, method="ar")
    sched = Scheduler(None, tok, max_queue=8, batch_window=0.0, generate_fn=gen)
    jobs = [job(tok, 1, a, max_tokens=4), job(tok, 2, a, eos={eos}), job(tok, 3, b, stops=["mat"]), job(tok, 1, a)]
    sched.start()
    sched.submit([jobs[0][0]])
    while not gen.batches:
        threading.Event().wait(0.005)
    sched.submit([j for j, _ in jobs[1:]])
    gen.opened.set()
    sched.shutdown(10)
    assert gen.batches == [[1], [2, 1], [3]]  # equal configs together, the ar job alone
    (_, e0), (_, e1), (_, e2), (_, e3) = jobs
    assert e0[-1] == ("done", "length", 4) and text_of(e0) == tok.decode(words[:4])
    assert e1[-1] == ("done", "stop", 4) and text_of(e1) == tok.decode(words[:3])
    assert e2[-1][:2] == ("done", "stop") and text_of(e2) == "The cat sat on the "
    assert text_of(e3) == tok.decode(words)
    m = sched.metrics
    assert m.batch_size.count() == 3 and m.finished.value("stop") == 2


def test_scheduler_isolates_a_bad_request(tiny_tokenizer):
    gen = Scripted({1: [5, 6, 7]})
    sched = Scheduler(None, tiny_tokenizer, batch_window=0.05, generate_fn=gen)
    (good, eg), (bad, eb) = job(tiny_tokenizer, 1, DecodeConfig()), job(tiny_tokenizer, 9, DecodeConfig())
    sched.submit([good, bad])
    sched.start()
    sched.shutdown(10)
    assert gen.batches == [[1, 9], [1], [9]]
    assert eg[-1][:2] == ("done", "length") and eb[-1][0] == "error" and isinstance(eb[-1][1], ConfigError)


def test_scheduler_queue_bound_and_shutdown(tiny_tokenizer):
    sched = Scheduler(None, tiny_tokenizer, max_queue=2, generate_fn=Scripted({}))
    (j1, e1), (j2, _), (j3, _) = (job(tiny_tokenizer, 1, DecodeConfig()) for _ in range(3))
    sched.submit([j1])
    with pytest.raises(QueueFull) as e:
        sched.submit([j2, j3])  # all or nothing
    assert e.value.retry_after >= 1 and sched.queue_length == 1
    sched.shutdown(0.1)  # the worker never started: queued work fails
    assert e1[-1][0] == "error" and isinstance(e1[-1][1], ShuttingDown)
    with pytest.raises(ShuttingDown):
        sched.submit([j2])


def test_cancelled_jobs_never_reach_the_decoder(tiny_tokenizer):
    gen = Scripted({1: [5, 6]})
    sched = Scheduler(None, tiny_tokenizer, generate_fn=gen)
    (j1, e1), (j2, e2) = job(tiny_tokenizer, 1, DecodeConfig()), job(tiny_tokenizer, 1, DecodeConfig())
    sched.submit([j1, j2])
    j1.cancel()
    sched.start()
    sched.shutdown(10)
    assert gen.batches == [[1]] and e1 == [("done", "cancelled", 0)] and e2[-1][:2] == ("done", "length")


def test_admit_takes_what_fits_and_lets_no_job_overtake_a_long_one(tiny_tokenizer, monkeypatch):
    """Joining a running batch: same config only, at most `room` jobs, prompts of at most
    `max_len` tokens; the first too-long job stops the joining (it heads the next batch)."""
    monkeypatch.setattr("refusion.serve.scheduler.check_prompts", lambda *a: None)
    a, b = DecodeConfig(gen_length=16), DecodeConfig(gen_length=16, method="ar")
    sched = Scheduler(None, tiny_tokenizer, generate_fn=Scripted({}))

    def make(n: int, cfg: DecodeConfig) -> Job:
        return Job([1] * n, cfg, 100, [], tiny_tokenizer, {0}, lambda e: None)

    running = [make(3, a)]
    queued = [make(4, a), make(2, b), make(9, b), make(5, a), make(9, a), make(2, a)]
    sched._queue.extend(queued)
    got = sched._admit(running, room=5, max_len=6)
    assert got == [[1] * 4, [1] * 5]  # the ar jobs wait; the 9-token job blocks the 2-token one behind it
    assert list(sched._queue) == [queued[i] for i in (1, 2, 4, 5)] and len(running) == 3
    sched._queue.clear()
    sched._queue.extend([make(2, a), make(2, a), make(2, a)])
    assert len(sched._admit(running, room=2, max_len=6)) == 2 and sched.queue_length == 1


def test_library_errors_map_to_statuses():
    """A request's own fault (context, config) is a 400; the server's (a compile that the
    machine cannot do, a crash) is a 500; shutting down is a 503."""
    from refusion.errors import CompileError, ContextLengthError
    from refusion.serve.app import library_error

    cases = [(ContextLengthError("too long"), 400, "context_length_exceeded"), (ConfigError("bad"), 400, "invalid_config"),
             (CompileError("no C++ compiler"), 500, "compile_failed"), (RuntimeError("boom"), 500, "internal_error"),
             (ShuttingDown("bye"), 503, "shutting_down")]
    for err, status, code in cases:
        e = library_error(err)
        assert (e.status, e.code) == (status, code)
