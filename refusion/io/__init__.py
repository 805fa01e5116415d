"""Checkpoints in and out: resolving a model name (a directory, a hub id, a `.gguf` file,
a bundled model), reading safetensors and GGUF, saving in Hugging Face format, and adding
the MASK token to an autoregressive checkpoint.

Names are imported when first used, so `import refusion.io` costs nothing until a
checkpoint is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

_WHERE = {
    "load": "checkpoint", "save_pretrained": "checkpoint", "describe": "checkpoint", "convert": "checkpoint",
    "add_mask_token": "checkpoint", "load_metadata": "checkpoint",
}
__all__ = ["add_mask_token", "convert", "describe", "load", "load_metadata", "save_pretrained"]

if TYPE_CHECKING:
    from .checkpoint import (
        add_mask_token,
        convert,
        describe,
        load,
        load_metadata,
        save_pretrained,
    )

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
