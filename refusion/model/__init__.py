"""The model: its settings (`ModelConfig`), the transformer with one cached forward, the
KV cache with its named operations, the tensor-parallel split, the sizing rule (what a
request needs and what fits) and the tokenizer conventions (chat template, EOS, MASK).

Names are imported when first used: `ModelConfig` (in `settings`) needs no torch, so the CLI can read a
config without loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

_WHERE = {"ModelConfig": ".settings.model", "Transformer": "transformer", "KVCache": "kv_cache"}
__all__ = ["KVCache", "ModelConfig", "Transformer"]

if TYPE_CHECKING:
    from ..settings.model import ModelConfig
    from .kv_cache import KVCache
    from .transformer import Transformer

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
