"""Every error answers in OpenAI's error shape, counted by type: the API's own,
Starlette's (an unknown route, a wrong method) and anything unexpected (a 500); a client
gone while its body was read (a connection closed for a slow body, say) gets nothing."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request

from ..metrics import Metrics
from ..protocol.errors import APIError

log = logging.getLogger("refusion.serve")


def error_response(e: APIError, metrics: Metrics | None = None) -> JSONResponse:
    """The response for `e`, counted in `metrics` when given."""
    if metrics is not None:
        metrics.errors.inc(1, e.type)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    quiet_disconnects(app)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError) -> JSONResponse:
        return error_response(e, metrics)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, e: HTTPException) -> JSONResponse:
        return error_response(_http_error(e), metrics)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        error = APIError(
            500, f"internal server error: {type(e).__name__}", type="server_error", code="internal_error"
        )
        return error_response(error, metrics)


def quiet_disconnects(app: FastAPI) -> None:
    """A body cut off by its client (or closed by the connection's limits, which answered
    it already) ends the request as a disconnect does elsewhere: a 499 that no one reads,
    and no traceback in the log."""

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_request: Request, _e: ClientDisconnect) -> Response:
        return Response(status_code=499)


def _http_error(e: HTTPException) -> APIError:
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return APIError(e.status_code, str(e.detail), param=None, code=code, headers=dict(e.headers or {}))
