"""Weight-only quantization of the linear layers, through torchao (docs/quantization.md).

Decoding at batch 1 reads every weight once per forward, so weight bytes are time; int8
halves them against bfloat16 (a quarter of float32), int4 quarters them. Only the
projections of the blocks are quantized: the embedding and the output head stay in the
model's dtype (the head's rows are the logits every decoding rule ranks, and a tied head
is the embedding itself). Everything above a linear layer (the cache, the engine, the
decoders, tensor parallelism, the server) is unchanged: a quantized weight is a torchao
tensor subclass that `F.linear` dispatches on.

What runs where (torchao 0.18):

  scheme  device  weights                                   activations
  int8    cpu     per-channel int8 (`Int8WeightOnlyConfig`)  the model's dtype
  int8    cuda    the same                                   the model's dtype
  int4    cpu     groups of 32, tinygemm-packed              bfloat16 only
          (`PrototypeInt4WeightOnlyConfig`, `_weight_int4pack_mm_for_cpu`)
  int4    cuda    groups of 32, tile-packed                  bfloat16 only
          (`Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")`)

A layer whose input width is not a multiple of 32 stays in the model's dtype (int4 only).

A quantized model is saved as torchao documents it: the state dict, tensor subclasses
and all, written by `torch.save` and read back by `torch.load(weights_only=True)` then
`load_state_dict(assign=True)` (no re-quantizing). config.json records the scheme under
`QUANT_KEY`, so a loader knows the weights file is not safetensors.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, MissingExtraError, first_line

if TYPE_CHECKING:
    from ..model.transformer import Transformer

SCHEMES = ("int8", "int4")
# int4 scales per group of 32 weights along the input: on SmolLM2-135M, groups of 64 kept 22%
# of bfloat16's greedy tokens and groups of 32 all of them (docs/quantization.md)
INT4_GROUP_SIZE = 32
QUANT_KEY = "refusion_quantization"  # config.json's record of a quantized checkpoint
WEIGHTS_FILE = "model.torchao.pt"
_INSTALL = "pip install 'refusion[quant]' (torchao)"


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao's import logs a warning per CUDA extension a CPU build of torch cannot load
    and one per Enum it registers with torch.compile: noise to a user, so held back."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def torchao() -> Any:
    """The torchao module, imported quietly; a one-line error naming the extra if absent."""
    try:
        with _quiet_import():
            import torchao as ao
            import torchao.prototype.quantization.int4  # noqa: F401 -- registers the CPU int4 tensors
            import torchao.quantization  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(f"quantized weights need torchao ({e}); {_INSTALL}") from None
    # torch.compile asks each of torchao's tensors for a cache hash it does not give: a warning
    # per compiled graph that a user can do nothing about
    warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching")
    return ao


def check_scheme(scheme: str | None) -> str | None:
    """None, or a known scheme (checked before any file is read)."""
    if scheme is None or scheme == "none":
        return None
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)} (or none)")
    return scheme


def run_dtype(
    scheme: str, device: torch.device, wanted: torch.dtype | None, default: torch.dtype | None
) -> torch.dtype | None:
    """The dtype the quantized model's activations (and unquantized weights) run in:
    `wanted` (else `default`) if the scheme runs it on the device, else a one-line refusal
    that names what does. int4 runs in bfloat16 only (torchao's int4 kernels), which is
    its default."""
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"--quantize {scheme} runs on cpu and cuda (torchao's kernels), not on {device.type}; "
            "use --device cpu or drop --quantize"
        )
    if scheme == "int8":
        return wanted or default
    if wanted not in (None, torch.bfloat16):
        raise ConfigError(
            f"--quantize int4 runs with bfloat16 activations (torchao's int4 kernels), not "
            f"{str(wanted).removeprefix('torch.')}; pass --dtype bfloat16 or leave --dtype out"
        )
    return torch.bfloat16


def _layer_config(scheme: str, device: torch.device, layer: nn.Linear) -> Any:
    """torchao's config for one layer, or None where the layer stays as it is."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if scheme == "int8":
        return Int8WeightOnlyConfig()
    if layer.in_features % INT4_GROUP_SIZE:
        return None
    group = INT4_GROUP_SIZE
    if device.type == "cpu":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False)
    return Int4WeightOnlyConfig(
        group_size=group, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
    )


def quantizable(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The linear layers a scheme quantizes: every projection inside the blocks; the
    output head (and so a tied embedding) is left out."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("model.layers."):
            yield name, module


def quantize_model(model: Transformer, scheme: str) -> dict[str, Any]:
    """Quantize `model`'s block projections in place (the model already on its device
    and in the dtype `run_dtype` chose) and record what was done as `model.quantization`,
    which `refusion info`, the save and the benchmarks read."""
    ao = torchao()
    from torchao.quantization import quantize_

    device, dtype = model.device, model.dtype
    left = []
    with _quiet_import():
        for name, layer in list(quantizable(model)):
            cfg = _layer_config(scheme, device, layer)
            if cfg is None:
                left.append(name)
                continue
            quantize_(layer, cfg, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    model.quantization = {
        "library": "torchao",
        "version": ao.__version__,
        "scheme": scheme,
        "group_size": INT4_GROUP_SIZE if scheme == "int4" else None,  # int8: a scale per output channel
        "packed_for": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "unquantized": left,
    }
    return model.quantization


class WrapperTensor(Protocol):
    """A tensor subclass that holds its data in inner tensors (torch's protocol for them)."""

    def __tensor_flatten__(self) -> tuple[list[str], Any]: ...


def is_quantized(t: torch.Tensor) -> TypeGuard[WrapperTensor]:
    """A torchao tensor subclass (a packed weight), not a plain tensor."""
    return type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__")


def _storage_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding t's data: t itself, or a subclass's inner tensors."""
    if not is_quantized(t):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        yield from _storage_tensors(getattr(t, name))


def weight_bytes(tensors: dict[str, torch.Tensor] | nn.Module) -> dict[str, int]:
    """Bytes of weights per storage dtype (`int8`, `bfloat16`, ...), each tensor counted
    once (a tied head is the embedding): what a forward at batch 1 reads."""
    if isinstance(tensors, nn.Module):
        tensors = dict(tensors.named_parameters())
    seen: set[tuple[int, torch.dtype, torch.Size]] = set()
    out: dict[str, int] = {}
    for t in tensors.values():
        for s in _storage_tensors(t):
            key = s.untyped_storage().data_ptr() if s.device.type != "meta" else id(s)
            if (key, s.dtype, s.shape) in seen:
                continue
            seen.add((key, s.dtype, s.shape))
            name = str(s.dtype).removeprefix("torch.")
            out[name] = out.get(name, 0) + s.numel() * s.element_size()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def describe_bytes(by_dtype: dict[str, int]) -> str:
    """`int8 5.2 MB, float32 1.1 MB (6.3 MB)`: what `info` and the benchmarks print."""
    parts = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in by_dtype.items())
    return f"{parts} ({sum(by_dtype.values()) / 1e6:.1f} MB)" if len(by_dtype) > 1 else parts


# ---------------------------------------------------------------------------- saving


def quantization_in(config_extra: dict[str, Any]) -> dict[str, Any] | None:
    """The quantization record of a checkpoint's config.json, checked, or None."""
    q = config_extra.get(QUANT_KEY)
    if q is None:
        return None
    if not isinstance(q, dict) or q.get("scheme") not in SCHEMES or q.get("library") != "torchao":
        raise CheckpointError(
            f"config.json's {QUANT_KEY} is {q!r}, not a record refusion wrote; "
            "quantize the unquantized checkpoint again (refusion convert --quantize)"
        )
    return q


def read_weights(directory: Path, record: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The saved state dict, through `torch.load(weights_only=True)` (no code runs but
    torch's and torchao's tensor constructors), on `device`."""
    from ..files import check_regular, checkpoint_file

    file = checkpoint_file(directory, WEIGHTS_FILE)
    if not (file.exists() or file.is_symlink()):
        raise CheckpointError(
            f"{directory} is a {record['scheme']} checkpoint but has no {WEIGHTS_FILE}; save it again "
            "(refusion convert --quantize)"
        )
    check_regular(file, CheckpointError, fix="save the quantized checkpoint again")
    torchao()
    try:
        with _quiet_import():
            state = torch.load(file, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 -- the unpickler raises many kinds for a bad file
        raise CheckpointError(
            f"{file} is not a readable quantized state dict ({type(e).__name__}: {first_line(e)[:200]}); "
            "save it again (refusion convert --quantize)"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"{file} does not hold a state dict; save it again (refusion convert --quantize)"
        )
    return state


def check_loadable(
    record: dict[str, Any], device: torch.device, wanted: torch.dtype | None, scheme: str | None
) -> None:
    """A saved quantized checkpoint loads as it was saved: the dtype, and for int4 the
    device type it was packed for."""
    dtype = getattr(torch, record.get("dtype", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"config.json's {QUANT_KEY} names no dtype; save the checkpoint again")
    if scheme is not None and scheme != record["scheme"]:
        raise ConfigError(
            f"the checkpoint is already quantized ({record['scheme']}); drop --quantize or quantize the "
            "unquantized checkpoint to another scheme"
        )
    if wanted is not None and wanted != dtype:
        raise ConfigError(
            f"a quantized checkpoint runs in the dtype it was saved in ({record['dtype']}); "
            f"pass --dtype {record['dtype']} or leave --dtype out"
        )
    if record["scheme"] == "int4" and device.type != record.get("packed_for"):
        raise ConfigError(
            f"this int4 checkpoint is packed for {record.get('packed_for')}, whose layout {device.type} "
            f"cannot read; load it with --device {record.get('packed_for')}, or quantize the unquantized "
            f"checkpoint on {device.type}"
        )
    run_dtype(record["scheme"], device, dtype, dtype)


def quantized_copy(model: Transformer, scheme: str) -> Transformer:
    """A quantized copy of an unquantized model, in the dtype `run_dtype` gives the
    scheme (the original untouched): how the benchmarks compare both in one run."""
    import copy

    if getattr(model, "quantization", None) is not None:
        raise ConfigError("the model is quantized already; compare against its unquantized checkpoint")
    dtype = run_dtype(scheme, model.device, None, model.dtype)
    twin = copy.deepcopy(model).to(dtype)
    quantize_model(twin, scheme)
    return twin
