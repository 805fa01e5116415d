"""ReFusion: diffusion language models decoded by parallel autoregressive slots.

The names below are imported when first used, so `import refusion` (and `refusion
--help`) does not pay for torch until something needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_attributes

__version__ = "0.1.0"

_WHERE = {
    "load": "io",
    "ModelConfig": "model",
    "Transformer": "model",
    "ReFusionError": "errors",
    "DecodeConfig": "decode",
    "EngineConfig": "decode",
    "Engine": "decode",
    "RequestOutput": "decode",
    "generate": "decode",
    "stream": "decode",
}
__all__ = [
    "DecodeConfig",
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "ReFusionError",
    "RequestOutput",
    "Transformer",
    "__version__",
    "generate",
    "load",
    "stream",
]

if TYPE_CHECKING:
    from .decode import (
        DecodeConfig,
        Engine,
        EngineConfig,
        RequestOutput,
        generate,
        stream,
    )
    from .errors import ReFusionError
    from .io import load
    from .model import ModelConfig, Transformer

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
