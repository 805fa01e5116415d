"""The Llama / Qwen2 / Qwen3 decoder family, with explicit position ids and our own KV cache.

`model(tokens, positions)` -> logits. Attention is causal in the *physical* order of
what is fed (cached entries first, then the new tokens); RoPE uses the explicit
position ids. That is all ReFusion needs: out-of-order slots are the normal case.

Two forwards: `hidden` over (B, T) rows without a cache (training, MDM, and the reference
the tests hold the cached forward to), and `packed_hidden`, the one forward with a cache
(the decoder's every forward, eager or compiled as one graph, over the layout the cache
builds: `KVCache.packed_write`); `cached_hidden` and `model(tokens, positions, cache)` are
thin wrappers over it for callers that hold whole tensors.

Parameter names equal Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...),
so checkpoints load and save without renaming.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..settings.model import ModelConfig
from ..settings.recommended import Recommended
from .kv_cache import KVCache, storage_mask

if TYPE_CHECKING:
    from .tensor_parallel import Shard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as the reference
        # implementation does; in float32 that is one fused call (fewer ops per token
        # matter: a small model's decode step is bound by per-op overhead).
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with linear or Llama-3 scaling applied."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = config.rope_scaling
    if sc is None:
        return inv
    factor = float(sc["factor"])
    if sc["rope_type"] == "linear":
        return inv / factor
    # llama3: long wavelengths divided by factor, short kept, smooth ramp in between
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1): the halves swapped
    by one roll and the sign folded into `sin_signed` = (-sin, sin) (fewer ops per call)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


PACK_BELOW = 0.75  # pack a forward's rows when real tokens are at most this share of B * T


class Packing:
    """Right-padded rows of a forward pass, packed: the real tokens of every row as one
    (N, hidden) matrix. Norms, projections and the MLP (most of the FLOPs) then skip the
    padding; attention alone runs on the padded (B, T) layout. It pays when rows are
    ragged (a batch of decoding rows at different phases, prompts of different lengths)."""

    def __init__(self, lengths: torch.Tensor, T: int) -> None:  # lengths (B,) int64
        self.B, self.T = lengths.shape[0], T
        valid = torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]  # (B, T)
        self.idx = valid.flatten().nonzero().flatten()  # (N,) flat index of each real token

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, ...)"""
        return x.flatten(0, 1).index_select(0, self.idx)

    def unpack_split(self, x: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """(N, sum(sizes)) -> tensors (B, T, size) with zeros at the padding."""
        out = x.new_zeros(self.B * self.T, x.shape[-1])
        out.index_copy_(0, self.idx, x)
        return out.view(self.B, self.T, -1).split(sizes, dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        h, qkv_bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=config.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packing: Packing | None = None
    ) -> torch.Tensor:
        """Causal attention over the rows fed, without a cache (training, MDM, and the
        tests' references). x (B, T, hidden), or (N, hidden) when `packing` packed the
        rows' real tokens; cos, sin (B, 1, T, head_dim), sin's first half negated."""
        H, H_kv, D = self.n_heads, self.n_kv, self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (..., heads * D)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.unflatten(-1, (H, D))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (H_kv, D))).flatten(-2)
        if packing is not None:  # attention runs on the padded layout
            q, k, v = packing.unpack_split(torch.cat((q, k, v), dim=-1), (H * D, H_kv * D, H_kv * D))
        B, T = cos.shape[0], cos.shape[2]
        q = apply_rope(q.view(B, T, H, D).transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.view(B, T, H_kv, D).transpose(1, 2), cos, sin)  # (B, H_kv, T, D)
        v = v.view(B, T, H_kv, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H_kv != H)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(B, T, H * D)
        return self.o_proj(packing.pack(out) if packing is not None else out)

    def packed_step(
        self, x, cos, sin, where, rows, cols, k_cache, v_cache, mask, B, T, segments=None
    ) -> torch.Tensor:
        """`Transformer.packed_hidden` for one layer: x (N, hidden) real tokens only; keys and
        values go to (rows[n], cols[n]) of the cache; queries are scattered to the (B, T)
        layout (zeros where a row has no token: they attend, nothing reads them) for one
        attention over the cache window under `mask` (None: each query sees it all), or
        one per run of rows (`segments`). Returns (N, hidden)."""
        H, H_kv, D, N = self.n_heads, self.n_kv, self.head_dim, x.shape[0]
        q, k, v = (
            self.q_proj(x).view(N, H, D),
            self.k_proj(x).view(N, H_kv, D),
            self.v_proj(x).view(N, H_kv, D),
        )
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # cos (N, 1, D)
        k_cache[rows, :, cols] = k
        v_cache[rows, :, cols] = v
        q_bt = q.new_zeros(B * T, H * D).index_copy(0, where, q.flatten(1)).view(B, T, H, D).transpose(1, 2)
        out = self._attend_runs(q_bt, k_cache, v_cache, mask, segments)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B * T, H * D).index_select(0, where))

    def _attend_runs(self, q, k, v, mask, segments) -> torch.Tensor:
        """SDPA over the cache under `mask`, or per run of rows [(first row, end row,
        queries, keys), ...], each with only the columns its rows need."""
        gqa = self.n_kv != self.n_heads
        if not segments:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        out = q.new_zeros(q.shape)  # each run of rows fills its own part
        for a, b, t, e in segments:
            m = None if mask is None else mask[a:b, :, :t, :e]
            out[a:b, :, :t] = F.scaled_dot_product_attention(
                q[a:b, :, :t], k[a:b, :, :e], v[a:b, :, :e], attn_mask=m, enable_gqa=gqa
            )
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packing: Packing | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, packing)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, blocks and the final norm: Hugging Face's `model.*` submodule."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    """A causal LM whose forward takes explicit position ids and an optional `KVCache`."""

    inv_freq: torch.Tensor  # a buffer (registered in __init__), not a parameter

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.gradient_checkpointing = False
        # set by io.load: this rank's Shard when the model is split, and the decode settings
        # saved with the checkpoint
        self.tensor_parallel: Shard | None = None
        self.recommended: Recommended | None = None
        # what `io.quantize.quantize_model` did to the weights, if anything
        self.quantization: dict[str, Any] | None = None

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (B, 1, T, head_dim) for explicit position ids (B, T), computed
        in float32; the sin's first half is negated for `apply_rope`."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # (B, T, D/2)
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)[:, None]  # (B, 1, T, D)
        sin = torch.cat((-sin, sin), dim=-1)[:, None]
        return cos.to(dtype), sin.to(dtype)

    def hidden(
        self,
        tokens: torch.Tensor,  # (B, T) int64
        positions: torch.Tensor,  # (B, T) int64
        lengths: list[int] | None = None,
    ) -> torch.Tensor:
        """Final hidden states (B, T, hidden) of rows fed on their own, without a cache:
        training, MDM, and the reference the tests hold the cached forward to.
        `lengths[b]` says how many of row b's tokens are real (the rest is right padding,
        whose outputs are zeros): with enough padding the rows are packed (see `Packing`)."""
        if tokens.shape != positions.shape:
            raise ValueError(
                f"tokens {tuple(tokens.shape)} and positions {tuple(positions.shape)} differ in shape"
            )
        B, T = tokens.shape
        packing = None
        if lengths is not None and sum(lengths) <= PACK_BELOW * B * T:
            packing = Packing(torch.tensor(lengths, device=tokens.device), T)
            x = self.model.embed_tokens(packing.pack(tokens[..., None]).flatten())  # (N, hidden)
        else:
            x = self.model.embed_tokens(tokens)  # (B, T, hidden)
        cos, sin = self.rope(positions, x.dtype)  # (B, 1, T, D) each
        for block in self.model.layers:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, cos, sin, packing, use_reentrant=False)
            else:
                x = block(x, cos, sin, packing)
        x = self.model.norm(x)
        return packing.unpack_split(x, (x.shape[-1],))[0] if packing is not None else x

    def cached_hidden(
        self,
        tokens: torch.Tensor,  # (B, T) int64
        positions: torch.Tensor,  # (B, T) int64
        cache: KVCache,
        n_new: int | list[int] | None = None,
    ) -> torch.Tensor:
        """Final hidden states (B, T, hidden) of rows fed after their cache entries, through
        the decoder's one cached forward (`packed_hidden`); row b feeds and keeps its first
        n_new[b] tokens (default: all T; the rest is right padding, whose outputs are
        zeros). For callers that hold whole tensors (a benchmark's prefill, the tests);
        the engine builds its ragged feeds itself (`decode.forward`)."""
        B, T = tokens.shape
        n = [T] * B if n_new is None else [n_new] * B if isinstance(n_new, int) else [int(x) for x in n_new]
        layout = cache.packed_write(
            [tokens[b, : n[b]].tolist() for b in range(B)],
            [positions[b, : n[b]].tolist() for b in range(B)],
            plan_runs=True,
        )
        hidden = self.packed_hidden(
            *layout.tensors(), segments=layout.segments, masked=layout.masked
        )  # (N, hidden)
        cache.advance(n)
        fed = layout.query_cols.shape[1]  # the longest row's feed: where indexes b * fed + t
        out = hidden.new_zeros(B, max(T, fed), hidden.shape[-1])
        out[layout.where // fed, layout.where % fed] = hidden
        return out[:, :T]  # (B, T, hidden), zeros where a row fed nothing

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        n_new: int | list[int] | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab): of the rows alone (`hidden`), or fed after their entries in
        `cache`, which keeps them (`cached_hidden`)."""
        if cache is None:
            return self.lm_head(self.hidden(tokens, positions))
        return self.lm_head(self.cached_hidden(tokens, positions, cache, n_new))

    def packed_hidden(
        self,
        tokens: torch.Tensor,  # (N,) int64: every row's real tokens, row after row
        positions: torch.Tensor,  # (N,) int64
        where: torch.Tensor,  # (N,) int64: each token's place b * T + t in the rows' (B, T) layout
        query_cols: torch.Tensor,  # (B, T) int64: the cache column of row b's t-th token (its length + t)
        k: list[torch.Tensor],  # per layer (B, H_kv, capacity, D): the cache's keys, written in place
        v: list[torch.Tensor],
        cache_tokens: torch.Tensor,  # (B, capacity) int64, written in place
        cache_positions: torch.Tensor,
        segments: list[tuple[int, int, int, int]] | None = None,  # eager only: attention per run of rows
        masked: bool = True,  # False: every query sees the whole window (no mask needed)
    ) -> torch.Tensor:
        """Final hidden states (N, hidden) of a ragged forward whose every input is a tensor
        (`KVCache.packed_write` builds them): no cache object, no Python that depends on the
        rows' lengths. `torch.compile(dynamic=True)` therefore captures it as one graph that
        serves every batch, prompt length and cache size (see `decode.forward.CompiledStep`);
        eagerly, `segments` may split attention into runs of rows. The new entries are
        written at each row's end (the caller advances the cache's lengths) and query t of
        row b sees columns <= query_cols[b, t]: its numbers are `hidden`'s over the row's
        entries followed by its new tokens (the tests check that)."""
        B, T = query_cols.shape
        rows, cols = where // T, query_cols.flatten().index_select(0, where)  # (N,) each
        cache_tokens[rows, cols] = tokens
        cache_positions[rows, cols] = positions
        mask = storage_mask(query_cols, cache_tokens.shape[1]) if masked else None  # (B, 1, T, capacity)
        x = self.model.embed_tokens(tokens)  # (N, hidden)
        cos, sin = (c[0, 0, :, None] for c in self.rope(positions[None], x.dtype))  # (N, 1, D)
        blocks = cast("Iterable[Block]", self.model.layers)  # a ModuleList yields them as Modules
        for block, k_l, v_l in zip(blocks, k, v):
            x = x + block.self_attn.packed_step(
                block.input_layernorm(x), cos, sin, where, rows, cols, k_l, v_l, mask, B, T, segments
            )
            x = x + block.mlp(block.post_attention_layernorm(x))
        return self.model.norm(x)

    @classmethod
    def meta(cls, config: ModelConfig) -> Transformer:
        """The model's structure without storage (on the meta device): its state dict gives
        every tensor's name and shape before any weight is read."""
        with torch.device("meta"):
            return cls(config)

    def new_cache(self, batch_size: int, capacity: int, reserve: int = 0) -> KVCache:
        """An empty cache for this model's shapes, dtype and device (storage for `reserve`
        rows in all, if more than batch_size: see `KVCache.grow`)."""
        return KVCache.allocate(self.config, batch_size, capacity, self.dtype, self.device, reserve)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def stored_shapes(model: Transformer) -> dict[str, torch.Size]:
    """Every tensor a checkpoint of this model holds, by name; a tied lm_head is not stored
    on its own."""
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return shapes
