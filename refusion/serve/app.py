"""The FastAPI application: OpenAI routes over one engine loop.

A completion request's body is read (refused as soon as it passes `MAX_BODY`), then parsed,
validated (`protocol.parse_request`), and each prompt prepared once by the engine's
admission (tokenised, checked, fitted to the context: `protocol.admit`) on one of a few request threads, never
on the event loop, so a huge prompt delays only itself and not /health or other clients;
every check runs before any compute, so a bad request fails alone. It is queued as one
`Job` per prompt, each with its own `DecodeConfig`. The engine loop pushes each job's
text into an asyncio queue as the decoder finalises left-to-right prefixes; a streamed
response starts at once (headers, and chat's role chunk, before any token is final) and
forwards those events as server-sent events, ending with `[DONE]` after the last chunk
or an error event; a plain one collects them. A client that goes away cancels its jobs,
and the engine drops their rows before its next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException

from ..decode import DecodeConfig, Engine, EngineConfig
from ..decode.admit import PreparedRequest
from ..decode.follow import engine_for
from ..errors import ReFusionError
from .client import EngineClient, Generation
from .http.disconnect import ClientGone, DisconnectWatch
from .loop import EngineLoop, QueueFull, ShuttingDown
from .metrics import Metrics
from .playground import add_playground_routes, is_public
from .protocol.errors import APIError, bad, library_error
from .protocol.requests import (
    CompletionRequest,
    admit,
    check_model,
    parse_request,
    request_config,
    request_prompts,
)
from .protocol.responses import model_card
from .protocol.streams import completion_body, completion_events

log = logging.getLogger("refusion.serve")

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
MAX_BODY = 16 * 2**20
MAX_DEPTH = (
    32  # nesting of a JSON body; OpenAI's deepest field (a message's tool call's function) is 6 levels down
)
# threads that parse and tokenise requests: a few at once (the tokenizer releases the GIL), the
# rest wait their turn without holding up the event loop
REQUEST_THREADS = 4


def create_app(
    model: Any,
    tokenizer: Any,
    cfg: DecodeConfig | None = None,
    *,
    engine_config: EngineConfig | None = None,
    model_name: str = "refusion",
    api_key: str | None = None,
    max_queue: int = 256,
    shutdown_timeout: float = 30.0,
    engine: Engine | None = None,
) -> FastAPI:
    """The server for one model. `cfg` is the server's default DecodeConfig (requests
    override it field by field; default: the engine's, what the checkpoint recommends);
    `engine_config` its resources; `api_key` turns on bearer-token auth for everything but
    /health; `engine` replaces the engine made from the model (tests wrap its step)."""
    if tokenizer is None:
        raise ReFusionError("serving needs a tokenizer: this checkpoint has none")
    engine = engine or engine_for(model, tokenizer, engine_config)
    cfg = cfg or engine.default_config
    metrics = Metrics()
    engine_loop = EngineLoop(engine, max_queue=max_queue, metrics=metrics)
    server = _Server(engine, cfg, model_name, engine_loop)
    app = FastAPI(
        title="ReFusion",
        lifespan=_lifespan(engine, engine_loop, server.work, shutdown_timeout),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    _set_state(app, engine_loop, metrics, shutdown_timeout)
    _add_status_routes(app, engine_loop, metrics, model_name)
    _add_api_routes(app, server)
    add_playground_routes(app, model, cfg, model_name, server.context)
    _add_error_handlers(app, metrics)
    app.add_middleware(_Observe, metrics=metrics, api_key=api_key)
    return app


def _lifespan(
    engine: Engine, engine_loop: EngineLoop, work: concurrent.futures.Executor, shutdown_timeout: float
) -> Callable[[FastAPI], Any]:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        """The engine loop runs while the app does. uvicorn sends the shutdown event only
        after its own drain, so `refusion.serve.server.Server` closes the loop earlier,
        when the drain begins; the first deadline stands."""
        engine_loop.start()
        yield
        work.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, engine_loop.shutdown, shutdown_timeout)
        # a split model's leader lets the other ranks go (uvicorn then re-raises the signal)
        if hasattr(engine, "close"):
            await asyncio.get_running_loop().run_in_executor(None, engine.close)

    return lifespan


def _set_state(app: FastAPI, engine_loop: EngineLoop, metrics: Metrics, shutdown_timeout: float) -> None:
    """What the app holds for others: `refusion.serve.server.Server` reads the shutdown
    timeout, calls `begin_drain` when the drain begins and keeps answering until
    `drained` (the engine loop has nothing left to run)."""
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    app.state.shutdown_timeout = shutdown_timeout
    app.state.begin_drain = engine_loop.close
    app.state.drained = lambda: not engine_loop.alive


def _add_status_routes(app: FastAPI, engine_loop: EngineLoop, metrics: Metrics, model_name: str) -> None:
    """/health (503 once the engine loop has stopped or is closing) and /metrics."""

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine_loop.alive and not engine_loop.closing
        body = {
            "status": "ok" if ok else "unavailable",
            "model": model_name,
            "queue_length": engine_loop.queue_length,
            "running": engine_loop.running,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_api_routes(app: FastAPI, server: _Server) -> None:
    """The OpenAI routes: the model list, one model, and both completion routes."""

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str) -> dict:
        server.check_model(name)
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.complete(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.complete(request, "chat")


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error answers in OpenAI's error shape, counted by type: the API's own,
    Starlette's (an unknown route, a wrong method) and anything unexpected (a 500)."""

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError) -> JSONResponse:
        return _error_response(metrics, e)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, e: HTTPException) -> JSONResponse:
        return _error_response(metrics, _http_error(e))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(
            metrics,
            APIError(
                500, f"internal server error: {type(e).__name__}", type="server_error", code="internal_error"
            ),
        )


def _http_error(e: HTTPException) -> APIError:
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return APIError(e.status_code, str(e.detail), param=None, code=code, headers=dict(e.headers or {}))


def _error_response(metrics: Metrics, e: APIError) -> JSONResponse:
    metrics.errors.inc(1, e.type)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Server:
    """Per-app state and the completion flow shared by both completion routes."""

    def __init__(self, engine: Engine, cfg: DecodeConfig, name: str, engine_loop: EngineLoop) -> None:
        self.engine, self.tokenizer, self.cfg, self.name = engine, engine.tokenizer, cfg, name
        self.client = EngineClient(engine_loop)
        self.context = engine.model.config.max_position_embeddings
        self.created = int(time.time())
        self.work = concurrent.futures.ThreadPoolExecutor(
            REQUEST_THREADS, thread_name_prefix="refusion-request"
        )

    def model_card(self) -> dict[str, Any]:
        return model_card(self.name, self.created, self.context)

    def check_model(self, name: str | None) -> None:
        check_model(name, self.name)

    # ---------------------------------------------------------------- request -> jobs
    async def complete(self, request: Request, kind: str) -> Response:
        """A completion request of either route, from its body to its response: parse ->
        admit (on a request thread; every check runs before anything is queued, so a bad
        request fails alone) -> generate -> respond."""
        raw = await read_body(request)
        loop = asyncio.get_running_loop()
        req, prompts = await loop.run_in_executor(self.work, self.prepare, raw, kind)
        try:
            outputs = self.client.generate(prompts, slots=req.include_slots)
        except (QueueFull, ShuttingDown) as e:
            raise library_error(e) from None
        return await _respond(request, req, outputs, self.name, sum(len(p.ids) for p in prompts))

    def prepare(self, raw: bytes, kind: str) -> tuple[CompletionRequest, list[PreparedRequest]]:
        """The request in `raw` checked, and each of its prompts prepared once by the
        engine's admission: tokenised, checked and fitted to the context (a request thread:
        all of this is CPU work, a prompt's tokenisation the most)."""
        req = parse_request(_parse_json(raw), kind)
        self.check_model(req.model)
        cfg = request_config(self.cfg, req)
        prompts, param = request_prompts(req, self.tokenizer)
        return req, [admit(self.engine.admission, p, cfg, req.max_tokens, param) for p in prompts]


async def _respond(
    request: Request, req: CompletionRequest, outputs: Generation, model: str, prompt_tokens: int
) -> Response:
    """A stream starts at once (headers, and chat's role chunk): a queued client knows it
    was accepted. A plain response waits for the whole completion; a client that left
    meanwhile gets a 499 and its choices are cancelled."""
    if req.stream:
        return StreamingResponse(
            completion_events(req, outputs, model, prompt_tokens),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    watch = DisconnectWatch(request)
    try:
        return JSONResponse(await completion_body(req, watch.guard(outputs), model, prompt_tokens))
    except ClientGone:
        return Response(status_code=499)
    finally:
        watch.close()


async def read_body(request: Request) -> bytes:
    """The request's bytes, at most MAX_BODY of them: a 413 as soon as more is declared
    or has arrived (a chunked body has no length to check first), not once it is all in."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise _too_large()
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> APIError:
    return APIError(
        413, f"the request body is over {MAX_BODY} bytes; send a shorter prompt", code="request_too_large"
    )


def _parse_json(raw: bytes) -> Any:
    body = _loads(raw)
    if _deeper_than(body, MAX_DEPTH):
        raise _too_deep()
    return body


def _loads(raw: bytes) -> Any:
    """The body as JSON, or a 400 (never a 500) whatever the bytes."""
    try:
        return json.loads(raw)
    except RecursionError:  # nesting deeper than the parser's stack
        raise _too_deep() from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and an integer over Python's digit limit
        if "integer string conversion" in str(e):
            raise bad(
                f"the request body has an integer of more than {sys.get_int_max_str_digits()} digits; "
                "no field takes one that long",
                None,
                "invalid_json",
            ) from None
        raise bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None


def _too_deep() -> APIError:
    return bad(
        f"the request body nests arrays and objects more than {MAX_DEPTH} deep; "
        "no field of this API needs more than a few levels",
        None,
        "invalid_json",
    )


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether `obj` nests lists and dicts more than `limit` deep, found without
    recursion (a check made recursively would itself overflow on the bodies it is for).
    A scalar (a body of `null` or `5`) is not nested at all."""
    level, depth = ([obj] if isinstance(obj, (list, dict)) else []), 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [
            v
            for x in level
            for v in (x.values() if isinstance(x, dict) else x)
            if isinstance(v, (list, dict))
        ]
    return False


class _Observe:
    """ASGI wrapper: bearer-token auth, and per-route request counts and latency (taken
    when the last byte of the response is sent, so streams count in full)."""

    def __init__(self, app: Any, metrics: Metrics, api_key: str | None) -> None:
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = (
            path if path in ROUTES else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        )
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
                return await _error_response(self.metrics, unauthorised())(scope, receive, observed_send)
            await self.app(scope, receive, observed_send)
        finally:
            record()


def authorised(scope: dict, api_key: str | None) -> bool:
    """Whether a request may pass: no key set, /health (which never needs one), or
    'Authorization: Bearer KEY' with the key. The playground's page and files pass too:
    the page asks for the key and sends it."""
    if api_key is None or scope["path"] == "/health" or is_public(scope["path"]):
        return True
    for k, v in scope["headers"]:
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), api_key.encode()
            )
    return False


def unauthorised() -> APIError:
    return APIError(
        401,
        "invalid or missing API key: send 'Authorization: Bearer <key>'",
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
