"""The machine's floors for a forward: the least time it can take on this device, set by
the bytes it must stream (weights, KV entries) at the copy bandwidth and the FLOPs it must
do at the best matmul rate, each measured here (`refusion bench speed`, sections a and b).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.transformer import Transformer
from ..timing import time_ms


def floor_ms(
    weight_bytes: float, kv_bytes: float, flops: float, bandwidth_gbs: float, matmul_gflops: float
) -> float:
    """The least time a forward can take on this machine: it must stream its weights and the
    KV entries it reads once, and do its flops at the best matmul rate; whichever is slower
    bounds it. Bandwidth in GB/s, rate in GFLOP/s, result in ms."""
    stream_s = (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9)
    compute_s = flops / (matmul_gflops * 1e9)
    return 1e3 * max(stream_s, compute_s)


@dataclass
class ForwardCost:
    """What one forward of `tokens` new tokens on a cache of `cache_len` entries must do."""

    tokens: int
    weight_bytes: int  # weights read once (the embedding table only when it is the tied lm_head)
    kv_bytes: int  # keys and values read by attention
    flops: float  # 2 x matmul parameters x tokens, plus attention's two products


def forward_cost(model: Transformer, cache_len: int, tokens: int) -> ForwardCost:
    """The floor's inputs for one forward, from the model's own shapes."""
    c, item = model.config, model.dtype.itemsize
    unique = {id(p): p for p in model.parameters()}.values()
    weight_bytes = sum(p.numel() for p in unique) * item
    if not c.tie_word_embeddings:  # an untied embedding table is only gathered from, not read whole
        weight_bytes -= (model.model.embed_tokens.weight.numel() - tokens * c.hidden_size) * item
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    seen = cache_len + tokens
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * seen * item
    attn_flops = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seen * tokens
    return ForwardCost(tokens, weight_bytes, kv_bytes, 2.0 * sum(linear.values()) * tokens + attn_flops)


class MachineProbe:
    """The two floors, measured on the model's device with buffers allocated once."""

    def __init__(self, device: torch.device, dtype: torch.dtype, bw_mib: int, matmul_n: int) -> None:
        self.device = device
        n = bw_mib * 2**20 // 4
        self.src = torch.ones(n, dtype=torch.float32, device=device)
        self.dst = torch.empty_like(self.src)
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.a = torch.randn(matmul_n, matmul_n, generator=gen).to(device=device, dtype=dtype)
        self.b = torch.randn(matmul_n, matmul_n, generator=gen).to(device=device, dtype=dtype)
        self.bandwidth_gbs(), self.matmul_gflops()  # warm-up: first-touch pages, BLAS handles

    def bandwidth_gbs(self) -> float:
        """Copy bandwidth: bytes read plus bytes written, per second."""
        ms = time_ms(lambda: self.dst.copy_(self.src), self.device, 1)
        return 2 * self.src.numel() * 4 / (ms * 1e6)

    def matmul_gflops(self) -> float:
        ms = time_ms(lambda: torch.mm(self.a, self.b), self.device, 1)
        return 2 * self.a.shape[0] ** 3 / (ms * 1e6)
