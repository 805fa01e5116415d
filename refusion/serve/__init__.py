"""OpenAI-compatible HTTP serving: `create_app` (FastAPI) and `serve` (uvicorn).

In layers, each over the next (docs/architecture.md#layers):
- `server.py`: uvicorn's server with the shutdown order serving needs (`make_server`)
- `app.py`: the app for one model, its parts wired together (`create_app`)
- `http/`: what every request passes first: the limits on connections, on the time a
  head and a body take and on a head's shape (`connection.py`), the API key and per-route
  metrics (`observe.py`, `auth.py`), limits on bodies and the request threads (`limits.py`),
  errors in OpenAI's shape (`errors.py`), a client that goes away (`disconnect.py`)
- `routes.py`: the routes (/v1/models, /v1/completions, /v1/chat/completions, /health,
  /metrics); a completion route is parse -> admit -> generate -> respond
- `protocol/`: the OpenAI wire format: requests, messages, errors, response bodies, streams
- `client.py`: the async client of the engine (`EngineClient.generate`: a request's
  choices in, their outputs out as an async iterator)
- `loop.py`, `jobs.py`: the engine loop, one worker thread that owns the `Engine` and
  steps it, and the completions (`Job`s) it reports on
- `playground.py`: the page at `/` (files in `static/`) and the settings it is made from
- `replicas/`: `--data-parallel-size N`, N replicas behind one front (least-loaded routing)
- `metrics.py`: Prometheus text format, by hand
- `loadtest.py`: `python -m refusion.serve.loadtest`, concurrent streaming clients

The web framework is imported only when an app is made, so `refusion.serve.loop`
works without the `serve` extra.
"""

from __future__ import annotations

from typing import Any

from ..settings.decode import DecodeConfig
from ..settings.serve import ServerLimits

__all__ = ["create_app", "serve"]


def create_app(model: Any, tokenizer: Any, cfg: DecodeConfig | None = None, **kwargs: Any):
    """The FastAPI app for one model; see `refusion.serve.app.create_app`."""
    from .app import create_app as make

    return make(model, tokenizer, cfg, **kwargs)


def serve(
    model: Any,
    tokenizer: Any,
    cfg: DecodeConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    uds: str | None = None,
    limits: ServerLimits | None = None,
    **kwargs: Any,
) -> None:
    """Run the server until interrupted. The first SIGINT/SIGTERM stops it taking work
    (new and queued requests get 503 `shutting_down`), lets running requests finish for
    up to `shutdown_timeout` seconds, then cuts what is left (streams end with an error
    event and `[DONE]`); a second signal exits at once. `limits`: the time a request's
    head and body may take and the connections open at once (`ServerLimits`)."""
    import logging

    from .server import make_server

    app = create_app(model, tokenizer, cfg, shutdown_timeout=shutdown_timeout, **kwargs)
    server = make_server(app, host=host, port=port, log_level=log_level, uds=uds, limits=limits)
    # after make_server: uvicorn's logging config, which prints this logger's lines, is in place
    where = f"on {uds}" if uds else f"at http://{_url_host(host)}:{port}/ (the playground; the API under /v1)"
    logging.getLogger("refusion.serve").info("serving %s; draft widths %s", where, app.state.draft_widths)
    server.run()


def _url_host(host: str) -> str:
    """The host as a browser takes it: IPv6 in brackets, a wildcard as this machine."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1" if host != "::" else "[::1]"
    return f"[{host}]" if ":" in host else host
