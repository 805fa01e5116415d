"""`refusion serve` against clients that hold connections rather than send bad bodies:
bodies that stall or trickle (408 and close), more connections than the caps (503, 429),
a head with both Content-Length and Transfer-Encoding (400 and close, nothing smuggled),
API keys no client can send, and a tokenizer that panics on a prompt (an OpenAI 400)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
import test_serve  # noqa: E402
from test_serve import live  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from refusion.cli.dispatch import main as cli_main  # noqa: E402
from refusion.errors import ConfigError  # noqa: E402
from refusion.serve import create_app  # noqa: E402

model_dirs, loaded = test_serve.model_dirs, test_serve.loaded

HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n"
)


def ServerLimits(**figures):  # noqa: N802 (the settings class, imported where a test uses it)
    from refusion.settings.serve import ServerLimits

    return ServerLimits(**figures)


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def read_all(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    sock.settimeout(timeout)
    t0, got = time.monotonic(), b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return got, float("inf")
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    return got, time.monotonic() - t0


def error_of(raw: bytes) -> tuple[int, dict]:
    """(status, OpenAI error object) of a raw HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return status, err


# ---------------------------------------------------------------------------- bodies that stall or trickle
def test_bodies_that_stall_get_408_and_are_closed(loaded):
    """Headers declaring a body, then nothing: every such connection is answered 408 and
    closed once the body timeout has passed, and the server answers others meanwhile."""
    with live(loaded, limits=ServerLimits(body_timeout=1.0, min_body_rate=500)) as s:
        socks = [socket.create_connection(address(s)) for _ in range(20)]
        for sock in socks:
            sock.sendall(HEAD % 1000)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        for sock in socks:
            got, after = read_all(sock, timeout=10)
            sock.close()
            assert after < 10, "the connection was kept open"
            status, err = error_of(got)
            assert status == 408 and err["code"] == "request_timeout" and "body" in err["message"], err


def test_a_body_that_trickles_gets_408_and_is_closed(loaded):
    """A byte every 0.2 s keeps a connection busy but far below the minimum rate: it is
    closed once the body's deadline (the timeout, plus 1/rate s per byte) has passed."""
    with live(loaded, limits=ServerLimits(body_timeout=1.0, min_body_rate=500)) as s:
        sock = socket.create_connection(address(s))
        sock.sendall(HEAD % 1000)
        sock.settimeout(0.2)
        t0, got = time.monotonic(), b""
        while time.monotonic() - t0 < 10:
            try:
                sock.sendall(b" ")
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            got += chunk
        took = time.monotonic() - t0
        sock.close()
        assert took < 5, took
        assert error_of(got)[0] == 408


def test_a_body_that_keeps_the_minimum_rate_is_read(loaded):
    """A body sent slowly but within its deadline is answered as usual."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 2, "user": "x" * 1500}).encode()
    with live(loaded, limits=ServerLimits(body_timeout=1.0, min_body_rate=1000)) as s:
        sock = socket.create_connection(address(s))
        sock.sendall(HEAD % len(body))
        for i in range(0, len(body), 400):  # some 800 bytes a second, over two seconds
            time.sleep(0.5)
            sock.sendall(body[i : i + 400])
        got, _ = read_all(sock, timeout=60)
        sock.close()
        assert got.startswith(b"HTTP/1.1 200"), got[:300]


# ---------------------------------------------------------------------------- how many connections
def idle_connections(server, n: int) -> list[socket.socket]:
    socks = [socket.create_connection(address(server)) for _ in range(n)]
    time.sleep(0.3)  # each counted by the server before the next test
    return socks


def test_connections_over_the_per_client_cap_get_429(loaded):
    with live(loaded, limits=ServerLimits(max_connections_per_client=5)) as s:
        held = idle_connections(s, 5)
        extra = socket.create_connection(address(s))
        got, after = read_all(extra, timeout=5)
        status, err = error_of(got)
        assert status == 429 and err["code"] == "too_many_connections" and "per client" in err["message"]
        held.pop().close()
        time.sleep(0.3)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200  # a freed place is taken
        for sock in held + [extra]:
            sock.close()


def test_connections_over_the_total_cap_get_503(loaded):
    with live(loaded, limits=ServerLimits(max_connections=4)) as s:
        held = idle_connections(s, 4)
        got, _ = read_all(socket.create_connection(address(s)), timeout=5)
        status, err = error_of(got)
        assert status == 503 and err["code"] == "too_many_connections", err
        for sock in held:
            sock.close()
        time.sleep(0.3)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200


def test_the_limits_are_flags_with_their_figures_in_help(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, figure in [
        ("--header-timeout", "10.0"),
        ("--body-timeout", "20.0"),
        ("--min-body-rate", "500"),
        ("--max-connections", "1024"),
        ("--max-connections-per-client", "256"),
    ]:
        entry = text.split(f"{flag} {flag[2:].upper().replace('-', '_')} ")[1]  # its line of the options
        assert f"(default: {figure})" in entry[:400], (flag, entry[:400])


# ---------------------------------------------------------------------------- a head read two ways
def test_content_length_with_transfer_encoding_is_a_400_and_nothing_is_smuggled(loaded):
    """A proxy that trusts Content-Length would pass the chunked body's tail on as part of
    this request; read as chunked, the tail is a second request. Neither: one 400, and
    the connection closed."""
    hidden = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    body = b"0\r\n\r\n" + hidden
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n" % len(body)
    )
    with live(loaded) as s:
        sock = socket.create_connection(address(s))
        sock.sendall(head + body)
        got, after = read_all(sock, timeout=10)
        sock.close()
    assert got.count(b"HTTP/1.1 ") == 1 and after < 10, got
    status, err = error_of(got)
    assert status == 400 and "Content-Length and Transfer-Encoding" in err["message"], err


# ---------------------------------------------------------------------------- API keys
@pytest.mark.parametrize("key", ["clé-secrète", "two words", "", "tab\tkey"])
def test_an_api_key_no_client_can_send_is_refused_at_start(loaded, capsys, monkeypatch, key):
    import refusion.io
    import refusion.serve

    model, tok = loaded
    with pytest.raises(ConfigError, match="printable ASCII"):
        create_app(model, tok, api_key=key)
    for module, name in [(refusion.io, "load"), (refusion.serve, "serve")]:
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the key was taken"))
    code = cli_main(["serve", "--api-key", key])  # refused before any model loads
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "printable ASCII" in err, err


def test_the_api_key_is_compared_as_bytes(loaded):
    """The right key passes; a header of other bytes (UTF-8 that a Latin-1 reading would
    mangle) is a 401 like any wrong key, never a 500."""
    with live(loaded, api_key="sk-abc") as s:
        sock = socket.create_connection(address(s))
        utf8 = "Bearer sk-abç".encode()
        sock.sendall(
            b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: %s\r\nconnection: close\r\n\r\n" % utf8
        )
        got, _ = read_all(sock, timeout=10)
        sock.close()
        assert error_of(got)[0] == 401
        ok = httpx.get(s.url + "/v1/models", headers={"authorization": "Bearer sk-abc"}, timeout=10)
        assert ok.status_code == 200


# ---------------------------------------------------------------------------- a tokenizer that panics
PANIC_REGEX = r"(\w+\s?)*$"  # backtracks past the regex engine's limit on "aaa...a!"


@pytest.fixture
def panicking(loaded, tokenizer_dir):
    from tokenizers import Regex, pre_tokenizers

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(PANIC_REGEX), "isolated"), tok.backend_tokenizer.pre_tokenizer]
    )
    return loaded[0], tok


def test_a_tokenizer_panic_is_an_openai_400_and_the_server_goes_on(panicking):
    with live(panicking) as s:
        r = httpx.post(
            s.url + "/v1/completions", json={"prompt": "a" * 40 + "!", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "tokenizer_failed" and "pre-tokenizer" in err["message"], err
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text


def test_many_slow_bodies_leave_the_server_answering_other_clients(loaded):
    """Stalled bodies from one client at once: those over its cap are refused at once,
    the rest closed by their deadline, and another client (another address) is answered
    all along."""
    limits = ServerLimits(body_timeout=1.0, min_body_rate=500, max_connections_per_client=50)
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=10)
    with live(loaded, limits=limits) as s, other:
        socks, results = [], []
        for _ in range(60):
            sock = socket.create_connection(address(s))
            sock.sendall(HEAD % 1000)
            socks.append(sock)
        threads = [threading.Thread(target=lambda x=x: results.append(read_all(x, 15))) for x in socks]
        for t in threads:
            t.start()
        assert other.get(s.url + "/health").status_code == 200
        for t in threads:
            t.join()
        for sock in socks:
            sock.close()
    statuses = sorted(int(got.split(b" ", 2)[1]) for got, _ in results if got)
    assert all(after < 15 for _, after in results)
    assert statuses.count(429) == 10 and statuses.count(408) == 50, statuses
