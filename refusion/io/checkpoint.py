"""Checkpoints in Hugging Face format, both ways: load, save, and add the MASK token.

`load` accepts a local model directory, a hub id, a `.gguf` file or nothing (the model
bundled with the package) and returns our `Transformer` plus the tokenizer. Weights are
read with `safetensors` straight into the model, after every name and shape has been
checked against the config from the file headers alone, so a bad checkpoint fails with
the name of the first bad tensor before any weight is read; `describe` (what `refusion
info` prints) makes the same checks. `save_pretrained` writes a directory that
`transformers.AutoModelForCausalLM` loads too (SPEC §1), atomically.

`transformers` is imported inside the functions that need it (tokenizers, GGUF), so that
`import refusion` stays cheap.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..decode.recommended import Recommended, recommended_of
from ..errors import CheckpointError, ConfigError
from ..model.config import DTYPE_NAMES, ModelConfig
from ..model.prompts import MASK_TOKEN, mask_id_of, tokenizer_mask_id
from ..model.tensor_parallel import local_config, make_row_parallel, slice_of
from ..model.transformer import Transformer, rope_inv_freq, stored_shapes
from ..parallel.launch import tensor_shard

BUNDLED_ROOT = Path(__file__).parent.parent / "bundled"
BUNDLED_DIR = BUNDLED_ROOT / "refusion-tiny"  # the default model
BUNDLED_PREFIX = "bundled:"  # `bundled:NAME` names a model shipped in the package: refusion-tiny, ar-tiny


def bundled_names() -> list[str]:
    """The models this installation ships (`bundled:NAME`)."""
    return sorted(d.name for d in BUNDLED_ROOT.iterdir() if (d / "config.json").is_file()) if BUNDLED_ROOT.is_dir() else []
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
# tensors some checkpoints carry that the model recomputes
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)

PathLike = str | os.PathLike
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- load
def load(
    path: PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    tensor_parallel_size: int = 1,
) -> tuple[Transformer, Any]:
    """Load a model and its tokenizer.

    path: a local Hugging Face model directory (config.json + model.safetensors, or
    shards with model.safetensors.index.json), a hub id (downloaded with
    huggingface_hub), a `.gguf` file (de-quantised by transformers), `bundled:NAME` for
    a model shipped with the package (`bundled:refusion-tiny`, `bundled:ar-tiny`, its
    AR baseline), or None for `bundled:refusion-tiny`. dtype: None or "auto" = the config's torch_dtype if
    the device can run it, else float32; or "float32" / "bfloat16" / "float16" / a torch
    dtype. The tokenizer is None when the directory has no tokenizer files.
    `model.config.mask_token_id` is the config's, else the tokenizer's `<|mask|>` id.
    tensor_parallel_size N > 1 (in a group of N processes, see `refusion.parallel`): this
    rank's share of the model, read as slices of the checkpoint's tensors; its config is
    the share's (`model.tensor_parallel` says which).
    """
    dev = _check_device(device)
    wanted = parse_dtype(dtype, dev)  # a bad dtype fails before any file is read
    source = _resolve(path)
    shard = tensor_shard(tensor_parallel_size)
    if source.suffix == ".gguf":
        if shard is not None:
            raise ConfigError("tensor parallelism reads safetensors slices; convert the GGUF file first "
                              "(refusion convert FILE.gguf OUT) and load OUT")
        return _load_gguf(source, dev, wanted)
    config, tokenizer = _read_metadata(source)
    model = Transformer.meta(config)
    headers = _checked_headers(source, model)
    slicer = None
    if shard is not None:
        model = Transformer.meta(local_config(config, shard.world))
        make_row_parallel(model, shard)
        slicer = lambda name: slice_of(name, config, shard)  # noqa: E731
    state = _read_tensors(headers, set(stored_shapes(model)), dev, wanted or _config_dtype(config, dev), slicer)
    model = _fill(model, state, dev)
    model.tensor_parallel = shard
    model.recommended = Recommended.read(source)  # decode settings that travel with the weights
    return model, tokenizer


def load_metadata(path: PathLike | None = None) -> tuple[ModelConfig, Any]:
    """The config (with the MASK id resolved) and tokenizer of a checkpoint, without
    reading its weights. Same `path` forms as `load`."""
    source = _resolve(path)
    if source.suffix != ".gguf":
        return _read_metadata(source)
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise CheckpointError(f"cannot read the GGUF file {source}: {e}") from None
    config = ModelConfig.from_hf_dict(_plain_hf_dict(hf_config))
    tokenizer = _gguf_tokenizer(source)
    _settle_vocabulary(config, tokenizer, where=str(source))
    return config, tokenizer


def describe(path: PathLike | None = None) -> dict[str, Any]:
    """What `refusion info` reports. Reads no weights, but checks them as `load` does
    before reading any: every safetensors header, each file's size against the data its
    header declares, and every tensor's name and shape against the config. So `info`
    fails on the checkpoints `load` refuses, instead of describing a model that cannot
    be loaded. The parameter count comes from the shapes the config implies (a model
    built on the meta device), which the check has just matched with the headers'."""
    source = _resolve(path)
    config, tokenizer = load_metadata(source)
    model = Transformer.meta(config)
    if source.suffix != ".gguf":  # transformers has parsed the GGUF file to read its config
        _checked_headers(source, model)
    return {
        "path": str(BUNDLED_DIR if path is None else path),
        "architecture": config.to_hf_dict()["architectures"][0],
        "model_type": config.model_type,
        "parameters": model.num_parameters(),
        "vocab_size": config.vocab_size,
        "tokenizer_size": None if tokenizer is None else len(tokenizer),
        "context_length": config.max_position_embeddings,
        "mask_token_id": config.mask_token_id,
        "dtype": config.torch_dtype,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "tie_word_embeddings": config.tie_word_embeddings,
        "recommended": (Recommended() if source.suffix == ".gguf" else Recommended.read(source)).as_dict(),
    }


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """A supported torch dtype that runs on `device`, or None for "use the config's"."""
    if dtype is None or dtype == "auto":
        return None
    choices = f"choose one of auto, {', '.join(DTYPES)}"
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; {choices}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ConfigError(f"dtype {dtype} is not supported; {choices}")
    if not _device_runs(device, dtype):
        raise ConfigError(f"device {device} cannot run {dtype}; pass dtype='float32'")
    return dtype


def _config_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype the checkpoint was stored in, or float32 where the device cannot run it."""
    stored = DTYPES.get(str(config.torch_dtype).removeprefix("torch."), torch.float32)
    return stored if _device_runs(device, stored) else torch.float32


def _device_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a small matmul in `dtype` works on `device` (the model's core operation)."""
    try:
        x = torch.ones(2, 2, dtype=dtype, device=device)
        (x @ x).sum().item()
    except (RuntimeError, TypeError):
        return False
    return True


def _check_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError) as e:  # torch asserts when built without CUDA
        raise ConfigError(f"device {str(device)!r} is not available: {e}") from None
    return dev


# ---------------------------------------------------------------------------- where the files are
def _resolve(path: PathLike | None) -> Path:
    """A local directory or .gguf file for any accepted `path` form."""
    if path is None:
        if not (BUNDLED_DIR / "config.json").is_file():
            raise CheckpointError(
                f"the bundled model is missing from this installation ({BUNDLED_DIR}); "
                "pass a model directory, a .gguf file or a hub id instead"
            )
        return BUNDLED_DIR
    if isinstance(path, str) and path.startswith(BUNDLED_PREFIX):
        name = path[len(BUNDLED_PREFIX):]
        if name not in bundled_names():
            have = ", ".join(BUNDLED_PREFIX + n for n in bundled_names()) or "none"
            raise CheckpointError(f"no bundled model {path!r}; this installation ships: {have}")
        return BUNDLED_ROOT / name
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.is_file():
        if local.suffix == ".gguf":
            return local
        raise CheckpointError(
            f"{local} is a file; expected a model directory (config.json + *.safetensors) or a .gguf file"
        )
    if isinstance(path, str) and _HUB_ID.fullmatch(path) and not path.startswith("."):
        return _download(path)
    raise CheckpointError(f"no model directory or file at {local}")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except (OSError, ValueError) as e:  # offline, not found, gated, invalid id
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{repo_id!r} is not a local directory, and fetching it from the Hugging Face hub failed "
            f"({reason}). To load offline, pass the path of a local model directory "
            "(config.json + *.safetensors) or of a .gguf file."
        ) from None


def _read_metadata(directory: Path) -> tuple[ModelConfig, Any]:
    config = ModelConfig.from_json(directory / "config.json")
    tokenizer = _load_tokenizer(directory)
    _settle_vocabulary(config, tokenizer, where=str(directory))
    return config, tokenizer


def _load_tokenizer(directory: Path) -> Any:
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot load the tokenizer in {directory}: {e}") from None


def _settle_vocabulary(config: ModelConfig, tokenizer: Any, where: str) -> None:
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
            f"vocab_size={config.vocab_size}: its ids past {config.vocab_size - 1} would index past the embedding; "
            "use the tokenizer the weights were made with"
        )


def _resolve_mask_id(config: ModelConfig, tokenizer: Any) -> None:
    """config.mask_token_id := the config's, else the tokenizer's `<|mask|>`, else None."""
    config.mask_token_id = mask_id_of(config, tokenizer)
    mask = config.mask_token_id
    if mask is not None and not 0 <= mask < config.vocab_size:
        raise CheckpointError(f"mask_token_id={mask} is outside the vocabulary (vocab_size={config.vocab_size})")


# ---------------------------------------------------------------------------- weights
def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} names the shard {f.name}, which is missing")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    hint = " (PyTorch .bin weights are not supported; save them as safetensors)" if any(directory.glob("*.bin")) else ""
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {directory}{hint}")


def _checked_headers(directory: Path, model: Transformer) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """The headers of the directory's weight files, checked against the model its config
    describes: what `load` and `describe` both do before (or instead of) reading weights."""
    headers = _read_headers(_weight_files(directory))
    _check_tensors(model, headers, where=str(directory))
    return headers


def _read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) for every tensor, from the safetensors headers only."""
    headers: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        _check_not_truncated(f)
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    headers[name] = (f, tuple(st.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    return headers


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


def _check_tensors(model: Transformer, found: dict[str, tuple[Any, tuple[int, ...]]], where: str) -> None:
    """Every expected tensor present with the expected shape, and nothing unexplained."""
    expected = stored_shapes(model)
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"tensor {name} is missing from {where}")
        if found[name][1] != tuple(shape):
            raise CheckpointError(
                f"tensor {name} in {where} has shape {list(found[name][1])}, but the config implies {list(shape)}"
            )
    allowed = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    for name in found:
        if name not in expected and name not in allowed and not name.endswith(_IGNORED_TENSOR_SUFFIXES):
            raise CheckpointError(f"unexpected tensor {name} in {where}: the config does not describe it")


def _read_tensors(
    headers: dict[str, tuple[Path, tuple[int, ...]]],
    names: set[str],
    device: torch.device,
    dtype: torch.dtype,
    slicer: Callable[[str], tuple[int, int, int] | None] | None = None,
) -> dict[str, torch.Tensor]:
    """The named tensors, cast and moved one at a time; where `slicer` gives (dim, start,
    stop) for a name, only that slice. Read with plain reads into each tensor's own
    memory, not through a memory map, whose pages would count against the process until
    the file is closed: the peak is about the weights kept plus one tensor."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted({f for f, _ in headers.values()}):
        try:
            entries, data_start = _safetensors_header(f)
            with open(f, "rb", buffering=0) as fh:
                for name, entry in entries.items():
                    if name in names:
                        part = slicer(name) if slicer is not None else None
                        state[name] = _read_tensor(fh, entry, data_start, part).to(device=device, dtype=dtype)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read the tensors of {f}: {e}") from None
    return state


_SAFETENSORS_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"),
    ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("U8", "uint8"), ("BOOL", "bool")) if hasattr(torch, attr)}


def _safetensors_header(file: Path, size: int | None = None) -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors file (dtype, shape, data_offsets) and where its
    data starts; ValueError for a header longer than the file (`size`, when known)."""
    with open(file, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if size is not None and n > size:
            raise ValueError(f"{file}: a header of {n} bytes in a file of {size}")
        header = json.loads(fh.read(n))
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
        buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
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


def _fill(model: Transformer, state: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    """Give the meta-device model the loaded tensors (no copy), re-tie, rebuild RoPE."""
    tied = model.config.tie_word_embeddings
    if tied:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(model.config).to(device)
    return model.eval()


# ---------------------------------------------------------------------------- GGUF
def _load_gguf(file: Path, device: torch.device, wanted: torch.dtype | None) -> tuple[Transformer, Any]:
    """De-quantise with transformers, then move its weights into our model."""
    from transformers import AutoModelForCausalLM

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name)
    except ImportError as e:
        raise CheckpointError(f"reading GGUF needs the gguf package (pip install 'refusion[gguf]'): {e}") from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"cannot import the GGUF file {file}: {e}") from None
    config = ModelConfig.from_hf_dict(_plain_hf_dict(hf_model.config))
    tokenizer = _gguf_tokenizer(file)
    _settle_vocabulary(config, tokenizer, where=str(file))
    model = Transformer.meta(config)
    hf_state = hf_model.state_dict()
    _check_tensors(model, {k: (None, tuple(v.shape)) for k, v in hf_state.items()}, where=str(file))
    dtype = wanted or _config_dtype(config, device)
    state = {k: hf_state[k].to(device=device, dtype=dtype) for k in stored_shapes(model)}
    return _fill(model, state, device), tokenizer


def _gguf_tokenizer(file: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the tokenizer of the GGUF file {file}: {e}") from None


def _plain_hf_dict(hf_config: Any) -> dict[str, Any]:
    """The config as a plain checkpoint would have it: without the GGUF quantisation
    record (which would make transformers treat our saved copy as quantised) or
    transformers' private keys."""
    d = hf_config.to_dict()
    return {k: v for k, v in d.items() if k != "quantization_config" and not k.startswith("_")}


# ---------------------------------------------------------------------------- save
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size


def save_pretrained(model: Transformer, tokenizer: Any, out_dir: PathLike, overwrite: bool = False,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write config.json, model.safetensors and the tokenizer files (if any) to out_dir.
    Weights above `max_shard_bytes` go to shards model-0000i-of-0000n.safetensors of at
    most that size (a tensor larger than it alone in one) with model.safetensors.index.json,
    as transformers writes them.

    Written into a staging directory next to out_dir, then renamed into place, so a
    failure never leaves a half-written checkpoint; staging directories of out_dir that a
    killed save left behind are removed first (see `_remove_stale_staging`). A non-empty
    out_dir is replaced only with overwrite=True. The directory and its files get the
    modes any new directory and file would (0777 and 0666 less the umask), as
    `transformers` gives them. The result loads in `transformers.AutoModelForCausalLM` too.
    """
    out = Path(out_dir)
    if getattr(model, "tensor_parallel", None) is not None:
        raise CheckpointError("this model is one rank's share of a tensor-parallel split; save the whole model "
                              "(load it with tensor_parallel_size=1)")
    check_output_dir(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(out)
        staging = _make_staging(out)
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {e}") from None
    try:
        _write_checkpoint(model, tokenizer, staging, max_shard_bytes)
        _follow_umask(staging)
        _move_into_place(staging, out)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot write {out}: {e}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def _writer_tag() -> str:
    """This host and process, as staging names carry them. The host keeps a cleaner on one
    machine from judging, by its own process table, a writer on another that shares the
    filesystem."""
    return f"{re.sub(r'[^A-Za-z0-9.-]', '_', socket.gethostname())}-{os.getpid()}"


def _make_staging(out: Path) -> Path:
    """A new, empty `.{name}.partial-{host}-{pid}-{random}` directory next to out.

    Made with os.mkdir(mode=0o777), so it gets the umask's mode as any new directory does
    (tempfile.mkdtemp's would be 0700, and the rename would carry that to out)."""
    while True:
        staging = out.parent / f"{_staging_prefix(out)}{_writer_tag()}-{secrets.token_hex(4)}"
        try:
            staging.mkdir(mode=0o777)
            return staging
        except FileExistsError:
            continue


def _remove_stale_staging(out: Path) -> None:
    """Remove the staging directories of `out` whose writer is dead, and log in one line
    how much that freed.

    A save killed mid-write (SIGKILL, out of memory, power) cannot clean up after itself,
    and leaves a staging directory as large as the checkpoint. Its name carries its
    writer's host and pid, so the next save of the same target can tell a dead writer's
    directory from a live one's: a directory is removed only when its host is this one
    and no process has its pid. A live writer's, another host's (its pids mean nothing
    here), another target's, and any other name are left alone. The pid test was chosen
    over a lock file (flock) because it needs no file inside the directory that would
    have to be left out of the checkpoint, and keeps working where locks do not (some
    network filesystems). A pid reused since the writer died only makes a leftover stay
    for one more save; on systems without a safe pid probe nothing is removed.
    """
    prefix = _staging_prefix(out)
    pattern = re.compile(rf"{re.escape(prefix)}(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}")
    host = _writer_tag().rsplit("-", 1)[0]
    removed, freed = 0, 0
    for entry in out.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if not match or match["host"] != host or entry.is_symlink() or not entry.is_dir():
            continue
        if _pid_alive(int(match["pid"])):
            continue
        size = _tree_size(entry)
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed, freed = removed + 1, freed + size
    if removed:
        folders = "folder" if removed == 1 else "folders"
        log.warning(
            f"removed {removed} staging {folders} of {out} left by an interrupted save ({freed / 1e6:,.1f} MB)"
        )


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (any user's). True where it cannot be told
    safely: on Windows os.kill(pid, 0) would send CTRL_C_EVENT rather than probe."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _tree_size(directory: Path) -> int:
    """Bytes in the files under directory (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _follow_umask(staging: Path) -> None:
    """Give every file and directory under staging 0666 / 0777 less the umask, whatever
    the writer chose (safetensors writes its file 0600). The umask is read off staging
    itself, made with mode 0777: asking os.umask would mean setting it, which races with
    other threads creating files."""
    umask = ~stat.S_IMODE(staging.stat().st_mode) & 0o777
    for root, dirs, files in os.walk(staging):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse to replace anything but an empty directory unless told to."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out} exists and is not empty; refusing to overwrite it (use --force / overwrite=True)")


def _write_checkpoint(model: Transformer, tokenizer: Any, directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    config = model.config.to_hf_dict()
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")  # what the weights are, as saved
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
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
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {k: name for name, keys in shards for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


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


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename staging to out; an existing out is moved aside first and restored on failure."""
    if not out.exists():
        staging.rename(out)
        return
    graveyard = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old = graveyard / out.name
    out.rename(old)
    try:
        staging.rename(out)
    except OSError:
        old.rename(out)
        raise
    finally:
        shutil.rmtree(graveyard, ignore_errors=True)


# ---------------------------------------------------------------------------- MASK token
def add_mask_token(model: Transformer, tokenizer: Any) -> int:
    """Prepare the model for ReFusion training: ensure a `<|mask|>` token and return its id.

    Adds `<|mask|>` to the tokenizer as an additional special token, and gives the
    model a row for it in the embedding and the output layer, initialised to the mean
    of the rows before it (SPEC §1; the tokens' rows, not the padding rows some vocabularies
    carry). The matrices grow only when the id is past the last row; tied embeddings
    stay tied. Idempotent: a model whose config or tokenizer already has the token is
    left as it is. With tokenizer=None the new id is the next row.
    """
    config = model.config
    if config.mask_token_id is not None:
        return config.mask_token_id
    mask_id = None if tokenizer is None else tokenizer_mask_id(tokenizer)
    is_new = mask_id is None
    if is_new:
        mask_id = config.vocab_size if tokenizer is None else _add_to_tokenizer(tokenizer)
    if is_new or mask_id >= config.vocab_size:
        _init_rows(model, mask_id)
    config.mask_token_id = mask_id
    return mask_id


def _add_to_tokenizer(tokenizer: Any) -> int:
    # The positional False keeps the tokenizer's other additional special tokens (the
    # argument is replace_additional_special_tokens in transformers 4, _extra_ in 5).
    tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]}, False)
    return tokenizer_mask_id(tokenizer)


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


# ---------------------------------------------------------------------------- convert
def convert(
    base: PathLike | None,
    out: PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> int:
    """Load an AR checkpoint, add `<|mask|>` and save it as a ReFusion checkpoint at out.
    Returns the MASK id. Fails before loading if out is a non-empty directory (unless
    overwrite), and never leaves a half-written out."""
    out = Path(out)
    check_output_dir(out, overwrite)
    model, tokenizer = load(base, device=device, dtype=dtype)
    mask_id = add_mask_token(model, tokenizer)
    save_pretrained(model, tokenizer, out, overwrite=overwrite)
    return mask_id
