"""Helpers of the server's tests: a `refusion serve` process for the tests that need a real
one (shutdown, replicas, tensor-parallel and quantized servers), the polling helper they
wait with, the server's fitting of one prompt by its length alone, and the plain forward
that reported log-probabilities are checked against."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from refusion.decode.admit import Admission
from refusion.settings.decode import DecodeConfig
from refusion.settings.model import ModelConfig


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """`refusion serve` in a subprocess, stderr collected in a thread."""

    def __init__(self, model: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-u",
            "-m",
            "refusion.cli",
            "serve",
            str(model),
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, PYTHONWARNINGS="ignore"),
        )
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._pump, daemon=True).start()
        wait_for(self._healthy, timeout=120, what="the server process to answer /health")

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError("the server exited: " + "\n".join(x for _, x in self.lines))
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def log_after(self, t0: float) -> list[str]:
        return [x for t, x in self.lines if t >= t0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def fit_length(
    cfg: DecodeConfig, prompt_len: int, max_tokens: int | None, context: int, param: str
) -> DecodeConfig:
    """The config the server decodes a `prompt_len`-token prompt with (`protocol.requests.admit`:
    the engine's admission, its errors as 400s) on a model of `context` positions."""
    from refusion.serve.protocol.requests import admit

    config = ModelConfig(
        vocab_size=64,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=context,
        mask_token_id=3,
        eos_token_id=2,
    )
    return admit(Admission(config, None, cfg), [1] * prompt_len, cfg, max_tokens, param).cfg


def forward_logprobs(model, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """log p(gen[i] | prompt + gen[:i]) (len(gen),) by one plain forward over the whole
    sequence, without a cache: the reference for a decoder's reported log-probabilities."""
    ids = torch.tensor([prompt + gen])  # (1, n)
    with torch.no_grad():
        hidden = model.hidden(ids, torch.arange(ids.shape[1])[None], lengths=[ids.shape[1]])
        lp = torch.log_softmax(model.lm_head(hidden).float()[0], dim=-1)  # (n, V)
    P = len(prompt)
    return lp[torch.arange(P - 1, P - 1 + len(gen)), torch.tensor(gen)]
