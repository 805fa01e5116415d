"""One replica process: a `refusion serve` of its own on a Unix socket (in its own
session, sent SIGTERM should the front die), and the front's client of it; started
again after a backoff when it exits, unless it keeps failing to start."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx

# restarting a replica that exited: the first wait, the longest, how long it must have served for
# its next exit to count as the first again, and how many starts in a row may fail before it is left
RESTART_FIRST_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
RESTART_STABLE_SECONDS = 60.0
MAX_FAILED_STARTS = 3


class Replica:
    """One replica process (started again when it exits), its socket, and the front's
    count of its load."""

    def __init__(self, index: int, socket_path: str, cmd: list[str], env: dict[str, str]) -> None:
        self.index, self.socket, self.cmd, self.env = index, socket_path, cmd, env
        self.in_flight = 0
        self.ready = False  # its /health has answered 200 since it was started
        self.ready_since = 0.0
        self.restarts = 0
        self.exits_in_a_row = 0  # exits without a stable run between them: the backoff's exponent
        self.failed_starts = 0  # starts in a row that exited before they were ready
        self.restart_at: float | None = None  # while it is down: when it is started again
        self.left = False  # not started again: it failed to start too often
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, start_new_session=True, preexec_fn=_end_with_parent
        )
        self.ready = False
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket),
            base_url="http://replica",
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0),
        )  # under uvicorn's 5 s

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    async def answers_health(self) -> bool:
        """Whether its /health answers 200 now."""
        try:
            return (await self.client.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def mark_ready(self) -> None:
        self.ready, self.ready_since, self.failed_starts = True, time.monotonic(), 0

    def exited(self) -> float | None:
        """Note that the process has exited: the seconds until it is started again, or
        None when it is left (it failed to start `MAX_FAILED_STARTS` times in a row).
        What is left of its session (tensor-parallel ranks) is killed."""
        now = time.monotonic()
        if self.ready and now - self.ready_since >= RESTART_STABLE_SECONDS:
            self.exits_in_a_row = 0
        self.exits_in_a_row += 1
        self.failed_starts = 0 if self.ready else self.failed_starts + 1
        self.ready = False
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.failed_starts >= MAX_FAILED_STARTS:
            self.left = True
            return None
        delay = min(RESTART_MAX_SECONDS, RESTART_FIRST_SECONDS * 2 ** (self.exits_in_a_row - 1))
        self.restart_at = now + delay
        return delay

    def signal(self, sig: int, group: bool = False) -> None:
        """Signal the replica; with `group`, its tensor-parallel ranks too (its session's
        processes: they would otherwise wait in a collective for a leader gone)."""
        if self.alive:
            try:
                os.killpg(self.proc.pid, sig) if group else self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def _end_with_parent() -> None:
    """In the replica, before it runs: Linux sends it SIGTERM when the front dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
