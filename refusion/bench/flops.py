"""What a decoding asks of the machine's linear layers: their FLOPs per token fed, the rate
each of the model's matmul shapes reaches here, and the tokens/s ceiling those rates allow.

`refusion bench decode` reads its GFLOP/s and ceiling columns from these; the linear
layers dominate a forward of these models, so they bound what any batch size can reach.
"""

from __future__ import annotations

import torch

from ..timing import time_ms


def linear_shapes(model) -> dict[tuple[int, int], tuple[int, int]]:
    """(out, in) of each distinct linear shape -> (layers of that shape in the body, in the
    vocabulary projection): the weights one fed token, or one logit row, goes through."""
    shapes: dict[tuple[int, int], tuple[int, int]] = {}
    for m in model.model.modules():
        if isinstance(m, torch.nn.Linear):
            out_f, in_f = m.weight.shape
            body, head = shapes.get((out_f, in_f), (0, 0))
            shapes[(out_f, in_f)] = (body + 1, head)
    out_f, in_f = model.lm_head.weight.shape
    body, head = shapes.get((out_f, in_f), (0, 0))
    shapes[(out_f, in_f)] = (body, head + 1)
    return shapes


def linear_flops(model, fed: int, logit_rows: int) -> float:
    """FLOPs of the linear layers for `fed` tokens through the body and `logit_rows` through
    the vocabulary projection (attention left out: small next to them at these lengths)."""
    return sum(
        2.0 * o * i * (body * fed + head * logit_rows)
        for (o, i), (body, head) in linear_shapes(model).items()
    )


def linear_rate(model, out_f: int, in_f: int, rows: int, inner: int) -> float:
    """GFLOP/s of a (rows x in_f) by (in_f -> out_f) matmul in the model's dtype and device,
    best of 5 samples of `inner` calls."""
    x = torch.randn(rows, in_f, device=model.device, dtype=model.dtype)
    w = torch.randn(out_f, in_f, device=model.device, dtype=model.dtype)
    best_ms = min(time_ms(lambda: torch.nn.functional.linear(x, w), model.device, inner) for _ in range(5))
    return 2.0 * rows * in_f * out_f / best_ms / 1e6


def matmul_peak(model, rows: int = 512) -> float:
    """GFLOP/s of one matmul of the model's own shapes (rows x hidden by hidden x
    intermediate), best of a few: what a batch's linear layers could reach at most."""
    c = model.config
    return linear_rate(model, c.intermediate_size, c.hidden_size, rows, 10)


def shape_rates(model, rows: int = 512) -> dict[tuple[int, int], float]:
    """GFLOP/s of each linear shape with `rows` input rows, best of a few (an upper bound
    on what a batch's forwards get from that shape)."""
    return {(out_f, in_f): linear_rate(model, out_f, in_f, rows, 5) for out_f, in_f in linear_shapes(model)}


def ceiling_tps(
    model, rates: dict[tuple[int, int], float], tokens: float, fed: float, logit_rows: float
) -> float:
    """Tokens/s if every linear layer ran at its shape's best rate and nothing else (attention,
    norms, sampling, bookkeeping) took any time: what no batch size can beat on this machine
    for this many fed tokens and logit rows per committed token."""
    seconds = 0.0
    for (out_f, in_f), (body, head) in linear_shapes(model).items():
        seconds += 2.0 * out_f * in_f * (body * fed + head * logit_rows) / (rates[(out_f, in_f)] * 1e9)
    return tokens / seconds if seconds > 0 else float("inf")
