"""The front's app: /health and /metrics answered from every replica's (and the front's
own state), everything else passed on to one replica (`proxy.py`); while it runs, a
watch starts replicas that exited again and stops the front when none is left."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..http.auth import check_api_key
from ..http.errors import error_response, quiet_disconnects
from ..protocol.errors import APIError
from .metrics import merge_metrics
from .pool import ReplicaPool
from .process import Replica
from .proxy import METHODS, pass_on, passed_headers, response_headers

log = logging.getLogger("refusion.serve")


def create_front(replicas: ReplicaPool, model_name: str, shutdown_timeout: float = 30.0) -> FastAPI:
    """The HTTP front over started, ready replicas."""
    check_api_key(replicas.api_key)
    app = FastAPI(
        title="ReFusion",
        lifespan=_lifespan(replicas, shutdown_timeout),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.shutdown_timeout = shutdown_timeout
    app.state.begin_drain, app.state.on_exit_now = replicas.terminate, replicas.exit_now
    app.state.drained = lambda: replicas.drained
    app.state.replicas = replicas

    @app.get("/health")
    async def health() -> JSONResponse:
        return await front_health(replicas, model_name)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return await front_metrics(request, replicas)

    @app.api_route("/{path:path}", methods=METHODS)
    async def passed_on(request: Request) -> Response:
        return await pass_on(request, replicas)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    quiet_disconnects(app)
    return app


def _lifespan(replicas: ReplicaPool, shutdown_timeout: float) -> Callable[[FastAPI], Any]:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        """The watch runs while the front does; after uvicorn's drain (the replicas had
        their signal when it began) the front waits for them to exit."""
        watcher = asyncio.ensure_future(_watch(replicas, app))
        yield
        watcher.cancel()
        wait = shutdown_timeout + 10.0
        await asyncio.get_running_loop().run_in_executor(None, replicas.stop, wait)
        await replicas.aclose()

    return lifespan


async def front_health(replicas: ReplicaPool, model_name: str) -> JSONResponse:
    """Every replica's state, the queues and running counts summed: 200 only while every
    replica answers ok and the front is not draining."""
    states = await asyncio.gather(*(_replica_health(r) for r in replicas.all))
    ok = not replicas.closing and all(s["status"] == "ok" for s in states)
    body = {
        "status": "ok" if ok else "unavailable",
        "model": model_name,
        "queue_length": sum(s.get("queue_length", 0) for s in states),
        "running": sum(s.get("running", 0) for s in states),
        "replicas": states,
    }
    return JSONResponse(body, status_code=200 if ok else 503)


async def front_metrics(request: Request, replicas: ReplicaPool) -> Response:
    """Every replica's metrics, labelled, and the front's own; a replica's refusal (a
    wrong API key) as it is."""
    headers = passed_headers(request.headers.raw)
    answers = await asyncio.gather(*(_replica_metrics(r, headers) for r in replicas.all))
    for answer in answers:
        if isinstance(answer, httpx.Response) and answer.status_code != 200:
            return Response(answer.content, status_code=answer.status_code, headers=response_headers(answer))
    for r in replicas.all:
        replicas.metrics.up.set(1 if r.alive and r.ready else 0, str(r.index))
        replicas.metrics.in_flight.set(r.in_flight, str(r.index))
    texts = [(str(r.index), a.text) for r, a in zip(replicas.all, answers) if isinstance(a, httpx.Response)]
    body = merge_metrics(texts) + replicas.metrics.render()
    return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _watch(replicas: ReplicaPool, app: FastAPI, every: float = 0.5) -> None:
    """Start replicas that exited again (`ReplicaPool.tend`), and stop the front when none
    is left running or starting (a supervisor then sees the front exit, and can start it
    again, instead of a front answering 503 for ever)."""
    while not replicas.closing:
        await asyncio.sleep(every)
        await replicas.tend()
        if not replicas.closing and replicas.all_left:
            log.error("every replica has exited: the front stops")
            replicas.all_gone = True
            server = getattr(app.state, "server", None)
            if server is not None:
                server.should_exit = True
            return


async def _replica_health(r: Replica) -> dict[str, Any]:
    state: dict[str, Any] = {
        "replica": r.index,
        "status": "exited",
        "in_flight": r.in_flight,
        "restarts": r.restarts,
    }
    if not r.alive:
        return {**state, "exit_code": r.proc.returncode}
    if not r.ready:
        return {**state, "status": "starting"}
    try:
        answer = await r.client.get("/health", timeout=5.0)
        body = answer.json()
        return {
            **state,
            "status": body.get("status", "unavailable"),
            "queue_length": body.get("queue_length", 0),
            "running": body.get("running", 0),
        }
    except (httpx.HTTPError, ValueError):
        return {**state, "status": "unavailable"}


async def _replica_metrics(r: Replica, headers: list) -> httpx.Response | None:
    if not r.alive:
        return None
    try:
        return await r.client.get("/metrics", headers=headers, timeout=5.0)
    except httpx.HTTPError:
        return None
