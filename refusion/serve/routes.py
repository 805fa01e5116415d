"""The routes: OpenAI's (the model list, completions, chat completions), /health and
/metrics.

A completion route is four steps: parse (the body read within its limit, then checked
field by field), admit (each prompt prepared once by the engine's admission: tokenised,
checked, fitted to the context), both on a request thread since they are CPU work;
generate (the prompts queued on the engine, all or none); respond (a stream at once, or
the whole completion when it is done).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import Request

from ..decode.admit import Admission, PreparedRequest
from ..settings.decode import DecodeConfig
from .client import EngineClient, Generation
from .http.disconnect import ClientGone, DisconnectWatch
from .http.limits import RequestThreads, parse_json, read_body
from .loop import EngineLoop, QueueFull, ShuttingDown
from .metrics import Metrics
from .protocol.errors import library_error
from .protocol.requests import (
    CompletionRequest,
    admit_request,
    check_model,
    completion_warning,
    parse_request,
)
from .protocol.responses import model_card
from .protocol.streams import completion_body, completion_events

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = logging.getLogger("refusion.serve")


class Completions:
    """The completion routes' work: the server's default settings, its model's name and
    admission, and the engine client. `chat_only`: the checkpoint knows text only through
    its chat template, so a raw text completion is answered with a warning."""

    def __init__(
        self,
        admission: Admission,
        cfg: DecodeConfig,
        name: str,
        client: EngineClient,
        threads: RequestThreads,
        chat_only: bool = False,
    ) -> None:
        self.admission, self.cfg, self.name, self.client, self.threads = admission, cfg, name, client, threads
        self.chat_only, self.warned = chat_only, False
        self.created = int(time.time())

    def model_card(self) -> dict[str, Any]:
        return model_card(self.name, self.created, self.admission.context)

    async def __call__(self, request: Request, kind: str) -> Response:
        """A request of either completion route, from its body to its response; every
        check runs before anything is queued, so a bad request fails alone."""
        raw = await read_body(request)
        req, prompts = await self.threads.run(self.prepare, raw, kind)
        try:
            outputs = self.client.generate(prompts, slots=req.include_slots)
        except (QueueFull, ShuttingDown) as e:
            raise library_error(e) from None
        # the prompt tokens of each prompt once, however many choices decode it
        return await self.respond(request, req, outputs, sum(len(p.ids) for p in prompts[:: req.rows]))

    def prepare(self, raw: bytes, kind: str) -> tuple[CompletionRequest, list[PreparedRequest]]:
        """The body parsed and checked, and each of its prompts admitted (a request thread)."""
        req = parse_request(parse_json(raw), kind)
        check_model(req.model, self.name)
        prepared = admit_request(req, self.admission, self.cfg)
        req.warning = completion_warning(req, self.chat_only)
        if req.warning and not self.warned:  # once: every such response carries the warning itself
            log.warning("a raw text completion: %s (logged once)", req.warning)
            self.warned = True
        return req, prepared

    async def respond(
        self, request: Request, req: CompletionRequest, outputs: Generation, prompt_tokens: int
    ) -> Response:
        """A stream starts at once (headers, and chat's role chunk): a queued client knows
        it was accepted. A plain response waits for the whole completion; a client that
        left meanwhile gets a 499 and its choices are cancelled."""
        if req.stream:
            events = completion_events(req, outputs, self.name, prompt_tokens, self.admission.tokenizer)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        watch = DisconnectWatch(request)
        try:
            tokenizer = self.admission.tokenizer
            return JSONResponse(
                await completion_body(req, watch.guard(outputs), self.name, prompt_tokens, tokenizer)
            )
        except ClientGone:
            return Response(status_code=499)
        finally:
            watch.close()


def add_api_routes(app: FastAPI, completions: Completions) -> None:
    """The OpenAI routes: the model list, one model, and both completion routes."""

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [completions.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str) -> dict:
        check_model(name, completions.name)
        return completions.model_card()

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Response:
        return await completions(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completions(request, "chat")


def add_status_routes(app: FastAPI, engine_loop: EngineLoop, metrics: Metrics, model_name: str) -> None:
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
