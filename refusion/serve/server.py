"""uvicorn's server with the shutdown and the limits a serving process needs.

uvicorn alone drains first (it stops listening and waits up to its graceful timeout for
connections to finish) and only then tells the app to stop: the engine loop would keep
queued requests waiting through the whole drain, and whatever outlived it would be
cancelled by uvicorn, as plain-text 500s, cut streams and one traceback each. Here the
first SIGINT/SIGTERM closes the engine loop as the drain begins (new and queued requests
get 503 `shutting_down`; running ones finish or are cut with an error event at
`--shutdown-timeout`). The server keeps listening, and keeps kept-alive connections open,
until the app has drained, so a request sent meanwhile gets that 503 rather than a
refused or closed connection; then uvicorn's own drain runs, its timeout only a backstop,
and a second signal exits at once.

Limits on what a client sends before its body: a request's headers over
`MAX_HEADER_BYTES` get a 431 (uvicorn's h11 refuses a head that large while it is still
arriving; a head that arrives whole is measured here), and a connection whose request
line and headers are not all in within `HEADER_TIMEOUT` seconds is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http.errors import error_response
from .protocol.errors import APIError

log = logging.getLogger("refusion.serve")

# How long after the engine's deadline uvicorn still waits for connections before it
# cancels their tasks: time for the cut requests' last step and their error events.
BACKSTOP_SECONDS = 5.0
# a request's header bytes (names and values): h11's own default, and far above what any client sends
MAX_HEADER_BYTES = 16 * 1024
# seconds from a connection's first byte (or its opening) to the end of its request's headers
HEADER_TIMEOUT = 10.0


class Server(uvicorn.Server):
    """A uvicorn server for an app made by `create_app` or `replicas.front.create_front`. It
    reads from `app.state`: `shutdown_timeout`, `begin_drain(timeout)` (called as the
    drain begins) and, optionally, `drained()` (whether the drain is over: until then
    the server answers) and `on_exit_now(sig)` (called before a second signal ends the
    process)."""

    def __init__(self, config: uvicorn.Config, app_state: Any, drain_on_usr1: bool = False) -> None:
        super().__init__(config)
        self.app_state = app_state
        self.drain_on_usr1 = drain_on_usr1

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's signals; a replica also takes SIGUSR1, its front's word to drain, as a
        first SIGTERM, and as nothing when it drains already (systemd, say, signals every
        process of a service, and the front passes its own signal on too)."""
        with super().capture_signals():
            if not (self.drain_on_usr1 and threading.current_thread() is threading.main_thread()):
                yield
                return
            previous = signal.signal(signal.SIGUSR1, self._drain_asked)
            try:
                yield
            finally:
                signal.signal(signal.SIGUSR1, previous)

    def _drain_asked(self, _sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self.handle_exit(signal.SIGTERM, frame)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: shut down gracefully (uvicorn raises the signal again once done,
        so the process ends as that signal says: SIGTERM's exit status, or SIGINT's
        KeyboardInterrupt). Second: exit now."""
        if self.should_exit:
            hook = getattr(self.app_state, "on_exit_now", None)
            if hook is not None:
                hook(sig)
            exit_now(sig)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Begin the app's drain (close the engine loop; a front: tell its replicas) before
        uvicorn's own, so its deadline runs alongside, and answer until it is over."""
        self.app_state.begin_drain(self.app_state.shutdown_timeout)
        await self._answer_while_draining()
        await super().shutdown(sockets)

    async def _answer_while_draining(self) -> None:
        """Keep the listening socket and every connection open until the app says it has
        drained (`app.state.drained()`), at most the shutdown timeout and a second for the
        cut requests' last events: what arrives meanwhile is answered (503
        `shutting_down`), not refused."""
        drained = getattr(self.app_state, "drained", None)
        if drained is None:
            return
        deadline = time.monotonic() + self.app_state.shutdown_timeout + 1.0
        while not drained() and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def exit_now(sig: int) -> None:
    """Leave without waiting for anything: requests in flight are dropped."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    log.warning("%s again: exiting now, without waiting for requests in flight", name)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(128 + sig)


def make_server(
    app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", uds: str | None = None
) -> Server:
    """The server for `app`; `server.run()` serves until a signal (or `should_exit`).
    With `uds` it listens on that Unix socket instead of host:port, logs no access
    lines and drains on SIGUSR1: a replica behind a front (which logs them)."""
    timeout = app.state.shutdown_timeout
    config = uvicorn.Config(
        HeaderLimit(app),
        host=host,
        port=port,
        uds=uds,
        http=HeadTimeoutProtocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        access_log=uds is None,
        log_level=log_level,
        log_config=_log_config(log_level),
        timeout_graceful_shutdown=timeout + BACKSTOP_SECONDS,
    )
    return Server(config, app.state, drain_on_usr1=uds is not None)


class HeaderLimit:
    """ASGI wrapper: a request whose headers add up to more than `MAX_HEADER_BYTES` gets
    a 431 in OpenAI's error shape, before the app (and its body) is touched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and header_bytes(scope) > MAX_HEADER_BYTES:
            error = APIError(
                431,
                f"the request's headers are over {MAX_HEADER_BYTES} bytes; send shorter ones",
                code="request_headers_too_large",
                headers={"connection": "close"},
            )
            return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


def header_bytes(scope: dict) -> int:
    """The bytes of a request's header names and values, and its target."""
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    return target + sum(len(k) + len(v) for k, v in scope["headers"])


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline for each request's head: a connection
    that has not sent a whole request line and headers `HEADER_TIMEOUT` seconds after it
    opened, or after the first byte of its next request, is closed (a 408 first when
    part of a head came). uvicorn's keep-alive timeout covers the wait between requests.
    It is the h11 protocol whether or not httptools is installed, so the limits hold
    on every install."""

    header_timeout = HEADER_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of a kept-alive connection's next request
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.head_timer = self.loop.call_later(self.header_timeout, self._head_too_slow)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:
            self.transport.write(_timeout_response(self.header_timeout))
        self.transport.close()


def _timeout_response(seconds: float) -> bytes:
    """A 408 in OpenAI's error shape, written by hand: h11 has no request to answer."""
    error = APIError(
        408, f"the request line and headers did not arrive within {seconds:g} s", code="request_timeout"
    )
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, with the server's own lines (shutdown, failed steps) in the
    same format and stream as uvicorn's."""
    cfg = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    cfg["loggers"]["refusion.serve"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg
