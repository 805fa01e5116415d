"""Which device and dtype the weights are read onto: the caller's choice, checked before any
file is read, or the checkpoint's own dtype where the device can run it.

One place for the supported dtypes, so that `load`, the GGUF import, the CLI and the
benchmarks accept and refuse the same ones.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..settings.model import DTYPE_NAMES, ModelConfig

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


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


def config_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
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


def check_device(device: str | torch.device) -> torch.device:
    """The device, once a tensor has been made on it: an unavailable one fails before any
    file is read."""
    try:
        dev = torch.device(device)
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError) as e:  # torch asserts when built without CUDA
        raise ConfigError(f"device {str(device)!r} is not available: {e}") from None
    return dev
