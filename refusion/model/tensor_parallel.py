"""Tensor parallelism: one model split over the ranks of a `torch.distributed` group.

Megatron's layout on our own model: q/k/v and gate/up are column-parallel (each rank
holds a run of heads, or of the MLP's columns), o and down are row-parallel (each rank
multiplies its part, an all-reduce sums the parts, the bias is added once after it). KV
heads are split where their count divides by the ranks, and otherwise each rank holds the
one KV head its query heads share (replicated over the ranks of that group). Embedding,
norms and LM head are replicated: the head is a small share of the weights of the models
this is for, and keeping it whole spares a gather of the vocabulary per forward.

A rank's model is an ordinary `Transformer` built from the *local* config (its share of
the heads and columns), so the KV cache it allocates holds its heads only and every
cache operation of the engine runs unchanged on the shard. Every rank runs the same
engine on the same requests: after each all-reduce all ranks hold the same numbers, so
they make the same choices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..settings.model import ModelConfig

if TYPE_CHECKING:
    from .transformer import Transformer


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group."""

    rank: int
    world: int
    group: Any = None  # the torch.distributed group (None: the default group)


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_r @ W_r^T) + b: this rank's input columns times its weight columns,
    summed over the ranks, the bias added once."""

    group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def check_divisible(config: ModelConfig, world: int) -> None:
    """Refuse a split the layout cannot make, naming sizes that work."""
    H, H_kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    ok = [n for n in range(1, H + 1) if H % n == 0 and inter % n == 0 and (H_kv % n == 0 or n % H_kv == 0)]
    if world not in ok:
        raise ConfigError(
            f"tensor_parallel_size {world} does not split this model ({H} attention heads, {H_kv} KV "
            f"heads, MLP width {inter}); sizes that do: {', '.join(map(str, ok))}"
        )


def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's share: 1/world of the query heads and MLP columns, and of
    the KV heads (one KV head when there are fewer KV heads than ranks)."""
    check_divisible(config, world)
    H_kv = config.num_key_value_heads
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world,
        num_key_value_heads=H_kv // world if H_kv % world == 0 else 1,
        intermediate_size=config.intermediate_size // world,
        head_dim=config.head_dim,
    )


def slice_of(name: str, config: ModelConfig, shard: Shard) -> tuple[int, int, int] | None:
    """(dim, start, stop) of checkpoint tensor `name` that `shard` holds, or None for a
    tensor every rank holds whole."""
    r, n, D = shard.rank, shard.world, config.head_dim
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    local = local_config(config, n)
    parts = name.split(".")
    leaf = ".".join(parts[-2:])  # e.g. "q_proj.weight"
    if leaf in ("q_proj.weight", "q_proj.bias"):
        width = local.num_attention_heads * D
        return 0, r * width, (r + 1) * width
    if leaf in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        if H_kv % n == 0:
            width = local.num_key_value_heads * D
            return 0, r * width, (r + 1) * width
        group = r * local.num_attention_heads // (H // H_kv)  # the KV head this rank's query heads share
        return 0, group * D, (group + 1) * D
    if leaf == "o_proj.weight":
        width = local.num_attention_heads * D
        return 1, r * width, (r + 1) * width
    if leaf in ("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias"):
        width = local.intermediate_size
        return 0, r * width, (r + 1) * width
    if leaf == "down_proj.weight":
        width = local.intermediate_size
        return 1, r * width, (r + 1) * width
    return None


def make_row_parallel(model: Transformer, shard: Shard) -> None:
    """Turn every o_proj and down_proj into a RowParallelLinear of the same shapes (on the
    meta device, before the weights are assigned)."""
    for block in model.model.layers:
        for owner, attr in ((block.self_attn, "o_proj"), (block.mlp, "down_proj")):
            old: nn.Linear = getattr(owner, attr)
            new = RowParallelLinear(
                old.in_features, old.out_features, bias=old.bias is not None, device="meta"
            )
            new.group = shard.group
            setattr(owner, attr, new)
