"""Checkpoints in: `load` accepts a local model directory, a hub id, a `.gguf` file or a
bundled model and returns our `Transformer` plus the tokenizer; `load_metadata` and
`describe` (what `refusion info` prints) read the same checkpoints without their weights.

The entry points only: what a name points to, the checks and the reading of each format
live in the modules beside this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..model.tensor_parallel import Shard, local_config, make_row_parallel, slice_of
from ..model.transformer import Transformer, stored_shapes
from ..parallel.launch import tensor_shard
from ..settings.model import ModelConfig
from ..settings.recommended import Recommended
from .adapter import ADAPTER_WEIGHTS, adapter_base, fold_into, is_adapter_dir, read_adapter
from .dtypes import check_device, config_dtype, parse_dtype
from .gguf import gguf_metadata, load_gguf
from .metadata import read_metadata
from .quantize import (
    check_loadable,
    check_scheme,
    quantization_in,
    quantize_model,
    read_weights,
    run_dtype,
    weight_bytes,
)
from .resolve import PathLike, resolve_source
from .weights import check_finite, check_tensors, checked_headers, fill_model, header_bytes, read_tensors


def load(
    path: PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    tensor_parallel_size: int = 1,
    allow_nonfinite: bool = False,
    quantize: str | None = None,
) -> tuple[Transformer, Any]:
    """Load a model and its tokenizer.

    path: a local Hugging Face model directory (config.json + model.safetensors, or
    shards with model.safetensors.index.json), a hub id (downloaded with
    huggingface_hub), a `.gguf` file (de-quantised by transformers), `bundled:NAME` for
    a model shipped with the package (`bundled:refusion-tiny`, `bundled:ar-tiny`, its
    AR baseline, `bundled:refusion-smollm2`, adapters over SmolLM2), `package:MODULE/PATH`
    for a checkpoint inside an installed Python package, a directory of adapters over a
    base (`io.adapter`), or None for `bundled:refusion-tiny`. dtype: None or "auto" = the
    config's torch_dtype if the device can run it, else float32; or "float32" / "bfloat16" /
    "float16" / a torch dtype. The tokenizer is None when the directory has no tokenizer files.
    `model.config.mask_token_id` is the config's, else the tokenizer's `<|mask|>` id.
    tensor_parallel_size N > 1 (in a group of N processes, see `refusion.parallel`): this
    rank's share of the model, read as slices of the checkpoint's tensors; its config is
    the share's (`model.tensor_parallel` says which). A weight that is NaN or infinite
    fails the load unless allow_nonfinite.
    quantize "int8" or "int4": the blocks' linear layers quantized after the load, weight
    only, through torchao (docs/quantization.md); int4 runs in bfloat16. A checkpoint
    saved quantized (`refusion convert --quantize`) loads as it was saved, without
    quantizing again.
    """
    dev = check_device(device)
    wanted = parse_dtype(dtype, dev)  # a bad dtype fails before any file is read
    scheme = check_scheme(quantize)
    if scheme is not None:  # int4's bfloat16, or a refusal of the pair, before any file is read
        wanted = run_dtype(scheme, dev, wanted, None)
    source = resolve_source(path)
    shard = tensor_shard(tensor_parallel_size)
    if source.suffix == ".gguf":
        return _load_gguf(source, dev, wanted, scheme, shard, allow_nonfinite)
    config, tokenizer = read_metadata(source)
    if is_adapter_dir(source):
        return _load_adapted(
            source, config, tokenizer, dev, wanted, scheme, shard, allow_nonfinite
        ), tokenizer
    record = quantization_in(config.extra)
    if record is not None:
        return _load_saved_quantized(
            source, config, record, dev, wanted, scheme, shard, allow_nonfinite
        ), tokenizer
    return _load_safetensors(source, config, dev, wanted, scheme, shard, allow_nonfinite), tokenizer


def _load_gguf(
    source: Path,
    dev: torch.device,
    wanted: torch.dtype | None,
    scheme: str | None,
    shard: Shard | None,
    allow_nonfinite: bool,
) -> tuple[Transformer, Any]:
    """A `.gguf` file, de-quantised whole (it has no slices to split)."""
    if shard is not None:
        raise ConfigError(
            "tensor parallelism reads safetensors slices; convert the GGUF file first "
            "(refusion convert FILE.gguf OUT) and load OUT"
        )
    model, tokenizer = load_gguf(source, dev, wanted, allow_nonfinite)
    if scheme is not None:
        quantize_model(model, scheme)
    return model, tokenizer


def _load_adapted(
    source: Path,
    config: ModelConfig,
    tokenizer: Any,
    dev: torch.device,
    wanted: torch.dtype | None,
    scheme: str | None,
    shard: Shard | None,
    allow_nonfinite: bool,
) -> Transformer:
    """Adapters over a base (`io.adapter`): the base read in float32, given `<|mask|>`'s row
    as `refusion convert` gives it, the factors folded in; then moved into a model of the
    adapter's own config, in the dtype (and quantization) asked for."""
    if shard is not None:
        raise ConfigError(
            f"{source} holds adapters, which fold into whole weights; write them out first "
            f"(refusion convert {source} OUT) and load OUT with --tensor-parallel-size"
        )
    from .mask import add_mask_token  # mask.py's convert loads through this module

    meta, factors = read_adapter(source)
    base, _ = load(
        adapter_base(meta, source), device=dev, dtype=torch.float32, allow_nonfinite=allow_nonfinite
    )
    add_mask_token(base, tokenizer)
    fold_into(base, factors, meta["alpha"] / meta["r"], where=str(source))
    model = Transformer.meta(config)
    state = base.state_dict()
    where = f"{meta['base']} adapted by {source}"
    check_tensors(model, {k: (None, tuple(v.shape)) for k, v in state.items()}, where)
    dtype = wanted or config_dtype(config, dev)
    model = fill_model(model, {k: state[k].to(dtype) for k in stored_shapes(model)}, dev)
    model.recommended = Recommended.read(source)
    if scheme is not None:
        quantize_model(model, scheme)
    return model


def _load_safetensors(
    source: Path,
    config: ModelConfig,
    dev: torch.device,
    wanted: torch.dtype | None,
    scheme: str | None,
    shard: Shard | None,
    allow_nonfinite: bool,
) -> Transformer:
    """A safetensors checkpoint: every header checked against the config, then the
    tensors (this rank's slices of them, with `shard`) read into the model."""
    model, headers = checked_headers(source, config)
    slicer = None
    if shard is not None:
        model = Transformer.meta(local_config(config, shard.world))
        make_row_parallel(model, shard)
        slicer = lambda name: slice_of(name, config, shard)  # noqa: E731
    dtype = wanted or config_dtype(config, dev)
    state = read_tensors(headers, set(stored_shapes(model)), dev, dtype, slicer, allow_nonfinite)
    model = fill_model(model, state, dev)
    model.tensor_parallel = shard
    model.recommended = Recommended.read(source)  # decode settings that travel with the weights
    if scheme is not None:  # each rank quantizes its own share
        quantize_model(model, scheme)
    return model


def _load_saved_quantized(
    source, config: ModelConfig, record: dict[str, Any], dev, wanted, scheme, shard, allow_nonfinite: bool
) -> Transformer:
    """A checkpoint saved quantized: its state dict as saved (torchao's tensors
    included), checked against the config as a safetensors checkpoint is."""
    if shard is not None:
        raise ConfigError(
            "a checkpoint saved quantized loads whole; to split a quantized model, load the unquantized "
            "checkpoint with --tensor-parallel-size and --quantize (each rank quantizes its share)"
        )
    check_loadable(record, dev, wanted, scheme)
    model, state = _saved_quantized_state(source, config, record, dev)
    if not allow_nonfinite:
        for name, t in state.items():
            if t.is_floating_point() and type(t) is torch.Tensor:
                check_finite(name, t, str(source))
    model = fill_model(model, state, dev)
    model.quantization = dict(record)
    model.recommended = Recommended.read(source)
    return model


def _saved_quantized_state(
    source, config: ModelConfig, record: dict[str, Any], dev: torch.device
) -> tuple[Transformer, dict[str, torch.Tensor]]:
    """The model the config describes (on the meta device) and the saved state dict
    (memory-mapped), every name and shape checked against each other."""
    state = read_weights(source, record, dev)
    model = Transformer.meta(config)
    check_tensors(model, {k: (None, tuple(v.shape)) for k, v in state.items()}, where=str(source))
    return model, state


def load_metadata(path: PathLike | None = None) -> tuple[ModelConfig, Any]:
    """The config (with the MASK id resolved) and tokenizer of a checkpoint, without
    reading its weights. Same `path` forms as `load`."""
    source = resolve_source(path)
    return gguf_metadata(source) if source.suffix == ".gguf" else read_metadata(source)


def describe(path: PathLike | None = None) -> dict[str, Any]:
    """What `refusion info` reports. Reads no weights, but checks them as `load` does
    before reading any: every safetensors header, each file's size against the data its
    header declares, and every tensor's name and shape against the config. So `info`
    fails on the checkpoints `load` refuses, instead of describing a model that cannot
    be loaded. The parameter count comes from the shapes the config implies (a model
    built on the meta device), which the check has just matched with the headers'."""
    source = resolve_source(path)
    config, tokenizer = load_metadata(source)
    record = None if source.suffix == ".gguf" else quantization_in(config.extra)
    if source.suffix == ".gguf":  # transformers has parsed the GGUF file to read its config
        model, stored = Transformer.meta(config), {}
    elif is_adapter_dir(source):  # the factors only: the base's weights are another checkpoint's
        read_adapter(source)
        model, stored = Transformer.meta(config), header_bytes([source / ADAPTER_WEIGHTS])
    elif record is not None:  # the saved state dict, memory-mapped: its tensors' bytes, no copy
        model, state = _saved_quantized_state(source, config, record, torch.device("cpu"))
        stored = weight_bytes(state)
    else:
        model, headers = checked_headers(source, config)
        stored = header_bytes(sorted({f for f, _ in headers.values()}))
    return {
        "path": str(source if path is None else path),  # None: the bundled model's directory
        "architecture": config.to_hf_dict()["architectures"][0],
        "model_type": config.model_type,
        "parameters": model.num_parameters(),
        "vocab_size": config.vocab_size,
        "tokenizer_size": None if tokenizer is None else len(tokenizer),
        "context_length": config.max_position_embeddings,
        "mask_token_id": config.mask_token_id,
        "dtype": config.torch_dtype,
        "weight_bytes": stored,  # per dtype, as stored (GGUF: not read)
        "quantization": record,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "tie_word_embeddings": config.tie_word_embeddings,
        "recommended": (Recommended() if source.suffix == ".gguf" else Recommended.read(source)).as_dict(),
    }
