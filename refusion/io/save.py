"""Checkpoints out: `save_pretrained` writes a directory in Hugging Face format, which
`transformers.AutoModelForCausalLM` loads too (docs/algorithm.md), atomically, with the
weights in shards above a size, as `transformers` writes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..model.transformer import Transformer
from ..settings.recommended import recommended_of
from .quantize import QUANT_KEY, WEIGHTS_FILE
from .resolve import PathLike
from .staging import follow_umask, make_staging, move_into_place, remove_stale_staging

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size


def save_pretrained(
    model: Transformer,
    tokenizer: Any,
    out_dir: PathLike,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write config.json, model.safetensors and the tokenizer files (if any) to out_dir
    (a quantized model: its state dict as torchao saves it, `_write_quantized`).
    Weights above `max_shard_bytes` go to shards model-0000i-of-0000n.safetensors of at
    most that size (a tensor larger than it alone in one) with model.safetensors.index.json,
    as transformers writes them.

    Written into a staging directory next to out_dir, then renamed into place, so a
    failure never leaves a half-written checkpoint; staging directories of out_dir that a
    killed save left behind are removed first (see `staging.remove_stale_staging`). A non-empty
    out_dir is replaced only with overwrite=True. The directory and its files get the
    modes any new directory and file would (0777 and 0666 less the umask), as
    `transformers` gives them. The result loads in `transformers.AutoModelForCausalLM` too.
    """
    out = Path(out_dir)
    if getattr(model, "tensor_parallel", None) is not None:
        raise CheckpointError(
            "this model is one rank's share of a tensor-parallel split; save the whole model "
            "(load it with tensor_parallel_size=1)"
        )
    check_output_dir(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(out)
        staging = make_staging(out)
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {e}") from None
    try:
        _write_checkpoint(model, tokenizer, staging, max_shard_bytes)
        follow_umask(staging)
        move_into_place(staging, out)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot write {out}: {e}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse to replace anything but an empty directory unless told to."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(
            f"{out} exists and is not empty; refusing to overwrite it (use --force / overwrite=True)"
        )


def _write_checkpoint(
    model: Transformer, tokenizer: Any, directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
    config = model.config.to_hf_dict()
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")  # what the weights are, as saved
    config.pop(QUANT_KEY, None)
    quantization = getattr(model, "quantization", None)
    if quantization is not None:  # torchao's format, not safetensors (docs/quantization.md)
        config[QUANT_KEY] = quantization
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if quantization is not None:
        _write_quantized(model, directory)
    else:
        _write_weights(model, directory, max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    recommended_of(model).write(directory)


def _write_weights(model: Transformer, directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    state = model.state_dict()
    if model.config.tie_word_embeddings:  # one tensor on disk, as transformers writes it
        drop_tied_head(state)
    sizes = {k: t.numel() * t.element_size() for k, t in state.items()}
    shards = shard_plan(sizes, max_shard_bytes)
    if len(shards) == 1:
        _write_shard(state, shards[0][1], directory / "model.safetensors")
        return
    for name, keys in shards:  # one shard in memory (on the CPU) at a time
        _write_shard(state, keys, directory / name)
    write_index(directory, shards, sizes)


def _write_quantized(model: Transformer, directory: Path) -> None:
    """A quantized model's state dict as torchao saves it (`torch.save`, its tensor
    subclasses included; docs/quantization.md), on the CPU, with a tied head stored once."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # before the copies to the CPU, which part the tied pair
        drop_tied_head(state)
    torch.save({k: v.cpu() for k, v in state.items()}, directory / WEIGHTS_FILE)


def shard_plan(sizes: dict[str, int], max_bytes: int) -> list[tuple[str, list[str]]]:
    """(file name, tensor names) per shard: the tensors in order, cut into runs of at most
    max_bytes (a larger tensor alone), named as transformers names them."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, n in sizes.items():
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return [(f"model-{i:05d}-of-{len(groups):05d}.safetensors", keys) for i, keys in enumerate(groups, 1)]


def write_index(directory: Path, shards: list[tuple[str, list[str]]], sizes: dict[str, int]) -> None:
    """model.safetensors.index.json: each tensor's shard, and the weights' total bytes."""
    index = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": {k: name for name, keys in shards for k in keys},
    }
    (directory / "model.safetensors.index.json").write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n"
    )


def _write_shard(state: dict[str, torch.Tensor], keys: list[str], file: Path) -> None:
    save_file({k: state[k].detach().cpu().contiguous() for k in keys}, file, metadata={"format": "pt"})


def drop_tied_head(state: dict[str, torch.Tensor]) -> None:
    """Delete, in place, each output matrix (`[prefix]lm_head.weight`) that is its model's
    input embedding (`[prefix]model.embed_tokens.weight`, same storage): a tied matrix is
    stored once, and the loaders tie it again. Left to the libraries (safetensors through
    accelerate), the copy is dropped too, but with a "Removed shared tensor" warning at
    every save."""
    head = "lm_head.weight"
    for name in [k for k in state if k.endswith(head)]:
        embed = state.get(name[: -len(head)] + "model.embed_tokens.weight")
        if embed is not None and embed.data_ptr() == state[name].data_ptr():
            del state[name]
