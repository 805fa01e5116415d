"""The FastAPI application for one model, in layers: the HTTP guards (`http/`: auth and
metrics around every request, limits on bodies, errors in OpenAI's shape) over the routes
(`routes.py`) over the OpenAI protocol (`protocol/`) over an async client of the engine
(`client.py`) over the engine loop, the one thread that owns and steps the `Engine`
(`loop.py`).

A completion request is read within its limit, parsed, checked and prepared once on a
request thread (never the event loop, so a huge prompt delays only itself), queued as one
`Job` per choice, each with its own `DecodeConfig`, and answered with the outputs the
engine loop hands back as the decoder finalises left-to-right prefixes: as a stream at
once, or whole when done. A client that goes away cancels its choices, and the engine
drops their rows before its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from ..decode import DecodeConfig, Engine, EngineConfig
from ..decode.follow import engine_for
from ..errors import ReFusionError
from ..settings.recommended import recommended_of
from .client import EngineClient
from .http.auth import check_api_key
from .http.errors import add_error_handlers
from .http.limits import RequestThreads
from .http.observe import Observe
from .loop import EngineLoop
from .metrics import Metrics
from .playground import add_playground_routes
from .routes import Completions, add_api_routes, add_status_routes


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
    check_api_key(api_key)
    engine = engine or engine_for(model, tokenizer, engine_config)
    cfg = cfg or engine.default_config
    metrics = Metrics()
    engine_loop = EngineLoop(engine, max_queue=max_queue, metrics=metrics)
    threads = RequestThreads()
    chat_only = recommended_of(model).chat_only
    completions = Completions(
        engine.admission, cfg, model_name, EngineClient(engine_loop), threads, chat_only=chat_only
    )
    app = FastAPI(
        title="ReFusion",
        lifespan=_lifespan(engine, engine_loop, threads, shutdown_timeout),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    _set_state(app, engine_loop, metrics, shutdown_timeout)
    app.state.draft_widths = draft_widths(engine)
    add_status_routes(app, engine_loop, metrics, model_name)
    add_api_routes(app, completions)
    widths = engine.widths.adaptive, app.state.draft_widths
    add_playground_routes(app, model, cfg, model_name, engine.admission.context, widths)
    add_error_handlers(app, metrics)
    app.add_middleware(Observe, metrics=metrics, api_key=api_key)
    return app


def draft_widths(engine: Engine) -> str:
    """The engine's draft widths in words (an engine a test wraps may have no policy)."""
    policy = getattr(engine, "widths", None)
    return policy.describe() if policy is not None else "the engine's own"


def _lifespan(
    engine: Engine, engine_loop: EngineLoop, threads: RequestThreads, shutdown_timeout: float
) -> Callable[[FastAPI], Any]:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        """The engine loop runs while the app does. uvicorn sends the shutdown event only
        after its own drain, so `refusion.serve.server.Server` closes the loop earlier,
        when the drain begins; the first deadline stands."""
        engine_loop.start()
        yield
        threads.shutdown()
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
