"""Safetensors weights in: the headers, the checks made on them, and the reading of tensors
(or this rank's slices of them) into the model.

Every name and shape is checked against the config from the file headers alone, so a
bad checkpoint fails with the name of the first bad tensor before any weight is read;
`describe` makes the same checks without reading. Tensors are read with plain reads
rather than a memory map, which bounds the peak memory of a load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from ..files import check_regular, checkpoint_file, open_regular, parse_json, read_json
from ..model.sizing import stored_parameters
from ..model.transformer import Transformer, rope_inv_freq, stored_shapes
from ..settings.fields import shown
from ..settings.model import FIX_CONFIG, ModelConfig

# tensors some checkpoints carry that the model recomputes
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(directory: Path) -> list[Path]:
    """The directory's safetensors files: the shards its index names, or its one file;
    each a regular file (a FIFO or `/dev/zero` in a shard's place would stall the read)."""
    index = checkpoint_file(directory, "model.safetensors.index.json")
    if index.exists() or index.is_symlink():
        files = _index_shards(index, directory)
        for f in files:
            if not (f.exists() or f.is_symlink()):
                raise CheckpointError(f"{index} names the shard {f.name}, which is missing")
            check_regular(f, CheckpointError, fix=_FIX_WEIGHTS)
        return files
    single = checkpoint_file(directory, "model.safetensors")
    if single.exists() or single.is_symlink():
        check_regular(single, CheckpointError, fix=_FIX_WEIGHTS)
        return [single]
    hint = (
        " (PyTorch .bin weights are not supported; save them as safetensors)"
        if any(directory.glob("*.bin"))
        else ""
    )
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {directory}{hint}")


_FIX_WEIGHTS = "download or copy the checkpoint again"
_MAX_HEADER_BYTES = 100 * 2**20  # the most a safetensors header may take (the format's own limit)


def _index_shards(index: Path, directory: Path) -> list[Path]:
    """The shard files `model.safetensors.index.json` names: file names inside the
    checkpoint directory, never an absolute path or one that climbs out of it (an index
    must not make a load read files elsewhere). A shard may be a symlink, as in the
    Hugging Face cache, whose files link to blobs beside the snapshot."""
    d = read_json(index, CheckpointError, fix=_FIX_WEIGHTS)
    weight_map = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index}: weight_map must be an object of tensor name -> shard file; {_FIX_WEIGHTS}"
        )
    names = set()
    for tensor, name in weight_map.items():
        parts = PurePosixPath(name).parts if isinstance(name, str) else ()
        if not parts or name.startswith("/") or "\\" in name or ".." in parts or "\0" in name:
            raise CheckpointError(
                f"{index}: weight_map[{shown(tensor)}]={shown(name)} is not the name of a shard file "
                f"inside {directory}; {_FIX_WEIGHTS}"
            )
        names.add(name)
    return sorted(checkpoint_file(directory, name) for name in names)


def check_config_fits(config: ModelConfig, files: list[Path], bits_per_value: int = 8) -> None:
    """The config claims no more values than its weight files can hold (at `bits_per_value`
    the least, a byte for safetensors): a config of a million layers or a hidden size of a
    trillion is refused here, before a model of its shape is built or sized."""
    held = sum(f.stat().st_size for f in files) * 8 // bits_per_value
    claimed = stored_parameters(config)
    if claimed > held:
        where = files[0].parent / "config.json" if files[0].suffix != ".gguf" else files[0]
        raise CheckpointError(
            f"{where} describes {claimed:,} weights (num_hidden_layers={config.num_hidden_layers}, "
            f"hidden_size={config.hidden_size}, vocab_size={config.vocab_size}), more than the weight files "
            f"({', '.join(f.name for f in files[:3])}{', ...' if len(files) > 3 else ''}) can hold: "
            f"the config does not describe these weights; {FIX_CONFIG}"
        )


def checked_headers(
    directory: Path, config: ModelConfig
) -> tuple[Transformer, dict[str, tuple[Path, tuple[int, ...]]]]:
    """The model `config` describes (on the meta device) and the headers of the
    directory's weight files, checked against each other: what `load` and `describe`
    both do before (or instead of) reading weights. The config is weighed against the
    files' sizes before the model is built, so that one of a million layers is refused
    without building it."""
    files = weight_files(directory)
    headers = _read_headers(files)
    check_config_fits(config, files)
    model = Transformer.meta(config)
    check_tensors(model, headers, where=str(directory))
    return model, headers


def _read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) for every tensor, from the safetensors headers only."""
    headers: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        _check_not_truncated(f)
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    tensor = st.get_slice(name)
                    _check_float(name, tensor.get_dtype(), f)
                    headers[name] = (f, tuple(tensor.get_shape()))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    return headers


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _check_float(name: str, dtype: str, file: Path) -> None:
    """Weights stored as integers (I8, U8, ...) are quantised: casting them to float, as a
    read would, makes numbers of the wrong scale without a word."""
    if dtype not in _FLOAT_DTYPES and not name.endswith(_IGNORED_TENSOR_SUFFIXES):
        raise CheckpointError(
            f"tensor {name} in {file} is stored as {dtype}, not as floating point: quantised weights "
            f"are not read; use a checkpoint saved in {', '.join(_FLOAT_DTYPES[:4])}"
        )


def _check_not_truncated(file: Path) -> None:
    """Fail on a safetensors file shorter than the data its header declares: a download or
    copy cut short, whose header still reads but whose tensors are not all there. Reads
    the 8-byte header length and the JSON header, nothing more. A file whose header does
    not parse is left to `safe_open`, whose error says what is wrong with it."""
    try:
        size = file.stat().st_size
        entries, data_start = _safetensors_header(file, size)
        needed = data_start + int(max((t["data_offsets"][1] for t in entries.values()), default=0))
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return
    if size < needed:
        raise CheckpointError(
            f"{file} is truncated: it holds {size:,} bytes, but its header declares {needed:,}; "
            "download or copy it again"
        )


def check_tensors(model: Transformer, found: dict[str, tuple[Any, tuple[int, ...]]], where: str) -> None:
    """Every expected tensor present with the expected shape, and nothing unexplained."""
    expected = stored_shapes(model)
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"tensor {name} is missing from {where}")
        if found[name][1] != tuple(shape):
            raise CheckpointError(
                f"tensor {name} in {where} has shape {list(found[name][1])}, "
                f"but the config implies {list(shape)}"
            )
    allowed = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    for name in found:
        if name not in expected and name not in allowed and not name.endswith(_IGNORED_TENSOR_SUFFIXES):
            raise CheckpointError(f"unexpected tensor {name} in {where}: the config does not describe it")


def read_tensors(
    headers: dict[str, tuple[Path, tuple[int, ...]]],
    names: set[str],
    device: torch.device,
    dtype: torch.dtype,
    slicer: Callable[[str], tuple[int, int, int] | None] | None = None,
    allow_nonfinite: bool = False,
) -> dict[str, torch.Tensor]:
    """The named tensors, cast and moved one at a time; where `slicer` gives (dim, start,
    stop) for a name, only that slice. Read with plain reads into each tensor's own
    memory, not through a memory map, whose pages would count against the process until
    the file is closed: the peak is about the weights kept plus one tensor. Each tensor
    is checked to be finite as stored (`check_finite`) unless `allow_nonfinite`."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted({f for f, _ in headers.values()}):
        try:
            entries, data_start = _safetensors_header(f)
            with open(f, "rb", buffering=0) as fh:
                for name, entry in entries.items():
                    if name in names:
                        part = slicer(name) if slicer is not None else None
                        tensor = _read_tensor(fh, entry, data_start, part)
                        if not allow_nonfinite:
                            check_finite(name, tensor, str(f))
                        state[name] = tensor.to(device=device, dtype=dtype)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read the tensors of {f}: {e}") from None
    return state


def check_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    """Refuse a tensor with NaN or infinite values: a damaged file, whose every output
    would be garbage (the engine only warns once its logits are not finite). The flag
    named lets a user who knows why load it anyway."""
    values = (
        tensor
        if tensor.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        else tensor.float()
    )
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise CheckpointError(
            f"tensor {name} in {where} holds {bad:,} NaN or infinite value{'s' if bad > 1 else ''}: the "
            "weights are damaged; load a sound copy, or pass --allow-nonfinite-weights "
            "(allow_nonfinite=True) to load them as they are"
        )


_SAFETENSORS_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in (
        ("F64", "float64"),
        ("F32", "float32"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("I64", "int64"),
        ("I32", "int32"),
        ("I16", "int16"),
        ("I8", "int8"),
        ("U64", "uint64"),
        ("U32", "uint32"),
        ("U16", "uint16"),
        ("U8", "uint8"),
        ("BOOL", "bool"),
    )
    if hasattr(torch, attr)
}


def header_bytes(files: list[Path]) -> dict[str, int]:
    """Bytes of weights per dtype (`float32`, `bfloat16`, ...) as the safetensors headers
    declare them, reading no tensor: what `refusion info` reports."""
    out: dict[str, int] = {}
    for f in files:
        try:
            entries, _ = _safetensors_header(f)
        except ValueError as e:
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
        for entry in entries.values():
            dtype = str(_SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"])).removeprefix("torch.")
            start, stop = entry["data_offsets"]
            out[dtype] = out.get(dtype, 0) + stop - start
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _safetensors_header(file: Path, size: int | None = None) -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors file (dtype, shape, data_offsets) and where its
    data starts; ValueError for a header longer than the file (`size`, when known)."""
    with open_regular(file, CheckpointError, fix=_FIX_WEIGHTS) as fh:
        n = int.from_bytes(fh.read(8), "little")
        if (size is not None and n > size) or n > _MAX_HEADER_BYTES:
            raise ValueError(f"{file}: a header of {n} bytes in a file of {size}")
        header = parse_json(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_tensor(fh, entry: dict, data_start: int, part: tuple[int, int, int] | None) -> torch.Tensor:
    """One tensor (or rows a:b of it, part=(0, a, b); columns, part=(1, a, b)) read from
    the open file into new memory."""
    if entry["dtype"] not in _SAFETENSORS_DTYPES:
        raise ValueError(f"tensor dtype {entry['dtype']} is not one this torch reads")
    dtype, shape = _SAFETENSORS_DTYPES[entry["dtype"]], list(entry["shape"])
    start, end = entry["data_offsets"]
    offset, rows = start, shape
    if part is not None and part[0] == 0:
        _, a, b = part
        row_bytes = (end - start) // shape[0] if shape[0] else 0
        offset, rows = start + a * row_bytes, [b - a] + shape[1:]
    tensor = torch.empty(rows, dtype=dtype)
    if tensor.numel():
        buffer = tensor.reshape(-1).view(torch.uint8).numpy().data  # the tensor's bytes, writable
        fh.seek(data_start + offset)
        got = 0
        while got < len(buffer):
            n = fh.readinto(buffer[got:])
            if not n:
                raise ValueError(f"the file ends inside a tensor ({got} of {len(buffer)} bytes read)")
            got += n
    if part is not None and part[0] == 1:
        tensor = tensor[:, part[1] : part[2]].contiguous()
    return tensor


def fill_model(model: Transformer, state: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    """Give the meta-device model the loaded tensors (no copy), re-tie, rebuild RoPE."""
    tied = model.config.tie_word_embeddings
    if tied:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(model.config).to(device)
    return model.eval()
