"""Decoding: the `Engine` that runs ReFusion (plan-and-infill, docs/algorithm.md#decoding) and its AR and MDM
baselines (docs/algorithm.md#baselines) over one continuous batch, and `generate` / `stream`, its thinnest
drivers. Every request carries its own `DecodeConfig`; the engine's resources are an
`EngineConfig`.

Names are imported when first used: the configs (`decode.config`) need no torch, so the
CLI can build its flags from them without loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

_WHERE = {
    "DecodeConfig": "config",
    "EngineConfig": "config",
    "METHODS": "config",
    "PRESETS": "config",
    "Engine": "engine",
    "RequestOutput": "request",
    "DecodeStats": "request",
    "TraceEvent": "request",
    "StopText": "text",
    "TextDeltas": "text",
    "generate": "api",
    "stream": "api",
}
__all__ = [
    "METHODS",
    "PRESETS",
    "DecodeConfig",
    "DecodeStats",
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "StopText",
    "TextDeltas",
    "TraceEvent",
    "generate",
    "stream",
]

if TYPE_CHECKING:
    from .api import generate, stream
    from .config import METHODS, PRESETS, DecodeConfig, EngineConfig
    from .engine import Engine
    from .request import DecodeStats, RequestOutput, TraceEvent
    from .text import StopText, TextDeltas

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
