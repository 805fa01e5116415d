"""What a connection may hold before the app reads its request, kept by the HTTP protocol
(`GuardedProtocol`, uvicorn's h11 protocol with the limits of a `ServerLimits`) and by one
ASGI check of the request's head (`HeadChecks`):

- time: a request's head must be in within `header_timeout` seconds of its first byte,
  and its body within `body_timeout` seconds of the head's end plus 1/`min_body_rate`
  seconds per byte that arrives (Apache's mod_reqtimeout rule), or the client gets a 408
  and the connection is closed; a stalled or trickling body no longer holds a socket
  for ever;
- count: a connection past `max_connections` open at once is answered 503 and closed, one
  past `max_connections_per_client` from the same address 429, before anything is read;
- shape: a head whose headers add up to over `MAX_HEADER_BYTES` gets a 431, and one that
  declares both Content-Length and Transfer-Encoding a 400 and the connection is closed
  (RFC 9112 6.3): a proxy that trusts the length would read the rest of the body as the
  next request, which the server would then answer.

It is the h11 protocol whether or not httptools is installed, so the limits hold on
every install.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...settings.serve import ServerLimits
from ..protocol.errors import APIError
from .errors import error_response

log = logging.getLogger("refusion.serve")

# a request's header bytes (names and values): h11's own default, and far above what any client sends
MAX_HEADER_BYTES = 16 * 1024
# descriptors kept for what is not a client's connection (model files, logs, replicas' sockets)
SPARE_DESCRIPTORS = 128


class GuardedProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's head and body, and
    caps on the connections open at once (see the module's note). uvicorn's keep-alive
    timeout covers the wait between requests. `protocol_for` makes one with a server's
    limits."""

    limits = ServerLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.body_started = self.last_byte = 0.0
        self.body_bytes = 0
        self.counted: str | None = None
        refusal = self._refusal()
        if refusal is not None:
            transport.write(refusal)
            transport.close()
            return
        self._arm_head()

    def data_received(self, data: bytes) -> None:
        if self.head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_head()  # the first bytes of a kept-alive connection's next request
        body_before = self.body_timer is not None
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_head()
        if self.conn.their_state is h11.SEND_BODY:
            if not body_before:
                self._arm_body()
            else:
                self.body_bytes += len(data)
                self.last_byte = time.monotonic()
        else:
            self._disarm_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head()
        self._disarm_body()
        if self.counted is not None:
            clients = _clients(self.server_state)
            clients[self.counted] -= 1
            if clients[self.counted] <= 0:
                del clients[self.counted]
        super().connection_lost(exc)

    # ------------------------------------------------------------------ how many
    def _refusal(self) -> bytes | None:
        """The answer for a connection over a cap (and nothing for one within them, which
        is then counted for its client)."""
        if len(self.connections) > self.limits.max_connections:
            return raw_response(
                APIError(
                    503,
                    f"the server has {self.limits.max_connections} connections open, its limit; retry later",
                    type="server_error",
                    code="too_many_connections",
                )
            )
        host = self.client[0] if self.client else None
        if host is None:  # a Unix socket: the one client is a replica's front
            return None
        clients = _clients(self.server_state)
        if clients[host] >= self.limits.max_connections_per_client:
            return raw_response(
                APIError(
                    429,
                    f"{host} has {clients[host]} connections open to this server, its limit per client; "
                    "close some, or reuse them (keep-alive)",
                    type="rate_limit_error",
                    code="too_many_connections",
                )
            )
        clients[host] += 1
        self.counted = host
        return None

    # ------------------------------------------------------------------ the head
    def _arm_head(self) -> None:
        self.head_timer = self.loop.call_later(self.limits.header_timeout, self._head_too_slow)

    def _disarm_head(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why the connection ends
            seconds = self.limits.header_timeout
            what = f"the request line and headers did not arrive within {seconds:g} s"
            self.transport.write(raw_response(APIError(408, what, code="request_timeout")))
        self.transport.close()

    # ------------------------------------------------------------------ the body
    def _arm_body(self) -> None:
        self.body_started = self.last_byte = time.monotonic()
        self.body_bytes = 0
        self.body_timer = self.loop.call_later(self.limits.body_timeout, self._check_body)

    def _disarm_body(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def _body_deadline(self) -> float:
        rate, timeout = self.limits.min_body_rate, self.limits.body_timeout
        if rate > 0:
            return self.body_started + timeout + self.body_bytes / rate
        return self.last_byte + timeout

    def _check_body(self) -> None:
        """At the body's deadline, or later: close the connection (with a 408 if no answer
        has begun) unless bytes that arrived meanwhile put the deadline later. While the
        app is not reading (uvicorn holds the client back then), the clock starts again."""
        self.body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        now = time.monotonic()
        if self.flow.read_paused:
            self.body_started, self.last_byte, self.body_bytes = now, now, 0
        elif now >= self._body_deadline():
            self._body_too_slow()
            return
        self.body_timer = self.loop.call_later(max(self._body_deadline() - now, 0.05), self._check_body)

    def _body_too_slow(self) -> None:
        answered = self.cycle is not None and self.cycle.response_started
        if not answered:
            rate, seconds = self.limits.min_body_rate, self.limits.body_timeout
            pace = f" and {rate} bytes a second after that" if rate else " without a pause that long"
            what = f"the request body did not arrive within {seconds:g} s{pace}"
            self.transport.write(raw_response(APIError(408, what, code="request_timeout")))
        self.transport.close()


def _clients(server_state: Any) -> Counter:
    """The open connections by client address, kept on uvicorn's server state."""
    if not hasattr(server_state, "refusion_clients"):
        server_state.refusion_clients = Counter()
    return server_state.refusion_clients


def protocol_for(limits: ServerLimits) -> type[GuardedProtocol]:
    """The protocol class uvicorn makes each connection's protocol from, with `limits`."""
    return type("Guarded", (GuardedProtocol,), {"limits": limits})


def raw_response(error: APIError) -> bytes:
    """An error response in OpenAI's shape, written by hand where h11 has no request to
    answer (a timeout, a connection over a cap); the connection is closed after it."""
    body = json.dumps(error.body()).encode()
    reason = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}.get(
        error.status, "Error"
    )
    head = (
        f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def fit_to_descriptors(limits: ServerLimits) -> ServerLimits:
    """`limits` with max_connections the process can hold: its soft open-file limit is
    raised toward the hard one if need be, and where that is not enough the cap is
    lowered (said once), so that the server refuses connections with a 503 instead of
    failing to accept them."""
    need = limits.max_connections + SPARE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        wanted = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return limits
    most = max(1, soft - SPARE_DESCRIPTORS)
    log.warning(
        "the open-file limit (%d) holds %d connections, not --max-connections %d; raise it (ulimit -n) "
        "for more",
        soft,
        most,
        limits.max_connections,
    )
    return limits.replace(
        max_connections=most, max_connections_per_client=min(most, limits.max_connections_per_client)
    )


class HeadChecks:
    """ASGI wrapper: a request whose headers add up to more than `MAX_HEADER_BYTES` gets a
    431, one with both Content-Length and Transfer-Encoding a 400, both in OpenAI's error
    shape and with the connection closed, before the app (and its body) is touched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = head_error(scope)
            if error is not None:
                return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


def head_error(scope: dict) -> APIError | None:
    """What is wrong with a request's head, if anything."""
    if header_bytes(scope) > MAX_HEADER_BYTES:
        return APIError(
            431,
            f"the request's headers are over {MAX_HEADER_BYTES} bytes; send shorter ones",
            code="request_headers_too_large",
            headers={"connection": "close"},
        )
    names = {k.lower() for k, _ in scope["headers"]}
    if b"content-length" in names and b"transfer-encoding" in names:
        return APIError(
            400,
            "the request has both Content-Length and Transfer-Encoding, which RFC 9112 refuses "
            "(a proxy and this server could read its body differently); send one of them",
            code="invalid_request",
            headers={"connection": "close"},
        )
    return None


def header_bytes(scope: dict) -> int:
    """The bytes of a request's header names and values, and its target."""
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    return target + sum(len(k) + len(v) for k, v in scope["headers"])
