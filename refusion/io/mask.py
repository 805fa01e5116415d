"""The MASK token an autoregressive checkpoint lacks: `add_mask_token` gives the tokenizer
`<|mask|>` and the model a row for it, and `convert` turns an AR checkpoint into a
ReFusion one on disk (load, add the token, save).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..model.prompts import MASK_TOKEN, tokenizer_mask_id
from ..model.transformer import Transformer
from .loading import load
from .resolve import PathLike
from .save import check_output_dir, save_pretrained


def add_mask_token(model: Transformer, tokenizer: Any) -> int:
    """Prepare the model for ReFusion training: ensure a `<|mask|>` token and return its id.

    Adds `<|mask|>` to the tokenizer as an additional special token, and gives the
    model a row for it in the embedding and the output layer, initialised to the mean
    of the rows before it (docs/algorithm.md; the tokens' rows, not the padding rows some vocabularies
    carry). The matrices grow only when the id is past the last row; tied embeddings
    stay tied. Idempotent: a model whose config or tokenizer already has the token is
    left as it is. With tokenizer=None the new id is the next row.
    """
    config = model.config
    if config.mask_token_id is not None:
        return config.mask_token_id
    mask_id = None if tokenizer is None else tokenizer_mask_id(tokenizer)
    is_new = mask_id is None
    if mask_id is None:
        mask_id = config.vocab_size if tokenizer is None else _add_to_tokenizer(tokenizer)
    if is_new or mask_id >= config.vocab_size:
        _init_rows(model, mask_id)
    config.mask_token_id = mask_id
    return mask_id


def _add_to_tokenizer(tokenizer: Any) -> int:
    # The positional False keeps the tokenizer's other additional special tokens (the
    # argument is replace_additional_special_tokens in transformers 4, _extra_ in 5).
    tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]}, False)
    return tokenizer.get_vocab()[MASK_TOKEN]


def _init_rows(model: Transformer, mask_id: int) -> None:
    """Rows first..mask_id of the embedding and output matrices := the mean of rows
    [0, first), growing the matrices if mask_id is past the end."""
    first = min(mask_id, model.config.vocab_size)
    if mask_id >= model.config.vocab_size:
        _grow_vocab(model, mask_id + 1)
    matrices = [model.model.embed_tokens.weight]
    if not model.config.tie_word_embeddings:
        matrices.append(model.lm_head.weight)
    with torch.no_grad():
        for w in matrices:  # (V, hidden)
            w[first : mask_id + 1] = w[:first].float().mean(0).to(w.dtype)


def _grow_vocab(model: Transformer, n_rows: int) -> None:
    """Append zero rows to the embedding and output matrices (re-tying if tied)."""
    embed, head = model.model.embed_tokens, model.lm_head
    extra = n_rows - embed.weight.shape[0]
    embed.weight = torch.nn.Parameter(_append_zero_rows(embed.weight, extra))
    embed.num_embeddings = n_rows
    if model.config.tie_word_embeddings:
        head.weight = embed.weight
    else:
        head.weight = torch.nn.Parameter(_append_zero_rows(head.weight, extra))
    head.out_features = n_rows
    model.config.vocab_size = n_rows


def _append_zero_rows(w: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([w.detach(), w.new_zeros(n, w.shape[1])])  # (V + n, hidden)


def convert(
    base: PathLike | None,
    out: PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    quantize: str | None = None,
) -> int:
    """Load an AR checkpoint, add `<|mask|>` and save it as a ReFusion checkpoint at out.
    Returns the MASK id. Fails before loading if out is a non-empty directory (unless
    overwrite), and never leaves a half-written out. quantize "int8" / "int4": the saved
    weights are quantized (`io.quantize`), and load again without quantizing."""
    out = Path(out)
    check_output_dir(out, overwrite)
    model, tokenizer = load(base, device=device, dtype=dtype, quantize=quantize)
    mask_id = add_mask_token(model, tokenizer)
    save_pretrained(model, tokenizer, out, overwrite=overwrite)
    return mask_id
