"""`refusion serve` end to end: a live uvicorn server on 127.0.0.1 with a tiny converted
model, driven by the official `openai` client (and httpx for raw HTTP)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from served import wait_for  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import refusion  # noqa: E402
from refusion.cli.dispatch import main as cli_main  # noqa: E402
from refusion.decode import DecodeConfig, Engine, EngineConfig, generate  # noqa: E402
from refusion.serve import create_app  # noqa: E402
from refusion.serve.server import make_server  # noqa: E402

MODEL = "tiny"
BASE = DecodeConfig(gen_length=32)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, make_hf_model, tokenizer_dir):
    """(AR base without MASK, converted ReFusion model)."""
    root = tmp_path_factory.mktemp("serve")
    make_hf_model("qwen3").save_pretrained(root / "hf")
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(root / "hf")
    assert cli_main(["convert", str(root / "hf"), str(root / "rf")]) == 0
    return root / "hf", root / "rf"


@pytest.fixture(scope="module")
def loaded(model_dirs):
    return refusion.load(model_dirs[1])


class LiveServer:
    """The server `refusion serve` runs, in a thread on a free loopback port (`stop` is
    its graceful shutdown, as on a first SIGTERM)."""

    def __init__(self, app, limits=None) -> None:
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = make_server(app, log_level="warning", limits=limits)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, what="server start")

    @property
    def loop(self):
        return self.app.state.engine_loop

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics").text)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextmanager
def live(loaded, **kwargs) -> Iterator[LiveServer]:
    model, tok = loaded
    cfg, limits = kwargs.pop("cfg", BASE), kwargs.pop("limits", None)
    server = LiveServer(create_app(model, tok, cfg, model_name=MODEL, **kwargs), limits)
    try:
        yield server
    finally:
        server.stop()


class ReplicatedServer:
    """`refusion serve --data-parallel-size 2` in a subprocess: a front over two replica
    processes of the same model, answering as one server. `metrics` sums each sample
    over the replicas, so a test reads the same names as from one server."""

    def __init__(self, model_dir) -> None:
        from served import Process

        self.process = Process(
            model_dir,
            "--data-parallel-size",
            "2",
            "--served-model-name",
            MODEL,
            "--gen-length",
            "32",
            "--log-level",
            "warning",
        )
        self.url = self.process.url

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, value in parse_metrics(httpx.get(self.url + "/metrics").text).items():
            key = re.sub(r'replica="\d+",?', "", name).replace("{}", "")
            out[key] = out.get(key, 0.0) + value
        return out

    def stop(self) -> None:
        from test_serve_replicas import _stop

        _stop(self.process)


@pytest.fixture(scope="module", params=["one process", "two replicas"])
def server(request, loaded, model_dirs):
    """The server the openai-client tests run against: in this process, and as a front
    over two replica processes (`--data-parallel-size 2`)."""
    if request.param == "one process":
        with live(loaded) as s:
            yield s
        return
    s = ReplicatedServer(model_dirs[1])
    try:
        yield s
    finally:
        s.stop()


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class GatedEngine(Engine):
    """The real engine, held before each step while `opened` is clear; `delay` slows every
    step so a decode outlives a client. Records the finished outputs and each step's rows."""

    def __init__(self, loaded, delay: float = 0.0, config: EngineConfig | None = None) -> None:
        super().__init__(*loaded, config)
        self.opened = threading.Event()
        self.opened.set()
        self.delay = delay
        self.outputs: list = []
        self.step_rows: list[int] = []

    def step(self):
        assert self.opened.wait(60)
        time.sleep(self.delay)
        outs = super().step()
        self.step_rows.append(self.rows_last_step)
        self.outputs += [o for o in outs if o.finished]
        return outs


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list]:
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    return t, box


# ---------------------------------------------------------------------------- happy paths
def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_chat_streamed_equals_plain_equals_library(server, loaded):
    model, tok = loaded
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there, how are you?"},
    ]
    client = server.client()
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=32, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = chat_ids(tok, messages)
    ref = generate(model, tok, [ids], BASE.replace(gen_length=32))[0]

    assert plain.choices[0].message.content == streamed == ref.text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 1
    assert (
        plain.choices[0].finish_reason
        == chunks[-2].choices[0].finish_reason
        == ("stop" if ref.finish_reason == "stop" else "length")
    )
    assert plain.usage.prompt_tokens == len(ids) and plain.usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_completion_sampled_stream_equals_plain(server, loaded):
    model, tok = loaded
    client = server.client()
    kw = dict(model=MODEL, prompt="The cat sat on", max_tokens=16, temperature=0.9, top_p=0.95, seed=11)
    plain = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    ref = generate(
        model,
        tok,
        ["The cat sat on"],
        BASE.replace(gen_length=16, temperature=0.9, top_p=0.95, seed=11),
        chat=False,
    )[0]
    assert plain.choices[0].text == streamed == ref.text
    other = client.completions.create(**{**kw, "seed": 12})
    assert other.choices[0].text != plain.choices[0].text  # the seed reaches the sampler


def test_refusion_knobs_as_extra_fields(server, loaded):
    model, tok = loaded
    client = server.client()
    for extra, cfg in [
        ({"method": "ar"}, BASE.replace(method="ar", gen_length=12)),
        (
            {"slot_size": 4, "serial_blocks": 3, "slot_threshold": 0.5, "token_threshold": 0.2},
            BASE.replace(
                gen_length=12, slot_size=4, serial_blocks=3, slot_threshold=0.5, token_threshold=0.2
            ),
        ),
    ]:
        got = client.completions.create(model=MODEL, prompt="Two plus three", max_tokens=12, extra_body=extra)
        ref = generate(model, tok, ["Two plus three"], cfg, chat=False)[0]
        assert got.choices[0].text == ref.text, extra


def test_stop_strings_cut_streamed_and_plain(server):
    client = server.client()
    kw = dict(model=MODEL, prompt="Hello world!", max_tokens=32)
    full = client.completions.create(**kw).choices[0].text
    start = next(i for i in range(4, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    stop = full[start : start + 3]
    want = full[: full.find(stop)]
    plain = client.completions.create(**kw, stop=[stop, "never-in-there"]).choices[0]
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert plain.text == want and plain.finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_prompt_list_gives_one_choice_each(server):
    client = server.client()
    prompts = ["The cat sat", "def add(a, b):"]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8).choices[0].text for p in prompts]
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == alone
    streamed = ["", ""]
    for c in client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, stream=True):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == alone


def _sse(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_a_raw_completion_on_a_chat_only_model_says_so(loaded, capfd):
    """The bundled model knows text only through its chat template (`chat_only` in its
    decode_config.json): a raw text completion is answered with a `warning` (on the first
    chunk of a stream) and one log line; `"chat_template": true` renders the prompt as a
    chat would, and answers as the library does."""
    model, tok = refusion.load()
    prompt = "Find the largest number: 47, 38, 23"
    with live((model, tok), cfg=None) as s:
        url = s.url + "/v1/completions"
        raw = [httpx.post(url, json={"prompt": prompt}, timeout=60).json() for _ in range(2)]
        assert all("chat template" in r["warning"] and "chat_template" in r["warning"] for r in raw)
        logged = [line for line in capfd.readouterr().err.splitlines() if "a raw text completion" in line]
        assert len(logged) == 1 and logged[0].startswith("WARNING") and raw[0]["warning"] in logged[0]
        rendered = httpx.post(url, json={"prompt": prompt, "chat_template": True}, timeout=60).json()
        assert "warning" not in rendered
        assert rendered["choices"][0]["text"] == generate(model, tok, [prompt])[0].text
        assert rendered["choices"][0]["text"].endswith("Answer: 47")
        chunks = _sse(httpx.post(url, json={"prompt": prompt, "stream": True}, timeout=60))
        assert "chat template" in chunks[0]["warning"] and chunks[0]["choices"]
        assert not any("warning" in c for c in chunks[1:])
        ids = tok(prompt)["input_ids"]  # ids are the client's own rendering: no warning
        assert "warning" not in httpx.post(url, json={"prompt": ids, "max_tokens": 8}, timeout=60).json()
        chat = {"messages": [{"role": "user", "content": prompt}]}
        assert "warning" not in httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=60).json()
        refused = httpx.post(url, json={"prompt": ids, "chat_template": True}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def test_a_model_not_marked_chat_only_completes_without_a_warning(loaded):
    with live(loaded) as s:
        body = httpx.post(s.url + "/v1/completions", json={"prompt": "The cat sat"}, timeout=60).json()
    assert body["choices"] and "warning" not in body


# ---------------------------------------------------------------------------- bad input
TOO_LONG = [5] * 520  # the tiny models have 512 positions
CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, "invalid_json", None),
    ("body not an object", "/v1/completions", [1, 2], 400, "invalid_type", None),
    (
        "max_tokens a string",
        "/v1/completions",
        {"prompt": "x", "max_tokens": "ten"},
        400,
        "invalid_type",
        "max_tokens",
    ),
    (
        "max_tokens a bool",
        "/v1/completions",
        {"prompt": "x", "max_tokens": True},
        400,
        "invalid_type",
        "max_tokens",
    ),
    (
        "max_tokens zero",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 0},
        400,
        "invalid_value",
        "max_tokens",
    ),
    (
        "max_tokens over the context",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 100000},
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    (
        "prompt over the context",
        "/v1/completions",
        {"prompt": TOO_LONG},
        400,
        "context_length_exceeded",
        "prompt",
    ),
    ("prompt a number", "/v1/completions", {"prompt": 5}, 400, "invalid_type", "prompt"),
    ("prompt empty", "/v1/completions", {"prompt": ""}, 400, "empty_prompt", "prompt"),
    (
        "token id outside the vocabulary",
        "/v1/completions",
        {"prompt": [99999]},
        400,
        "invalid_value",
        "prompt",
    ),
    (
        "temperature negative",
        "/v1/completions",
        {"prompt": "x", "temperature": -1},
        400,
        "invalid_value",
        "temperature",
    ),
    ("top_p a string", "/v1/completions", {"prompt": "x", "top_p": "high"}, 400, "invalid_type", "top_p"),
    ("seed beyond int64", "/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "invalid_value", "seed"),
    (
        "temperature NaN",
        "/v1/completions",
        b'{"prompt": "x", "temperature": NaN}',
        400,
        "invalid_type",
        "temperature",
    ),
    ("stop a number", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "invalid_type", "stop"),
    (
        "unknown field",
        "/v1/completions",
        {"prompt": "x", "frobnicate": 1},
        400,
        "unknown_parameter",
        "frobnicate",
    ),
    ("n over its bound", "/v1/completions", {"prompt": "x", "n": 17}, 400, "invalid_value", "n"),
    (
        "best_of < n",
        "/v1/completions",
        {"prompt": "x", "best_of": 2, "n": 3},
        400,
        "invalid_value",
        "best_of",
    ),
    (
        "best_of streamed",
        "/v1/completions",
        {"prompt": "x", "best_of": 2, "stream": True},
        400,
        "invalid_value",
        "best_of",
    ),
    ("a suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "unsupported_value", "suffix"),
    (
        "top_logprobs over 20",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        400,
        "invalid_value",
        "top_logprobs",
    ),
    (
        "logit_bias past the vocabulary",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"100000000": 1}},
        400,
        "invalid_value",
        "logit_bias",
    ),
    ("unknown method", "/v1/completions", {"prompt": "x", "method": "beam"}, 400, "invalid_value", "method"),
    (
        "slot_threshold over 1",
        "/v1/completions",
        {"prompt": "x", "slot_threshold": 1.5},
        400,
        "invalid_value",
        "slot_threshold",
    ),
    ("unknown preset", "/v1/completions", {"prompt": "x", "preset": "nope"}, 400, "invalid_value", "preset"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model_not_found", "model"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "empty_array", "messages"),
    ("no messages", "/v1/chat/completions", {"model": MODEL}, 400, "missing_required_parameter", "messages"),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, 400, "invalid_type", "messages"),
    (
        "unknown role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "invalid_value",
        "messages[0].role",
    ),
    (
        "image content",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "invalid_type",
        "messages[0].content",
    ),
    (
        "stream not a bool",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
        400,
        "invalid_type",
        "stream",
    ),
]


@pytest.mark.parametrize("name,path,body,status,code,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_openai_error(server, name, path, body, status, code, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["code"], err["param"]) == (code, param)


def test_bad_input_never_kills_the_server(server):
    """After the table above (and on its own): no 500 was ever sent and the server answers."""
    for _ in range(3):
        assert httpx.post(server.url + "/v1/chat/completions", content=b"\xff\xfe").status_code == 400
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(server.url + "/nope").status_code == 404
    assert (
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=8).choices[0].text is not None
    )
    m = server.metrics()
    assert not [k for k in m if k.startswith("refusion_requests_total") and 'status="500"' in k]
    assert m['refusion_requests_total{route="/v1/chat/completions",status="400"}'] >= 3
    assert m['refusion_errors_total{type="invalid_request_error"}'] >= 5


def test_library_error_is_a_400(loaded, model_dirs):
    """A model without MASK: the library's MissingMaskTokenError for method refusion maps to 400;
    method ar still works on it."""
    model, tok = refusion.load(model_dirs[0])
    with live((model, tok)) as s:
        with pytest.raises(openai.BadRequestError) as e:
            s.client().completions.create(model=MODEL, prompt="x", max_tokens=8)
        assert e.value.body["code"] == "missing_mask_token"
        with pytest.raises(openai.BadRequestError):
            list(s.client().completions.create(model=MODEL, prompt="x", max_tokens=8, stream=True))
        ok = s.client().completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"method": "ar"})
        assert ok.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------- auth
def test_api_key(loaded):
    with live(loaded, api_key="s3cret") as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.client("s3cret").completions.create(model=MODEL, prompt="x", max_tokens=8).choices


# ---------------------------------------------------------------------------- batching and queue
def test_requests_with_different_settings_share_steps(loaded):
    """Four requests with four settings (refusion at two thresholds, ar, sampled refusion)
    added while the engine is held: they decode in the same steps (the rows-per-step
    metric shows it), and each answer equals the library's for that request alone."""
    model, tok = loaded
    engine = GatedEngine(loaded)
    settings = [
        {},
        {"slot_threshold": 0.5, "token_threshold": 0.2, "slot_size": 4},
        {"method": "ar"},
        {"temperature": 0.9, "seed": 5, "serial_blocks": 2},
    ]
    with live(loaded, engine=engine) as s:
        engine.opened.clear()
        client = s.client()
        threads = [
            in_thread(
                lambda e=e: client.completions.create(
                    model=MODEL, prompt="The cat sat", max_tokens=24, extra_body=e
                )
            )
            for e in settings
        ]
        wait_for(lambda: s.loop.queue_length == 4, what="four queued requests")
        engine.opened.set()
        for t, _ in threads:
            t.join(60)
        m = s.metrics()
    texts = [box[0].choices[0].text for _, box in threads]
    refs = [
        generate(model, tok, ["The cat sat"], BASE.replace(gen_length=24, **e), chat=False)[0].text
        for e in settings
    ]
    assert texts == refs
    assert max(engine.step_rows) == 4  # one step carried all four settings
    assert m['refusion_rows_per_step_bucket{le="2"}'] < m["refusion_rows_per_step_count"]
    assert m["refusion_engine_forward_passes"] < sum(
        o.stats.nfe for o in engine.outputs
    )  # forwards were shared
    # how the ReFusion rows decoded: drafting steps and blocks as AR, summed over completions
    assert m["refusion_drafting_steps_total"] == sum(o.stats.draft_steps for o in engine.outputs) > 0
    assert m["refusion_ar_blocks_total"] == sum(o.stats.ar_blocks for o in engine.outputs)


def test_a_preset_request_keeps_the_servers_sampling_settings(loaded):
    """`"preset": "gsm8k"` sets the slot layout and thresholds; the server's own
    temperature and seed stay (the preset does not reset them)."""
    model, tok = loaded
    base = BASE.replace(temperature=0.8, seed=3)
    with live(loaded, cfg=base) as s:
        got = s.client().completions.create(
            model=MODEL, prompt="Two plus", max_tokens=16, extra_body={"preset": "gsm8k"}
        )
    ref = generate(
        model, tok, ["Two plus"], DecodeConfig.preset("gsm8k", base).for_max_tokens(16), chat=False
    )[0]
    greedy = generate(model, tok, ["Two plus"], DecodeConfig.preset("gsm8k").for_max_tokens(16), chat=False)[
        0
    ]
    assert got.choices[0].text == ref.text
    assert ref.text != greedy.text  # the sampling settings made a difference


def test_full_queue_gets_429_with_retry_after(loaded):
    engine = GatedEngine(loaded)
    with live(loaded, engine=engine, max_queue=2) as s:
        client = s.client()
        running = in_thread(
            lambda: client.completions.create(
                model=MODEL, prompt="a", max_tokens=200, extra_body={"method": "ar"}
            )
        )
        wait_for(lambda: s.loop.running == 1, what="the first request to run")
        engine.opened.clear()
        queued = [
            in_thread(lambda: client.completions.create(model=MODEL, prompt="b", max_tokens=8))
            for _ in range(2)
        ]
        wait_for(lambda: s.loop.queue_length == 2, what="a full queue")
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "c", "max_tokens": 8})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt=["c", "d"], max_tokens=8)
        engine.opened.set()
        for t, box in [running, *queued]:
            t.join(60)
            assert box and box[0].choices
        assert s.metrics()["refusion_rejected_total"] == 2
        assert s.client().completions.create(model=MODEL, prompt="again", max_tokens=8).choices


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(loaded):
    """A step that raises (a bug, a device error) fails the requests in it with a 500;
    the engine loop survives and the next request is answered."""

    class Flaky(GatedEngine):
        fail_next = True

        def _step_cached(self):
            if Flaky.fail_next:
                Flaky.fail_next = False
                raise RuntimeError("boom")
            return super()._step_cached()

    with live(loaded, engine=Flaky(loaded)) as s:
        with pytest.raises(openai.InternalServerError):
            s.client().completions.create(model=MODEL, prompt="x", max_tokens=8)
        assert (
            s.client().completions.create(model=MODEL, prompt="x", max_tokens=8).choices[0].text is not None
        )
        assert s.loop.alive


# ---------------------------------------------------------------------------- cancellation and shutdown
def test_disconnect_cancels_the_row(loaded):
    engine = GatedEngine(loaded, delay=0.02)
    with live(loaded, engine=engine) as s:
        body = {"prompt": "Hello", "max_tokens": 200, "method": "ar", "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # one chunk, then hang up
        wait_for(lambda: len(engine.outputs) == 1, what="the streamed row to stop")
        with pytest.raises(httpx.ReadTimeout):  # a plain request whose client gives up
            httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
        wait_for(lambda: len(engine.outputs) == 2, what="the plain row to stop")
        assert [o.finish_reason for o in engine.outputs] == ["cancelled", "cancelled"]
        assert all(len(o.token_ids) < 100 for o in engine.outputs)
        assert s.metrics()['refusion_completions_total{reason="cancelled"}'] == 2
        assert engine.num_running == 0


def test_graceful_shutdown_finishes_in_flight_requests(loaded):
    engine = GatedEngine(loaded, delay=0.01)
    model, tok = loaded
    s = LiveServer(create_app(model, tok, BASE, model_name=MODEL, engine=engine, shutdown_timeout=20))
    body = {"prompt": "Hello", "max_tokens": 40, "method": "ar", "stream": True}
    lines = []
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
        for line in filter(None, r.iter_lines()):
            lines.append(line)
            if len(lines) == 1:
                stopper = threading.Thread(target=s.stop)
                stopper.start()
    stopper.join(30)
    assert len(lines) > 3 and lines[-1] == "data: [DONE]"  # chunks kept coming after the stop began
    finish = [json.loads(x[5:])["choices"][0]["finish_reason"] for x in lines if x.startswith("data: {")]
    assert finish[-1] in ("stop", "length") and engine.outputs[0].finish_reason != "cancelled"
    assert not s.thread.is_alive() and not s.loop.alive


def test_shutdown_cancels_what_outlives_the_grace_period(loaded):
    engine = GatedEngine(loaded, delay=0.02)
    model, tok = loaded
    app = create_app(model, tok, BASE, model_name=MODEL, engine=engine, shutdown_timeout=0.3)
    s = LiveServer(app)
    body = {"prompt": "Hello", "max_tokens": 400, "method": "ar", "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
        next(line for line in r.iter_lines() if line.startswith("data:"))
        s.stop()
    assert not s.thread.is_alive() and not s.loop.alive
    assert time.monotonic() - t0 < 6  # 400 tokens at 20 ms would take 8 s
    assert engine.outputs[0].finish_reason == "cancelled"


def test_loadtest_script_reports(server, capsys):
    import os

    from refusion.serve.loadtest import main as loadtest

    code = loadtest(
        [
            "--url",
            server.url,
            "--clients",
            "3",
            "--seconds",
            "0.5",
            "--max-tokens",
            "8",
            "--pid",
            str(os.getpid()),
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    phase = report["phases"][0]
    assert code == 0 and phase["requests_ok"] >= 3 and 0 < phase["tokens"] <= 8 * phase["requests_ok"]
    assert phase["incomplete"] == 0 and not phase["errors"] and report["rss_kib_after"]["VmRSS"] > 0


def test_loadtest_compare_interleaves_rounds_and_reports_the_median(server, capsys):
    from refusion.serve.loadtest import PROMPTS
    from refusion.serve.loadtest import main as loadtest

    code = loadtest(
        [
            "--url",
            server.url,
            "--compare",
            "1,2",
            "--rounds",
            "2",
            "--seconds",
            "0.4",
            "--max-tokens",
            "4",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and [ph["clients"] for ph in report["phases"]] == [1, 2]
    for ph in report["phases"]:
        assert (
            len(ph["rounds_tokens_per_s"]) == 2 and ph["tokens_per_s"] == sorted(ph["rounds_tokens_per_s"])[0]
        )
    assert report["tokens_per_s_ratio"] == round(
        report["phases"][1]["tokens_per_s"] / report["phases"][0]["tokens_per_s"], 2
    )
    assert len(PROMPTS) > 2  # each client cycles through them all (see run_phase)


def test_loadtest_compares_same_and_mixed_settings(server, capsys, monkeypatch):
    import refusion.serve.loadtest as lt
    from refusion.serve.loadtest import MIXED
    from refusion.serve.loadtest import main as loadtest

    bodies: list[dict] = []
    send = lt.one_request

    async def recorded(client, url, body, phase):
        bodies.append((phase.label, body))
        await send(client, url, body, phase)

    monkeypatch.setattr(lt, "one_request", recorded)
    code = loadtest(
        [
            "--url",
            server.url,
            "--compare",
            "same,mixed",
            "--clients",
            "3",
            "--seconds",
            "0.4",
            "--max-tokens",
            "4",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and [(ph["phase"], ph["clients"]) for ph in report["phases"]] == [
        ("same", 3),
        ("mixed", 3),
    ]
    assert all(ph["requests_ok"] >= 3 and not ph["errors"] for ph in report["phases"])
    assert len({json.dumps(m, sort_keys=True) for m in MIXED}) == len(MIXED) >= 8
    knobs = {k for m in MIXED for k in m}
    extras = {
        ph: {json.dumps({k: b[k] for k in knobs if k in b}, sort_keys=True) for p, b in bodies if p == ph}
        for ph in ("same", "mixed")
    }
    assert extras["same"] == {"{}"} and len(extras["mixed"]) == 3  # 3 clients: the first 3 settings of MIXED


def test_cli_wires_flags_to_the_server(model_dirs, monkeypatch):
    import refusion.serve as serve_pkg

    seen = {}
    monkeypatch.setattr(serve_pkg, "serve", lambda model, tok, cfg, **kw: seen.update(cfg=cfg, **kw))
    argv = [
        "serve",
        str(model_dirs[1]),
        "--port",
        "9",
        "--api-key",
        "k",
        "--max-queue",
        "5",
        "--max-batch-size",
        "3",
        "--slot-size",
        "4",
        "--method",
        "ar",
        "--gen-length",
        "48",
    ]
    assert cli_main(argv) == 0
    assert (seen["host"], seen["port"], seen["api_key"], seen["max_queue"]) == ("127.0.0.1", 9, "k", 5)
    assert seen["engine_config"] == EngineConfig(max_batch_size=3)
    assert seen["model_name"] == model_dirs[1].name
    assert (seen["cfg"].method, seen["cfg"].slot_size, seen["cfg"].gen_length) == ("ar", 4, 48)


def test_loadtest_compares_two_methods_per_client_count(server, capsys, monkeypatch):
    import refusion.serve.loadtest as lt
    from refusion.serve.loadtest import main as loadtest

    methods: list[tuple[str, str]] = []
    asked: set[str] = set()
    send = lt.one_request

    async def recorded(client, url, body, phase):
        methods.append((phase.label, body.get("method")))
        asked.add(body["messages"][0]["content"])
        await send(client, url, body, phase)

    monkeypatch.setattr(lt, "one_request", recorded)
    args = [
        "--url",
        server.url,
        "--compare",
        "1,2",
        "--methods",
        "ar,refusion",
        "--seconds",
        "0.4",
        "--suite",
    ]
    code = loadtest([*args, "--max-tokens", "4", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [ph["phase"] for ph in report["phases"]] == ["ar@1", "refusion@1", "ar@2", "refusion@2"]
    assert {label: m for label, m in methods} == {
        p["phase"]: p["phase"].split("@")[0] for p in report["phases"]
    }
    ph = report["phases"]
    assert report["method_ratio"] == {
        str(n): round(b["tokens_per_s"] / a["tokens_per_s"], 2)
        for n, a, b in [(1, ph[0], ph[1]), (2, ph[2], ph[3])]
    }
    assert asked and asked <= set(lt.suite_prompts())  # --suite: the bundled suite's held-out prompts
    with pytest.raises(SystemExit):
        loadtest(["--url", server.url, "--methods", "ar,refusion"])  # needs --compare client counts
