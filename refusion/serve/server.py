"""uvicorn's server with the shutdown a serving process needs.

uvicorn alone drains first (it stops listening and waits up to its graceful timeout for
connections to finish) and only then tells the app to stop: the engine loop would keep
queued requests waiting through the whole drain, and whatever outlived it would be
cancelled by uvicorn, as plain-text 500s, cut streams and one traceback each. Here the
first SIGINT/SIGTERM closes the engine loop as the drain begins (new and queued requests
get 503 `shutting_down`; running ones finish or are cut with an error event at
`--shutdown-timeout`), uvicorn's own timeout is only a backstop after that, and a second
signal exits at once.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import socket
import sys
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger("refusion.serve")

# How long after the engine's deadline uvicorn still waits for connections before it
# cancels their tasks: time for the cut requests' last step and their error events.
BACKSTOP_SECONDS = 5.0


class Server(uvicorn.Server):
    """A uvicorn server for an app made by `create_app` (it reads the app's engine loop
    and shutdown timeout from `app.state`)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.app_state = config.app.state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: shut down gracefully (uvicorn raises the signal again once done,
        so the process ends as that signal says: SIGTERM's exit status, or SIGINT's
        KeyboardInterrupt). Second: exit now."""
        if self.should_exit:
            exit_now(sig)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Close the engine loop before uvicorn's drain, so its deadline runs alongside."""
        self.app_state.engine_loop.close(self.app_state.shutdown_timeout)
        await super().shutdown(sockets)


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


def make_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> Server:
    """The server for `app`; `server.run()` serves until a signal (or `should_exit`)."""
    timeout = app.state.shutdown_timeout
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=_log_config(log_level),
                            timeout_graceful_shutdown=timeout + BACKSTOP_SECONDS)
    return Server(config)


def _log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, with the server's own lines (shutdown, failed steps) in the
    same format and stream as uvicorn's."""
    cfg = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    cfg["loggers"]["refusion.serve"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg
