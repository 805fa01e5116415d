"""Memory: how much a model needs per device (its weights, a rank's share under tensor
parallelism, and the KV cache for a batch of a given context, from the config alone),
and how much a process holds. Imports no torch until a function needs it (the load test
reads a server's memory with it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .config import ModelConfig


def process_memory_kib(pid: int | str | None = None) -> dict[str, int] | None:
    """VmRSS (resident now) and VmHWM (the peak) of a process (None: this one) in KiB,
    from /proc; None where there is no /proc. getrusage's maximum would not do: it
    carries over the peak of the process that exec'd this one."""
    try:
        text = Path(f"/proc/{pid or 'self'}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def kv_bytes_per_entry(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one cache entry (one token of one row) takes in every layer: keys and
    values of the config's KV heads (a rank's config: its heads)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize


def weight_bytes(config: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of the weights one device holds: all of them, or rank 0's share (every rank
    holds the same amount)."""
    from .tensor_parallel import Shard, slice_of
    from .transformer import Transformer, stored_shapes

    shard = Shard(0, tensor_parallel_size) if tensor_parallel_size > 1 else None
    total = 0
    for name, shape in stored_shapes(Transformer.meta(config)).items():
        n = 1
        for d in shape:
            n *= d
        part = slice_of(name, config, shard) if shard is not None else None
        if part is not None:
            dim, a, b = part
            n = n // shape[dim] * (b - a)
        total += n
    return total * dtype.itemsize


def memory_plan(config: ModelConfig, dtype: torch.dtype, batch_size: int, context: int,
                tensor_parallel_size: int = 1, rows_per_request: int = 1) -> dict[str, Any]:
    """Per device: weights, KV cache of batch_size requests of `context` positions (each
    holding rows_per_request cache rows: a ReFusion request forks one per slot of a
    block while it infills), and their sum, in bytes."""
    from .tensor_parallel import local_config

    local = local_config(config, tensor_parallel_size) if tensor_parallel_size > 1 else config
    rows = batch_size * rows_per_request
    kv = rows * context * (kv_bytes_per_entry(local, dtype) + 16)  # + the token and position ids
    weights = weight_bytes(config, dtype, tensor_parallel_size)
    return {"dtype": str(dtype).removeprefix("torch."), "tensor_parallel_size": tensor_parallel_size,
            "batch_size": batch_size, "context": context, "cache_rows": rows, "weights_bytes": weights,
            "kv_cache_bytes": kv, "total_bytes": weights + kv}
