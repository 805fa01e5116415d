"""`chat` and `serve` on a split model: rank 0 owns the terminal or the socket and sends
each step's requests and aborts to the other rank, whose engine follows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import refusion
from refusion.io import BUNDLED_DIR

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from served import Process  # noqa: E402  (a served process, its log collected)

PROMPTS = [
    "Sort these numbers from smallest to largest: 55, 25, 75, 93",
    "Reverse the words: red green blue",
    "Write a Python function run(n) that returns n * 3.",
]


def _chat(*flags: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "refusion.cli", "chat", *flags],
        input="\n".join(PROMPTS) + "\n\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_chat_split_over_two_ranks_answers_as_one_process():
    assert _chat("--tensor-parallel-size", "2") == _chat()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_serve_split_over_two_ranks_answers_aborts_and_shuts_down():
    model, tok = refusion.load()
    want = [o.text for o in refusion.generate(model, tok, PROMPTS)]
    server = Process(BUNDLED_DIR, "--tensor-parallel-size", "2")
    try:
        followers = _children(server.proc.pid)
        assert followers  # rank 1 (and the spawn helper)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        got: dict[int, str] = {}

        def ask(i: int) -> None:
            r = client.chat.completions.create(
                model="refusion-tiny", messages=[{"role": "user", "content": PROMPTS[i]}]
            )
            got[i] = r.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]  # they share steps
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [got[i] for i in range(len(PROMPTS))] == want
        # a stream abandoned after its first chunk is aborted on both ranks; the next request still runs
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            timeout=60,
            json={
                "model": "refusion-tiny",
                "stream": True,
                "max_tokens": 64,
                "messages": [{"role": "user", "content": PROMPTS[2]}],
            },
        ) as r:
            next(r.iter_lines())
        ask(0)
        assert got[0] == want[0]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(90) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
        deadline = time.monotonic() + 60  # the other rank leaves its loop at the leader's stop, then exits
        while [p for p in followers if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in followers if _alive(p)]
    finally:
        server.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
