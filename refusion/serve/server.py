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

The limits on connections and on what a client sends before the app reads its request
(the time a head and a body may take, the connections open at once, the head's size and
shape) are kept by `http/connection.py`, with the figures of a `ServerLimits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from ..settings.serve import ServerLimits
from .http.connection import MAX_HEADER_BYTES, HeadChecks, fit_to_descriptors, protocol_for

log = logging.getLogger("refusion.serve")

# How long after the engine's deadline uvicorn still waits for connections before it
# cancels their tasks: time for the cut requests' last step and their error events.
BACKSTOP_SECONDS = 5.0


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
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    uds: str | None = None,
    limits: ServerLimits | None = None,
) -> Server:
    """The server for `app`; `server.run()` serves until a signal (or `should_exit`).
    With `uds` it listens on that Unix socket instead of host:port, logs no access
    lines and drains on SIGUSR1: a replica behind a front (which logs them). `limits`:
    what a connection may hold (default: `ServerLimits()`)."""
    timeout = app.state.shutdown_timeout
    config = uvicorn.Config(
        HeadChecks(app),
        host=host,
        port=port,
        uds=uds,
        http=protocol_for(fit_to_descriptors(limits or ServerLimits())),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        access_log=uds is None,
        log_level=log_level,
        log_config=_log_config(log_level),
        timeout_graceful_shutdown=timeout + BACKSTOP_SECONDS,
    )
    return Server(config, app.state, drain_on_usr1=uds is not None)


def _log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, with the server's own lines (shutdown, failed steps) in the
    same format and stream as uvicorn's."""
    cfg = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    cfg["loggers"]["refusion.serve"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg
