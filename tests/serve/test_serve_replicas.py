"""`refusion serve --data-parallel-size N`: a front over N replica processes. (The
openai-client tests of test_serve.py also run against one: its `server` fixture.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from served import Process  # noqa: E402

from refusion.io import BUNDLED_DIR  # noqa: E402
from refusion.serve.replicas.metrics import merge_metrics  # noqa: E402
from refusion.serve.replicas.pool import ReplicaPool  # noqa: E402

CHAT = [{"role": "user", "content": "Reverse the words: red green blue"}]


def _replica_pids(front: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "--", "--replica-socket"], capture_output=True, text=True)
    pids = [int(x) for x in out.stdout.split()]
    return [p for p in pids if _parent(p) == front]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_least_loaded_takes_the_request_and_a_tie_goes_to_the_first():
    reps = ReplicaPool(
        [SimpleNamespace(index=i, in_flight=n, alive=True, ready=True) for i, n in enumerate((2, 1, 1))],
        "/nonexistent",
    )
    assert reps.pick().index == 1
    reps.all[1].in_flight = 3
    assert reps.pick().index == 2
    reps.all[2].alive = False  # an exited replica takes nothing
    assert reps.pick().index == 0
    reps.all[2].alive, reps.all[2].ready = True, False  # nor one started again but not yet ready
    assert reps.pick().index == 0
    for r in reps.all:
        r.alive = False
    assert reps.pick() is None


def test_metrics_of_the_replicas_merge_under_one_header_each():
    one = (
        "# HELP refusion_requests_total HTTP requests\n# TYPE refusion_requests_total counter\n"
        'refusion_requests_total{route="/health",status="200"} 3\n'
        "# HELP refusion_queue_length waiting\n# TYPE refusion_queue_length gauge\nrefusion_queue_length 0\n"
    )
    two = one.replace(" 3\n", " 5\n").replace("length 0", "length 2")
    merged = merge_metrics([("0", one), ("1", two)]).splitlines()
    assert merged == [
        "# HELP refusion_requests_total HTTP requests",
        "# TYPE refusion_requests_total counter",
        'refusion_requests_total{replica="0",route="/health",status="200"} 3',
        'refusion_requests_total{replica="1",route="/health",status="200"} 5',
        "# HELP refusion_queue_length waiting",
        "# TYPE refusion_queue_length gauge",
        'refusion_queue_length{replica="0"} 0',
        'refusion_queue_length{replica="1"} 2',
    ]


def test_two_replicas_share_requests_report_each_and_outlive_one_of_them_until_it_is_back():
    server = Process(BUNDLED_DIR, "--data-parallel-size", "2", "--log-level", "warning")
    try:
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "ok" and [r["replica"] for r in health["replicas"]] == [0, 1]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        texts: list[str] = []

        def ask() -> None:
            for _ in range(4):
                r = client.chat.completions.create(model="refusion-tiny", messages=CHAT, max_tokens=64)
                texts.append(r.choices[0].message.content)

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert len(texts) == 16 and len(set(texts)) == 1  # greedy: every replica answers the same
        metrics = httpx.get(server.url + "/metrics").text
        sent = {i: _sample(metrics, f'refusion_replica_requests_total{{replica="{i}"}}') for i in (0, 1)}
        assert sent[0] + sent[1] == 16 and sent[0] > 0 and sent[1] > 0, sent  # concurrent requests spread
        for i in (0, 1):  # each replica's own counters, labelled
            assert (
                _sample(
                    metrics,
                    f'refusion_requests_total{{replica="{i}",route="/v1/chat/completions",status="200"}}',
                )
                == sent[i]
            )
            assert _sample(metrics, f'refusion_replica_up{{replica="{i}"}}') == 1
        # a client that leaves, streamed or plain, cancels its row in the replica that ran it
        long = {"messages": CHAT, "max_tokens": 480, "method": "ar", "stop_token_ids": []}
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json={**long, "stream": True}, timeout=60
        ) as r:
            next(r.iter_lines())
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/chat/completions", json=long, timeout=httpx.Timeout(60, read=0.3))
        deadline = time.monotonic() + 30
        while _cancelled(server) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _cancelled(server) == 2
        # a replica that dies mid-stream: the stream ends with an error event; /health says so, and the
        # other replica takes every request until the front has started it again
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json={**long, "stream": True}, timeout=60
        ) as r:
            it = r.iter_lines()
            lines = [next(it)]  # both idle: the first replica runs it
            killed = _by_index(server.proc.pid, 0)
            os.kill(killed, signal.SIGKILL)
            lines += [x for x in it if x]
        assert (
            lines[-1] == "data: [DONE]"
            and json.loads(lines[-2][len("data: ") :])["error"]["code"] == "replica_failed"
        )
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["replicas"][0]["status"] in ("exited", "starting")
        before = _sample(
            httpx.get(server.url + "/metrics").text, 'refusion_replica_requests_total{replica="1"}'
        )
        r = client.chat.completions.create(model="refusion-tiny", messages=CHAT, max_tokens=64)
        assert r.choices[0].message.content == texts[0]
        metrics = httpx.get(server.url + "/metrics").text
        assert _sample(metrics, 'refusion_replica_up{replica="0"}') == 0
        assert _sample(metrics, 'refusion_replica_requests_total{replica="1"}') == before + 1
        # the front starts it again (after a second's backoff) and /health recovers
        deadline = time.monotonic() + 120
        while httpx.get(server.url + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200, health.text
        assert [(x["status"], x["restarts"]) for x in health.json()["replicas"]] == [("ok", 1), ("ok", 0)]
        assert _by_index(server.proc.pid, 0) != killed
        metrics = httpx.get(server.url + "/metrics").text
        assert _sample(metrics, 'refusion_replica_restarts_total{replica="0"}') == 1
        before = _sample(metrics, 'refusion_replica_requests_total{replica="0"}')
        r = client.chat.completions.create(model="refusion-tiny", messages=CHAT, max_tokens=64)
        assert r.choices[0].message.content == texts[0]  # both idle: the first replica, back, answers
        metrics = httpx.get(server.url + "/metrics").text
        assert _sample(metrics, 'refusion_replica_requests_total{replica="0"}') == before + 1
        assert _sample(metrics, 'refusion_replica_up{replica="0"}') == 1
    finally:
        _stop(server)


def _cancelled(server: Process) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(x.rsplit(" ", 1)[1])
        for x in text.splitlines()
        if x.startswith("refusion_completions_total{") and 'reason="cancelled"' in x
    )


def _stop(server: Process) -> None:
    """End a front as a user would (SIGTERM: its replicas go with it), killing it only if
    it does not go."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def _by_index(front: int, index: int) -> int:
    """The pid of replica `index` of the front `front` (its socket is named by its index)."""
    for pid in _replica_pids(front):
        with open(f"/proc/{pid}/cmdline") as f:
            if f.read().split("\0")[-2].endswith(f"/{index}.sock"):
                return pid
    raise AssertionError(f"no replica {index}")


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} in the metrics")


def test_sigterm_on_the_front_drains_the_replicas_and_ends_them():
    server = Process(BUNDLED_DIR, "--data-parallel-size", "2", "--log-level", "warning")
    try:
        replicas = _replica_pids(server.proc.pid)
        assert len(replicas) == 2
        lines: list[str] = []
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            timeout=60,
            json={"messages": CHAT, "max_tokens": 256, "stream": True},
        ) as r:
            it = r.iter_lines()
            lines.append(next(it))  # the stream has begun
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(server.url + "/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = httpx.post(  # while the stream drains, a new request is answered
                server.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}, timeout=30
            )
            lines += [x for x in it if x]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines)  # it ran to its end
        assert server.proc.wait(60) in (0, -signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in replicas) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in replicas)
    finally:
        _stop(server)


def test_a_replica_that_cannot_start_ends_the_front_with_its_error(tmp_path):
    """A checkpoint whose config and tokenizer read (the front checks them before any
    replica starts) but whose weights do not: each replica fails as it loads them."""
    import shutil

    from refusion.io import BUNDLED_ROOT

    broken = tmp_path / "broken"
    shutil.copytree(BUNDLED_ROOT / "refusion-tiny", broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "refusion.cli",
            "serve",
            str(broken),
            "--data-parallel-size",
            "2",
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "replica" in out.stderr and "before it was ready" in out.stderr
    assert str(broken / "model.safetensors") in out.stderr  # the replica's own error, above the front's


def test_a_taken_port_fails_before_any_replica_starts():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "refusion.cli", "serve", "--data-parallel-size", "2", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert (
        out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr
    )
    assert "starting 2 replicas" not in out.stderr and time.monotonic() - t0 < 60


def test_the_front_checks_the_key_first_and_stops_when_no_replica_can_start_again(tmp_path):
    model = tmp_path / BUNDLED_DIR.name
    shutil.copytree(BUNDLED_DIR, model)
    server = Process(model, "--data-parallel-size", "2", "--api-key", "k", "--log-level", "warning")
    try:
        big = b"x" * (17 * 2**20)  # over the body limit: a wrong key is still what the answer says
        r = httpx.post(
            server.url + "/v1/completions",
            content=big,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/metrics").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200  # never needs the key
        ok = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Sort: 3, 1, 2", "max_tokens": 8},
            headers={"authorization": "Bearer k"},
            timeout=60,
        )
        assert ok.status_code == 200 and "date" in ok.headers and len(ok.headers.get_list("date")) == 1
        assert (
            'refusion_replica_up{replica="1"} 1'
            in httpx.get(server.url + "/metrics", headers={"authorization": "Bearer k"}).text
        )
        shutil.rmtree(model)  # every start from now on fails
        for i in (0, 1):
            os.killpg(_by_index(server.proc.pid, i), signal.SIGKILL)
        assert server.proc.wait(180) == 2  # a supervisor sees the front go, and can start it again
        log = "\n".join(server.log_after(0))
        assert log.count("starting it again in") == 6 and log.count("not started again") == 2, log
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(
            "every replica exited" in x for x in server.log_after(0)
        ):
            time.sleep(0.1)
        assert any("every replica exited" in x for x in server.log_after(0))
    finally:
        _stop(server)
