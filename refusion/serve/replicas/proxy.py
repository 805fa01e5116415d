"""A request passed on to the least-loaded replica and its answer passed back as it comes
(a stream chunk by chunk), body and headers untouched but for those that describe one
connection. The front checks the API key first (before reading a body that would be
refused) and answers 503 itself while the replicas drain; everything else (validation,
limits, error bodies) is the replica's own. A client that goes away before the answer
starts closes the replica connection, which aborts its rows there.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request

from ..http.auth import authorised, unauthorised
from ..http.disconnect import ClientGone, DisconnectWatch
from ..http.limits import read_body
from ..loop import REFUSED, ShuttingDown
from ..protocol.errors import APIError, library_error
from ..protocol.streams import DONE, event
from .pool import ReplicaPool
from .process import Replica

log = logging.getLogger("refusion.serve")

# headers that describe one connection, not the message: never passed through
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
}
OWN = {"date", "server"}  # a response's own, which the front's server writes
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def passed_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A request's headers as the replica gets them."""
    return [(k, v) for k, v in raw if k.decode("latin-1").lower() not in HOP_BY_HOP]


def response_headers(answer: httpx.Response) -> dict[str, str]:
    """A replica's response headers as the client gets them."""
    return {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP | OWN}


async def pass_on(request: Request, replicas: ReplicaPool) -> Response:
    """Send the request to the least-loaded replica and its answer back, as it comes."""
    if not authorised(request.scope, replicas.api_key):  # before reading a body that would be refused
        raise unauthorised()
    if replicas.closing:  # every replica drains: it would refuse the request too, or be gone already
        raise library_error(ShuttingDown(REFUSED))
    body = await read_body(request)
    replica = replicas.pick()
    if replica is None:
        raise APIError(503, "no replica is running", type="server_error", code="no_replica")
    replica.in_flight += 1
    replicas.metrics.dispatched.inc(1, str(replica.index))
    try:
        answer = await _send(request, replica, body)
    except BaseException as e:
        replica.in_flight -= 1
        if isinstance(e, ClientGone):
            return Response(status_code=499)
        if isinstance(e, httpx.HTTPError):
            raise APIError(
                503,
                f"replica {replica.index} did not answer ({type(e).__name__}); retry",
                type="server_error",
                code="replica_unavailable",
            ) from None
        raise
    return StreamingResponse(
        _relay(answer, replica), status_code=answer.status_code, headers=response_headers(answer)
    )


async def _send(request: Request, replica: Replica, body: bytes) -> httpx.Response:
    """The replica's answer to the request, once it starts (`ClientGone` should the client
    leave first: a plain completion's answer starts only when it is done)."""
    raw = request.scope.get("raw_path") or request.url.path.encode()  # as sent: %3F stays %3F
    target = raw.decode("latin-1") + (f"?{request.url.query}" if request.url.query else "")
    upstream = replica.client.build_request(
        request.method, target, headers=passed_headers(request.headers.raw), content=body
    )
    watch = DisconnectWatch(request)
    try:
        return await watch.race(replica.client.send(upstream, stream=True))
    finally:
        watch.close()


async def _relay(answer: httpx.Response, replica: Replica) -> AsyncIterator[bytes]:
    """The answer's bytes as they come; the replica's load is let go at the end."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.HTTPError:  # the replica went away mid-answer
        log.warning("replica %d broke off a response", replica.index)
        if not answer.headers.get("content-type", "").startswith("text/event-stream"):
            raise  # the client's connection is cut too, so a partial body does not pass for a whole one
        error = APIError(
            502,
            f"replica {replica.index} stopped during the response",
            type="server_error",
            code="replica_failed",
        )  # a stream ends as the server's own do, after a cut event
        yield ("\n\n" + event(error.body()) + DONE).encode()
    finally:
        replica.in_flight -= 1
        await answer.aclose()
