"""A checkpoint's config and tokenizer, and their agreement: the tokenizer must fit the
embedding, and the MASK id is the config's or else the tokenizer's `<|mask|>`.

Shared by every reader (safetensors directories and GGUF files alike) so that a model's
vocabulary is settled the same way whatever it was read from, and without its weights.
`transformers` is imported only when a tokenizer is there to load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, first_line
from ..files import LIMITS, check_checkpoint_dir, check_regular, checkpoint_file, read_json
from ..model.prompts import chat_text, mask_id_of
from ..settings.model import ModelConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# every file of a tokenizer that transformers may open, JSON or not
_TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
)
_TOKENIZER_OTHER = ("tokenizer.model", "spiece.model", "merges.txt", "vocab.txt", "chat_template.jinja")
_FIX_TOKENIZER = "use the tokenizer files the checkpoint was saved with"


def read_metadata(directory: Path) -> tuple[ModelConfig, Any]:
    """The config (with the MASK id resolved) and tokenizer of a model directory, checked
    against each other: what every reader of a safetensors checkpoint starts from. Every
    file a load may open is first checked to resolve inside the directory."""
    check_checkpoint_dir(directory)
    config = ModelConfig.from_json(checkpoint_file(directory, "config.json"))
    tokenizer = _load_tokenizer(directory, config.vocab_size)
    settle_vocabulary(config, tokenizer, where=str(directory))
    return config, tokenizer


def load_tokenizer(name: str | Path) -> Any:
    """A tokenizer named on its own (`refusion train --tokenizer`): a directory, checked
    as a checkpoint's tokenizer is, or a hub id."""
    directory = Path(name).expanduser()
    if not directory.is_dir():
        return _from_pretrained(str(name), str(name))
    check_checkpoint_dir(directory)
    tokenizer = _load_tokenizer(directory)
    if tokenizer is None:
        raise CheckpointError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {directory}")
    return tokenizer


def _load_tokenizer(directory: Path, vocab_size: int | None = None) -> Any:
    """The directory's tokenizer, or None where it has no tokenizer files; its files
    checked first (`_check_tokenizer_files`, its entries against `vocab_size` when the
    config gives one) and its chat template tried."""
    present = _check_tokenizer_files(directory, vocab_size)
    if not present & set(_TOKENIZER_FILES):
        return None
    tokenizer = _from_pretrained(directory, str(directory))
    _try_chat_template(tokenizer, directory)
    return tokenizer


def _from_pretrained(source: str | Path, where: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as e:  # noqa: BLE001 -- the tokenizers library raises bare Exceptions for bad files
        raise CheckpointError(
            f"cannot load the tokenizer in {where} ({type(e).__name__}: {first_line(e)}); " + _FIX_TOKENIZER
        ) from None


def _check_tokenizer_files(directory: Path, vocab_size: int | None) -> set[str]:
    """The names of the tokenizer files present, each a regular file within its size
    limit (`files.LIMITS`), the JSON ones parseable (nesting, numbers, UTF-8) and
    tokenizer.json's entries within what the vocabulary can hold, before transformers
    opens any: a FIFO there would stall the load, a bad file would raise from deep inside
    the library, and a huge one would take minutes and gigabytes to be refused."""
    present = set()
    for name in _TOKENIZER_JSON + _TOKENIZER_OTHER:
        path = checkpoint_file(directory, name)
        if not (path.exists() or path.is_symlink()):
            continue
        if name in _TOKENIZER_JSON:
            data = read_json(path, CheckpointError, limit=LIMITS.tokenizer_json_bytes, fix=_FIX_TOKENIZER)
            if name == "tokenizer.json" and vocab_size is not None:
                _check_entries(path, data, vocab_size)
        elif check_regular(path, CheckpointError, fix=_FIX_TOKENIZER) > LIMITS.tokenizer_other_bytes:
            raise CheckpointError(
                f"{path} is larger than {LIMITS.tokenizer_other_bytes:,} bytes, more than a tokenizer's "
                f"file needs (a limit of this reader); {_FIX_TOKENIZER}"
            )
        present.add(name)
    return present


def _check_entries(path: Path, data: Any, vocab_size: int) -> None:
    """tokenizer.json's vocabulary and added tokens, each no more than the config's
    vocab_size, and its merges no more than `LIMITS.tokenizer_merges_per_token` per token:
    counted before the tokenizers library builds them."""
    model = data.get("model") if isinstance(data, dict) else None
    counts = {
        "model.vocab": model.get("vocab") if isinstance(model, dict) else None,
        "added_tokens": data.get("added_tokens") if isinstance(data, dict) else None,
        "model.merges": model.get("merges") if isinstance(model, dict) else None,
    }
    for key, entries in counts.items():
        most = vocab_size * (LIMITS.tokenizer_merges_per_token if key == "model.merges" else 1)
        if isinstance(entries, (list, dict)) and len(entries) > most:
            raise CheckpointError(
                f"{path} has {len(entries):,} entries in {key}, more than the config's "
                f"vocab_size={vocab_size} allows ({most:,}); {_FIX_TOKENIZER}"
            )


def _try_chat_template(tokenizer: Any, directory: Path) -> None:
    """A chat template that fails on a one-message conversation (a syntax error, a call
    the template sandbox refuses, an exception it raises) would fail every prompt: it is
    a broken checkpoint, said once at load rather than at each request."""
    try:
        chat_text(tokenizer, [{"role": "user", "content": "hello"}])
    except ConfigError as e:
        raise CheckpointError(f"the tokenizer in {directory}: {e}") from None


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
