"""Decoding: the `Engine` that runs ReFusion (plan-and-infill, docs/algorithm.md#decoding) and its AR and MDM
baselines (docs/algorithm.md#baselines) over one continuous batch, and `generate` / `stream`, its thinnest
drivers. Every request carries its own `DecodeConfig`; the engine's resources are an
`EngineConfig`.

Names are imported when first used: the configs (in `refusion.settings`) need no torch, so the
CLI can build its flags from them without loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

_WHERE = {
    "DecodeConfig": ".settings.decode",
    "EngineConfig": ".settings.decode",
    "METHODS": ".settings.decode",
    "PRESETS": ".settings.decode",
    "Engine": "engine",
    "RequestOutput": "request",
    "DecodeStats": "request",
    "TraceEvent": "request",
    "TokenLogprob": "shaping",
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
    "TokenLogprob",
    "TraceEvent",
    "generate",
    "stream",
]

if TYPE_CHECKING:
    from ..settings.decode import METHODS, PRESETS, DecodeConfig, EngineConfig
    from .api import generate, stream
    from .engine import Engine
    from .request import DecodeStats, RequestOutput, TraceEvent
    from .shaping import TokenLogprob
    from .text import StopText, TextDeltas

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
