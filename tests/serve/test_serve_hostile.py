"""`refusion serve` against what a hostile or unlucky client sends, and under a shutdown:
bodies that break parsers, OpenAI message fields, requests that cannot fit, streams whose
first token is late, and SIGTERM (then a second one) under load, end to end."""

from __future__ import annotations

import copy
import json
import re
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
import test_serve  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from served import Process, fit_length, wait_for  # noqa: E402
from test_serve import MODEL, GatedEngine, LiveServer, in_thread, live  # noqa: E402

from refusion.decode import DecodeConfig, EngineConfig, admit  # noqa: E402
from refusion.decode.admit import Admission  # noqa: E402
from refusion.serve import create_app  # noqa: E402
from refusion.serve.protocol.errors import APIError  # noqa: E402
from refusion.serve.protocol.messages import for_template  # noqa: E402
from refusion.serve.protocol.requests import parse_request  # noqa: E402
from refusion.settings.serve import ServerLimits  # noqa: E402

# test_serve's fixtures, shared here (one converted tiny model; one live server per module, in this
# process and as a front over two replicas)
model_dirs, loaded, server = test_serve.model_dirs, test_serve.loaded, test_serve.server

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello there"}]


def post(server, path: str, body: bytes | dict, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout
    )


def openai_error(r: httpx.Response, status: int) -> dict:
    """The error object of an OpenAI-format error response with this status."""
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---------------------------------------------------------------------------- bodies that break parsers
HUGE = [
    ("max_tokens of 5,000 digits", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("seed of 5,000 digits, negative", b'{"prompt": "x", "seed": -' + b"9" * 5000 + b"}"),
    ("token ids of 5,000 digits", b'{"prompt": [1, ' + b"7" * 5000 + b"]}"),
    ("100,000 levels of arrays", b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    (
        "100,000 levels of objects",
        b'{"prompt": "x", "metadata": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}",
    ),
    ("900 levels in stop_token_ids", b'{"prompt": "x", "stop_token_ids": ' + b"[" * 900 + b"]" * 900 + b"}"),
    (
        "900 levels in logit_bias",
        b'{"prompt": "x", "logit_bias": ' + b'{"a":' * 900 + b"1" + b"}" * 900 + b"}",
    ),
    (
        "900 levels in a message",
        b'{"messages": [{"role": "user", "content": ' + b"[" * 900 + b"]" * 900 + b"}]}",
    ),
]


@pytest.mark.parametrize("name,body", HUGE, ids=[h[0] for h in HUGE])
def test_bodies_that_break_json_parsers_are_400s(server, name, body):
    """Python's int-string digit limit and the parser's recursion limit raise inside
    json.loads (ValueError, RecursionError): both are the body's fault, never a 500."""
    path = CHAT if b'"messages"' in body else "/v1/completions"
    err = openai_error(post(server, path, body), 400)
    assert err["code"] in ("invalid_json", "invalid_type", "invalid_value")
    assert "integer string conversion" not in err["message"] and "sys.set_int" not in err["message"]


NOT_OBJECTS = [b"null", b"5", b"true", b"1.5", b"[]", b'[{"prompt": "x"}]', b'"x"', b'"{}"']


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
@pytest.mark.parametrize("body", NOT_OBJECTS, ids=[b.decode() for b in NOT_OBJECTS])
def test_a_body_that_is_not_an_object_is_a_400(server, path, body):
    """Valid JSON, but not the object both endpoints take: a 400 naming the body, not a
    500 from whatever first treats it as a container."""
    err = openai_error(post(server, path, body), 400)
    assert err["code"] == "invalid_type" and "JSON object" in err["message"], err


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user"},
        {"role": "user", "content": None},
        {"role": "system", "name": "setup"},
        {"role": "tool", "tool_call_id": "call_1"},
        {"role": "assistant", "content": None},
    ],
)
def test_a_message_without_content_is_a_400(server, message):
    messages = [message] if message["role"] != "tool" else [*TOOL_TURN[:3], message]
    err = openai_error(post(server, CHAT, {"messages": messages, "max_tokens": 4}), 400)
    where = f"messages[{len(messages) - 1}].content"
    assert (err["param"], err["code"]) == (where, "missing_required_parameter"), err


def test_an_assistant_message_may_leave_content_out_for_tool_calls_or_a_refusal():
    for message in (TOOL_TURN[2], {"role": "assistant", "refusal": "I cannot help with that."}):
        said = {k: v for k, v in message.items() if k != "content"}
        req = parse_request({"messages": [USER[0], said, USER[0]]}, "chat")
        assert req.messages[1]["content"] == ""


@pytest.mark.parametrize(
    "literal,shown",
    [("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("1e999", "Infinity")],
)
@pytest.mark.parametrize(
    "param",
    ["temperature", "top_p", "slot_threshold", "max_tokens", "seed", "presence_penalty", "frequency_penalty"],
)
def test_non_finite_numbers_are_refused_naming_the_param(server, literal, shown, param):
    body = f'{{"prompt": "x", "max_tokens": 4, "{param}": {literal}}}'.encode()
    err = openai_error(post(server, "/v1/completions", body), 400)
    assert err["param"] == param
    assert err["code"] == "invalid_type" and shown in err["message"], err


@pytest.mark.parametrize(
    "field,literal",
    [
        ("logit_bias", '{"5": NaN}'),
        ("logit_bias", '{"5": 1e999}'),
        ("logit_bias", '{"' + "9" * 5000 + '": 1}'),
        ("logit_bias", '{"5": {"5": 1}}'),
        ("top_logprobs", "1e999"),
        ("n", "1e999"),
    ],
)
def test_hostile_values_of_the_openai_fields_are_400s_naming_them(server, field, literal):
    head = '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "logprobs": true'
    body = f'{head}, "{field}": {literal}}}'
    err = openai_error(post(server, "/v1/chat/completions", body.encode()), 400)
    assert err["param"] == field, err
    assert len(err["message"]) < 300


def test_huge_integer_within_the_digit_limit_is_a_400_with_a_short_message(server):
    err = openai_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 10**4299}), 400)
    assert err["param"] == "max_tokens" and len(err["message"]) < 300


@pytest.mark.parametrize(
    "body,path,param",
    [
        ({"prompt": "a\ud800b"}, "/v1/completions", "prompt"),
        ({"prompt": ["ok", "\udfff"]}, "/v1/completions", "prompt"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, CHAT, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}, CHAT, "messages[0].name"),
        ({"prompt": "x", "model": "\ud800"}, "/v1/completions", "model"),
        ({"prompt": "x", "\ud800": 1}, "/v1/completions", "\\ud800"),
    ],
)
def test_lone_surrogates_are_400s(server, body, path, param):
    """A JSON escape such as \\ud800 decodes to a lone surrogate: not text to tokenise,
    and an error that quotes it must still encode."""
    r = post(server, path, json.dumps(body).encode())  # json.dumps writes the escape
    err = openai_error(r, 404 if param == "model" else 400)
    assert err["param"] == param


# ---------------------------------------------------------------------------- what one client cannot hold up
def test_a_huge_prompt_is_tokenised_without_holding_up_health_or_other_clients(loaded, monkeypatch):
    """A 2 MB prompt takes seconds to tokenise (only to be refused as too long; the
    length check that would refuse it untokenised is loosened here): /health and a small
    request answer meanwhile, because the tokenisation is not on the event loop."""
    monkeypatch.setattr(admit, "TEXT_SLACK", 10**6)
    huge = {"prompt": "Hello there, how are you? " * 80_000, "max_tokens": 4}
    with live(loaded) as s:
        t0 = time.monotonic()
        big, answer = in_thread(lambda: post(s, "/v1/completions", huge))
        time.sleep(0.3)  # the body is in; its tokenisation has begun
        health: list[float] = []
        while big.is_alive() and len(health) < 20:
            t = time.monotonic()
            assert httpx.get(s.url + "/health", timeout=30).status_code == 200
            health.append(time.monotonic() - t)
            time.sleep(0.05)
        small_took = time.monotonic()
        small = post(s, "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
        small_took, still_busy = time.monotonic() - small_took, big.is_alive()
        big.join(120)
        took = time.monotonic() - t0
    assert openai_error(answer[0], 400)["code"] == "context_length_exceeded"
    assert took > 1.0, f"the prompt took {took:.2f} s: too little to show anything"
    assert health and max(health) < 0.5, health
    assert small.status_code == 200 and (still_busy or small_took < 0.5), (small_took, took)


def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives(server):
    """A chunked body declares no length: the 413 comes once the limit is passed, not
    after the client has sent (and the server buffered) all of it."""
    host, port = server.url.removeprefix("http://").split(":")
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    chunk = b"x" * 2**20
    with socket.create_connection((host, int(port))) as c:
        c.sendall(head + b"transfer-encoding: chunked\r\n\r\n")
        for _ in range(17):  # 17 MiB, one over the limit, and no last chunk: the body never ends
            c.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        c.settimeout(10)
        got = b""
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            part = c.recv(65536)
            if not part:
                break
            got += part
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"


def test_text_too_long_to_fit_is_refused_without_tokenising_it(loaded):
    """No token spells more than the vocabulary's longest entry, so text longer than the
    context times that cannot fit: a 15 MB prompt is a 400 at once, not after seconds
    of tokenisation; text within the bound is tokenised and measured in tokens."""
    longest = Admission(loaded[0].config, loaded[1], DecodeConfig()).longest_token
    limit = 512 * longest * admit.TEXT_SLACK  # the tiny models: 512 positions
    with live(loaded) as s:
        t0 = time.monotonic()
        err = openai_error(post(s, "/v1/completions", {"prompt": "Hello there. " * 1_150_000}), 400)
        took = time.monotonic() - t0
        assert (err["param"], err["code"]) == (
            "prompt",
            "context_length_exceeded",
        ) and "14950000 characters" in err["message"]
        assert took < 5, took
        chat = {"messages": [USER[0], {"role": "user", "content": "x" * limit}]}
        err = openai_error(post(s, CHAT, chat), 400)
        assert (err["param"], err["code"]) == ("messages", "context_length_exceeded") and "characters" in err[
            "message"
        ]
        within = openai_error(post(s, "/v1/completions", {"prompt": "Hello " * (limit // 6)}), 400)
        assert within["code"] == "context_length_exceeded" and "characters" not in within["message"], within


@pytest.mark.parametrize("size", [100_000, 20_000])
def test_a_header_over_the_limit_is_refused_before_the_app(server, size):
    """uvicorn's h11 refuses a head over the limit while it arrives in pieces (a plain 400);
    one that arrives whole is measured before the app runs (a 431 in OpenAI's shape)."""
    try:
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 4},
            headers={"x-padding": "a" * size},
            timeout=60,
        )
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        r = None  # closed while the head was still being sent (a reset): refused all the same
    assert r is None or r.status_code in (400, 431), (r.status_code, r.text[:200])
    if r is not None and r.status_code == 431:
        assert openai_error(r, 431)["code"] == "request_headers_too_large"
    ok = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 4},
        headers={"x-padding": "a" * 8_000},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_a_client_that_sends_its_headers_slowly_is_closed(loaded):
    """One byte a second never finishes a head: the connection is closed at the header
    timeout, with a 408 (one that sends nothing is closed without one). A kept-alive
    connection idle between requests is not timed by it."""
    with live(loaded, limits=ServerLimits(header_timeout=1.0)) as s:
        host, port = s.url.removeprefix("http://").split(":")
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        address = (host, int(port))
        with socket.create_connection(address) as slow, socket.create_connection(address) as mute:
            slow.settimeout(0.5)  # the pace: a byte, then half a second's wait for an answer
            t0, got = time.monotonic(), b""
            for byte in head:
                try:
                    slow.sendall(bytes([byte]))
                    chunk = slow.recv(4096)
                except TimeoutError:
                    continue
                except OSError:  # reset, or a broken pipe: closed
                    break
                got += chunk
                if not chunk or time.monotonic() - t0 > 6:
                    break
            closed_after = time.monotonic() - t0
            mute.settimeout(5)
            assert mute.recv(4096) == b""  # closed, nothing said
        assert got.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in got, got[:300]
        assert closed_after < 3, closed_after
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            time.sleep(1.5)
            assert c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4}).status_code == 200


# ---------------------------------------------------------------------------- OpenAI message fields
TOOL_TURN = [
    {"role": "system", "content": "You can call tools.", "name": "setup"},
    {"role": "user", "content": "Weather in Paris?", "name": "alice"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_tool_conversation_is_accepted(server):
    r = post(server, CHAT, {"messages": TOOL_TURN, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_message_fields_are_parsed_and_reach_templates_that_use_them():
    req = parse_request({"messages": TOOL_TURN}, "chat")
    assert req.messages[2] == {"role": "assistant", "content": "", "tool_calls": TOOL_TURN[2]["tool_calls"]}
    assert req.messages[3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    assert req.messages[1]["name"] == "alice"
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert all(set(m) == {"role", "content"} for m in for_template(req.messages, plain))
    tools = plain + "{% for m in messages %}{{ m.tool_calls }}{{ m.tool_call_id }}{% endfor %}"
    kept = for_template(req.messages, tools)
    assert "tool_calls" in kept[2] and kept[3]["tool_call_id"] == "call_1" and "name" not in kept[1]


@pytest.mark.parametrize(
    "message,param,code",
    [
        ({"role": "user", "content": "x", "name": 5}, "messages[0].name", "invalid_type"),
        ({"role": "tool", "content": "x", "tool_call_id": ["a"]}, "messages[0].tool_call_id", "invalid_type"),
        (
            {"role": "user", "content": "x", "tool_call_id": "a"},
            "messages[0].tool_call_id",
            "unknown_parameter",
        ),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls", "unknown_parameter"),
        (
            {"role": "assistant", "content": None, "tool_calls": {"id": "a"}},
            "messages[0].tool_calls",
            "invalid_type",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]},
            "messages[0].tool_calls[0]",
            "invalid_type",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}],
            },
            "messages[0].tool_calls[0].type",
            "invalid_value",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            "messages[0].tool_calls[0].function.arguments",
            "invalid_type",
        ),
        ({"role": "user", "content": "x", "frobnicate": 1}, "messages[0].frobnicate", "unknown_parameter"),
    ],
)
def test_bad_message_fields_name_the_param(server, message, param, code):
    err = openai_error(post(server, CHAT, {"messages": [message]}), 400)
    assert (err["param"], err["code"]) == (param, code), err


def test_a_template_that_rejects_tool_messages_is_a_400(loaded):
    model, tok = loaded
    strict = copy.deepcopy(tok)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with live((model, strict)) as s:
        err = openai_error(post(s, CHAT, {"messages": TOOL_TURN, "max_tokens": 4}), 400)
        assert err["param"] == "messages" and "the chat template rejected the messages" in err["message"]
        assert post(s, CHAT, {"messages": TOOL_TURN[:2], "max_tokens": 4}).status_code == 200


# ---------------------------------------------------------------------------- requests that cannot fit
def test_a_unit_larger_than_the_context_names_slot_size_and_a_value_that_works(server):
    for extra in ({"max_tokens": 10}, {}):
        err = openai_error(
            post(server, "/v1/completions", {"prompt": "Hello", "slot_size": 4096, **extra}), 400
        )
        assert (err["param"], err["code"]) == ("slot_size", "context_length_exceeded"), err
        assert "to 0" not in err["message"] and "4096" in err["message"]
        k = int(re.search(r"lower slot_size to at most (\d+)", err["message"])[1])
        assert (
            k >= 1
            and post(server, "/v1/completions", {"prompt": "Hello", "slot_size": k, **extra}).status_code
            == 200
        )


ADVICE = re.compile(r"lower (\w+) to at most (\d+)(?: and serial_blocks to 1)?")


@settings(max_examples=400, deadline=None)
@given(
    method=st.sampled_from(["refusion", "mdm"]),
    size=st.integers(1, 4096),
    blocks=st.integers(1, 64),
    mdm_block=st.integers(1, 4096),
    prompt=st.integers(1, 511),
    max_tokens=st.one_of(st.none(), st.integers(1, 600)),
)
def test_every_length_error_suggests_a_value_that_fits(method, size, blocks, mdm_block, prompt, max_tokens):
    """Whatever the settings, the advice in a refusal is a change that makes the request fit."""
    cfg = DecodeConfig(
        method=method, slot_size=size, serial_blocks=blocks, mdm_block_length=mdm_block, gen_length=256
    )
    try:
        fit_length(cfg, prompt, max_tokens, 512, "prompt")
        return
    except APIError as e:
        err = e
    if err.param == "prompt" or (err.param == "max_tokens" and "maximum context length" in err.message):
        return  # the prompt leaves no room, or max_tokens alone is over the room: neither is a unit matter
    knob, value = ADVICE.search(err.message).groups()
    assert knob == err.param or err.param == "max_tokens", err.message
    change = {knob: int(value)} | ({"serial_blocks": 1} if "and serial_blocks to 1" in err.message else {})
    if knob == "max_tokens":
        max_tokens = int(value)
    fitted = fit_length(
        cfg.replace(**{k: v for k, v in change.items() if k != "max_tokens"}),
        prompt,
        max_tokens,
        512,
        "prompt",
    )
    assert fitted.region_length <= 512 - prompt
    if err.param == "max_tokens":  # the unit advice given next to it works too
        knob2, value2 = ADVICE.findall(err.message)[-1]
        change = {knob2: int(value2)} | (
            {"serial_blocks": 1} if err.message.endswith("and serial_blocks to 1") else {}
        )
        asked = int(re.search(r"max_tokens (\d+) needs", err.message)[1])
        assert fit_length(cfg.replace(**change), prompt, asked, 512, "prompt").region_length <= 512 - prompt


# ---------------------------------------------------------------------------- the first byte of a stream
@pytest.mark.parametrize("path,body", [(CHAT, {"messages": USER}), ("/v1/completions", {"prompt": "Hello"})])
def test_a_stream_is_accepted_before_any_token_is_final(loaded, path, body):
    """Headers (and chat's role chunk) come while the engine is held: a queued client
    knows it was accepted. Chat's first chunk is OpenAI's {"role": "assistant", "content": ""}."""
    engine = GatedEngine(loaded)
    with live(loaded, engine=engine) as s:
        engine.opened.clear()
        got: dict = {}

        def read() -> None:
            with httpx.stream(
                "POST", s.url + path, json={**body, "max_tokens": 8, "stream": True}, timeout=60
            ) as r:
                got["status"], got["type"] = r.status_code, r.headers["content-type"]
                lines = r.iter_lines()
                if path == CHAT:
                    got["first"] = next(x for x in lines if x)
                got["rest"] = [x for x in lines if x]

        t = threading.Thread(target=read, daemon=True)
        t.start()
        wait_for(
            lambda: "status" in got and (path != CHAT or "first" in got),
            timeout=10,
            what="headers while the step is held",
        )
        assert got["status"] == 200 and got["type"].startswith("text/event-stream") and "rest" not in got
        assert engine.outputs == []  # nothing decoded yet
        if path == CHAT:
            delta = json.loads(got["first"][6:])["choices"][0]["delta"]
            assert delta == {"role": "assistant", "content": ""}
        engine.opened.set()
        t.join(60)
    assert got["rest"][-1] == "data: [DONE]"


# ---------------------------------------------------------------------------- shutdown, in process
def test_shutdown_refuses_new_and_queued_requests_with_503_and_cuts_streams_with_an_error(loaded):
    engine = GatedEngine(loaded, delay=0.01, config=EngineConfig(max_batch_size=1))
    model, tok = loaded
    s = LiveServer(
        create_app(
            model, tok, DecodeConfig(gen_length=32), model_name=MODEL, engine=engine, shutdown_timeout=0.5
        )
    )
    long = {"prompt": "Hello", "max_tokens": 400, "method": "ar", "stop_token_ids": []}
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", s.url + "/v1/completions", json={**long, "stream": True}, timeout=30) as r:
            lines.extend(x for x in r.iter_lines() if x)

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    wait_for(lambda: s.loop.running == 1, what="the stream to run")
    queued: list = []
    waiter = threading.Thread(target=lambda: queued.append(post(s, "/v1/completions", long)), daemon=True)
    waiter.start()
    wait_for(lambda: s.loop.queue_length == 1, what="a queued request")
    t0 = time.monotonic()
    stopper = threading.Thread(target=s.stop)
    stopper.start()
    waiter.join(10)
    err = openai_error(queued[0], 503)
    assert (err["code"], err["type"]) == ("shutting_down", "server_error")
    wait_for(lambda: not streamer.is_alive(), timeout=10, what="the stream to end")
    assert time.monotonic() - t0 < 3  # 400 tokens at 10 ms would take 4 s: cut at the 0.5 s deadline
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    stopper.join(30)
    assert not s.thread.is_alive() and not s.loop.alive
    assert engine.outputs[-1].finish_reason == "cancelled"


def test_a_closing_engine_loop_answers_new_requests_with_503(server):
    if not hasattr(server, "loop"):
        pytest.skip("a front has no engine loop; its replicas' drain is tested in test_serve_replicas")
    loop = server.loop
    try:
        loop._closing = True  # as between the first signal and uvicorn closing its sockets
        err = openai_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4}), 503)
        assert err["code"] == "shutting_down"
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True})
        assert openai_error(r, 503)["code"] == "shutting_down"
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        loop._closing = False


# ---------------------------------------------------------------------------- shutdown, a real process
def stream_client(url: str, body: dict, out: list, started: threading.Event) -> None:
    """Loop streamed requests until the server goes; record how each one ended. A
    request sent on a kept-alive connection just as the draining server closes it (idle)
    gets no response at all: HTTP/1.1's race, which clients retry; it ends the loop as a
    refused connection does. A transport error once a response has begun is recorded."""
    with httpx.Client(timeout=60) as c:
        while True:
            answered = False
            try:
                with c.stream("POST", url + CHAT, json={**body, "stream": True}) as r:
                    answered = True
                    if r.status_code != 200:
                        r.read()
                        out.append(("status", r.status_code, r.content))
                        continue
                    started.set()
                    lines = [x for x in r.iter_lines() if x]
                out.append(("stream", lines))
            except httpx.HTTPError as e:
                if answered:
                    out.append(("transport", type(e).__name__))
                return


@pytest.mark.slow
def test_sigterm_under_load_drains_within_the_timeout(model_dirs):
    """Several streaming clients (more than the batch: some queue), then SIGTERM: the
    process exits within the timeout plus a margin; every response is a 200 stream that
    ended with [DONE] (normally, or after an error event) or a 503 shutting_down in the
    OpenAI format; the log has no traceback and at most a line per cut request."""
    timeout = 1.5
    p = Process(model_dirs[1], "--shutdown-timeout", str(timeout), "--max-batch-size", "4")
    try:
        body = {"messages": USER, "max_tokens": 400, "method": "ar", "stop_token_ids": []}
        results: list[list] = [[] for _ in range(8)]  # 4 queued: at least 2 still are when the signal comes
        started = [threading.Event() for _ in results]
        clients = [
            threading.Thread(target=stream_client, args=(p.url, body, out, ev), daemon=True)
            for out, ev in zip(results, started)
        ]
        for c in clients:
            c.start()
        for ev in started:
            assert ev.wait(60)
        time.sleep(0.3)
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        p.proc.wait(timeout + 15)
        elapsed = time.monotonic() - t0
        for c in clients:
            c.join(10)
    finally:
        p.kill()
    assert elapsed < timeout + 3, elapsed
    assert p.proc.returncode in (0, -signal.SIGTERM)
    outcomes = [r for out in results for r in out]
    for kind, *rest in outcomes:
        assert kind in ("stream", "status"), (kind, rest)
        if kind == "status":
            status, content = rest
            assert status == 503 and json.loads(content)["error"]["code"] == "shutting_down", (
                status,
                content,
            )
        else:
            lines = rest[0]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            last = json.loads(lines[-2][6:])
            assert "error" in last or last["choices"][0]["finish_reason"] is not None, last
            if "error" in last:
                assert (
                    set(last["error"]) == {"message", "type", "param", "code"}
                    and last["error"]["code"] == "shutting_down"
                )
    ended_with_error = [o for o in outcomes if o[0] == "stream" and "error" in json.loads(o[1][-2][6:])]
    assert len(ended_with_error) >= 2  # of the 4 queued behind a batch of 4, those not yet admitted
    log = p.log_after(t0)
    assert not any("Traceback" in x or "Exception in ASGI" in x for _, x in p.lines), "\n".join(log)
    assert sum("cut" in x for x in log) <= 1 and sum("refused" in x for x in log) <= 2, "\n".join(
        log
    )  # one line per event, not per request
    assert sum(1 for x in log if '" 200' not in x and '" 503' not in x) <= 10, "\n".join(log)


def health_status(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


@pytest.mark.slow
def test_after_sigterm_new_requests_get_503_until_the_drain_ends(model_dirs):
    """While running requests drain, the server still listens and keeps its connections:
    a request on a new connection and one on a kept-alive connection both get 503
    `shutting_down` in the OpenAI format (not a refused or closed connection), /health
    503; the streams end with [DONE] and the process exits."""
    p = Process(model_dirs[1], "--shutdown-timeout", "5", "--max-batch-size", "4")
    body = {"messages": USER, "max_tokens": 400, "method": "ar", "stop_token_ids": []}
    results: list[list] = [[] for _ in range(4)]
    started = [threading.Event() for _ in results]
    try:
        for out, ev in zip(results, started):
            threading.Thread(target=stream_client, args=(p.url, body, out, ev), daemon=True).start()
        for ev in started:
            assert ev.wait(60)
        with (
            httpx.Client(base_url=p.url, timeout=10) as kept,
            httpx.Client(base_url=p.url, timeout=10) as new,
        ):
            assert kept.get("/v1/models").status_code == 200  # a connection now kept alive
            p.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: health_status(p.url) == 503, timeout=5, what="/health to answer 503")
            for client in (kept, new):
                r = client.post(CHAT, json={"messages": USER, "max_tokens": 4})
                assert openai_error(r, 503)["code"] == "shutting_down"
        p.proc.wait(30)
    finally:
        p.kill()
    streams = [o[1] for out in results for o in out if o[0] == "stream"]
    assert streams and all(lines[-1] == "data: [DONE]" for lines in streams)
    assert not any("Traceback" in x for _, x in p.lines)


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once(model_dirs):
    p = Process(model_dirs[1], "--shutdown-timeout", "120", "--max-batch-size", "16")
    try:
        body = {"messages": USER, "max_tokens": 400, "method": "ar", "stop_token_ids": []}
        results: list[list] = [[] for _ in range(8)]
        started = [threading.Event() for _ in results]
        for out, ev in zip(results, started):
            threading.Thread(target=stream_client, args=(p.url, body, out, ev), daemon=True).start()
        for ev in started:
            assert ev.wait(60)
        p.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        p.proc.wait(10)
        elapsed = time.monotonic() - t0
    finally:
        p.kill()
    assert p.proc.returncode == 128 + signal.SIGTERM, p.log_after(0)  # exit_now, not a graceful end
    assert elapsed < 2, elapsed
    assert any("exiting now" in x for _, x in p.lines)
    assert not any("Traceback" in x for _, x in p.lines)
