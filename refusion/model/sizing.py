"""Memory: how much a model needs per device (its weights, a rank's share under tensor
parallelism), how much a process holds, and the one rule for the KV cache: what a request
needs of it (`CacheNeed`, by its method: `decode.methods`), how long every row of one
cache must be (`row_capacity`),
and what that costs (`cache_bytes`). The engine admits requests and allocates its cache
by this rule and `refusion info` reports it, so they agree on what fits. Imports no torch
until a function needs it (the load test reads a server's memory with it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..settings.model import ModelConfig

ID_BYTES = 16  # an entry's token and position ids, int64 each


@dataclass(frozen=True)
class CacheNeed:
    """What one request asks of the KV cache (each method says, `decode.methods.Method.cache_need`)."""

    prompt: int  # entries its prompt takes
    growth: int  # entries its decoding adds past the prompt, at most
    width: (
        int  # entries one forward writes past the row's committed end, beyond its growth (a block of MASKs)
    )
    rows: int = 1  # cache rows it holds at once (ReFusion: its row and a fork per slot of a block; MDM: none)


def row_capacity(needs: Sequence[CacheNeed], joining: bool = False) -> int:
    """Entries every row of one cache must hold for each step of these requests to fit
    (a forward writes each row's new entries from the longest row's end on): the longest
    row a request reaches (prompt + growth), plus the widest write past it (a block of
    MASKs), plus, where requests join rows that already run, the longest prompt (a
    joining prompt is prefilled beside the running rows)."""
    needs = [n for n in needs if n.rows]
    if not needs:
        return 0
    longest = max(n.prompt + n.growth for n in needs)
    joined = max(n.prompt for n in needs) if joining else 0
    return longest + max(n.width for n in needs) + joined


def cache_bytes(needs: Sequence[CacheNeed], per_entry: int, joining: bool = False) -> int:
    """Bytes of the cache rows these requests hold at once, every row (and fork) as long as
    `row_capacity`, `per_entry` bytes an entry (`entry_bytes`)."""
    return sum(n.rows for n in needs) * row_capacity(needs, joining) * per_entry


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


def entry_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one cache entry (one token of one row) takes: keys and values in every layer
    for the config's KV heads (a rank's config: its heads), and its token and position id."""
    return (
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize
        + ID_BYTES
    )


def stored_parameters(config: ModelConfig) -> int:
    """Values a checkpoint of `config` stores, counted on a one-layer model scaled by the
    layer count: what a config claims can be weighed against its files before a model of
    a million layers is built."""
    import dataclasses
    import math

    from .transformer import Transformer, stored_shapes

    one = Transformer.meta(dataclasses.replace(config, num_hidden_layers=1))
    layers = config.num_hidden_layers
    return sum(
        math.prod(shape) * (layers if name.startswith("model.layers.") else 1)
        for name, shape in stored_shapes(one).items()
    )


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


def memory_plan(
    config: ModelConfig,
    dtype: torch.dtype,
    batch_size: int,
    context: int,
    alone: CacheNeed,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """Per device: the weights, and the KV cache the engine allocates for batch_size
    requests admitted together, each of `context` positions (prompt and generation, the
    generation as long as a request's growth where the context allows; `alone`: what one
    request of the settings asks with no prompt, `decode.methods.Method.cache_need`), by
    the engine's rule (`row_capacity`); and their sum, in bytes."""
    from .tensor_parallel import local_config

    local = local_config(config, tensor_parallel_size) if tensor_parallel_size > 1 else config
    growth = min(alone.growth, context)
    need = CacheNeed(context - growth, growth, alone.width, alone.rows)
    needs = [need] * batch_size
    kv = cache_bytes(needs, entry_bytes(local, dtype))
    weights = weight_bytes(config, dtype, tensor_parallel_size)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "tensor_parallel_size": tensor_parallel_size,
        "batch_size": batch_size,
        "context": context,
        "cache_rows": batch_size * need.rows,
        "row_capacity": row_capacity(needs),
        "weights_bytes": weights,
        "kv_cache_bytes": kv,
        "total_bytes": weights + kv,
    }
