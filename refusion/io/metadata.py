"""A checkpoint's config and tokenizer, and their agreement: the tokenizer must fit the
embedding, and the MASK id is the config's or else the tokenizer's `<|mask|>`.

Shared by every reader (safetensors directories and GGUF files alike) so that a model's
vocabulary is settled the same way whatever it was read from, and without its weights.
`transformers` is imported only when a tokenizer is there to load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..model.config import ModelConfig
from ..model.prompts import mask_id_of

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_metadata(directory: Path) -> tuple[ModelConfig, Any]:
    """The config (with the MASK id resolved) and tokenizer of a model directory, checked
    against each other: what every reader of a safetensors checkpoint starts from."""
    config = ModelConfig.from_json(directory / "config.json")
    tokenizer = _load_tokenizer(directory)
    settle_vocabulary(config, tokenizer, where=str(directory))
    return config, tokenizer


def _load_tokenizer(directory: Path) -> Any:
    """The directory's tokenizer, or None where it has no tokenizer files."""
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot load the tokenizer in {directory}: {e}") from None


def settle_vocabulary(config: ModelConfig, tokenizer: Any, where: str) -> None:
    """Check that the tokenizer fits the embedding, then resolve the MASK id."""
    _check_tokenizer_fits(config, tokenizer, where)
    _resolve_mask_id(config, tokenizer)


def _check_tokenizer_fits(config: ModelConfig, tokenizer: Any, where: str) -> None:
    """A tokenizer with more tokens than the embedding has rows makes ids that index past
    it (an IndexError, or a device-side assert on CUDA, at the first such token). Fewer
    tokens than rows is normal: many vocabularies are padded to a round size."""
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        raise CheckpointError(
            f"the tokenizer in {where} has {len(tokenizer)} tokens, more than the config's "
            f"vocab_size={config.vocab_size}: its ids past {config.vocab_size - 1} "
            "would index past the embedding; "
            "use the tokenizer the weights were made with"
        )


def _resolve_mask_id(config: ModelConfig, tokenizer: Any) -> None:
    """config.mask_token_id := the config's, else the tokenizer's `<|mask|>`, else None."""
    config.mask_token_id = mask_id_of(config, tokenizer)
    mask = config.mask_token_id
    if mask is not None and not 0 <= mask < config.vocab_size:
        raise CheckpointError(
            f"mask_token_id={mask} is outside the vocabulary (vocab_size={config.vocab_size})"
        )
