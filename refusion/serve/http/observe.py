"""The ASGI wrapper around the app: the API key, then per-route request counts and latency."""

from __future__ import annotations

import time
from typing import Any

from ..metrics import Metrics
from .auth import authorised, unauthorised
from .errors import error_response

# routes counted by their own name; /v1/models/NAME as one route, anything else as "other"
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


def route_of(path: str) -> str:
    """The label a request's path is counted under (a bounded set: a client cannot grow it)."""
    return path if path in ROUTES else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class Observe:
    """ASGI wrapper: bearer-token auth, and per-route request counts and latency (taken
    when the last byte of the response is sent, so streams count in full)."""

    def __init__(self, app: Any, metrics: Metrics, api_key: str | None) -> None:
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_of(scope["path"])
        t0, status, recorded = time.monotonic(), [500], [False]

        def record() -> None:
            if not recorded[0]:
                recorded[0] = True
                self.metrics.requests.inc(1, route, str(status[0]))
                self.metrics.latency.observe(time.monotonic() - t0, route)

        async def observed_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record()

        try:
            if not authorised(scope, self.api_key):
                return await error_response(unauthorised(), self.metrics)(scope, receive, observed_send)
            await self.app(scope, receive, observed_send)
        finally:
            record()
