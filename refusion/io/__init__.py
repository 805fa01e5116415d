"""Checkpoints in and out: resolving a model name (a directory, a hub id, a `.gguf` file,
a bundled model), reading safetensors and GGUF, saving in Hugging Face format, and adding
the MASK token to an autoregressive checkpoint.

Names are imported when first used, so `import refusion.io` costs nothing until a
checkpoint is read. The modules, by concern: `resolve` (what a name points to),
`metadata` (config and tokenizer), `dtypes` (device and dtype), `weights` (safetensors
headers, checks, reading), `gguf`, `loading` (load, load_metadata, describe), `staging`
(atomic directory replacement), `save` (save_pretrained) and `mask` (add_mask_token,
convert).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

_WHERE = {
    "load": "loading",
    "load_metadata": "loading",
    "describe": "loading",
    "save_pretrained": "save",
    "MAX_SHARD_BYTES": "save",
    "shard_plan": "save",
    "write_index": "save",
    "drop_tied_head": "save",
    "add_mask_token": "mask",
    "convert": "mask",
    "DTYPES": "dtypes",
    "parse_dtype": "dtypes",
    "BUNDLED_DIR": "resolve",
    "BUNDLED_PREFIX": "resolve",
    "BUNDLED_ROOT": "resolve",
    "bundled_names": "resolve",
    "checkpoint_fingerprint": "resolve",
}
__all__ = [
    "BUNDLED_DIR",
    "BUNDLED_PREFIX",
    "BUNDLED_ROOT",
    "DTYPES",
    "MAX_SHARD_BYTES",
    "add_mask_token",
    "bundled_names",
    "checkpoint_fingerprint",
    "convert",
    "describe",
    "drop_tied_head",
    "load",
    "load_metadata",
    "parse_dtype",
    "save_pretrained",
    "shard_plan",
    "write_index",
]

if TYPE_CHECKING:
    from .dtypes import DTYPES, parse_dtype
    from .loading import describe, load, load_metadata
    from .mask import add_mask_token, convert
    from .resolve import BUNDLED_DIR, BUNDLED_PREFIX, BUNDLED_ROOT, bundled_names, checkpoint_fingerprint
    from .save import (
        MAX_SHARD_BYTES,
        drop_tied_head,
        save_pretrained,
        shard_plan,
        write_index,
    )

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
