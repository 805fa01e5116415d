"""ReFusion: diffusion language models decoded by parallel autoregressive slots.

The names below are imported when first used, so `import refusion` (and `refusion
--help`) does not pay for torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "load": "checkpoint", "ModelConfig": "config", "Transformer": "model", "ReFusionError": "errors",
    "DecodeConfig": "decode", "EngineConfig": "decode", "Engine": "decode", "RequestOutput": "decode",
    "generate": "decode", "stream": "decode",
}
__all__ = [
    "DecodeConfig", "Engine", "EngineConfig", "ModelConfig", "ReFusionError", "RequestOutput", "Transformer",
    "__version__", "generate", "load", "stream",
]

if TYPE_CHECKING:
    from .checkpoint import load
    from .config import ModelConfig
    from .decode import DecodeConfig, Engine, EngineConfig, RequestOutput, generate, stream
    from .errors import ReFusionError
    from .model import Transformer


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'refusion' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
