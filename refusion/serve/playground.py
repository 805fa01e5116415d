"""The playground: `refusion serve` answers `/` with one page (plain HTML, CSS and
JavaScript shipped in the package, no build step, nothing fetched from elsewhere) that
talks to the server's own API (docs/playground.md).

The page's settings form is made from `DecodeConfig`'s field metadata, the same bounds
and help the CLI's flags are made from, sent as `/playground/settings` with the server's
defaults (what the checkpoint recommends, with the server's flags on top), the
checkpoint's example prompts and the presets. The slot view is drawn by the decode
layer's drawing module (`refusion/decode/static/slots.js`), the one the `--trace` page
inlines. The page and its files need no API key; the settings and the completions do,
and the page asks for the key when the server wants one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from ..decode.trace import STATIC as DRAWING
from ..settings.decode import PRESETS, DecodeConfig, EngineConfig
from ..settings.fields import field_kind
from ..settings.recommended import recommended_of
from .protocol.requests import DECODE_FIELDS

PAGE_DIR = Path(__file__).with_name("static")
# the files the page loads, by the name it asks for: its own and the shared drawing module
FILES = {
    "playground.js": PAGE_DIR / "playground.js",
    "playground.css": PAGE_DIR / "playground.css",
    "replay.js": PAGE_DIR / "replay.js",
    "slots.js": DRAWING / "slots.js",
    "slots.css": DRAWING / "slots.css",
}
MEDIA = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
# the paper's rule: the checkpoint's settings with the options beyond the paper turned off
PAPER_RULE = {"ar_correction": False, "first_token_check": False, "infill_window": None}


def is_public(path: str) -> bool:
    """The page and its files, which hold nothing of the server's: no API key needed."""
    return path == "/" or path.startswith("/static/")


def add_playground_routes(
    app: FastAPI, model: Any, cfg: DecodeConfig, model_name: str, context: int, widths: tuple[bool, str]
) -> None:
    """`/` (the page), `/static/NAME` (its files) and `/playground/settings` (its form).
    `widths`: whether the engine's draft widths follow the batch (its WidthPolicy), and the
    widths in force in words (`WidthPolicy.describe`)."""
    settings = settings_body(model, cfg, model_name, context)
    settings["draft_widths"] = draft_widths(*widths)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> FileResponse:
        return FileResponse(PAGE_DIR / "index.html", media_type="text/html; charset=utf-8")

    @app.get("/static/{name}")
    async def static(name: str) -> FileResponse:
        if name not in FILES:
            raise HTTPException(404, f"no file {name!r}; the page's files are {', '.join(FILES)}")
        return FileResponse(FILES[name], media_type=MEDIA[FILES[name].suffix])

    @app.get("/playground/settings")
    async def playground_settings() -> JSONResponse:
        return JSONResponse(settings)


def settings_body(model: Any, cfg: DecodeConfig, model_name: str, context: int) -> dict[str, Any]:
    """What the page's form is made from: each request field of DecodeConfig with its kind,
    bounds and help, the server's values of them, max_tokens, the checkpoint's example
    prompts, and the presets (each a set of field values)."""
    rec = recommended_of(model)
    gen = next(f for f in dataclasses.fields(DecodeConfig) if f.name == "gen_length")
    max_tokens = {
        "name": "max_tokens",
        "kind": "int",
        "help": f"{gen.metadata['help']} (max_tokens of the request)",
        "lo": 1,
        "hi": context,
        "bounds": bounds_text(1, context),
        "choices": None,
        "optional": True,
    }
    return {
        "model": model_name,
        "about": rec.about,
        "single_turn": rec.single_turn,
        "examples": rec.examples,
        "context": context,
        "fields": [max_tokens] + [field_spec(f) for f in DECODE_FIELDS.values()],
        "defaults": {"max_tokens": cfg.gen_length} | request_values(cfg),
        "presets": presets(cfg),
    }


def field_spec(f: dataclasses.Field) -> dict[str, Any]:
    """One field as the form shows it: the metadata the CLI's flags are made from."""
    meta = f.metadata
    return {
        "name": f.name,
        "kind": field_kind(f),
        "help": meta["help"],
        "lo": meta.get("lo"),
        "hi": meta.get("hi"),
        "bounds": bounds_text(meta.get("lo"), meta.get("hi")),
        "choices": list(meta["choices"]) if meta.get("choices") else None,
        "optional": "None" in str(f.type),
    }


def bounds_text(lo: float | None, hi: float | None) -> str | None:
    """A field's range as a person writes it. A JSON number past 2^53 reaches a browser
    rounded (2^63 - 1 shows as 9223372036854776000), so such a bound is written here, as
    a power of two where it is one."""
    if lo is None or hi is None:
        return None
    return f"[{_number_text(lo)}, {_number_text(hi)}]"


def _number_text(x: float) -> str:
    if not isinstance(x, int) or abs(x) <= 2**53:
        return str(x)
    sign = "\u2212" if x < 0 else ""
    for off, tail in ((0, ""), (1, " \u2212 1")):  # 2^k or 2^k - 1
        k = (abs(x) + off).bit_length() - 1
        if abs(x) + off == 2**k:
            return f"{sign}2^{k}{tail}"
    return str(x)


def draft_widths(adaptive: bool, in_force: str) -> dict[str, Any]:
    """Which draft widths the engine uses (EngineConfig.adaptive_drafts), with its help and
    the widths in force in words: the page shows it, and each finished request's stats say
    whether its row followed."""
    meta = next(f for f in dataclasses.fields(EngineConfig) if f.name == "adaptive_drafts").metadata
    return {"adaptive": adaptive, "help": meta["help"], "in_force": in_force}


def request_values(cfg: DecodeConfig) -> dict[str, Any]:
    """cfg's values of the fields a request may set."""
    return {
        name: list(v) if isinstance(v, tuple) else v
        for name, v in ((n, getattr(cfg, n)) for n in DECODE_FIELDS)
    }


def presets(cfg: DecodeConfig) -> dict[str, dict[str, Any]]:
    """The server's own settings, the same with the paper's rule, and the authors'
    per-benchmark presets on top of them (as a request's `preset` field sets them)."""
    out = {
        "server (checkpoint's)": request_values(cfg),
        "paper rule": request_values(cfg.replace(**PAPER_RULE)),
    }
    for name in PRESETS:
        out[name] = request_values(DecodeConfig.preset(name, cfg, gen_length=cfg.gen_length))
    return out
